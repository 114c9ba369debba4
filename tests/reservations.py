"""Reserved capacity added to a stack output the way the Pulumi program exports it
(tests/infra/test_reservations.py checks the program itself under mocks): a p4d Capacity Block
and the p4de On-Demand Capacity Reservations of a resource group, each first in its type's
order, in the workers' AZ. Shared by the unit tests of render, lint and cost and by the moto
tests of preflight."""

from __future__ import annotations

import copy
from typing import Any

BLOCK_ID = "cr-0fedcba9876543210"
GROUP = "arn:aws:resource-groups:us-east-1:123456789012:group/p4de-odcrs"
BLOCK_NAME = "ray.worker.p4d.24xlarge.block"
RESERVED_NAME = "ray.worker.p4de.24xlarge.reserved"


def with_reservations(o: dict[str, Any], templates: dict[str, str] | None = None) -> dict:
    """The ``rayfleet`` output ``o`` with a p4d block and a p4de reservation; ``templates``
    gives their launch template ids by market (default: their on-demand twin's)."""
    o = copy.deepcopy(o)
    workers = o["node_types"]["workers"]
    templates = templates or {}
    where = {"availability_zone": o["availability_zones"][0], "subnet_id": o["worker_subnet_id"]}

    def reserved(itype: str, market: str, target: dict) -> dict:
        twin = next(w for w in workers if w["instance_type"] == itype
                    and w["market"] == "ondemand")
        return {**twin, "market": market, "min_workers": 0, "max_workers": o["max_workers"],
                "launch_template": {"id": templates.get(market, twin["launch_template"]["id"])},
                "capacity_reservation": {**where, **target}}

    out = []
    for w in workers:
        if w["market"] == "spot" and w["instance_type"] == "p4d.24xlarge":
            out.append(reserved("p4d.24xlarge", "block", {"id": BLOCK_ID}))
        if w["market"] == "spot" and w["instance_type"] == "p4de.24xlarge":
            out.append(reserved("p4de.24xlarge", "reserved", {"resource_group_arn": GROUP}))
        out.append(w)
    o["node_types"]["workers"] = out
    return o
