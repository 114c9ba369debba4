"""The line `make test` starts with: what would skew the run (tests/machine.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.machine import DISK_FLOOR_GIB, Machine, leftover_segments, observe, report


def test_a_clean_machine_says_so():
    line = report(Machine({"/": 80.0, "/tmp": 80.0}, 0.2, 2, {}))
    assert line.startswith("machine clean: 80 GiB free, load 0.2 on 2 cores")
    # `make setup`'s own pip, just before the run, is about one core: not a finding.
    assert report(Machine({"/": 80.0}, 1.4, 2, {})).startswith("machine clean")


def test_each_thing_that_skews_a_run_is_named():
    line = report(Machine({"/": 80.0, "/var/tmp": DISK_FLOOR_GIB - 10.3}, 3.5, 2,
                          {"raylet": [41, 40], "moto_server": [7]}, ("rayfleet-n1",)))
    assert line == ("machine NOT clean, expect a slower run: 9.7 GiB free on /var/tmp "
                    f"(floor {DISK_FLOOR_GIB}); load 3.5 on 2 cores before the first test; "
                    "1 moto_server not started by this run (pids 7); 2 raylet not started by "
                    "this run (pids 40,41); 1 network namespaces left (rayfleet-n1)")
    assert "\n" not in line
    line = report(Machine({"/": 80.0}, 0.2, 2, {}, (), ("psm_1a2b", "sem.mp-x")))
    assert line == ("machine NOT clean, expect a slower run: 2 shared memory segments no "
                    "process holds in /dev/shm (psm_1a2b, sem.mp-x)")


def test_a_stray_server_process_is_found_by_its_name(tmp_path):
    """A real process named like a server (Redis's) is seen; this test's own is not."""
    exe = tmp_path / "redis-server"
    exe.symlink_to(sys.executable)
    proc = subprocess.Popen([str(exe), "-c", "import time; time.sleep(60)"])
    try:
        strays = {}
        for _ in range(50):
            strays = observe(netns=tmp_path / "none", shm=tmp_path / "none").strays
            if proc.pid in strays.get("redis-server", []):
                break
        assert proc.pid in strays.get("redis-server", []), strays
        assert os.getpid() not in sum(strays.values(), [])
    finally:
        proc.kill()
        proc.wait()


HOLD = """
import mmap, sys, time
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
    print("MAPPED", flush=True)
    time.sleep(60)
"""


def test_only_the_runs_own_segments_no_process_holds_are_left_over(tmp_path):
    """A segment a live process maps is held; once its process is SIGKILLed it is left over,
    unless it was there before the run or is not multiprocessing's (by its name)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("psm_mapped", "psm_before", "sem.mp-dead", "other"):
        (shm / name).write_bytes(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(shm / "psm_mapped")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "MAPPED"
        before = {"psm_before"}
        assert [p.name for p in leftover_segments(before, shm)] == ["sem.mp-dead"]
    finally:
        proc.kill()
        proc.wait()
    assert [p.name for p in leftover_segments(before, shm)] == ["psm_mapped", "sem.mp-dead"]
