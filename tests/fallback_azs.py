"""A fallback AZ added to a stack output the way the Pulumi program exports it
(tests/infra/test_fallback_azs.py checks the program itself under mocks): every worker entry
says its AZ, and after each type's spot and on-demand in the workers' AZ come the same two in
the fallback AZ, on templates of their own, with no minimum. Shared by the unit tests of the
stack contract, render, the scorer, lint and cost."""

from __future__ import annotations

import copy
from typing import Any

FALLBACK_AZ = "us-east-1c"


def with_fallback_az(o: dict[str, Any], az: str = FALLBACK_AZ) -> dict:
    """The ``rayfleet`` output ``o`` (one AZ, as the example) with fallback AZ ``az``."""
    o = copy.deepcopy(o)
    workers = o["node_types"]["workers"]
    home = o["availability_zones"][0]
    out = []
    for i in range(0, len(workers), 2):   # each type's spot and on-demand
        out += [dict(w, availability_zone=home) for w in workers[i:i + 2]]
        out += [dict(w, availability_zone=az, min_workers=0,
                     launch_template={"id": f"{w['launch_template']['id']}-{az}"})
                for w in workers[i:i + 2]]
    o["node_types"]["workers"] = out
    return o


def fallback_names(az: str = FALLBACK_AZ) -> list[str]:
    """The Ray node types of the example stack with fallback AZ ``az``, in the stack's order:
    type-major (p4d in the workers' AZ, p4d in ``az``, then p4de)."""
    return [f"ray.worker.{t}.{m}{suffix}" for t in ("p4d.24xlarge", "p4de.24xlarge")
            for suffix in ("", f".{az}") for m in ("spot", "ondemand")]
