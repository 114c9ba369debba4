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
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rayfleet import gcsft, nodeenv, raystart
from rayfleet.agents.gcs_supervisor import comm
from rayfleet.agents.haproxy_guard import MAX_SOCKET_PATH
# `prometheus`: up() has a `metrics` flag of its own.
from rayfleet.commands import metrics as prometheus
from rayfleet.commands.host import (alive, free_port, free_ports, is_same, last_line,
                                    no_proxy_with, open_direct, port_in_use, start_ticks,
                                    state_dir)
from rayfleet.entrypoint import parse_size
from rayfleet.errors import ClusterError, ConfigError, RayfleetError
from rayfleet.facts import LOCAL_METRICS_EXPORT_PORT, port
from rayfleet.ingress import (
    BINARY,
    DEFAULT_INGRESS,
    ENABLE,
    GUARD_NAME,
    INGRESS_CHOICES,
    haproxy_env,
)

# Ray's own defaults, the ports a cluster of the stack uses too.
DEFAULT_GCS_PORT = port("gcs")
DEFAULT_DASHBOARD_PORT = port("dashboard")
# Auxiliary ports: Ray's defaults when free, otherwise any free port, so a second cluster
# (the test suite's, say) can run beside the user's.
DEFAULT_CLIENT_PORT = port("client")
DEFAULT_AGENT_PORT = port("dashboard-agent-http")
# The node's Prometheus endpoint (facts.LOCAL_METRICS_EXPORT_PORT).
DEFAULT_METRICS_PORT = LOCAL_METRICS_EXPORT_PORT
START_TIMEOUT_S = 120


def ray_temp_dir() -> Path:
    """Ray's session folder for this cluster, one per rayfleet state folder. Ray's default,
    /tmp/ray, is shared by every cluster on the machine, and a job's driver is pointed at
    whichever cluster *last* wrote /tmp/ray/ray_current_cluster (job_supervisor resolves
    "auto"): a second cluster on the same machine would steal the first one's jobs. Kept
    short: Ray's Unix socket paths under it must stay within 107 bytes."""
    digest = hashlib.sha1(str(state_dir().resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"rayfleet-{digest}"


def own_ray_temp_dir() -> Path:
    """ray_temp_dir(), made 0700 if new; refused when it is a link or another user's (its
    name is predictable, in a shared /tmp), tightened to 0700 when it is this user's."""
    folder = ray_temp_dir()
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ClusterError(f"cannot make Ray's folder {folder} ({e.strerror})") from None
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ClusterError(f"Ray's folder {folder} is a link or another user's: remove it "
                           "(or set RAYFLEET_HOME elsewhere) and run `up` again")
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def token_path() -> Path:
    return state_dir() / "auth_token"


def ensure_token(path: Path | str | None = None) -> Path:
    """Create a cluster token once (0600); tighten the mode of an existing one. Default: the
    local cluster's token; `rayfleet render` passes a per-cluster path. A folder it creates is
    0700; one that exists is left as it is, unless another user owns it or may write in it (a
    token there could be swapped): then it refuses, as it does a token that is a link."""
    path = Path(path).expanduser() if path is not None else token_path()
    folder = path.parent
    if not folder.is_dir():
        folder.mkdir(parents=True, mode=0o700)
    st = folder.stat()
    if st.st_uid != os.geteuid() or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise RayfleetError(f"token folder {folder} is another user's or others may write in "
                            "it; keep the token in a folder of your own")
    if path.is_symlink():
        raise RayfleetError(f"token file {path} is a link; the token must be a file of its own")
    if not path.exists():
        # O_EXCL + mode at creation: the token is never readable by others, even briefly.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    elif stat.S_IMODE(path.stat().st_mode) != 0o600:
        os.chmod(path, 0o600)
    if not path.read_text().strip():
        raise RayfleetError(f"token file {path} is empty; delete it and create it again")
    return path


def auth_env(token: Path | None = None) -> dict[str, str]:
    """Environment that makes any Ray process or client use token auth with our token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token or token_path())}


@dataclass
class LocalCluster:
    pid: int
    gcs_port: int
    dashboard_port: int
    client_port: int
    agent_port: int
    num_cpus: int | None
    num_gpus: int | None
    object_store_memory: int | None
    log: str
    started_at: float
    python: str | None = None   # the interpreter Ray runs from (None: state of an older kit)
    ingress: str = "python"     # Serve's ingress (rayfleet.ingress); older state: the proxy
    haproxy_metrics_port: int | None = None  # HAProxy's exporter on 127.0.0.1, when haproxy
    ha: bool = False                # GCS fault tolerance (--ha): the GCS's tables in Redis
    redis_pid: int | None = None    # that Redis (its own process group)
    redis_port: int | None = None   # on 127.0.0.1
    # Start ticks (host.start_ticks) of the head's leader and of Redis: with the pid, each
    # names one process, so a pid the kernel reused is never signalled (None: older state).
    pid_start: int | None = None
    redis_start: int | None = None

    @property
    def redis_address(self) -> str | None:
        return f"127.0.0.1:{self.redis_port}" if self.ha else None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def client_env(self) -> dict[str, str]:
        return {
            # ray.init() and drivers read RAY_ADDRESS (the GCS); the Jobs CLI prefers
            # RAY_API_SERVER_ADDRESS and `serve deploy` reads RAY_DASHBOARD_ADDRESS.
            "RAY_ADDRESS": self.address,
            "RAY_API_SERVER_ADDRESS": self.dashboard_url,
            "RAY_DASHBOARD_ADDRESS": self.dashboard_url,
            **auth_env(),
            # Ray's clients (requests) send the token to a proxy unless told not to.
            "NO_PROXY": no_proxy_with(), "no_proxy": no_proxy_with(),
            # A node or driver started from these waits for a restarted GCS as the head's do.
            **(gcsft.node_env() if self.ha else {}),
        }


def _state_file() -> Path:
    return state_dir() / "local" / "cluster.json"


def load_state() -> LocalCluster | None:
    """The cluster `up` recorded, if any. A record whose head pid now names another process
    (the cluster ended without `down`: a reboot, a SIGKILL) is forgotten, saying so in one
    line: nothing of it is signalled. (A pid that names no process at all stays: what is left
    of its process group can only be the head's, as the kernel reuses no pid still a group's.)"""
    try:
        cluster = LocalCluster(**json.loads(_state_file().read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None
    if alive(cluster.pid) and not is_same(cluster.pid, cluster.pid_start, cluster.started_at):
        print(f"rayfleet: forgot the local cluster of {_state_file()}: its head (pid "
              f"{cluster.pid}) is gone and the pid is another process's now", file=sys.stderr)
        if cluster.ha:
            _stop_redis(cluster.redis_pid, cluster.redis_start, cluster.started_at)
        _forget()
        return None
    return cluster


def _save_state(cluster: LocalCluster) -> None:
    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cluster), indent=2))
    tmp.replace(path)


def _pick(default: int) -> int:
    return default if not port_in_use(default) else free_port()


def _request(url: str, token: str | None, timeout: float = 2.0) -> int:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with open_direct(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def jobs_api_ready(dashboard_url: str, token: str | None) -> bool:
    try:
        return _request(f"{dashboard_url}/api/jobs/", token) == 200
    except (urllib.error.URLError, OSError):
        return False


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

    existing = load_state()
    if existing and alive(existing.pid):
        token = ensure_token().read_text().strip()
        if jobs_api_ready(existing.dashboard_url, token):
            _same_settings(existing, {k: v for k, v in asked.items() if v is not None}, store)
            prom = _start_metrics(*_prepare_metrics(prometheus_port),
                                  existing.haproxy_metrics_port) if metrics else None
            if not quiet:
                _print_info(existing, "rayfleet local cluster is already up.", prom=prom)
            return existing
        raise ClusterError(
            f"a rayfleet head (pid {existing.pid}) is running but its Jobs API at "
            f"{existing.dashboard_url} does not answer; run `rayfleet local down` first")

    if existing and existing.ha:   # what a head that died without `down` left running
        _stop_redis(existing.redis_pid, existing.redis_start, existing.started_at)
    redis = gcsft.redis_binary() if ha else None
    if ha and redis is None:
        raise ClusterError(f"--ha keeps the GCS's tables in Redis, and {gcsft.REDIS_BINARY} is "
                           f"not installed: install it with `{gcsft.INSTALL_HINT}` (as root)")

    checks = ((port, "GCS", "--port"), (dashboard_port, "dashboard", "--dashboard-port"))
    for p, what, flag in checks:
        if port_in_use(p):
            raise ClusterError(
                f"port {p} ({what}) is already in use by another process; stop it "
                f"(`ray stop` if it is another Ray) or pick another with {flag}")

    python = _check_node_env(python)
    # Prometheus's port and binary are settled before anything starts.
    prepared = _prepare_metrics(prometheus_port, taken=(port, dashboard_port)) if metrics \
        else None
    token = ensure_token()
    logdir = state_dir() / "local"
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / "ray-head.log"
    client_port, agent_port = _pick(DEFAULT_CLIENT_PORT), _pick(DEFAULT_AGENT_PORT)
    metrics_port = _pick(DEFAULT_METRICS_PORT)
    ingress = ingress or DEFAULT_INGRESS
    ingress_env, haproxy_metrics_port = _ingress_env(ingress)
    cmd = raystart.argv(
        # The HA head is not `--block`: that would kill the whole head when gcs_server dies
        # (the supervisor below runs and watches it instead).
        _ray_bin(python), head=True, block=not ha, usage_stats=False,
        # The dashboard serves the Jobs API (remote code execution by design): it stays on
        # raystart's loopback host (CVE-2023-48022; rule 22). Remote users reach it through a
        # tunnel. The ports not named here are left to Ray's own (random) picks.
        ports={"gcs": port, "dashboard": dashboard_port, "client": client_port,
               "dashboard-agent-http": agent_port, "metrics-export": metrics_port},
        # Ray 2.60 turns 127.0.0.1 into the machine's own address
        # (services.resolve_ip_for_localhost): the GCS, raylet and client server still bind
        # beyond loopback, behind the token (README, "What listens").
        node_ip_address="127.0.0.1", temp_dir=str(own_ray_temp_dir()),
        num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=store)
    env = {**os.environ, **auth_env(token)}
    # Job drivers inherit the head's PATH: put the kit's interpreter first so that
    # `ray job submit -- python -m workloads...` runs with the pinned Ray and torch even
    # when the user never activated the venv.
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    env.pop("RAY_AUTH_TOKEN", None)  # a stray token in the environment would win over the file
    # On SIGTERM, Ray 2.60's `ray start --block` first drains its node for up to 30 s, waiting
    # for it to go idle so Serve can move replicas elsewhere. A one-node cluster has nowhere
    # to move them, and a head that has run any job never goes idle (Ray Data's autoscaling
    # coordinator actor lives on), so `down` would sit out the whole grace period before
    # SIGKILLing everything; without the drain it stops the node at once.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    # The ingress is the kit's choice (--ingress), not a stray variable's: HAProxy is never
    # turned on without the guard. Ray's other RAY_SERVE_HAPROXY_* tunings pass through.
    env.pop(ENABLE, None)
    env.pop(BINARY, None)
    env.update(ingress_env)
    for key in (gcsft.REDIS_ADDRESS_ENV, gcsft.RECONNECT_TIMEOUT_ENV):
        env.pop(key, None)  # HA is the flag's to turn on, not a stray variable's
    redis_pid = redis_port = redis_start = None
    if ha:
        redis_pid, redis_port = _start_redis(redis)
        redis_start = start_ticks(redis_pid)
        env.update(gcsft.head_env(redis_port))
        cmd = [python, str(_agent(gcsft.SUPERVISOR_NAME)),
               "--password-file", str(_redis_folder() / gcsft.PASSWORD_FILE),
               "--status", str(_supervisor_status()), "--", *cmd]
    try:
        with open(log, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        _stop_redis(redis_pid, redis_start, time.time())
        raise
    cluster = LocalCluster(pid=proc.pid, pid_start=start_ticks(proc.pid), redis_start=redis_start,
                           gcs_port=port, dashboard_port=dashboard_port,
                           client_port=client_port, agent_port=agent_port, num_cpus=num_cpus,
                           num_gpus=num_gpus, object_store_memory=store, log=str(log),
                           started_at=time.time(), python=python, ingress=ingress,
                           haproxy_metrics_port=haproxy_metrics_port, ha=ha,
                           redis_pid=redis_pid, redis_port=redis_port)
    _save_state(cluster)
    secret = token.read_text().strip()
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            _forget()
            _stop_redis(redis_pid, redis_start, time.time())
            raise ClusterError(f"ray start exited with code {proc.returncode}: "
                               f"{last_line(log)} (full log: {log})")
        # The Jobs API answers before the head's dashboard agent has registered, and until it
        # has, `ray job submit` fails with "No available agent to submit job" (on a busy
        # machine the gap is seconds): ready means both.
        # And `ray start` names the cluster in <temp dir>/ray_current_cluster only after the
        # dashboard is up; a job submitted before that has its driver pointed elsewhere.
        if (jobs_api_ready(cluster.dashboard_url, secret) and _listening(agent_port)
                and (ray_temp_dir() / "ray_current_cluster").exists()
                # HA: up once the supervisor watches gcs_server (after `ray start` exited).
                and (not ha or _supervised())):
            try:
                prom = _start_metrics(*prepared, haproxy_metrics_port) if prepared else None
            except RayfleetError:
                _stop(cluster)  # nothing half-done: no cluster without the Prometheus asked for
                raise
            if not quiet:
                _print_info(cluster, "rayfleet local cluster is up.", prom=prom)
            return cluster
        time.sleep(0.5)
    _stop(cluster)
    raise ClusterError(f"Ray head did not answer within {START_TIMEOUT_S}s; see {log}")


def _ingress_env(ingress: str) -> tuple[dict[str, str], int | None]:
    """`ray start`'s environment for Serve's ingress, and HAProxy's exporter port.

    HAProxy's files go to a 0700 folder of this cluster's own; its stats page, exporter and
    Serve's fallback proxy get free ports of their own (two HAProxies never share a port: Ray
    starts them without SO_REUSEPORT)."""
    if ingress != "haproxy":
        return {}, None
    folder = _haproxy_folder()
    shutil.rmtree(folder, ignore_errors=True)  # a previous run's sockets and state
    try:
        # In a shared /tmp: what this user cannot remove (another user's folder, a link
        # planted there) is refused, never used.
        folder.mkdir(mode=0o700)
    except OSError as e:
        raise ClusterError(f"cannot make HAProxy's folder {folder} ({e.strerror}): remove it, "
                           f"or use --ingress python") from None
    folder.chmod(0o700)
    # Free ports of their own, never the usual ones: HAProxy and the fallback proxy bind them
    # only when Serve starts, so two clusters that both found the usual port free at `up`
    # would collide at their first `serve deploy`.
    stats, exporter, http, grpc = free_ports(4)
    fallback = {"serve-fallback-proxy": http, "serve-fallback-proxy-grpc": grpc}
    guard = _agent(GUARD_NAME)
    return haproxy_env(str(folder), str(guard), stats, exporter, fallback), exporter


def _agent(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "agents" / f"{name}.py"


def _redis_folder() -> Path:
    return state_dir() / "local" / "redis"


def _supervisor_status() -> Path:
    return _redis_folder() / gcsft.SUPERVISOR_STATUS


REDIS_START_TIMEOUT_S = 30


def _start_redis(binary: str) -> tuple[int, int]:
    """The GCS's Redis: (pid, port). A fresh 0700 folder (a previous cluster's tables would
    be read back as this one's), a free port on 127.0.0.1, the password and config 0600, and
    every file Redis writes created under umask 077."""
    folder = gcsft.make_folder(_redis_folder())
    redis_port = free_port()
    config = gcsft.write_config(folder, redis_port)
    password = (folder / gcsft.PASSWORD_FILE).read_text()
    log = folder / gcsft.LOG_FILE
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as logf:
        proc = subprocess.Popen([binary, str(config)], cwd=folder, stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT, umask=0o077,
                                start_new_session=True)
    deadline = time.time() + REDIS_START_TIMEOUT_S
    while not gcsft.redis_ping(redis_port, password):
        if proc.poll() is not None or time.time() > deadline:
            _stop_redis(proc.pid, start_ticks(proc.pid), time.time())
            raise ClusterError(f"{gcsft.REDIS_BINARY} did not start on 127.0.0.1:{redis_port}"
                               f": {last_line(log)} (full log: {log})")
        time.sleep(0.1)
    return proc.pid, redis_port


def _stop_redis(pid: int | None, ticks: int | None, before: float,
                timeout: float = 10.0) -> None:
    """Stop the cluster's Redis (SIGTERM, then SIGKILL) and remove its folder: the password,
    the config and the GCS's tables. Only the process recorded (host.is_same), and a Redis."""
    if pid is not None and comm(pid).startswith(gcsft.REDIS_BINARY) and is_same(pid, ticks,
                                                                             before):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.time() + timeout
        while time.time() < end and alive(pid):
            time.sleep(0.1)
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(_redis_folder(), ignore_errors=True)


def _supervised() -> bool:
    try:
        return bool(json.loads(_supervisor_status().read_text())["gcs_pid"])
    except (OSError, ValueError, KeyError):
        return False


def _ha_lines(cluster: LocalCluster) -> list[str]:
    if not cluster.ha:
        return ["HA:         off (`rayfleet local up --ha`: the GCS's tables in Redis)"]
    restarts = []
    try:
        restarts = json.loads(_supervisor_status().read_text())["restarts"]
    except (OSError, ValueError, KeyError):
        pass
    return [f"HA:         on: the GCS's tables in Redis at {cluster.redis_address} (loopback; "
            f"password in {_redis_folder() / gcsft.PASSWORD_FILE}, mode 0600); gcs_server "
            f"started again {len(restarts)} time(s) by the head's supervisor"]


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


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _ray_bin(python: str | None = None) -> str:
    # The `ray` next to the interpreter: the pinned Ray of that environment, whatever PATH says.
    candidate = Path(python or sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


def _check_node_env(python: str | None) -> str:
    """The interpreter to start from, once it is known to hold the node environment (the
    same check a job would otherwise fail on later, on a worker, or after training)."""
    env = nodeenv.load()
    if python is None:
        python, lacking = sys.executable, nodeenv.missing(env.all)
    else:
        # Not resolved: a venv's python is a symlink to the base interpreter, whose
        # site-packages are not the venv's.
        path = Path(python).expanduser().absolute()
        if not path.is_file():
            raise ConfigError("--python", f"{python} is not an interpreter")
        python, lacking = str(path), nodeenv.missing_in(str(path), env.all)
    if lacking:
        shown = ", ".join(lacking[:4]) + (f" and {len(lacking) - 4} more" if len(lacking) > 4
                                          else "")
        raise ClusterError(f"{python} lacks the node environment: {shown} (`make setup`, or "
                           "pip install pyproject.toml's dependencies, then its deepspeed extra "
                           "with --no-build-isolation)")
    return python


def _forget() -> None:
    try:
        _state_file().unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(_haproxy_folder(), ignore_errors=True)  # HAProxy's sockets and state


# Ray puts Serve's HAProxy sockets in a folder of the node's own under the one it is given:
# the node id, 56 hex characters; the longer socket is metrics.sock.
_SOCKET_TAIL = len("/" + "0" * 56 + "/metrics.sock")


def _haproxy_folder() -> Path:
    """Serve's HAProxy files (rayfleet.ingress): beside Ray's session folder, as short, since
    HAProxy refuses a socket path over MAX_SOCKET_PATH characters; under /tmp where the temp
    folder (TMPDIR) is too long for that (the guard would refuse every deploy)."""
    name = ray_temp_dir().name.replace("rayfleet-", "rfhap-")
    folder = ray_temp_dir().with_name(name)
    if len(str(folder)) + _SOCKET_TAIL > MAX_SOCKET_PATH:
        folder = Path("/tmp") / name
    return folder


STRAGGLER_GRACE_S = 3.0


# `ray stop`'s own grace period before SIGKILL (its --grace-period default).
STOP_GRACE_S = 16.0


def _stop(cluster: LocalCluster, timeout: float = STOP_GRACE_S) -> bool:
    """SIGTERM the `ray start --block` leader only: it tears its children down in order, as
    `ray stop` would (a group-wide SIGTERM leaves it hung on unreaped children). Whatever is
    left of that process group, and only of it, gets SIGKILL after the grace period.
    Returns whether the leader itself had to be killed (its own teardown did not finish)."""
    try:
        pgid = os.getpgid(cluster.pid)
        os.kill(cluster.pid, signal.SIGTERM)
    except ProcessLookupError:
        pgid = cluster.pid  # the leader is gone; its group may still hold raylet/workers
    end = time.time() + timeout
    while time.time() < end and _group_alive(pgid):
        if not alive(cluster.pid):
            # The leader has finished its orderly teardown; what is left of the group are
            # stragglers (idle workers, a job driver) that would hold `down` for the full
            # grace period: a few seconds more, then SIGKILL.
            end = min(end, time.time() + STRAGGLER_GRACE_S)
        time.sleep(0.3)
    forced = alive(cluster.pid)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _forget()
    if cluster.ha:
        _stop_redis(cluster.redis_pid, cluster.redis_start, cluster.started_at)  # after the head
    return forced


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Only zombies left (children of this very process) count as gone.
    try:
        while os.waitpid(-pgid, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


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
    forced = _stop(cluster)
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
    env = require_running().client_env()
    # Ray reads RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH (which wins over ~/.ray/auth_token):
    # a token the user's shell already exports would be sent instead of the cluster's.
    stray = "RAY_AUTH_TOKEN" in os.environ
    if shell == "fish":
        return ["set -e RAY_AUTH_TOKEN;"] * stray + [f"set -gx {k} {v};" for k, v in env.items()]
    return ["unset RAY_AUTH_TOKEN"] * stray + [f"export {k}={v}" for k, v in env.items()]


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
