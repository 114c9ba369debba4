"""CPU time per test, where the cores are shared (the suite's budget is CPU, not wall time).

Each pytest process (an xdist worker, or the one process) moves itself into a cpuacct cgroup of
its own when it starts, so every process it starts (the session's Ray cluster, the fake cloud's
nodes and their sshd sessions, vLLM) is counted with it, detached or not. Each test's reports
carry the CPU that tree used during the phase (setup, call, teardown); the run ends with the
tests that used the most and the total. Where no cgroup can be made (no cgroup v1 cpuacct or
v2 cpu.stat, not root), the table says so in one line and the run goes on.

Only cgroups this module made are removed: named ``rft-cpu-<pid>-<start ticks>``, empty, and
their maker gone."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rayfleet.commands.host import start_ticks

PREFIX = "rft-cpu-"


def _mount() -> tuple[Path, str] | None:
    """(where this process's cgroup is, "v1" or "v2"), for the controller that counts CPU."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    groups = Path("/proc/self/cgroup").read_text().splitlines()
    for line in mounts:
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup" and "cpuacct" in options.split(","):
            mine = next((g.split(":", 2)[2] for g in groups
                         if "cpuacct" in g.split(":", 2)[1].split(",")), None)
            if mine is not None:
                return Path(fields[4]) / mine.lstrip("/"), "v1"
    for line in mounts:
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            mine = next((g.split(":", 2)[2] for g in groups if g.startswith("0::")), None)
            if mine is not None:
                return Path(fields[4]) / mine.lstrip("/"), "v2"
    return None


class Clock:
    """This process's own cgroup and its CPU so far, in seconds."""

    def __init__(self) -> None:
        self.group: Path | None = None
        self.kind = ""
        self.why = ""

    def start(self) -> Clock:
        try:
            found = _mount()
            if found is None:
                self.why = "no cgroup v1 cpuacct or cgroup v2 on this machine"
                return self
            parent, self.kind = found
            sweep(parent)
            pid = os.getpid()
            group = parent / f"{PREFIX}{pid}-{start_ticks(pid)}"
            group.mkdir()
            (group / "cgroup.procs").write_text(f"{pid}\n")
            self.group = group
        except OSError as e:
            self.why = f"cannot make a cgroup ({e.strerror or e})"
        return self

    def seconds(self) -> float | None:
        if self.group is None:
            return None
        try:
            if self.kind == "v1":
                return int((self.group / "cpuacct.usage").read_text()) / 1e9
            stat = (self.group / "cpu.stat").read_text()
            return int(re.search(r"^usage_usec (\d+)", stat, re.M).group(1)) / 1e6
        except (OSError, AttributeError, ValueError):
            return None

    def stop(self) -> None:
        """Back to the parent group, and this one removed if nothing is left in it (a process
        still running there keeps it, for the next run's sweep)."""
        if self.group is None:
            return
        try:
            (self.group.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.group.rmdir()
        except OSError:
            pass
        self.group = None


def sweep(parent: Path) -> list[Path]:
    """Remove the empty cgroups an earlier run of this module left whose maker is gone."""
    removed = []
    for group in parent.glob(f"{PREFIX}*"):
        m = re.fullmatch(rf"{PREFIX}(\d+)-(\d+)", group.name)
        if not m or not group.is_dir():
            continue
        alive = start_ticks(int(m.group(1))) == int(m.group(2))
        try:
            if not alive and not (group / "cgroup.procs").read_text().strip():
                group.rmdir()
                removed.append(group)
        except OSError:
            pass
    return removed


def table(cpu: dict[str, float], wall: dict[str, float], top: int = 25) -> list[str]:
    """The run's CPU per test, most first, beside its wall time."""
    if not cpu:
        return []
    total = sum(cpu.values())
    lines = [f"CPU per test (each pytest process's cgroup, its children included): "
             f"{total / 60:.1f} CPU-min in all; the {min(top, len(cpu))} that used the most:"]
    for nodeid, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{seconds:8.1f}s CPU {wall.get(nodeid, 0.0):8.1f}s wall  {nodeid}")
    return lines
