"""An AWS Budgets monthly cost limit that emails before an A100 bill surprises anyone.

A p4d.24xlarge costs tens of dollars an hour on demand; a worker left running over a weekend
is the classic way to blow a budget. The budget covers the whole account (cost-allocation
tags must be activated by hand before a tag filter would see anything), so it errs early.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

# (notification type, percent of the limit): spend so far, and AWS's month-end forecast.
ALERTS = (("ACTUAL", 80), ("ACTUAL", 100), ("FORECASTED", 100))


@dataclass(frozen=True)
class BudgetArgs:
    cluster_name: str
    monthly_usd: int
    emails: tuple[str, ...]


class Budget(pulumi.ComponentResource):
    def __init__(self, name: str, args: BudgetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:Budget", name, None, opts)
        self.budget = aws.budgets.Budget(
            f"{name}-monthly",
            name_prefix=f"rayfleet-{args.cluster_name}-",
            budget_type="COST",
            limit_amount=str(args.monthly_usd),
            limit_unit="USD",
            time_unit="MONTHLY",
            notifications=[
                aws.budgets.BudgetNotificationArgs(
                    notification_type=kind,
                    comparison_operator="GREATER_THAN",
                    threshold=percent,
                    threshold_type="PERCENTAGE",
                    subscriber_email_addresses=list(args.emails),
                )
                for kind, percent in ALERTS
            ],
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"budget_name": self.budget.name})
