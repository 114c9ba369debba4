"""The local cluster's files: its record (cluster.json) and token in the state folder, the
folders Ray and Serve's HAProxy write in (in the shared /tmp, so a predictable name there is
this user's own or refused), and the node agents the head runs from the kit. A record whose
pid is another process's now is forgotten, and nothing of it signalled."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import secrets
import shutil
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rayfleet import gcsft
from rayfleet.agents.haproxy_guard import MAX_SOCKET_PATH
from rayfleet.commands.host import alive, is_same, no_proxy_with, state_dir
from rayfleet.commands.localredis import stop_redis
from rayfleet.errors import ClusterError, RayfleetError


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


# Ray puts Serve's HAProxy sockets in a folder of the node's own under the one it is given:
# the node id, 56 hex characters; the longer socket is metrics.sock.
_SOCKET_TAIL = len("/" + "0" * 56 + "/metrics.sock")


def haproxy_folder() -> Path:
    """Serve's HAProxy files (rayfleet.ingress): beside Ray's session folder, as short, since
    HAProxy refuses a socket path over MAX_SOCKET_PATH characters; under /tmp where the temp
    folder (TMPDIR) is too long for that (the guard would refuse every deploy)."""
    name = ray_temp_dir().name.replace("rayfleet-", "rfhap-")
    folder = ray_temp_dir().with_name(name)
    if len(str(folder)) + _SOCKET_TAIL > MAX_SOCKET_PATH:
        folder = Path("/tmp") / name
    return folder


def agent(name: str) -> Path:
    """The node agent ``name`` (rayfleet/agents/), which the head runs from the kit itself."""
    return Path(__file__).resolve().parent.parent / "agents" / f"{name}.py"


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
            stop_redis(cluster.redis_pid, cluster.redis_start, cluster.started_at)
        forget()
        return None
    return cluster


def save_state(cluster: LocalCluster) -> None:
    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cluster), indent=2))
    tmp.replace(path)


def forget() -> None:
    """Remove the record, and HAProxy's sockets and state (nothing is stopped here)."""
    try:
        _state_file().unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(haproxy_folder(), ignore_errors=True)  # HAProxy's sockets and state


def _fish(value: str) -> str:
    if re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def export_lines(env: dict[str, str], shell: str = "sh") -> list[str]:
    """``env`` as lines for ``eval``, in sh's or fish's words. As `rayfleet local env` does:
    Ray reads RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH, so one the shell already exports is
    unset (it would be sent instead of the cluster's)."""
    stray = "RAY_AUTH_TOKEN" in os.environ
    if shell == "fish":
        return (["set -e RAY_AUTH_TOKEN;"] * stray
                + [f"set -gx {k} {_fish(v)};" for k, v in env.items()])
    return ["unset RAY_AUTH_TOKEN"] * stray + [f"export {k}={shlex.quote(v)}"
                                               for k, v in env.items()]
