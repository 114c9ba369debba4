"""`rayfleet cost CONFIG`: what a cluster YAML costs per hour and per month.

Prices come from the instance catalog (``rayfleet/catalog.py``), a dated table shipped with
the kit: EC2 prices cannot be fetched offline (the Pricing API needs credentials and the
network), so the table says when it was taken and every report repeats that date. Per node
type: on-demand, and spot where the node type is a spot one. Head + min workers is the floor
(an idle cluster), head + max workers the ceiling; the monthly ceiling is compared with the
stack's budget.
"""

from __future__ import annotations

import sys
from typing import Any

from rayfleet import catalog
from rayfleet.config import load_stack_file
from rayfleet.errors import ConfigError, RayfleetError, did_you_mean
from rayfleet.commands.lint import load_yaml

# Always on: 365 days x 24 hours / 12 months. A month has at most 31 x 24 hours.
HOURS_PER_MONTH = 730.0
MAX_HOURS_PER_MONTH = 744

def load_prices() -> dict[str, Any]:
    return catalog.prices()


def hourly(instance_type: str, market: str, prices: dict[str, Any]) -> float:
    """$/hour of one instance; ``market`` is ``on_demand`` or ``spot``."""
    if instance_type in prices["gpu"]:
        return prices["gpu"][instance_type][market]
    family, _, size = instance_type.partition(".")
    per_vcpu = prices["cpu_per_vcpu_hour"].get(family)
    heads = catalog.head_types()
    if per_vcpu is None or instance_type not in heads:
        known = list(prices["gpu"]) + list(heads)
        raise ConfigError("InstanceType", f"{instance_type!r} is not in the price table of "
                                          f"{prices['as_of']}{did_you_mean(instance_type, known)}")
    return round(per_vcpu[market] * heads[instance_type].vcpus, 4)


def estimate(cfg: dict[str, Any], prices: dict[str, Any] | None = None,
             hours_per_month: float = HOURS_PER_MONTH) -> dict[str, Any]:
    prices = prices or load_prices()
    provider = cfg.get("provider") or {}
    if provider.get("type") != "aws":
        raise RayfleetError(f"cost covers AWS clusters only; provider.type is "
                            f"{provider.get('type')!r}")
    region = provider.get("region")
    if region not in prices["regions"]:
        raise ConfigError("provider.region", f"{region!r} is not in the price table of "
                                             f"{prices['as_of']} (it covers "
                                             f"{', '.join(prices['regions'])})")
    head_type = cfg.get("head_node_type")
    types = cfg.get("available_node_types") or {}
    if head_type not in types:
        raise RayfleetError("head_node_type is missing or not one of available_node_types")
    rows = []
    for name, nt in types.items():
        nc = nt.get("node_config") or {}
        itype = nc.get("InstanceType")
        if not itype:
            raise ConfigError(f"available_node_types.{name}.node_config.InstanceType",
                              "missing; cost needs an instance type per node type")
        spot = (nc.get("InstanceMarketOptions") or {}).get("MarketType") == "spot"
        head = name == head_type
        lo = 1 if head else int(nt.get("min_workers", 0))
        hi = 1 if head else int(nt.get("max_workers", cfg.get("max_workers", 0)))
        if lo > hi:
            raise ConfigError(f"available_node_types.{name}", f"min_workers {lo} > "
                                                              f"max_workers {hi}")
        od = hourly(itype, "on_demand", prices)
        price = hourly(itype, "spot", prices) if spot else od
        rows.append({"node_type": name, "instance_type": itype,
                     "market": "spot" if spot else "on-demand", "price": price,
                     "on_demand_price": od, "min": lo, "max": hi})
    # The autoscaler never runs more workers than the global max_workers.
    cap = cfg.get("max_workers")
    total_max_workers = sum(r["max"] for r in rows if r["node_type"] != head_type)
    if cap is not None and total_max_workers > cap:
        total_max_workers = cap

    def total(key: str, price_key: str) -> float:
        return round(sum(r[price_key] * r[key] for r in rows), 2)

    out = {
        "as_of": prices["as_of"],
        "region": region,
        "rows": rows,
        "hourly": {
            "min": total("min", "price"),
            "max": total("max", "price"),
            "max_all_on_demand": total("max", "on_demand_price"),
        },
        "hours_per_month": hours_per_month,
        "max_workers": total_max_workers,
    }
    out["monthly"] = {k: round(v * hours_per_month, 2) for k, v in out["hourly"].items()}
    return out


def main(path: str, stack_file: str | None = None, budget_usd: float | None = None,
         hours_per_month: float = HOURS_PER_MONTH, out=None) -> int:
    out = out or sys.stdout
    if budget_usd is None and stack_file:
        budget_usd = float(load_stack_file(stack_file).budget.monthly_usd) or None
    cfg, _ = load_yaml(path)
    e = estimate(cfg, hours_per_month=hours_per_month)
    print(f"Prices: rayfleet's catalog as of {e['as_of']} ({e['region']}); they cannot be "
          "fetched offline - check https://aws.amazon.com/ec2/pricing/ before budgeting. "
          "EBS, NAT, transfer and S3 not included.", file=out)
    print(f"{'node type':28} {'instance':16} {'market':10} {'$/h each':>9} {'min':>4} "
          f"{'max':>4}", file=out)
    for r in e["rows"]:
        print(f"{r['node_type']:28} {r['instance_type']:16} {r['market']:10} "
              f"{r['price']:9.2f} {r['min']:4d} {r['max']:4d}", file=out)
    h, m = e["hourly"], e["monthly"]
    hrs = e["hours_per_month"]
    print(f"head + min workers: ${h['min']:.2f}/h  ${m['min']:,.0f}/month ({hrs:g} h)", file=out)
    print(f"head + max workers: ${h['max']:.2f}/h  ${m['max']:,.0f}/month (spot where the node "
          f"type is spot)", file=out)
    print(f"head + max workers, all on-demand (no spot capacity): "
          f"${h['max_all_on_demand']:.2f}/h  ${m['max_all_on_demand']:,.0f}/month", file=out)
    if budget_usd:
        for label, key in (("idle (min)", "min"), ("busy (max)", "max")):
            share = m[key] / budget_usd * 100
            verdict = "within" if m[key] <= budget_usd else "OVER"
            print(f"budget ${budget_usd:,.0f}/month: {label} is {share:.0f}% - {verdict}",
                  file=out)
        # Hours of full-size use the budget buys after the idle floor.
        spare = budget_usd - m["min"]
        extra = h["max"] - h["min"]
        if spare > 0 and extra > 0:
            print(f"  the budget covers about {spare / extra:,.0f} h/month at max workers "
                  "above the idle floor", file=out)
    else:
        print("no budget given (--budget-usd or --stack-file Pulumi.<stack>.yaml)", file=out)
    return 0
