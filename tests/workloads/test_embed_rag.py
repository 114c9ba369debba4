"""workloads.embed's refusals of bad input (one line, nothing written, before Ray starts), and
its leaving out of text files that are not UTF-8 (the cleaning workloads.data applies). Its
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


def test_a_text_file_that_is_not_utf8_is_left_out_as_workloads_data_leaves_it_out(
        ray_cluster, tmp_path):
    """The pipeline cleans with workloads/common/text.py (tested in
    test_data_embed_cleaning.py): latin-1 and UTF-16 files are discarded, not embedded as
    mangled text; with nothing left, one line and no done shard a re-run would skip."""
    import pyarrow.parquet as pq

    from workloads.common.text import clean_text

    docs = tmp_path / "docs"
    docs.mkdir()
    text = "Cr\u00e8me br\u00fbl\u00e9e is a custard under a layer of burnt sugar.\r\n"
    (docs / "utf8.txt").write_bytes(text.encode())
    (docs / "latin1.txt").write_bytes(text.encode("latin-1"))
    (docs / "utf16.txt").write_bytes(text.encode("utf-16"))
    out = tmp_path / "out"
    proc = _embed(ray_cluster, "--input", str(docs), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for f in sorted(out.glob("shard-*.parquet"))
            for r in pq.read_table(f, columns=["id", "text"]).to_pylist()]
    assert rows == [{"id": "utf8.txt", "text": clean_text(text.encode())}]

    out = tmp_path / "none-left"
    proc = _embed(ray_cluster, "--input", str(docs / "latin1.txt"), "--output", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("workloads.embed: error:")]
    assert len(errors) == 1 and "nothing left after cleaning" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list(out.glob("_done/*.json")) and not (out / "_manifest.json").exists()
