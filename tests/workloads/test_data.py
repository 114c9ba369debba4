"""workloads.data's refusals of bad input (one line, nothing written). Its runs (packed output,
row counts, sequence length, deterministic shard names, idempotent re-run) are in
tests/fakecloud/test_ray_up.py, on nodes `ray up` built from the cluster YAML; streaming
into training is README's example (tests/cluster/test_readme.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, run

pytestmark = pytest.mark.ray
DATA = [str(BIN / "python"), "-m", "workloads.data"]


def test_bad_inputs_are_one_line_exit_2_nothing_written(ray_cluster, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    jsonl = tmp_path / "j"
    jsonl.mkdir()
    (jsonl / "a.jsonl").write_text("".join(
        json.dumps({"body": f"document {i} " * 10}) + "\n" for i in range(50)))
    cases = [(["--input", str(tmp_path / "missing")], "does not exist"),
             (["--input", str(empty)], "corpus is empty"),
             (["--input", str(jsonl), "--column", "text"], "no column 'text'")]
    for args, needle in cases:
        out = tmp_path / "out"
        proc = run(DATA + args + ["--output", str(out)], env=ray_cluster["env"], timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[-2000:]   # the one line, nothing before it
        assert lines[0].startswith("workloads.data: error:") and needle in lines[0], lines
        assert not out.exists()  # not even an empty folder left behind


def test_a_relative_output_in_a_ray_job_is_refused_not_written_into_rays_temp_copy(
        ray_cluster, tmp_path):
    # What README's example did before: the output landed in Ray's temporary copy of the
    # working directory, and the next job found it only if it happened to share the copy.
    work = tmp_path / "checkout"
    (work / "workloads").mkdir(parents=True)
    shutil.copytree(REPO / "workloads", work / "workloads", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "rayfleet", work / "rayfleet",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = run([str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--", "python", "-m",
                "workloads.data", "--smoke-test", "--output", "runs/data/smoke-seq64"],
               env=ray_cluster["env"], cwd=work, timeout=180)
    assert proc.returncode == 1   # `ray job submit` exits 1 for any failed job
    errors = {ln for ln in proc.stdout.splitlines() if ln.startswith("workloads.data: error:")}
    assert errors == {
        "workloads.data: error: --output: runs/data/smoke-seq64 is a relative path, and this "
        "job runs in Ray's temporary copy of the working directory "
        + re.search(r"\((/\S+/working_dir_files/_ray_pkg_\w+)\)", proc.stdout).group(0)
        + ": what is written there is lost with it; give an absolute path (on a local "
        "cluster: \"$PWD/runs/data/smoke-seq64\") or s3://bucket/prefix"}, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    package = Path(re.search(r"\((/\S+/_ray_pkg_\w+)\)", proc.stdout).group(1))
    assert not (package / "runs").exists() and not (work / "runs").exists()
