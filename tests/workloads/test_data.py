"""workloads.data on the session's real Ray cluster: packed output (row counts, sequence
length, deterministic shard names), idempotent re-run, streaming into training, bad input."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.conftest import BIN, run, summary_of

pytestmark = pytest.mark.ray
DATA = [str(BIN / "python"), "-m", "workloads.data"]


@pytest.fixture(scope="module")
def packed(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    proc = run(DATA + ["--smoke-test", "--max-bytes", "300000", "--shard-bytes", "60000",
                       "--output", str(out)], env=ray_cluster["env"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, summary_of(proc.stdout)


def test_pipeline_writes_packed_sequences_in_named_shards(packed):
    out, s = packed
    assert s["seq_len"] == 64 and s["written"] == s["shards"] >= 2 and s["skipped"] == 0
    files = sorted(p.name for p in out.glob("*.parquet"))
    assert files and all(f.startswith("shard-0000") and f.endswith("-000.parquet")
                         for f in files)
    table = pq.read_table(out)
    assert table.num_rows == s["rows"] > 100
    first = table.column("tokens")[0].as_py()
    assert len(first) == 65 and all(0 <= t < 256 for t in first)  # seq_len + 1 bytes
    markers = [json.loads(p.read_text()) for p in sorted((out / "_done").glob("*.json"))]
    assert sum(m["rows"] for m in markers) == s["rows"]


def test_rerun_skips_written_shards_and_changes_nothing(packed, ray_cluster):
    out, s = packed
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    proc = run(DATA + ["--smoke-test", "--max-bytes", "300000", "--shard-bytes", "60000",
                       "--output", str(out)], env=ray_cluster["env"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = summary_of(proc.stdout)
    assert again["written"] == 0 and again["skipped"] == s["shards"]
    assert again["rows"] == s["rows"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before


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
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("workloads.data: error:") and needle in last, last
        assert "Traceback" not in proc.stderr
        assert not out.exists() or not any(out.iterdir())
