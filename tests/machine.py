"""What would skew a run of the suite, said in one line at its start (pytest's header).

A run on a machine with little free disk (a full disk once made every raylet warn and two
fault tests fail), Ray/moto/HAProxy/Redis processes an earlier run left, or a load already
high, is slower and can fail for reasons that are not the code's: the line points a slow or
failed run at its cause. It only reports; it never signals what it finds (the kit did not start
those in this run).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# Below this much free disk, Ray's file_system_monitor warns (95% full) and the wheelhouse
# (1.2 GB), the node folders and the fake cloud's clones stop fitting.
DISK_FLOOR_GIB = 20
# Process names of the servers the suite starts; any already running was not started by it.
SERVERS = ("raylet", "gcs_server", "haproxy", "redis-server", "moto_server")
# Where `ip netns add` leaves a name: the fake cloud's hosts, gone when it tears down.
NETNS = Path("/run/netns")
ROOTS = ("/", "/tmp", "/var/tmp")


@dataclass(frozen=True)
class Machine:
    free_gib: dict[str, float]            # mount point -> free GiB
    load1: float
    cores: int
    strays: dict[str, list[int]]          # server name -> pids
    netns: tuple[str, ...] = ()           # network namespaces left


def observe(proc: Path = Path("/proc"), me: int | None = None, netns: Path = NETNS) -> Machine:
    me = os.getpid() if me is None else me
    strays: dict[str, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            comm = (d / "comm").read_text().strip()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name in SERVERS:
            if comm == name or (name == "moto_server" and "moto_server" in cmd):
                strays.setdefault(name, []).append(int(d.name))
    free = {}
    for root in ROOTS:
        try:
            free[root] = shutil.disk_usage(root).free / 2**30
        except OSError:
            pass
    left = tuple(sorted(p.name for p in netns.iterdir())) if netns.is_dir() else ()
    return Machine(free, os.getloadavg()[0], os.cpu_count() or 1, strays, left)


def report(m: Machine) -> str:
    """One line: 'machine clean: ...' or 'machine NOT clean: <each finding>; ...'."""
    findings = []
    seen = set()
    for root, gib in sorted(m.free_gib.items()):
        if gib < DISK_FLOOR_GIB and round(gib, 1) not in seen:
            seen.add(round(gib, 1))
            findings.append(f"{gib:.1f} GiB free on {root} (floor {DISK_FLOOR_GIB})")
    # Above the cores: `make setup` just before (pip, about one core) does not count, a second
    # suite or a cluster left running does.
    if m.load1 > m.cores:
        findings.append(f"load {m.load1:.1f} on {m.cores} cores before the first test")
    for name, pids in sorted(m.strays.items()):
        shown = ",".join(map(str, sorted(pids)[:5])) + ("…" if len(pids) > 5 else "")
        findings.append(f"{len(pids)} {name} not started by this run (pids {shown})")
    if m.netns:
        findings.append(f"{len(m.netns)} network namespaces left ({', '.join(m.netns[:3])}"
                        f"{'…' if len(m.netns) > 3 else ''})")
    least = min(m.free_gib.values(), default=0.0)
    if findings:
        return "machine NOT clean, expect a slower run: " + "; ".join(findings)
    return (f"machine clean: {least:.0f} GiB free, load {m.load1:.1f} on {m.cores} cores, "
            f"no Ray/moto/HAProxy/Redis or namespaces left from another run")
