"""workloads.embed's refusals of bad input (one line, nothing written, before Ray starts). Its
runs (actor pool, packaged all-MiniLM-L6-v2, unit vectors equal to the model run here) are in
tests/fakecloud/test_ray_up.py, on nodes `ray up` built from the cluster YAML, and the `rag`
Serve app over them in README's example (tests/cluster/test_readme.py)."""

from __future__ import annotations

import pytest

from tests.conftest import BIN, run

pytestmark = pytest.mark.ray


def _embed(ray_cluster, *args: str, timeout: float = 400):
    return run([str(BIN / "python"), "-m", "workloads.embed", *args], env=ray_cluster["env"],
               timeout=timeout)


def test_bad_inputs_are_one_line_and_write_nothing(ray_cluster, tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"doc": "a document long enough", "key": 1}\n')
    cases = [
        (["--model", str(tmp_path / "no-model")], "--model"),
        (["--input", str(tmp_path / "missing")], "does not exist"),
        (["--input", str(tmp_path / "docs.jsonl"), "--column", "doc"], "no column 'id'"),
        (["--batch-size", "0"], "--batch-size: must be at least 1"),
    ]
    for args, expected in cases:
        out = tmp_path / "out"
        proc = _embed(ray_cluster, *args, "--output", str(out), timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert len(lines) == 1 and expected in lines[0], (args, proc.stderr[-2000:])
        assert not out.exists()
