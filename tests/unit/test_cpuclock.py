"""The suite's CPU clock (tests/cpuclock.py): a process's cgroup counts its children's CPU, and
the sweep removes only an empty group of its own whose maker is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import cpuclock
from tests.conftest import REPO

BURN = """
import subprocess, sys
from tests import cpuclock
clock = cpuclock.Clock().start()
if clock.group is None:
    print("none", clock.why); sys.exit(0)
before = clock.seconds()
# A detached grandchild: the CPU it burns counts all the same.
subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                "while time.process_time() - t < 1.0: pass"], start_new_session=True)
print("used", clock.seconds() - before, clock.group)
clock.stop()
"""


def test_a_process_group_counts_the_cpu_of_what_it_starts():
    out = subprocess.run([sys.executable, "-c", BURN], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    kind, *rest = out.stdout.split()
    if os.geteuid() != 0:   # not ours to make cgroups: the clock says why in one line
        assert kind == "none" and rest, out.stdout
        return
    assert kind == "used", out.stdout
    used, group = float(rest[0]), rest[1]
    assert 1.0 <= used < 3.0, used
    assert not os.path.exists(group), "the clock's group was left behind"


def test_the_sweep_removes_only_empty_groups_whose_maker_is_gone(tmp_path, monkeypatch):
    from rayfleet.commands.host import start_ticks

    me = f"{cpuclock.PREFIX}{os.getpid()}-{start_ticks(os.getpid())}"
    gone = f"{cpuclock.PREFIX}999999999-1"
    busy = f"{cpuclock.PREFIX}999999998-1"
    other = "someone-elses"
    for name, procs in ((me, ""), (gone, ""), (busy, "4242\n"), (other, "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text(procs)
    # A real cgroup's control files go with rmdir; a plain folder keeps them, so rmdir fails
    # there: the sweep's choice is read from what it tried to remove.
    tried = []
    monkeypatch.setattr(type(tmp_path), "rmdir", lambda self: tried.append(self.name))
    assert [g.name for g in cpuclock.sweep(tmp_path)] == [gone]
    assert tried == [gone]
