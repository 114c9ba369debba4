"""The operator's machine as the local commands see it: the kit's state folder, processes,
ports and logs. `local` and `metrics` both stand on it (neither imports the other for these)."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

from rayfleet.facts import RAY_PORTS, RAY_PORTS_BY_NAME

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


# Listener ports the kit picks for a process that binds them later (Ray's, HAProxy's): never in
# the kernel's ephemeral range, from which every outgoing connection draws its source port (a
# port picked there can be a client's by the time Ray binds it, and a check cannot tell a leaked
# listener from someone's connection); above Ray's own worker ports, and in none of the ranges
# Ray and Serve bind themselves (facts.RAY_PORTS: Serve's direct ingress among them).
PICK_FROM = RAY_PORTS_BY_NAME["worker-ports"].to_port + 1
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = EPHEMERAL) -> tuple[int, int]:
    """The kernel's ephemeral port range; Linux's default where it cannot be read."""
    try:
        low, high = map(int, path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def pickable(path: Path = EPHEMERAL) -> list[int]:
    low, high = ephemeral_range(path)
    taken = [(low, high)] + [(r.from_port, r.to_port) for r in RAY_PORTS]
    return [p for p in range(PICK_FROM, 65536) if not any(a <= p <= b for a, b in taken)]


def free_ports(n: int, candidates: list[int] | None = None) -> list[int]:
    """n distinct ports nothing is bound to on any address, drawn at random from pickable()
    (each held until all are picked)."""
    import random

    pool = candidates if candidates is not None else pickable()
    socks: list[socket.socket] = []
    try:
        for port in random.sample(pool, len(pool)):
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [s.getsockname()[1] for s in socks]
        raise OSError(f"fewer than {n} free ports from {PICK_FROM} up, outside the kernel's "
                      f"ephemeral range {'-'.join(map(str, ephemeral_range()))} and Ray's own")
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def port_holders(port: int) -> list[str]:
    """The processes with a TCP socket bound to ``port`` ("pid name"), found through
    /proc/net/tcp{,6} and each process's open files: what a "port still taken" message names."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    wanted = {f"socket:[{i}]" for i in inodes if i != "0"}
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    found.append(f"{d.name} {(d / 'comm').read_text().strip()}")
                    break
            except OSError:   # closed meanwhile (this listing's own fd, for one)
                continue
    return found


def last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["(empty log)"])[-1].strip()[:300]
