"""The head's autoscaler scorer: launch GPU workers in the stack's order, and move on to the
next allowed type when one has no capacity.

Ray's autoscaler (v1, what `ray up` runs) picks a node type for pending work by a score it
computes from resources alone, and breaks ties by the node type's *name*, largest first
(``sorted(scores, reverse=True)`` in ``resource_demand_scheduler.get_nodes_for``). For a stack
allowing p4d then p4de, whose node types declare the same resources, that launches
``ray.worker.p4de.24xlarge.spot`` first ("p4de" sorts after "p4d."), and the spot type of each
before its on-demand one, whatever the stack's order. It also passes the scorer what it knows
of each type's last launch (``NodeAvailabilitySummary``: EC2's error code and message for a type
whose launch failed, kept for ``AUTOSCALER_NODE_AVAILABILITY_MAX_STALENESS_S``, 30 min), but its
default scorer ignores it, so it keeps asking for the type that just failed.

This scorer keeps Ray's own score, never starts a GPU node type for work that asks for no GPU
and no accelerator type (Ray only prefers not to), and ranks the node types by, in turn:
1. Ray's GPU guard (no GPU node for CPU-only work);
2. whether the type's last launch succeeded (or none was tried): a type EC2 just refused
   goes behind every type that may still have capacity;
3. how many of the demanded resource kinds the type has (Ray's own term);
4. among refused types, the one refused longest ago (so that with every type failing the
   autoscaler goes round them in the stack's order, not back to the first each time);
5. the stack's order: ``RAYFLEET_NODE_TYPE_ORDER``, the worker node types as `rayfleet render`
   lists them (the stack's ``workerInstanceTypes`` order, each type's markets in turn);
6. Ray's utilisation terms.

So a job asking for ``accelerator_type:A100`` gets p4d while EC2 has it, then p4de once p4d's
launches fail, and p4d again once its failure is older than Ray's staleness window or a p4d
launch succeeds. When every fitting type has failed, the autoscaler keeps retrying them, the
one refused longest ago first; the training driver and `rayfleet status` read the
same availability record to say so (rayfleet/capacity.py).

The scorer is a hook of Ray's v1 autoscaler, and render starts the head's autoscaler as v1
(``RAY_enable_autoscaler_v2=0`` on the head's and the workers' `ray start`, which is what
`RAY_UP_enable_autoscaler_v2=0 ray up` would do). `ray up` has started v2 by default since Ray
2.50, and v2 cannot fall over on a launch error: its scheduler lowers a node type only after an
*allocation timeout* (``CloudResourceMonitor`` listens for ALLOCATION_TIMEOUT, not
ALLOCATION_FAILED), so EC2's immediate InsufficientInstanceCapacity leaves the failing type on
top. On the fake cloud, with p4d refused, v2 asked for ``ray.worker.p4d.24xlarge.spot`` 135
times in 5 min 45 s and never tried p4de; v1 with this scorer moves on at its next update.

Ray loads it by name from ``RAY_AUTOSCALER_UTILIZATION_SCORER`` in the environment of the head's
`ray start`; render copies this file alone into a folder of its own on the head and puts that
folder on the same line's PYTHONPATH, so nothing else of the agents' folder shadows a package in
the head's processes. It runs inside the autoscaler: Ray's modules only, imported there.
"""

from __future__ import annotations

import os

# The environment variables render sets on the head's `ray start` line.
ORDER_ENV = "RAYFLEET_NODE_TYPE_ORDER"
# Ray's switch between its autoscalers; render sets it to 0 (v1, which loads scorers) on every
# node's `ray start`, after `ray up`'s own `export RAY_enable_autoscaler_v2=1`.
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"
# Ray's own name for the scorer's module path (ray.autoscaler._private.constants).
SCORER_ENV = "RAY_AUTOSCALER_UTILIZATION_SCORER"
# The module name this file has on the head (render copies it under this name).
MODULE = "rayfleet_fallover"
SCORER = f"{MODULE}.score"


def order(environ=os.environ) -> list[str]:
    return [t for t in environ.get(ORDER_ENV, "").split(",") if t]


def available(node_type: str, summary) -> bool:
    """False when the type's last launch failed within Ray's staleness window."""
    record = (getattr(summary, "node_availabilities", None) or {}).get(node_type)
    return record is None or bool(record.is_available)


def last_refused(node_type: str, summary) -> float:
    """When the type's last launch failed (Unix time), 0 when it did not."""
    record = (getattr(summary, "node_availabilities", None) or {}).get(node_type)
    if record is None or record.is_available:
        return 0.0
    return float(record.last_checked_timestamp or 0)


def wants_accelerator(bundle) -> bool:
    """Whether a resource bundle asks for a GPU or an accelerator type (``GPU``, or
    ``accelerator_type:A100`` as the kit's jobs ask for A100 workers)."""
    return any(v > 0 and (k == "GPU" or k.startswith("accelerator_type:"))
               for k, v in dict(bundle).items())


def score(node_resources, resources, node_type, *, node_availability_summary):
    """Ray's UtilizationScorer signature; None where the type cannot hold any of the work, and
    for a GPU node type when none of the work asks for a GPU or an accelerator type."""
    from ray.autoscaler._private.resource_demand_scheduler import (
        _resource_based_utilization_scorer,
    )

    base = _resource_based_utilization_scorer(
        node_resources, resources, node_availability_summary=node_availability_summary)
    if base is None:
        return None
    # A GPU worker only for work that asks for one: Ray's own guard is a preference (it still
    # starts a GPU node when no CPU node type exists, as here), and it counts only "GPU", not
    # accelerator_type. On the fake cloud a Ray Data job's queued 1-CPU task made Ray's v1
    # autoscaler start a second A100 worker (p4de on-demand, $27/h). CPU-only work waits for
    # room on the head and the workers already running.
    if node_resources.get("GPU", 0) > 0 and not any(wants_accelerator(r) for r in resources):
        return None
    gpu_ok, matching, *utilisation = base
    preferred = order()
    rank = preferred.index(node_type) if node_type in preferred else len(preferred)
    # Among types EC2 refused, the one refused longest ago first: with every type failing, the
    # autoscaler retries them round the stack's order instead of asking for the first forever.
    return (gpu_ok, available(node_type, node_availability_summary), matching,
            -last_refused(node_type, node_availability_summary), -rank, *utilisation)
