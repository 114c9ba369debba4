"""The operator's machine as the local commands see it: the kit's state folder, processes,
ports and logs. `local` and `metrics` both stand on it (neither imports the other for these)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def state_dir() -> Path:
    """The rayfleet state folder: $RAYFLEET_HOME, else ~/.rayfleet."""
    return Path(os.environ.get("RAYFLEET_HOME") or Path.home() / ".rayfleet").expanduser()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process still answers kill(0); treat it as gone.
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def port_in_use(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (each held until all are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["(empty log)"])[-1].strip()[:300]
