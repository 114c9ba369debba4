"""workloads.data's refusals of bad input (one line, nothing written). Its runs (packed output,
row counts, sequence length, deterministic shard names, idempotent re-run) are in
tests/cluster/test_node_env.py, on a node built by the cluster YAML's setup commands; streaming
into training is the demo's (tests/workloads/test_demo.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import BIN, run

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
