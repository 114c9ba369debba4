"""The head's GCS supervisor (rayfleet/agents/gcs_supervisor.py) failing closed, over stand-ins
for `ray start` (real processes, in the supervisor's own process group): a SIGTERM during
the cleanup of a failed start ends it; an error after `ray start` stops the head in one line;
a failure before Ray starts reaches `--wait` at once; a GCS that keeps dying a few seconds
after each start is given up; and the group it stops is only ever its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, wait_until

AGENT = REPO / "rayfleet" / "agents" / "gcs_supervisor.py"

# `ray start` that fails, leaving a process that ignores SIGTERM (the cleanup takes a while).
FAILING_START = """
import subprocess, sys
open(sys.argv[1], "a").write("attempt\\n")
subprocess.Popen([sys.executable, "-c", "import signal, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
sys.exit(1)
"""

# `ray start` that leaves a gcs_server (a copy of sleep) which exits after argv[2] seconds.
SHORT_LIVED_GCS = """
import os, shutil, subprocess, sys
binary = os.path.join(sys.argv[1], "gcs_server")
shutil.copy(shutil.which("sleep"), binary)
subprocess.Popen([binary, sys.argv[2]])
"""


def _supervisor(tmp_path, start: str, *args: str, flags=(), **popen) -> subprocess.Popen:
    (tmp_path / "start.py").write_text(start)
    if not (tmp_path / "password").exists():
        (tmp_path / "password").write_text("pw")
    popen.setdefault("start_new_session", True)
    popen.setdefault("stdout", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, str(AGENT), "--password-file", str(tmp_path / "password"),
         "--status", str(tmp_path / "status.json"), *flags, "--", sys.executable,
         str(tmp_path / "start.py"), *args], stderr=subprocess.STDOUT,
        text=True, **popen)


def test_a_sigterm_during_the_cleanup_of_a_failed_start_ends_it(tmp_path):
    attempts, out = tmp_path / "attempts", tmp_path / "out"
    with open(out, "w") as f:
        proc = _supervisor(tmp_path, FAILING_START, str(attempts), flags=["--grace-s", "4"],
                           stdout=f)
    try:
        # Said just before stop(), whose SIGTERM the child ignores: the grace period runs
        # (a busy machine can take over a second to get there).
        wait_until("the cleanup of the failed start", lambda: "stopping what it started" in
                   out.read_text(), 60, 0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1, out.read_text()
        assert attempts.read_text().count("attempt") == 1, out.read_text()   # no retry
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_sigterm_during_ray_start_ends_it_as_a_failure(tmp_path):
    attempts = tmp_path / "attempts"
    start = ("import sys, time\nopen(sys.argv[1], 'a').write('attempt\\n')\n"
             "time.sleep(60)\n")
    proc = _supervisor(tmp_path, start, str(attempts), flags=["--grace-s", "2"])
    try:
        wait_until("`ray start` to run", lambda: attempts.exists(), 60, 0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1, proc.stdout.read()   # not 256 - SIGTERM
        assert attempts.read_text().count("attempt") == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_an_error_after_ray_start_stops_the_head_in_one_line(tmp_path):
    """`ray start` succeeded but no gcs_server appears: the supervisor stops what was
    started, says why once (no traceback) and in its status, and exits 1."""
    start = ("import subprocess, sys\nsubprocess.Popen(['sleep', '60'])\n")
    proc = _supervisor(tmp_path, start, flags=["--grace-s", "2", "--gcs-wait-s", "1"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert "stopping the head: RuntimeError: no gcs_server" in out, out
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["exit"].startswith("the supervisor failed: RuntimeError"), status
    try:
        os.killpg(proc.pid, 0)
        raise AssertionError("the head's process group outlived its supervisor")
    except ProcessLookupError:
        pass


def test_a_failure_before_ray_starts_reaches_wait_at_once(tmp_path):
    (tmp_path / "password").write_text("")
    proc = _supervisor(tmp_path, "raise SystemExit('never run')")
    assert proc.wait(timeout=30) == 2
    started = time.monotonic()
    waited = subprocess.run([sys.executable, str(AGENT), "--status",
                             str(tmp_path / "status.json"), "--wait", "120"],
                            capture_output=True, text=True, timeout=150)
    assert time.monotonic() - started < 30, "--wait sat out its time"
    assert waited.returncode == 1 and "is empty" in waited.stderr, waited.stderr
    assert waited.stderr.count("\n") == 1


def test_a_gcs_that_keeps_dying_soon_after_each_start_is_given_up(tmp_path):
    """Each gcs_server lives 2 s: far apart enough for any "N exits in a minute" rule to miss
    at a larger scale, but each dies within --stable-s of its start: after MAX_RESTARTS in a
    row the supervisor stops the head."""
    from rayfleet.agents import gcs_supervisor as sup

    proc = _supervisor(tmp_path, SHORT_LIVED_GCS, str(tmp_path), "2",
                       flags=["--grace-s", "2", "--stable-s", "10"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert f"its {sup.MAX_RESTARTS + 1}th exit in a row within 10 s of its start" in out, out
    status = json.loads((tmp_path / "status.json").read_text())
    assert len(status["restarts"]) == sup.MAX_RESTARTS, status


def test_started_inside_another_group_it_stops_only_its_own(tmp_path):
    """Started without setsid by a shell that leads its group, beside a sibling there: the
    supervisor makes a group of its own, and stopping its failed head leaves the shell and the
    sibling alone."""
    (tmp_path / "start.py").write_text("import sys; sys.exit(5)")
    (tmp_path / "password").write_text("pw")
    script = (f'sleep 60 >/dev/null 2>&1 & echo $! > {tmp_path}/sibling; {sys.executable} {AGENT} '
              f'--password-file {tmp_path}/password --status {tmp_path}/status.json '
              f'--grace-s 1 -- {sys.executable} {tmp_path}/start.py; echo "exit $?"')
    shell = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                           start_new_session=True)
    sibling = int((tmp_path / "sibling").read_text())
    try:
        assert shell.returncode == 0 and "exit 5" in shell.stdout, shell.stdout + shell.stderr
        os.kill(sibling, 0)   # alive: not in the group the supervisor stopped
    finally:
        os.kill(sibling, signal.SIGKILL)
