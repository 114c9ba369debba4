"""The operator's machine as the local commands see it: the kit's state folder, processes,
ports and logs. `local` and `metrics` both stand on it (neither imports the other for these)."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

# The token never leaves for a proxy: every request the kit makes to a cluster (they carry
# the cluster's token) goes straight to its address, whatever http_proxy/https_proxy say.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Hosts the shells `rayfleet local env` sets up never send through a proxy (Ray's clients use
# requests, which reads NO_PROXY).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def open_direct(request: urllib.request.Request | str, timeout: float):
    """urllib's urlopen, with no proxy whatever the environment says."""
    return _DIRECT.open(request, timeout=timeout)


def no_proxy_with(hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> str:
    """The environment's NO_PROXY with ``hosts`` added (for a shell that talks to clusters)."""
    have = [h.strip() for h in (os.environ.get("NO_PROXY") or os.environ.get("no_proxy")
                                or "").split(",") if h.strip()]
    return ",".join(have + [h for h in hosts if h not in have])


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


def start_ticks(pid: int) -> int | None:
    """When the process started: clock ticks since boot (/proc/<pid>/stat, field 22), which
    with the pid names one process for good. None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When the process started, as a time.time() (boot time + its start ticks)."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    with open("/proc/stat") as f:
        boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def is_same(pid: int, ticks: int | None, before: float) -> bool:
    """Whether ``pid`` is still the process recorded: its start ticks when recorded, else (a
    record of an older kit) a start no later than ``before``, when it was recorded; a pid the
    kernel gave to a newer process fails both. Never true for a pid that is gone."""
    if ticks is not None:
        return start_ticks(pid) == ticks
    start = started_at(pid)
    return start is not None and start <= before + 1.0   # btime is in whole seconds


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
