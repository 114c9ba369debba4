"""`ray start`'s command line, built here once for every node the kit starts: the cluster YAML's
start commands (``rayfleet render``), the local head (``rayfleet local up``) and the Ansible
role's launch script. The role's template (infra/ansible/roles/ray_node/templates/
ray-node-run.sh.j2) cannot call Python on a node; tests/unit/test_raystart.py renders it for
heads and workers, with and without each optional flag, and holds its command line equal to
:func:`argv`'s for the same inputs, flag by flag and in order.

Every port is a :data:`rayfleet.facts.RAY_PORTS` entry, passed with the entry's own flag: by
default all of them at facts' numbers (what infra's security group opens, rule 4), a worker
leaving out the head's own listeners; the local head names the ones it pins.

Standard library only (and facts), like the rest of the core the workloads import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from rayfleet.facts import HEAD_ONLY_PORTS, RAY_PORTS

# The dashboard serves the Jobs API, which runs code by design (CVE-2023-48022): loopback
# only, reached through a tunnel (rule 22).
DASHBOARD_HOST = "127.0.0.1"

# Ray opens a socket per worker and object: the default soft limit on open files (1024) runs
# out on big nodes, so every cluster node's start raises it to this (`ulimit -n`, and the role's
# systemd unit's LimitNOFILE).
NOFILE = 65536
# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES): 75 MiB.
MIN_OBJECT_STORE_BYTES = 75 * 1024 * 1024

# GCS fault tolerance (rayfleet:headHa on AWS; `rayfleet local up --ha`): the GCS keeps its
# tables in an external Redis, so a head that comes back at the same address finds the
# cluster's state, and every other node's raylet waits for it instead of exiting. The names
# are Ray 2.60's (ray/_private/node.py reads RAY_REDIS_ADDRESS; gcs_server and the raylet read
# the RAY_<config> variables and RAY_REDIS_CA_CERT, the CA bundle hiredis verifies the server
# with). This module is their one home: render and the local cluster import them.
REDIS_ADDRESS_ENV = "RAY_REDIS_ADDRESS"
REDIS_CA_CERT_ENV = "RAY_REDIS_CA_CERT"
# The GCS's Redis keys live under this namespace: the stack's cluster name, so a head
# replaced under the same name reads the same keys (Ray's own default would do for one
# cluster per Redis; naming it says which cluster the keys are).
EXTERNAL_STORAGE_NAMESPACE_ENV = "RAY_external_storage_namespace"
# How long a raylet (and a driver or worker process) keeps retrying a GCS it lost before it
# exits. Ray's default is 60 s, shorter than any head replacement: `ray up` launches an
# instance (1-2 min), waits for SSH over SSM, then the head's setup installs the node
# environment and vLLM from PyPI on the fresh instance (many minutes), then starts Ray. 30
# minutes covers that with margin; a worker whose head has not come back by then exits its
# raylet (it is billing anyway until `ray down` or the next head's autoscaler ends it).
GCS_RECONNECT_TIMEOUT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
GCS_RECONNECT_TIMEOUT_S = 1800


def gcs_ft_env(redis_url: str | None = None, *, ca_cert: str | None = None,
               namespace: str | None = None) -> dict[str, str]:
    """The environment a node of a fault-tolerant cluster starts Ray with: every node, head
    and workers, the reconnect timeout; the head also its GCS store (``redis_url``, e.g.
    ``rediss://host:port``: ``rediss`` is Ray's switch for TLS), the CA bundle that verifies
    it and the namespace of its keys. The password is not here: see :func:`argv`."""
    env = {GCS_RECONNECT_TIMEOUT_ENV: str(GCS_RECONNECT_TIMEOUT_S)}
    for name, value in ((REDIS_ADDRESS_ENV, redis_url), (REDIS_CA_CERT_ENV, ca_cert),
                        (EXTERNAL_STORAGE_NAMESPACE_ENV, namespace)):
        if value:
            env[name] = value
    return env


# A port's number, or (from, to) for a range (worker-ports: --min-worker-port/--max-worker-port).
Port = int | tuple[int, int]


def pinned_ports(head: bool) -> dict[str, Port]:
    """Every port `ray start` can pin, at facts' numbers; a worker's leave out the head's own
    listeners (GCS, dashboard, client server). Ssh and Serve's ports have no `ray start` flag."""
    return {p.name: (p.from_port, p.to_port) if "/" in p.flag else p.from_port
            for p in RAY_PORTS
            if p.flag.startswith("--") and (head or p.name not in HEAD_ONLY_PORTS)}


def port_flags(ports: Mapping[str, Port]) -> list[str]:
    """``--flag=N`` for each port given, in :data:`RAY_PORTS`' order."""
    unknown = set(ports) - set(pinned_ports(head=True))
    if unknown:
        raise ValueError(f"no `ray start` flag pins {sorted(unknown)}")
    flags = []
    for p in RAY_PORTS:
        if p.name not in ports:
            continue
        number = ports[p.name]
        if "/" in p.flag:
            (lo_flag, hi_flag), (lo, hi) = p.flag.split("/"), number
            flags += [f"{lo_flag}={lo}", f"{hi_flag}={hi}"]
        else:
            flags.append(f"{p.flag}={number}")
    return flags


def argv(ray: str, *, head: bool, address: str | None = None,
         ports: Mapping[str, Port] | None = None, dashboard_host: str = DASHBOARD_HOST,
         autoscaling_config: str | None = None, node_ip_address: str | None = None,
         num_cpus: int | None = None, num_gpus: int | None = None,
         object_store_memory: int | None = None, resources: Mapping[str, float] | None = None,
         temp_dir: str | None = None, extra: Sequence[str] = (), block: bool = False,
         usage_stats: bool = True, log_style: str | None = None) -> list[str]:
    """``[ray, "start", ...]``: a head (``head=True``) or a worker joining ``address``.

    ``ports``: RAY_PORTS name -> number (a range: (from, to)); default :func:`pinned_ports`.
    Options left at None (or empty) are left to Ray. The flags come in one order: ``--block``,
    what the node is (``--head`` with the autoscaling config and the dashboard's host, or
    ``--address``), its ports, then its address, resources, temp folder, ``extra`` verbatim,
    usage stats and log style.

    A head whose GCS keeps its tables in Redis (:data:`REDIS_ADDRESS_ENV` in its environment)
    gets its password from the kit's supervisor (rayfleet/agents/gcs_supervisor.py), which
    appends ``--redis-password`` read from a 0600 file, so it is in no YAML and no command
    line the kit writes. No ``--redis-username``: Ray then sends ``AUTH <password>``, which an
    ElastiCache auth token expects.
    """
    if head == (address is not None):
        raise ValueError("a head has no address to join; a worker needs one")
    ports = pinned_ports(head) if ports is None else ports
    head_only = set(ports) & set(HEAD_ONLY_PORTS)
    if head_only and not head:
        raise ValueError(f"a worker does not listen on {sorted(head_only)}")
    cmd = [ray, "start"] + ["--block"] * block
    if head:
        cmd.append("--head")
        if autoscaling_config:
            cmd.append(f"--autoscaling-config={autoscaling_config}")
        cmd.append(f"--dashboard-host={dashboard_host}")
    else:
        cmd.append(f"--address={address}")
    cmd += port_flags(ports)
    for flag, value in (("--node-ip-address", node_ip_address), ("--num-cpus", num_cpus),
                        ("--num-gpus", num_gpus), ("--object-store-memory", object_store_memory),
                        ("--resources", json.dumps(dict(resources)) if resources else None),
                        ("--temp-dir", temp_dir)):
        if value not in (None, ""):
            cmd.append(f"{flag}={value}")
    cmd += list(extra)
    if not usage_stats:
        cmd.append("--disable-usage-stats")
    if log_style:
        cmd.append(f"--log-style={log_style}")
    return cmd

