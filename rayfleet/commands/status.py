"""`rayfleet status [CLUSTER_YAML]`: per node type of a launched cluster, what runs, what is
launching and the last launch error with its AWS reason, one line each (rayfleet/capacity.py
reads the report).

It asks the head's dashboard (``/api/cluster_status``) through the tunnel `ray dashboard
<cluster.yaml>` opens, with the cluster's token, as `ray job submit` does. With the cluster
YAML, its node types come in the YAML's order (the order the head's scorer launches them in,
rayfleet/agents/fallover.py) and its token file is found the way render wrote it; a node type
no node has reached and no launch has touched still gets its line.

Then, with a cluster YAML of GPU types (its storage from render's facts), each GPU node's health
as the GPU health gate recorded it in the bucket (``health/``, rayfleet/agents/gpugate.py): one
line per gate run of the last HEALTH_SHOWN_S, its verdict as the node printed it, and the cap's
line for a type the head's scorer no longer launches; before the autoscaler's verdict, which
stays last. Read with the operator's AWS credentials.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from rayfleet import capacity, clusteryaml
from rayfleet.agents import gpugate
from rayfleet.commands.host import open_direct
from rayfleet.commands.render import default_token_file
from rayfleet.errors import ClusterError, RayfleetError
from rayfleet.facts import port

DEFAULT_ADDRESS = f"http://127.0.0.1:{port('dashboard')}"
HEALTH_SHOWN_S = 24 * 3600
HEALTH_PER_TYPE = 10


def _config(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        cfg, _ = clusteryaml.read(path, expand=True)
    except clusteryaml.Unloadable as e:
        if e.kind in (clusteryaml.MISSING, clusteryaml.UNREADABLE):
            raise RayfleetError(f"cannot read {path} ({e.strerror})") from None
        raise RayfleetError(f"{path} is not YAML: pass the cluster YAML `rayfleet render` "
                            "wrote") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("available_node_types"), dict):
        raise RayfleetError(f"{path} has no available_node_types: pass the cluster YAML "
                            "`rayfleet render` wrote")
    return cfg


def address_of(address: str | None) -> str:
    """--address, else RAY_ADDRESS when it is the dashboard's http(s) address, else the
    tunnel's default."""
    given = address or os.environ.get("RAY_ADDRESS", "")
    if given.startswith(("http://", "https://")):
        return given.rstrip("/")
    if address:
        raise RayfleetError(f"--address {address!r} is not the dashboard's http:// address "
                            f"(e.g. {DEFAULT_ADDRESS}, what `ray dashboard <cluster.yaml>` "
                            "forwards)")
    return DEFAULT_ADDRESS


def token_of(cfg: dict) -> str | None:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or (
        default_token_file(cfg["cluster_name"]) if cfg.get("cluster_name") else None)
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as e:
        raise RayfleetError(f"cannot read the cluster's token {path} ({e.strerror}); set "
                            "RAY_AUTH_TOKEN_PATH") from None


def fetch(address: str, token: str | None, timeout: float = 10) -> dict:
    """The dashboard's cluster status (``cluster_status``: the autoscaler's last report)."""
    req = urllib.request.Request(f"{address}/api/cluster_status",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with open_direct(req, timeout=timeout) as r:   # never through a proxy: the token
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ClusterError(f"{address} refused the request ({e.code}): the cluster's token "
                               "is missing or wrong (RAY_AUTH_TOKEN_PATH, or the CLUSTER_YAML "
                               "argument)") from None
        raise ClusterError(f"{address}/api/cluster_status answered {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ClusterError(f"cannot reach the dashboard at {address} ({reason}); open the "
                           "tunnel first: ray dashboard <cluster.yaml>") from None
    return (body.get("data") or {}).get("clusterStatus") or {}


def health_lines(storage: str, s3=None, now: float | None = None) -> list[str]:
    """The GPU nodes' health: each gate run of the last HEALTH_SHOWN_S (one per node set up;
    a host name alone does not tell nodes apart, as EC2 reuses private addresses), at most
    HEALTH_PER_TYPE per node type, oldest first, then each capped type's line."""
    now = time.time() if now is None else now
    try:
        records = gpugate.read_records(s3 or gpugate.s3_client(), storage,
                                       since=now - HEALTH_SHOWN_S)
    except Exception as e:  # noqa: BLE001 - boto3's and the endpoint's errors alike: one line
        return [f"GPU health: cannot read {storage.rstrip('/')}/{gpugate.HEALTH}/ "
                f"({type(e).__name__}: {str(e)[:200]})"]
    if not records:
        return [f"GPU health: no GPU node has run the health gate in the last "
                f"{HEALTH_SHOWN_S // 3600} h"]
    types = list(dict.fromkeys(r["node_type"] for r in records))
    shown = sorted((r for t in types for r in [x for x in records if x["node_type"] == t]
                    [-HEALTH_PER_TYPE:]), key=lambda r: r["time"])
    lines = [f"GPU health (the gate's verdicts of the last {HEALTH_SHOWN_S // 3600} h):"]
    for r in shown:
        when = datetime.datetime.fromtimestamp(r["time"], datetime.UTC).strftime("%H:%M:%SZ")
        lines.append(f"  {r['node_type']} {r.get('host', '?')} {when}: {r['line']}")
    lines += [f"  {line}" for t in types if (line := gpugate.capped(records, t, now))]
    return lines


def _health(config: str) -> list[str]:
    """The health lines of a cluster YAML with GPU types, where render's facts give its
    storage; one line saying why not where they cannot."""
    try:
        facts = clusteryaml.render_facts(config)
    except RayfleetError as e:
        return [f"GPU health: not shown ({e})"]
    if facts is None:
        return [f"GPU health: not shown ({config} has no storage of `rayfleet render`'s)"]
    return health_lines(facts.storage_uri)


def main(address: str | None = None, config: str | None = None, out=None) -> int:
    cfg = _config(config)
    url = address_of(address)
    rep = capacity.report(fetch(url, token_of(cfg)))
    cluster = clusteryaml.ClusterYaml(cfg)
    head = cluster.head_type
    order = [t.name for t in cluster.workers()]
    rows = [r for r in capacity.node_types(rep, order) if r.name != head]
    lines = [r.line() for r in rows] or ["no worker node types: the cluster does not autoscale "
                                         "(no `ray up` autoscaler report yet)"]
    if not rep:
        lines.insert(0, "the autoscaler has not reported yet (it does every few seconds "
                        "after `ray up`)")
    if config and any(t.resources.get("GPU") for t in cluster.workers()):
        lines += _health(config)
    failing = capacity.all_failing(rep, order) if order else []
    if failing:
        lines.append(capacity.failing_line(failing))
    print("\n".join(lines), file=out)
    return 0
