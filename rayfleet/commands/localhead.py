"""The local cluster's head: `ray start --head` in a process group of its own (under the kit's
GCS supervisor with --ha), whether it takes jobs yet, and stopping that group and only it
(commands/local.py says why)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rayfleet import gcsft, nodeenv, raystart
from rayfleet.commands.host import (alive, free_port, last_line, open_direct, port_in_use,
                                    start_ticks, state_dir)
from rayfleet.commands.localingress import ingress_env
from rayfleet.commands.localredis import (redis_folder, start_redis, stop_redis, supervised,
                                          supervisor_status)
from rayfleet.commands.localstate import (LocalCluster, agent, auth_env, ensure_token, forget,
                                          own_ray_temp_dir, ray_temp_dir, save_state,
                                          token_path)
from rayfleet.errors import ClusterError, ConfigError
from rayfleet.facts import LOCAL_METRICS_EXPORT_PORT, port
from rayfleet.ingress import BINARY, ENABLE

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
STRAGGLER_GRACE_S = 3.0
# `ray stop`'s own grace period before SIGKILL (its --grace-period default).
STOP_GRACE_S = 16.0


def _pick(default: int) -> int:
    return default if not port_in_use(default) else free_port()


def status_of(url: str, token: str | None, timeout: float = 2.0) -> int:
    """The HTTP status of GET ``url`` with the token, sent straight (never through a proxy)."""
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
        return status_of(f"{dashboard_url}/api/jobs/", token) == 200
    except (urllib.error.URLError, OSError):
        return False


def listening(port: int) -> bool:
    """Whether something on 127.0.0.1 takes a TCP connection on ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _ray_bin(python: str | None = None) -> str:
    # The `ray` next to the interpreter: the pinned Ray of that environment, whatever PATH says.
    candidate = Path(python or sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


def check_node_env(python: str | None) -> str:
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


def _head_env(python: str, token: Path, ingress_vars: dict[str, str]) -> dict[str, str]:
    """`ray start`'s environment: token auth with the cluster's token, the kit's interpreter
    first on PATH, Serve's ingress as asked, and no stray variable's say in any of it."""
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
    env.update(ingress_vars)
    for key in (gcsft.REDIS_ADDRESS_ENV, gcsft.RECONNECT_TIMEOUT_ENV):
        env.pop(key, None)  # HA is the flag's to turn on, not a stray variable's
    return env


def _head_argv(python: str, ports: dict[str, int], ha: bool, num_cpus: int | None,
               num_gpus: int | None, store: int | None) -> list[str]:
    return raystart.argv(
        # The HA head is not `--block`: that would kill the whole head when gcs_server dies
        # (the supervisor runs and watches it instead).
        _ray_bin(python), head=True, block=not ha, usage_stats=False,
        # The dashboard serves the Jobs API (remote code execution by design): it stays on
        # raystart's loopback host (CVE-2023-48022; rule 22). Remote users reach it through a
        # tunnel. The ports not named here are left to Ray's own (random) picks.
        ports=ports,
        # Ray 2.60 turns 127.0.0.1 into the machine's own address
        # (services.resolve_ip_for_localhost): the GCS, raylet and client server still bind
        # beyond loopback, behind the token (README, "What listens").
        node_ip_address="127.0.0.1", temp_dir=str(own_ray_temp_dir()),
        num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=store)


def start(python: str, *, gcs_port: int, dashboard_port: int, num_cpus: int | None,
          num_gpus: int | None, store: int | None, ingress: str,
          redis: str | None) -> tuple[subprocess.Popen, LocalCluster]:
    """Start the head and record it in the state file: the process and the record. redis:
    the redis-server binary with --ha (its Redis starts first and the head runs under the
    kit's supervisor), else None. A head that could not be started leaves no Redis."""
    token = ensure_token()
    logdir = state_dir() / "local"
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / "ray-head.log"
    client_port, agent_port = _pick(DEFAULT_CLIENT_PORT), _pick(DEFAULT_AGENT_PORT)
    metrics_port = _pick(DEFAULT_METRICS_PORT)
    ingress_vars, haproxy_metrics_port = ingress_env(ingress)
    ha = redis is not None
    cmd = _head_argv(python, {"gcs": gcs_port, "dashboard": dashboard_port,
                              "client": client_port, "dashboard-agent-http": agent_port,
                              "metrics-export": metrics_port}, ha, num_cpus, num_gpus, store)
    env = _head_env(python, token, ingress_vars)
    redis_pid = redis_port = redis_start = None
    if ha:
        redis_pid, redis_port = start_redis(redis)
        redis_start = start_ticks(redis_pid)
        env.update(gcsft.head_env(redis_port))
        cmd = [python, str(agent(gcsft.SUPERVISOR_NAME)),
               "--password-file", str(redis_folder() / gcsft.PASSWORD_FILE),
               "--status", str(supervisor_status()), "--", *cmd]
    try:
        with open(log, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        stop_redis(redis_pid, redis_start, time.time())
        raise
    cluster = LocalCluster(pid=proc.pid, pid_start=start_ticks(proc.pid), redis_start=redis_start,
                           gcs_port=gcs_port, dashboard_port=dashboard_port,
                           client_port=client_port, agent_port=agent_port, num_cpus=num_cpus,
                           num_gpus=num_gpus, object_store_memory=store, log=str(log),
                           started_at=time.time(), python=python, ingress=ingress,
                           haproxy_metrics_port=haproxy_metrics_port, ha=ha,
                           redis_pid=redis_pid, redis_port=redis_port)
    save_state(cluster)
    return proc, cluster


def _ready(cluster: LocalCluster, secret: str) -> bool:
    # The Jobs API answers before the head's dashboard agent has registered, and until it
    # has, `ray job submit` fails with "No available agent to submit job" (on a busy
    # machine the gap is seconds): ready means both.
    # And `ray start` names the cluster in <temp dir>/ray_current_cluster only after the
    # dashboard is up; a job submitted before that has its driver pointed elsewhere.
    return (jobs_api_ready(cluster.dashboard_url, secret) and listening(cluster.agent_port)
            and (ray_temp_dir() / "ray_current_cluster").exists()
            # HA: up once the supervisor watches gcs_server (after `ray start` exited).
            and (not cluster.ha or supervised()))


def wait_ready(proc: subprocess.Popen, cluster: LocalCluster) -> None:
    """Until the head `start` started takes jobs. One that exits first is forgotten (its Redis
    stopped); one that does not answer within START_TIMEOUT_S is stopped: ClusterError."""
    secret = token_path().read_text().strip()
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            forget()
            stop_redis(cluster.redis_pid, cluster.redis_start, time.time())
            raise ClusterError(f"ray start exited with code {proc.returncode}: "
                               f"{last_line(Path(cluster.log))} (full log: {cluster.log})")
        if _ready(cluster, secret):
            return
        time.sleep(0.5)
    stop(cluster)
    raise ClusterError(f"Ray head did not answer within {START_TIMEOUT_S}s; see {cluster.log}")


def stop(cluster: LocalCluster, timeout: float = STOP_GRACE_S) -> bool:
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
    forget()
    if cluster.ha:
        stop_redis(cluster.redis_pid, cluster.redis_start, cluster.started_at)  # after the head
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
