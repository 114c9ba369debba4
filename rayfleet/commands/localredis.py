"""The local cluster's Redis (`rayfleet local up --ha`): its folder in the state folder, the
process, and the head's supervisor's record of gcs_server (rayfleet.gcsft has the facts and
files, rayfleet/agents/gcs_supervisor.py the supervisor)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from rayfleet import gcsft
from rayfleet.agents.gcs_supervisor import comm
from rayfleet.commands.host import alive, free_port, is_same, last_line, start_ticks, state_dir
from rayfleet.errors import ClusterError

REDIS_START_TIMEOUT_S = 30


def redis_folder() -> Path:
    return state_dir() / "local" / "redis"


def supervisor_status() -> Path:
    return redis_folder() / gcsft.SUPERVISOR_STATUS


def start_redis(binary: str) -> tuple[int, int]:
    """The GCS's Redis: (pid, port). A fresh 0700 folder (a previous cluster's tables would
    be read back as this one's), a free port on 127.0.0.1, the password and config 0600, and
    every file Redis writes created under umask 077."""
    folder = gcsft.make_folder(redis_folder())
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
            stop_redis(proc.pid, start_ticks(proc.pid), time.time())
            raise ClusterError(f"{gcsft.REDIS_BINARY} did not start on 127.0.0.1:{redis_port}"
                               f": {last_line(log)} (full log: {log})")
        time.sleep(0.1)
    return proc.pid, redis_port


def stop_redis(pid: int | None, ticks: int | None, before: float,
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
    shutil.rmtree(redis_folder(), ignore_errors=True)


def supervised() -> bool:
    """Whether the head's supervisor watches a gcs_server (its status file names one)."""
    try:
        return bool(json.loads(supervisor_status().read_text())["gcs_pid"])
    except (OSError, ValueError, KeyError):
        return False


def restarts() -> list:
    """The supervisor's record of the gcs_servers it started again ([] before the first)."""
    try:
        return json.loads(supervisor_status().read_text())["restarts"]
    except (OSError, ValueError, KeyError):
        return []
