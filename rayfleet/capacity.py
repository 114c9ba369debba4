"""What the head's autoscaler knows of each node type: how many run, how many are launching,
and why its last launch failed. One reader for `rayfleet status` and the training driver's
fail-fast, both over the report Ray's autoscaler (v1, what `ray up` runs) writes to the GCS
after every update: the internal KV key ``__autoscaling_status`` (``ray_constants.
DEBUG_AUTOSCALING_STATUS``), served as JSON by the dashboard's ``/api/cluster_status``. Its
``autoscaler_report`` is ``asdict(AutoscalerSummary)``: ``active_nodes`` and
``pending_launches`` by node type, ``pending_nodes`` as (ip, type, status), ``failed_nodes``
(launched but failed setup) and ``node_availability_summary``: per node type the last launch
attempt's outcome and, when it failed, the error's category and description (EC2's code and
message, e.g. ``InsufficientInstanceCapacity``: "We currently do not have sufficient p4d.24xlarge
capacity in the Availability Zone you requested (us-east-1b)..."). Ray forgets a failure after
``AUTOSCALER_NODE_AVAILABILITY_MAX_STALENESS_S`` (30 min) or at the type's next good launch.

Standard library only: the driver imports it on the head.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class NodeTypeStatus:
    name: str
    running: int
    pending: int                 # launching, or launched and not yet up
    failed_setup: int            # launched, but setup or `ray start` failed
    error: str | None            # the last launch's error: "<code>: <message>"
    error_at: float | None       # when that launch was tried (Unix time)

    def line(self) -> str:
        """One line: ``<type>: 1 running, 0 pending; last launch failed at 18:02:11Z:
        InsufficientInstanceCapacity: ...``."""
        head = f"{self.name}: {self.running} running, {self.pending} pending"
        if self.failed_setup:
            head += f", {self.failed_setup} failed setup"
        if self.error is None:
            return head
        when = ("" if self.error_at is None else " at " + datetime.datetime.fromtimestamp(
            self.error_at, datetime.timezone.utc).strftime("%H:%M:%SZ"))
        return f"{head}; last launch failed{when}: {' '.join(self.error.split())}"


def _get(d: Mapping[str, Any] | None, key: str) -> Any:
    """``d[key]``, or its camelCase spelling: the dashboard's REST answers convert every
    snake_case key of the report to camelCase (``rest_response(convert_google_style=True)``),
    the KV holds the report as the autoscaler wrote it. Node type names are keys too, and are
    looked up as given."""
    if not d:
        return None
    if key in d:
        return d[key]
    first, *rest = key.split("_")
    return d.get(first + "".join(w.title() for w in rest))


def report(status: Mapping[str, Any] | str | bytes | None) -> dict[str, Any]:
    """The ``autoscaler_report`` of an autoscaler status (the KV value, or the dashboard's
    ``clusterStatus``); {} when the autoscaler has written none yet (or there is none: a
    cluster started without `ray up` does not autoscale)."""
    if isinstance(status, (str, bytes)):
        status = json.loads(status)
    return dict(_get(status, "autoscaler_report") or {})


def node_types(rep: Mapping[str, Any], order: Iterable[str] = ()) -> list[NodeTypeStatus]:
    """Every node type the report or ``order`` names: ``order``'s first (the cluster YAML's
    node types, as render lists them), then any other the report mentions, sorted."""
    active = _get(rep, "active_nodes") or {}
    launching = dict(_get(rep, "pending_launches") or {})
    for _ip, name, _status in _get(rep, "pending_nodes") or []:
        launching[name] = launching.get(name, 0) + 1
    failed: dict[str, int] = {}
    for _ip, name in _get(rep, "failed_nodes") or []:
        failed[name] = failed.get(name, 0) + 1
    avail = _get(_get(rep, "node_availability_summary"), "node_availabilities") or {}
    names = list(dict.fromkeys(order))
    names += sorted({*active, *launching, *failed, *avail} - set(names))
    out = []
    for name in names:
        record = avail.get(name) or {}
        error = at = None
        available = _get(record, "is_available")
        if record and available is not None and not available:
            info = _get(record, "unavailable_node_information") or {}
            error = ": ".join(p for p in (info.get("category"), info.get("description")) if p) \
                or "launch failed (no reason given)"
            at = _get(record, "last_checked_timestamp")
        out.append(NodeTypeStatus(name, int(active.get(name, 0)), int(launching.get(name, 0)),
                                  failed.get(name, 0), error, at))
    return out


def all_failing(rep: Mapping[str, Any], candidates: Iterable[str],
                since: float | None = None) -> list[NodeTypeStatus]:
    """The candidates' statuses when every one of them has a failed last launch (tried at or
    after ``since``, when given) and none is running or launching: the autoscaler has nothing
    left that may have capacity. [] otherwise (or with no candidates).

    ``since`` keeps a failure older than the question out of the verdict: Ray remembers one for
    30 min, and a type that failed for an earlier job may have capacity now; the autoscaler
    tries it again (in the stack's order) only once new work asks for it."""
    names = list(dict.fromkeys(candidates))
    rows = [r for r in node_types(rep, names) if r.name in names]
    if rows and all(r.error is not None and not r.running and not r.pending
                    and (since is None or (r.error_at or 0) >= since) for r in rows):
        return rows
    return []


def failing_line(rows: list[NodeTypeStatus]) -> str:
    """The one line a job (or `rayfleet status`) gives when no allowed type can launch."""
    reasons = "; ".join(f"{r.name}: {' '.join(r.error.split())}" for r in rows if r.error)
    return (f"no allowed worker type can launch ({reasons}); the autoscaler keeps retrying in "
            "the stack's order: wait, add a type or a capacity reservation to "
            "rayfleet:workerInstanceTypes, or see `rayfleet status`")
