"""Fault 1 (DESIGN): a Ray Train worker killed mid-run. FailureConfig restarts the worker
group, which resumes from the latest checkpoint, redoes at most one checkpoint interval and
ends where an uninterrupted run with the same seed ends."""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import BIN, REPO, summary_of

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]

ARGS = ["--smoke-test", "--model", "small", "--max-steps", "80", "--checkpoint-every", "20",
        "--log-every", "10", "--seed", "7"]


def _args(tmp_path, name):
    return [str(BIN / "python"), "-m", "workloads.train", *ARGS, "--name", name,
            "--storage-path", str(tmp_path)]


def test_killed_worker_resumes_from_latest_checkpoint(ray_cluster, tmp_path):
    proc = subprocess.Popen(_args(tmp_path, "killed"), env=ray_cluster["env"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, killed_pid, last_step_at_kill = [], None, None
    deadline = time.time() + 300
    for line in proc.stdout:
        out.append(line)
        m = re.search(r"RayTrainWorker pid=(\d+).*\[rayfleet\] step (\d+)/", line)
        if m and killed_pid is None and int(m.group(2)) >= 30:
            killed_pid, last_step_at_kill = int(m.group(1)), int(m.group(2))
            os.kill(killed_pid, signal.SIGKILL)
        if time.time() > deadline:
            proc.kill()
            break
    proc.wait(timeout=60)
    text = "".join(out)
    assert proc.returncode == 0, text[-4000:]
    assert killed_pid is not None, "the run ended before a worker could be killed"
    resumed = [int(s) for s in re.findall(r"\[rayfleet\] resumed from step (\d+)", text)]
    assert resumed, text[-3000:]
    assert last_step_at_kill - resumed[-1] <= 20 + 10  # at most one interval (+ log lag) redone
    s = summary_of(text)
    assert s["steps"] == 80

    clean = subprocess.run(_args(tmp_path, "clean"), env=ray_cluster["env"], cwd=REPO,
                           capture_output=True, text=True, timeout=400)
    assert clean.returncode == 0, clean.stdout[-3000:]
    # Same seed, resumed model/optimizer/RNG/data position: the curves meet again.
    assert s["final_loss"] == pytest.approx(summary_of(clean.stdout)["final_loss"], abs=0.1)
