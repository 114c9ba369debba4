"""Issue 41's first item, through the real readers on a real cluster: a training job that no
allowed node type can serve stops in one line, and `rayfleet status` says the same.

The session's cluster does not autoscale, so what `ray up` would leave on a head is put where
the kit reads it: the autoscaling config at `~/ray_bootstrap_config.yaml` (HOME is the test's
folder: `workloads.train` reads it there, `driver.autoscaler_config`) and the autoscaler's
report in the GCS key Ray's monitor writes (`DEBUG_AUTOSCALING_STATUS`), built by Ray's own
code with EC2's capacity error for every A100 type (tests/unit/test_capacity.py's
`ray_report`). The local head's monitor writes its own report there every few seconds, so a
writer puts ours back every 0.1 s while the test runs. Everything else is the kit's path:
`python -m workloads.train` asks for A100 workers the cluster lacks, its launch watch reads the
GCS through `autoscaler_report()`, and the dashboard's `/api/cluster_status` serves the same
key to `rayfleet status`."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.conftest import BIN, REPO, run, wait_until
from tests.unit.test_capacity import ORDER

pytestmark = [pytest.mark.ray]

# Puts a fresh report (every type refused just now, after the run's watch started) into the
# GCS key every 0.1 s until its stdin closes.
WRITER = """
import sys, threading, time
import ray
from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
from ray.experimental.internal_kv import _internal_kv_put
from tests.unit.test_capacity import ORDER, ray_report
ray.init(logging_level="ERROR", log_to_driver=False)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("writing", flush=True)
while not done.is_set():
    _internal_kv_put(DEBUG_AUTOSCALING_STATUS, ray_report(ORDER, ago=0), overwrite=True)
    time.sleep(0.1)
"""


def _autoscaling_config(home) -> str:
    types = {"ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}}
    for name in ORDER:
        types[name] = {"resources": {"CPU": 96, "GPU": 8, "accelerator_type:A100": 1},
                       "node_config": {}, "min_workers": 0, "max_workers": 1}
    path = home / "ray_bootstrap_config.yaml"
    path.write_text(yaml.safe_dump({"cluster_name": "verdict", "max_workers": 1,
                                    "head_node_type": "ray.head.default",
                                    "available_node_types": types}, sort_keys=False))
    return str(path)


def test_a_run_no_allowed_type_can_serve_stops_in_one_line_and_status_says_so(ray_cluster,
                                                                              tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    config = _autoscaling_config(home)
    env = ray_cluster["env"]
    writer = subprocess.Popen([str(BIN / "python"), "-c", WRITER], env=env, cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        train = run([str(BIN / "python"), "-m", "workloads.train", "--smoke-test", "--name",
                     "no-capacity", "--storage-path", str(tmp_path / "runs"),
                     "--resources-per-worker", '{"accelerator_type:A100": 0.5}'],
                    env={**env, "HOME": str(home)}, timeout=180)
        assert train.returncode == 2, train.stdout[-2000:] + train.stderr[-3000:]
        (line,) = [ln for ln in train.stderr.splitlines() if ln.strip()]
        assert line.startswith("workloads.train: error: no allowed worker type can launch (")
        for name in ORDER:
            assert f"{name}: InsufficientInstanceCapacity: We currently do not have " \
                   "sufficient p4d.24xlarge capacity" in line, line
        assert "RAYFLEET_SUMMARY" not in train.stdout

        # The same report through the cluster's dashboard: each type's row and the verdict.
        def status() -> list[str] | None:
            out = run([str(BIN / "rayfleet"), "status", config, "--address",
                       ray_cluster["dashboard_url"]], env=env, timeout=60)
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            return lines if any(ln.startswith("no allowed worker type") for ln in lines) \
                else None

        lines = wait_until("rayfleet status's verdict", status, timeout=60, interval=1)
        rows = {ln.split(":")[0]: ln for ln in lines}
        assert all("last launch failed" in rows[name] for name in ORDER), lines
        assert lines[-1] == line.removeprefix("workloads.train: error: "), lines
    finally:
        writer.stdin.close()
        writer.wait(timeout=60)
