"""What would skew a run of the suite, said in one line at its start (pytest's header).

A run on a machine with little free disk (a full disk once made every raylet warn and two
fault tests fail), Ray/moto/HAProxy/Redis processes an earlier run left, or a load already
high, is slower and can fail for reasons that are not the code's: the line points a slow or
failed run at its cause. It only reports; it never signals what it finds (the kit did not start
those in this run).

Shared memory is the one thing a run cleans after itself here: vLLM's engine makes two
segments in /dev/shm (Python's shared_memory, 160 and 240 MiB, for its message queues) and
named semaphores, and a replica Serve kills leaves them there. At its end the run removes those
of its own (:func:`leftover_segments`): made during the run, by this user, and held by no live
process.
"""

from __future__ import annotations

import os
import shutil
import stat
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
SHM = Path("/dev/shm")
# What Python's multiprocessing names its shared memory segments and semaphores there.
SHM_PREFIXES = ("psm_", "sem.mp-")


@dataclass(frozen=True)
class Machine:
    free_gib: dict[str, float]            # mount point -> free GiB
    load1: float
    cores: int
    strays: dict[str, list[int]]          # server name -> pids
    netns: tuple[str, ...] = ()           # network namespaces left
    shm: tuple[str, ...] = ()             # /dev/shm segments no live process holds


def observe(proc: Path = Path("/proc"), me: int | None = None, netns: Path = NETNS,
            shm: Path = SHM) -> Machine:
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
    orphans = tuple(p.name for p in orphan_segments(shm, proc))
    return Machine(free, os.getloadavg()[0], os.cpu_count() or 1, strays, left, orphans)


def held(proc: Path = Path("/proc"), shm: Path = SHM) -> set[str]:
    """The names in ``shm`` that a live process maps or holds open."""
    names: set[str] = set()
    where = f"{shm}/"
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "maps").read_text().splitlines():
                if where in line:
                    names.add(line.split(where, 1)[1].split()[0])
            for fd in (d / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(where):
                    names.add(target[len(where):].split()[0])
        except OSError:   # gone meanwhile, or not ours to read
            continue
    return names


def orphan_segments(shm: Path = SHM, proc: Path = Path("/proc")) -> list[Path]:
    """This user's shared memory segments and semaphores (SHM_PREFIXES) in ``shm`` that no
    live process holds: what a killed owner left."""
    if not shm.is_dir():
        return []
    live, uid, out = held(proc, shm), os.getuid(), []
    for p in shm.iterdir():
        if not p.name.startswith(SHM_PREFIXES) or p.name in live:
            continue
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            out.append(p)
    return sorted(out)


def leftover_segments(before: set[str], shm: Path = SHM, proc: Path = Path("/proc")
                      ) -> list[Path]:
    """The orphan segments that were not there when the run started (``before``: every name
    in ``shm`` then): the run's own, to remove."""
    return [p for p in orphan_segments(shm, proc) if p.name not in before]


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
    if m.shm:
        findings.append(f"{len(m.shm)} shared memory segments no process holds in {SHM} "
                        f"({', '.join(m.shm[:3])}{'…' if len(m.shm) > 3 else ''})")
    least = min(m.free_gib.values(), default=0.0)
    if findings:
        return "machine NOT clean, expect a slower run: " + "; ".join(findings)
    return (f"machine clean: {least:.0f} GiB free, load {m.load1:.1f} on {m.cores} cores, "
            f"no Ray/moto/HAProxy/Redis or namespaces left from another run")
