"""The head's autoscaler scorer: launch GPU workers in the stack's order, and move on to the
next allowed type when EC2 has no capacity for one. A hook of Ray's v1 autoscaler, which loads
it by name from ``RAY_AUTOSCALER_UTILIZATION_SCORER`` and runs it inside itself: Ray's modules
only, imported there. How it ranks node types, and why Ray's own autoscalers do not do this:
docs/operations.md#when-ec2-has-no-capacity.

It also caps launches of a GPU type whose nodes the GPU health gate keeps refusing
(gpugate.capped, over the verdicts in the stack's storage, read again every REREAD_S): such a
type gets no score, so the autoscaler launches it no more and moves on in the stack's order. The
cap's one line goes to the autoscaler's stderr (monitor.err in the head's Ray logs) once per
verdict, and `rayfleet status` prints the same line from the same records.
"""

from __future__ import annotations

import os
import sys
import time

try:    # in the kit; on the head, gpugate.py sits beside this file (render's SCORER_ALSO)
    from rayfleet.agents import gpugate
except ImportError:
    import gpugate

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
# The stack's storage, where the GPU health gate records its verdicts (render sets it).
HEALTH_ENV = "RAYFLEET_HEALTH_STORAGE"
REREAD_S = 30
_health: dict = {"at": None, "records": [], "said": set()}


def capped(node_type: str, now: float | None = None, environ=os.environ) -> str | None:
    """The GPU health gate's cap on ``node_type`` (its one line), from the verdicts in the
    stack's storage; None under the cap, or where no storage is set."""
    storage = environ.get(HEALTH_ENV)
    if not storage:
        return None
    now = time.time() if now is None else now
    if _health["at"] is None or now - _health["at"] >= REREAD_S:
        _health["at"] = now
        try:
            # Short timeouts, one attempt: this runs inside the autoscaler's update loop.
            _health["records"] = gpugate.read_records(gpugate.s3_client(5, 1), storage,
                                                      since=now - gpugate.CAP_WINDOW_S)
        except Exception as e:  # noqa: BLE001 - the autoscaler must go on; said once a read
            print(f"rayfleet scorer: cannot read the GPU health verdicts in {storage} "
                  f"({type(e).__name__}: {str(e)[:200]}); the cap counts what it read last",
                  file=sys.stderr, flush=True)
    line = gpugate.capped(_health["records"], node_type, now)
    if line and line not in _health["said"]:
        _health["said"].add(line)
        print(f"rayfleet scorer: {line}", file=sys.stderr, flush=True)
    return line


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
    if node_resources.get("GPU", 0) > 0 and capped(node_type):
        return None
    gpu_ok, matching, *utilisation = base
    preferred = order()
    rank = preferred.index(node_type) if node_type in preferred else len(preferred)
    # Among types EC2 refused, the one refused longest ago first: with every type failing, the
    # autoscaler retries them round the stack's order instead of asking for the first forever.
    return (gpu_ok, available(node_type, node_availability_summary), matching,
            -last_refused(node_type, node_availability_summary), -rank, *utilisation)
