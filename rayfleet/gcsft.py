"""GCS fault tolerance on a local cluster (`rayfleet local up --ha`): the facts and files.

Ray's GCS keeps the cluster's tables (nodes, actors, jobs, placement groups, Serve's
checkpoints in its KV store) in memory unless ``RAY_REDIS_ADDRESS`` names a Redis at the head's
start; then a gcs_server started again with the same command line reads them back, and the
raylets that lost it wait for it (up to ``RAY_gcs_rpc_server_reconnect_timeout_s``) instead of
exiting. Ray restarts nothing itself: that is left to whoever runs the head (KubeRay restarts
the head pod). Locally the kit does it: rayfleet/agents/gcs_supervisor.py leads the head and
starts gcs_server again when it dies (docs/faults.md, fault 9).

The local Redis is Debian's ``redis-server``, on 127.0.0.1 only (``protected-mode yes``), with
a random password (``requirepass``) that lives in a 0600 file in a 0700 folder of the state
folder; its append-only file lands in that folder too, created under umask 077. Ray passes the
password on to gcs_server (and the raylet) on their command lines: Ray 2.60 has no other way
(docs/security.md, "The local cluster's Redis").

Standard library only: a core module (docs/house.md, level 1).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import stat
from pathlib import Path

# Ray 2.60's variable names have their one home in raystart (the cloud's HA head uses them
# too); the values here are the local cluster's.
from rayfleet.raystart import GCS_RECONNECT_TIMEOUT_ENV as RECONNECT_TIMEOUT_ENV
from rayfleet.raystart import REDIS_ADDRESS_ENV

# How long a raylet (and a driver or worker process) retries a GCS it lost before it exits,
# on a local cluster. The supervisor starts gcs_server again at once and the GCS reads its
# tables back from Redis in a second or two; Ray's default (60 s) is set explicitly and
# doubled for a busy laptop. Past it the nodes give up rather than hang on a head that is not
# coming back. (A cloud head is replaced by `ray up`, minutes: raystart's 1800 s.)
RECONNECT_TIMEOUT_S = 120

REDIS_BINARY = "redis-server"
INSTALL_HINT = "apt-get install redis-server"
SUPERVISOR_NAME = "gcs_supervisor"
# Files in the Redis folder (0700): the password, the config that carries it, Redis's log and
# append-only file, and the supervisor's record of its restarts.
PASSWORD_FILE = "password"
CONFIG_FILE = "redis.conf"
LOG_FILE = "redis.log"
SUPERVISOR_STATUS = "gcs-supervisor.json"


def redis_binary() -> str | None:
    """Debian's redis-server on PATH (or /usr/bin, for a PATH without it), else None."""
    return shutil.which(REDIS_BINARY) or shutil.which(REDIS_BINARY, path="/usr/bin:/usr/sbin")


def make_folder(folder: Path) -> Path:
    """The Redis folder afresh, mode 0700: a previous cluster's files (its tables, which a new
    GCS would read back as its own) are removed first."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    return folder


def write_secret(path: Path, text: str) -> None:
    """A file only its owner may read, from the moment it exists (O_EXCL, mode at creation)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if stat.S_IMODE(path.stat().st_mode) != 0o600:
        raise OSError(f"{path} is not mode 0600")


def new_password(folder: Path) -> Path:
    path = folder / PASSWORD_FILE
    write_secret(path, secrets.token_hex(32))
    return path


def redis_config(folder: Path, port: int, password: str) -> str:
    """redis.conf for the GCS's store: loopback only, password required, data kept in the
    0700 folder (an append-only file: Redis restarted on its own keeps the tables)."""
    return "\n".join([
        "bind 127.0.0.1",
        "protected-mode yes",
        f"port {port}",
        f"requirepass {password}",
        f'dir "{folder}"',
        f'logfile "{folder / LOG_FILE}"',
        "daemonize no",
        'save ""',
        "appendonly yes",
        "appendfsync everysec",
        "",
    ])


def write_config(folder: Path, port: int) -> Path:
    """The password (new) and the config holding it, both 0600, in ``folder``."""
    password = new_password(folder).read_text()
    path = folder / CONFIG_FILE
    write_secret(path, redis_config(folder, port, password))
    return path


def auth_ping(s: socket.socket, password: str) -> bool:
    """AUTH with ``password``, then PING, on a connected socket (plain or TLS): whether Redis
    answered +OK and +PONG."""
    def command(*args: str) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(
            b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)
    s.sendall(command("AUTH", password) + command("PING"))
    data = b""
    while data.count(b"\r\n") < 2:
        chunk = s.recv(256)
        if not chunk:
            break
        data += chunk
    return data == b"+OK\r\n+PONG\r\n"


def redis_ping(port: int, password: str, timeout: float = 1.0) -> bool:
    """Whether the Redis on 127.0.0.1:port answers PING after AUTH with ``password``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            return auth_ping(s, password)
    except OSError:
        return False


def node_env() -> dict[str, str]:
    """What every node of an HA cluster (head and workers) starts Ray with."""
    return {RECONNECT_TIMEOUT_ENV: str(RECONNECT_TIMEOUT_S)}


def head_env(redis_port: int) -> dict[str, str]:
    """The head's: its GCS's store (the address only; the password goes on `ray start`'s
    command line, added by the supervisor from the 0600 file, never into an environment a
    job inherits)."""
    return {**node_env(), REDIS_ADDRESS_ENV: f"127.0.0.1:{redis_port}"}
