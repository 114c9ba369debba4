"""CPU time from /proc: a process tree's, this run's own, the whole machine's busy time
(benchmarks measure CPU where cores are shared, not wall time)."""

from __future__ import annotations

import os
from pathlib import Path


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process this user can read."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:
            continue
        out[int(entry)] = (int(stat[1]), cmd)
    return out


def home_of(pid: int) -> str | None:
    """The RAYFLEET_HOME in a process's environment: which kit cluster it belongs to."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for var in env:
        if var.startswith(b"RAYFLEET_HOME="):
            return var.split(b"=", 1)[1].decode(errors="replace")
    return None


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and
    iowait), summed over cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_processes(home: str | None, bare_pid: int) -> list[int]:
    """This run's processes: the benchmark (and load generator) itself, the bare server's
    process group, and the throwaway cluster's (its RAYFLEET_HOME in their environment)."""
    out = []
    for pid in processes():
        try:
            group = os.getpgid(pid)
        except OSError:
            continue
        if pid == os.getpid() or group == bare_pid or (home and home_of(pid) == home):
            out.append(pid)
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (their own threads, not their children)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) / tick
    return total
