"""Data, BPE: `workloads.data --tokenizer FOLDER` (a byte-level BPE fast tokenizer in the actor
pool, EOS between documents, packed into seq 128 + 1) under Ray Data vs the same stage
functions (clean, keep, `HFTokenizer`, pack) in one plain Python process, over the same
generated JSONL corpus, side by side in one run.

    python -m bench.data_tokenize [--mb 32] [--vocab 2048]

The tokenizer is trained here on this interpreter's standard library by
workloads.common.tiny_hf.make_tokenizer (nothing is downloaded).
Hugging Face's tokenizers library threads a batched call over every core unless
TOKENIZERS_PARALLELISM=false, which the workload's actors set (the pool is the parallelism):
the ratio is taken with it off on both sides (the same single-threaded stage functions: what
Ray Data's processes add), and the one process with the library's threads on is reported too
(`one_process_threads_s`). Same-data check as in
bench.data_throughput (`check_same_stream`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import ArgumentParser, at_least, command
from bench.cluster import cluster_env
from bench.data_throughput import (
    add_pipeline_flags,
    check_same_stream,
    make_corpus,
    one_process,
    pipeline_args,
    run_ray_side,
    shipped_tokenizer,
)
from workloads.common.tiny_hf import make_tokenizer
from workloads.data.tokenize import HFTokenizer


def summarize(one_s: float, ray_s: float, corpus_bytes: int, threads_s: float | None = None
              ) -> dict:
    """Throughputs over the corpus' bytes and the ratio one process / Ray Data."""
    out = {"one_process_s": round(one_s, 2), "ray_data_s": round(ray_s, 2),
           "one_process_mb_s": round(corpus_bytes / one_s / 2**20, 2),
           "ray_data_mb_s": round(corpus_bytes / ray_s / 2**20, 2),
           "speedup": round(one_s / ray_s, 2)}
    if threads_s is not None:
        out.update({"one_process_threads_s": round(threads_s, 2),
                    "speedup_vs_threads": round(threads_s / ray_s, 2)})
    return out


def timed_one_process(paths: list[Path], cfg, shipped: dict, parallel: bool, runs: int = 2):
    """Best of `runs` runs of `one_process`, with the tokenizers library's threads on or off
    (it reads TOKENIZERS_PARALLELISM at every batched call)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    best, result = float("inf"), None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = one_process(paths, cfg, HFTokenizer(**shipped))
        best = min(best, time.perf_counter() - t0)
    return best, result


def main(argv: list[str] | None = None, env: dict | None = None) -> dict:
    ap = ArgumentParser(prog="bench.data_tokenize")
    ap.add_argument("--mb", type=at_least(0.1, float), default=32.0,
                    help="generated corpus size (Ray's fixed start-up, ~1-2 s, is amortized "
                         "over it)")
    ap.add_argument("--vocab", type=at_least(300), default=2048, help="BPE vocabulary size")
    add_pipeline_flags(ap)
    args = ap.parse_args(argv)
    extra = args.pipeline_args.split()
    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-bpe-") as tmp_s:
        tmp = Path(tmp_s)
        folder = tmp / "bpe"
        make_tokenizer(folder, vocab_size=args.vocab, corpus_bytes=1_000_000)
        extra = ["--tokenizer", str(folder), *extra]
        paths = make_corpus(tmp / "corpus", args.mb)
        corpus_bytes = sum(p.stat().st_size for p in paths)
        cfg = pipeline_args(extra)
        shipped = shipped_tokenizer(str(folder))
        threads_s, _ = timed_one_process(paths, cfg, shipped, parallel=True, runs=1)
        one_s, (rows, starts, stream) = timed_one_process(paths, cfg, shipped, parallel=False)
        with cluster_env(env) as cenv:
            timing, ray_rows = run_ray_side(cenv, tmp, extra)
    problem = check_same_stream(ray_rows, stream, starts)
    if problem:
        raise SystemExit(f"bench.data_tokenize: Ray Data and one process disagree: {problem}")
    out = summarize(one_s, timing["seconds"], corpus_bytes, threads_s)
    out.update({"ray_data_first_s": round(timing["first_s"], 2), "corpus_mb": args.mb,
                "vocab": args.vocab, "docs": len(starts), "tokens": int(stream.size),
                "rows_one_process": int(rows.shape[0]), "rows_ray": int(ray_rows.shape[0]),
                "nproc": os.cpu_count(), "load_avg": round(os.getloadavg()[0], 1)})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(command(main, "bench.data_tokenize"))
