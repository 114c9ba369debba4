"""`make demo`'s script end to end (data job -> training job streaming it -> serve deploy ->
an answer through the openai client -> summary), on the session's cluster. It is also the
test of training streaming from the data pipeline's output (`--dataset`) so it does not
start a second Ray on a 2-core machine. The script sees the running cluster and leaves it up."""

from __future__ import annotations

import pytest

from tests.conftest import BIN, REPO, run
from tests.workloads.conftest import serve_shutdown

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_demo_script_runs_every_stage(ray_cluster, tmp_path):
    env = {**ray_cluster["env"], "RAYFLEET_STORAGE": str(tmp_path), "DEMO_STEPS": "60",
           "PATH": f"{BIN}:{ray_cluster['env'].get('PATH', '')}"}
    try:
        proc = run(["bash", str(REPO / "scripts" / "demo.sh")], env=env, timeout=480)
    finally:
        serve_shutdown(ray_cluster)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-3000:]
    for stage in ("workloads.data", "workloads.train", "serve deploy", "openai client",
                  "summary"):
        assert stage in out, stage
    answer = [ln for ln in out.splitlines() if ln.startswith("  A: ")]
    assert answer and len(answer[0]) > len("  A: ")
    assert "stage times" in out and "loss curve" in out
    assert (tmp_path / "data" / "smoke-seq64" / "_manifest.json").exists()
    assert list(tmp_path.glob("demo-*/loss.png"))
    assert "rayfleet local down" not in out  # the cluster was not ours to stop
