"""`rayfleet local up | down | status | env`: a real single-machine Ray cluster with token auth.

The head runs as ``ray start --head --block`` in its own process group, so ``down`` stops
exactly what ``up`` started (``ray stop`` would kill every Ray process on the machine, the
user's own included). Token authentication (Ray >= 2.52, rule 21) is on: the token is
generated once into the state folder with mode 0600 and handed to Ray through
``RAY_AUTH_TOKEN_PATH``; clients get it the same way from ``rayfleet local env``.

With ``--ha`` the GCS keeps its tables in a Redis of the cluster's own (Debian's redis-server on
127.0.0.1, a password in a 0600 file, rayfleet.gcsft) and the head runs under the kit's
supervisor (rayfleet/agents/gcs_supervisor.py), which starts gcs_server again when it dies:
the raylets wait for it and the cluster's jobs, actors and Serve apps are still there
(docs/faults.md, fault 9). ``down`` stops Redis too and removes its files.

The machinery is in one module per concern: the cluster's files (localstate), its head
(localhead), its Redis (localredis) and Serve's ingress (localingress).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rayfleet import gcsft, raystart
# `prometheus`: up() has a `metrics` flag of its own.
from rayfleet.commands import metrics as prometheus
from rayfleet.commands.host import alive, port_in_use
from rayfleet.commands.localhead import (DEFAULT_DASHBOARD_PORT, DEFAULT_GCS_PORT,
                                         STOP_GRACE_S, check_node_env, jobs_api_ready, start,
                                         stop, wait_ready)
from rayfleet.commands.localredis import redis_folder, restarts, stop_redis
from rayfleet.commands.localstate import (LocalCluster, ensure_token, export_lines, load_state,
                                          ray_temp_dir)
from rayfleet.entrypoint import parse_size
from rayfleet.errors import ClusterError, ConfigError, RayfleetError
from rayfleet.ingress import DEFAULT_INGRESS, INGRESS_CHOICES


def _print_info(cluster: LocalCluster, headline: str, out=sys.stdout, prom=None) -> None:
    env = cluster.client_env()
    print(headline, file=out)
    print(f"  address:    {cluster.address}", file=out)
    print(f"  dashboard:  {cluster.dashboard_url}  (loopback only; token required)", file=out)
    print(f"  token:      {env['RAY_AUTH_TOKEN_PATH']}  (mode 0600)", file=out)
    for line in _ha_lines(cluster):
        print(f"  {line}", file=out)
    if prom is not None:
        print("\n".join(prometheus.info_lines(prom, ray_temp_dir())), file=out)
    print("  submit a job:", file=out)
    print('    eval "$(rayfleet local env)"', file=out)
    print("    ray job submit --working-dir . -- python -m workloads.train --smoke-test",
          file=out)


def up(num_cpus: int | None = None, num_gpus: int | None = None,
       object_store_memory: str | int | None = None, port: int | None = None,
       dashboard_port: int | None = None, quiet: bool = False,
       python: str | None = None, metrics: bool = False,
       prometheus_port: int | None = None, ingress: str | None = None,
       ha: bool = False) -> LocalCluster:
    """Start the head (idempotent). Raises RayfleetError with one line on any expected failure.

    python: the interpreter whose environment the head, its workers and job drivers run in
    (default: this one). It must hold the node environment, as every node of a cluster does.
    A cluster that is already up is reused only if every setting given here matches it.
    metrics: also run Prometheus on 127.0.0.1:prometheus_port scraping the cluster; asked of
    a cluster that is already up, it starts Prometheus for it.
    ingress: Serve's ingress, "haproxy" (default) or "python" (rayfleet.ingress).
    ha: GCS fault tolerance: the GCS's tables in a Redis on 127.0.0.1 (Debian's redis-server),
    the head under the kit's supervisor, which starts gcs_server again when it dies."""
    asked = {"--num-cpus": num_cpus, "--num-gpus": num_gpus,
             "--object-store-memory": object_store_memory, "--port": port,
             "--dashboard-port": dashboard_port, "--python": python, "--ingress": ingress,
             "--ha": True if ha else None}
    port, dashboard_port, store = _checked_flags(port, dashboard_port, object_store_memory,
                                                 ingress, metrics, prometheus_port)
    existing = load_state()
    if existing and alive(existing.pid):
        return _already_up(existing, {k: v for k, v in asked.items() if v is not None}, store,
                           metrics, prometheus_port, quiet)
    if existing and existing.ha:   # what a head that died without `down` left running
        stop_redis(existing.redis_pid, existing.redis_start, existing.started_at)
    redis = _redis_binary(ha)
    _check_ports(port, dashboard_port)
    python = check_node_env(python)
    # Prometheus's port and binary are settled before anything starts.
    prepared = _prepare_metrics(prometheus_port, taken=(port, dashboard_port)) if metrics \
        else None
    proc, cluster = start(python, gcs_port=port, dashboard_port=dashboard_port,
                          num_cpus=num_cpus, num_gpus=num_gpus, store=store,
                          ingress=ingress or DEFAULT_INGRESS, redis=redis)
    wait_ready(proc, cluster)
    try:
        prom = _start_metrics(*prepared, cluster.haproxy_metrics_port) if prepared else None
    except RayfleetError:
        stop(cluster)  # nothing half-done: no cluster without the Prometheus asked for
        raise
    if not quiet:
        _print_info(cluster, "rayfleet local cluster is up.", prom=prom)
    return cluster


def _checked_flags(port: int | None, dashboard_port: int | None,
                   object_store_memory: str | int | None, ingress: str | None, metrics: bool,
                   prometheus_port: int | None) -> tuple[int, int, int | None]:
    """`up`'s flags checked before anything is looked at: (GCS port, dashboard port, object
    store bytes), Ray's defaults for the ports not given."""
    if ingress is not None and ingress not in INGRESS_CHOICES:
        raise ConfigError(f"--ingress {ingress!r}: choose one of {', '.join(INGRESS_CHOICES)}")
    port = DEFAULT_GCS_PORT if port is None else port
    dashboard_port = DEFAULT_DASHBOARD_PORT if dashboard_port is None else dashboard_port
    store = parse_size(object_store_memory)
    if store is not None and store < raystart.MIN_OBJECT_STORE_BYTES:
        raise ConfigError("--object-store-memory",
                          f"{store} bytes is below Ray's minimum of "
                          f"{raystart.MIN_OBJECT_STORE_BYTES // 2**20}MiB")
    if prometheus_port is not None and not metrics:
        raise ConfigError("--prometheus-port", "goes with --metrics")
    return port, dashboard_port, store


def _already_up(existing: LocalCluster, asked: dict, store: int | None, metrics: bool,
                prometheus_port: int | None, quiet: bool) -> LocalCluster:
    """`up` on a running head: reused when its Jobs API answers and the settings asked match
    (Prometheus started for it when asked); refused in one line otherwise."""
    token = ensure_token().read_text().strip()
    if jobs_api_ready(existing.dashboard_url, token):
        _same_settings(existing, asked, store)
        prom = _start_metrics(*_prepare_metrics(prometheus_port),
                              existing.haproxy_metrics_port) if metrics else None
        if not quiet:
            _print_info(existing, "rayfleet local cluster is already up.", prom=prom)
        return existing
    raise ClusterError(
        f"a rayfleet head (pid {existing.pid}) is running but its Jobs API at "
        f"{existing.dashboard_url} does not answer; run `rayfleet local down` first")


def _redis_binary(ha: bool) -> str | None:
    """The redis-server `--ha` keeps the GCS's tables in (None without --ha)."""
    redis = gcsft.redis_binary() if ha else None
    if ha and redis is None:
        raise ClusterError(f"--ha keeps the GCS's tables in Redis, and {gcsft.REDIS_BINARY} is "
                           f"not installed: install it with `{gcsft.INSTALL_HINT}` (as root)")
    return redis


def _check_ports(port: int, dashboard_port: int) -> None:
    checks = ((port, "GCS", "--port"), (dashboard_port, "dashboard", "--dashboard-port"))
    for p, what, flag in checks:
        if port_in_use(p):
            raise ClusterError(
                f"port {p} ({what}) is already in use by another process; stop it "
                f"(`ray stop` if it is another Ray) or pick another with {flag}")


def _ha_lines(cluster: LocalCluster) -> list[str]:
    if not cluster.ha:
        return ["HA:         off (`rayfleet local up --ha`: the GCS's tables in Redis)"]
    return [f"HA:         on: the GCS's tables in Redis at {cluster.redis_address} (loopback; "
            f"password in {redis_folder() / gcsft.PASSWORD_FILE}, mode 0600); gcs_server "
            f"started again {len(restarts())} time(s) by the head's supervisor"]


def _same_settings(existing: LocalCluster, asked: dict, store: int | None) -> None:
    """`up` on a running cluster: settings the user gave that the cluster does not have are
    refused in one line (answering "already up" would silently ignore them)."""
    have = {"--num-cpus": existing.num_cpus, "--num-gpus": existing.num_gpus,
            "--object-store-memory": existing.object_store_memory,
            "--port": existing.gcs_port, "--dashboard-port": existing.dashboard_port,
            "--python": existing.python, "--ingress": existing.ingress,
            "--ha": True if existing.ha else None}
    if "--object-store-memory" in asked:
        asked["--object-store-memory"] = store
    if "--python" in asked:
        asked["--python"] = str(Path(asked["--python"]).expanduser().absolute())
    differ = [f"{flag} {'default' if have[flag] is None else have[flag]} (asked {value})"
              for flag, value in asked.items() if have[flag] != value]
    if differ:
        raise ClusterError(f"a rayfleet local cluster is already up with other settings: "
                           f"{', '.join(differ)}; `rayfleet local down` first to restart it "
                           "with these, or leave the flags out to use it as it is")


def _prepare_metrics(prometheus_port: int | None, taken: tuple[int, ...] = ()):
    """(port, binary) for a Prometheus still to start; (None, None) when one already runs."""
    running = prometheus.load_local()
    if running is not None:
        if prometheus_port not in (None, running.port):
            raise ClusterError(f"Prometheus is already up on port {running.port} (asked "
                               f"--prometheus-port {prometheus_port}); `rayfleet local down` "
                               "first, or leave the flag out")
        return None, None
    prometheus_port = prometheus.PROMETHEUS_PORT if prometheus_port is None else prometheus_port
    prometheus.check_port(prometheus_port)
    if prometheus_port in taken:
        raise ConfigError("--prometheus-port", f"{prometheus_port} is the cluster's own port")
    return prometheus_port, prometheus.ensure_binary()


def _start_metrics(prometheus_port: int | None, binary: str | None,
                   haproxy_port: int | None = None):
    if binary is None:
        return prometheus.load_local()
    return prometheus.start_local(ray_temp_dir(), prometheus_port, binary, haproxy_port)


def down(quiet: bool = False) -> bool:
    """Stop the head `up` started, and only it. Returns False when there was nothing to stop."""
    prom = prometheus.stop_local()
    if prom is not None and not quiet:
        print(f"prometheus stopped (pid {prom.pid}).")
    cluster = load_state()
    if cluster is None:
        if not quiet:
            print("no rayfleet local cluster is running" +
                  (" (nothing to stop)." if prom is None else "."))
        return prom is not None
    started = time.time()
    forced = stop(cluster)
    if not quiet:
        how = (f"its teardown did not finish in {STOP_GRACE_S:g} s, so what was left was killed"
               if forced else f"in {time.time() - started:.1f} s")
        print(f"rayfleet local cluster stopped (head pid {cluster.pid}); {how}.")
    return True


def require_running() -> LocalCluster:
    cluster = load_state()
    if cluster is None or not alive(cluster.pid):
        raise ClusterError("no rayfleet local cluster is running; start one with "
                           "`rayfleet local up`")
    return cluster


def env_lines(shell: str = "sh") -> list[str]:
    return export_lines(require_running().client_env(), shell)


def status(out=sys.stdout) -> int:
    """Print nodes (ALIVE/DEAD) and free CPUs/GPUs/memory, read from the GCS."""
    cluster = require_running()
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over our token file (env_lines)
    os.environ.update(cluster.client_env())
    # Imported here: `rayfleet --help` and `local env` must not pay for importing Ray.
    import ray

    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = ray.nodes()
        free = ray.available_resources()
        total = ray.cluster_resources()
    finally:
        ray.shutdown()
    print(f"rayfleet local cluster at {cluster.address}  dashboard {cluster.dashboard_url}",
          file=out)
    print("\n".join(_ha_lines(cluster)), file=out)
    prom = prometheus.load_local()
    if prom is not None:
        print("\n".join(prometheus.info_lines(prom, ray_temp_dir())), file=out)
    print(f"{'NODE':<18} {'STATE':<6} {'ADDRESS':<16} {'CPU':>5} {'GPU':>5} {'MEMORY':>10}",
          file=out)
    for n in nodes:
        res = n.get("Resources", {})
        print(f"{n['NodeID'][:16]:<18} {'ALIVE' if n['Alive'] else 'DEAD':<6} "
              f"{n.get('NodeManagerAddress', '?'):<16} {res.get('CPU', 0):>5g} "
              f"{res.get('GPU', 0):>5g} {_gib(res.get('memory', 0)):>10}", file=out)
    print(f"free: CPU {free.get('CPU', 0):g}/{total.get('CPU', 0):g}  "
          f"GPU {free.get('GPU', 0):g}/{total.get('GPU', 0):g}  "
          f"memory {_gib(free.get('memory', 0))}/{_gib(total.get('memory', 0))}  "
          f"object store {_gib(free.get('object_store_memory', 0))}/"
          f"{_gib(total.get('object_store_memory', 0))}", file=out)
    return 0


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}GiB"
