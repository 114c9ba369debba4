"""Data: the `workloads.data` pipeline (clean -> filter -> tokenizer actor pool -> pack) under
Ray Data vs the same stage functions in one plain Python process, over the same generated
JSONL corpus, side by side in one run; then the share of step time a 2-worker training run
spends waiting for the pipeline's output streamed into it (Ray Data -> iter_torch_batches).

    python -m bench.data_throughput [--mb 24] [--train-steps 60]

Both sides must produce the same training data: Ray Data packs whatever groups of
`--pack-rows` documents its batches hold (batch boundaries follow block sizes), so instead of
comparing rows one for one, every Ray row is checked to be the one-process token stream at a
document-aligned offset, in order (`check_same_stream`), and the token counts are compared.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import ArgumentParser, at_least, command
from bench.cluster import cluster_env
from workloads.common.hf import load_tokenizer
from workloads.common.runs import METRICS, read_history
from workloads.common.shards import Inputs
from workloads.data.pipeline import (
    DEFAULTS,
    ByteTokenizer,
    build_parser,
    build_pipeline,
    clean,
    keep,
    make_packer,
)
from workloads.data.tokenize import ship

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORDS = ("def class return self import from for while if else elif try except with as "
         "yield lambda None True False data model batch token shard ray train serve loss "
         "step value index config result path request worker actor").split()


# --------------------------------------------------------------------------- corpus

def make_doc(rng: random.Random, i: int) -> str:
    """A Python-looking document with a unique header (so no two documents share a prefix,
    which `check_same_stream` relies on). Some are too short, some use CRLF, a few have one
    minified line: the clean/filter stages have real work to do."""
    kind = rng.random()
    if kind < 0.05:
        return f"# doc {i}\n"                                          # filtered: too short
    lines = [f"# doc {i:07d}"]
    for _ in range(rng.randint(20, 120)):
        indent = "    " * rng.randint(0, 3)
        lines.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))))
    if kind > 0.98:
        lines.append("x = [" + ", ".join(str(rng.random()) for _ in range(200)) + "]")  # filtered
    sep = "\r\n" if kind < 0.2 else "\n"
    return sep.join(lines) + sep


def make_corpus(folder: Path, megabytes: float, files: int = 8, seed: int = 0) -> list[Path]:
    """JSONL files ({"text": ...} per line), about `megabytes` in all, deterministic."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = int(megabytes * 2**20 / files)
    paths, doc = [], 0
    for f in range(files):
        path = folder / f"part-{f:03d}.jsonl"
        size = 0
        with open(path, "w") as out:
            while size < per_file:
                line = json.dumps({"text": make_doc(rng, doc)}) + "\n"
                out.write(line)
                size += len(line)
                doc += 1
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- the two sides

def pipeline_args(extra: list[str] | None = None):
    """The workload's own flag defaults (seq_len 128, batch 64, pack 256, 2 actors)."""
    args = build_parser().parse_args(["--format", "jsonl", *(extra or [])])
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def one_process(paths: list[Path], args, tokenizer=None
                ) -> tuple[np.ndarray, list[int], np.ndarray]:
    """The pipeline's stage functions in one process, in order, with `tokenizer` (the byte
    tokenizer stage by default). Returns (packed rows, the document start offsets in the token
    stream, the token stream)."""
    tokenizer, pack = tokenizer or ByteTokenizer(), make_packer(args.seq_len)
    texts: list[str] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = clean({"text": json.loads(line)[args.column]})
                if keep(row, args.min_chars):
                    texts.append(row["text"])
    ids: list[np.ndarray] = []
    for i in range(0, len(texts), args.batch_size):
        ids += tokenizer({"text": texts[i:i + args.batch_size]})["ids"]
    rows = [pack({"ids": ids[i:i + args.pack_rows]})["tokens"]
            for i in range(0, len(ids), args.pack_rows)]
    starts = np.cumsum([0] + [len(a) for a in ids])
    return np.concatenate(rows), starts[:-1].tolist(), np.concatenate(ids)


def check_same_stream(rows: np.ndarray, stream: np.ndarray, doc_starts: list[int]) -> str | None:
    """None if every row of `rows`, in order, is stream[p:p+L+1] where p advances by L inside
    a packing group and jumps to a later document start between groups; else what differs."""
    if rows.size == 0:
        return "no rows"
    width = rows.shape[1]
    seq = width - 1
    pos = None
    for k, row in enumerate(rows):
        if pos is not None and np.array_equal(stream[pos:pos + width], row):
            pos += seq
            continue
        # A new packing group: it starts at a document boundary after the previous row.
        lo = 0 if pos is None else bisect.bisect_right(doc_starts, pos)
        for j in range(lo, len(doc_starts)):
            s = doc_starts[j]
            if np.array_equal(stream[s:s + width], row):
                pos = s + seq
                break
        else:
            return f"row {k} is not in the one-process token stream after offset {pos}"
    return None


def shipped_tokenizer(folder: str) -> dict:
    """What `workloads.data` does on its driver before Ray starts: load the tokenizer once and
    hand its backend to the tokenizer stage (workloads.data.tokenize.ship)."""
    return ship(load_tokenizer(folder))


def ray_side(corpus: Path, out: Path, extra: list[str]) -> None:
    """Runs inside the cluster's environment (token auth is read once per process): the
    workload's build_pipeline, twice (the first run also starts worker processes and the actor
    pool, which loads the tokenizer)."""
    import ray
    from ray.data import DataContext

    args = pipeline_args(extra)
    tokenizer = getattr(args, "tokenizer", "byte")
    shipped = shipped_tokenizer(tokenizer) if tokenizer != "byte" else None
    paths = sorted(str(p) for p in corpus.glob("*.jsonl"))
    inputs = Inputs("jsonl", [(p, os.path.getsize(p)) for p in paths], None)
    ray.init(logging_level="ERROR", log_to_driver=False)
    DataContext.get_current().execution_options.preserve_order = True  # as the workload
    DataContext.get_current().enable_progress_bars = False
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        batches = [b["tokens"] for b in build_pipeline(inputs, paths, args, shipped=shipped
                                                       ).iter_batches(batch_size=None,
                                                                      batch_format="numpy")]
        seconds.append(time.perf_counter() - t0)
    np.save(out / "ray_rows.npy", np.concatenate(batches))
    (out / "ray.json").write_text(json.dumps({"first_s": seconds[0], "seconds": seconds[1]}))


# --------------------------------------------------------------------------- data wait

def data_wait(env: dict, corpus: Path, tmp: Path, steps: int, extra: list[str]) -> dict:
    """`workloads.data` writes the corpus as Parquet shards, then `workloads.train --dataset`
    streams them into 2 workers (the user's path, as in `make demo`); the loop's
    data_wait_frac (seconds blocked on the next batch / wall) per logged interval."""
    data_out = tmp / "shards"
    # Only the files the run will read (twice what `steps` global batches of 2 x 16 rows of
    # 129 tokens need): the throughput part above already timed the whole corpus.
    need = 2 * steps * 2 * 16 * 129
    subprocess.run([str(BIN / "python"), "-m", "workloads.data", "--input", str(corpus),
                    "--output", str(data_out), "--max-bytes", str(need), *extra], cwd=REPO,
                   env=env, check=True, capture_output=True, text=True)
    subprocess.run([str(BIN / "python"), "-m", "workloads.train", "--dataset", str(data_out),
                    "--model", "small", "--batch-size", "16", "--max-steps", str(steps),
                    "--checkpoint-every", str(steps), "--log-every", "10",
                    "--num-workers", "2", "--storage-path", str(tmp / "runs"),
                    "--name", "data-wait"], cwd=REPO, env=env, check=True,
                   capture_output=True, text=True)
    history = read_history((tmp / "runs" / "data-wait" / METRICS).read_text())
    return {"intervals": [h["data_wait_frac"] for h in history],
            "step_ms": [h["step_time_s"] * 1000 for h in history]}


def summarize(one_s: float, ray_s: float, tokens: int, waits: list[float]) -> dict:
    """Throughputs and ratio; data wait as the median and worst logged interval after the
    first (which holds the stream's start-up)."""
    steady = waits[1:] or waits
    return {
        "one_process_s": round(one_s, 2), "ray_data_s": round(ray_s, 2),
        "one_process_mb_s": round(tokens / one_s / 2**20, 2),
        "ray_data_mb_s": round(tokens / ray_s / 2**20, 2),
        "speedup": round(one_s / ray_s, 2),
        "data_wait_median_pct": round(100 * float(np.median(steady)), 2) if steady else None,
        "data_wait_max_pct": round(100 * max(steady), 2) if steady else None,
        "data_wait_first_pct": round(100 * waits[0], 2) if waits else None,
    }


def add_pipeline_flags(ap) -> None:
    """The flags both data benchmarks take: workloads.data flags for both sides, and the
    hidden entry point of the Ray side (run in the cluster's environment)."""
    ap.add_argument("--pipeline-args", default="",
                    help="extra workloads.data flags for both sides, e.g. '--concurrency 4'")
    ap.add_argument("--ray-side", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)


def run_ray_side(cenv: dict, tmp: Path, extra: list[str]) -> tuple[dict, np.ndarray]:
    """`ray_side` over tmp/corpus in the cluster's environment (token auth is read once per
    process, so it gets its own); (timings, the packed rows it produced)."""
    subprocess.run([str(BIN / "python"), "-m", "bench.data_throughput",
                    f"--pipeline-args={' '.join(extra)}",
                    "--ray-side", str(tmp / "corpus"), str(tmp)],
                   cwd=REPO, env=cenv, check=True, capture_output=True, text=True)
    return json.loads((tmp / "ray.json").read_text()), np.load(tmp / "ray_rows.npy")


def main(argv: list[str] | None = None, env: dict | None = None) -> dict:
    ap = ArgumentParser(prog="bench.data_throughput")
    ap.add_argument("--mb", type=at_least(0.1, float), default=24.0, help="generated corpus size")
    ap.add_argument("--train-steps", type=at_least(20), default=60,
                    help="steps of the data-wait run (two logged intervals at least)")
    add_pipeline_flags(ap)
    args = ap.parse_args(argv)
    extra = args.pipeline_args.split()
    if args.ray_side:
        ray_side(Path(args.ray_side[0]), Path(args.ray_side[1]), extra)
        return {}

    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-data-") as tmp_s:
        tmp = Path(tmp_s)
        paths = make_corpus(tmp / "corpus", args.mb)
        cfg = pipeline_args(extra)
        for _ in range(2):  # the second run, as on the Ray side
            t0 = time.perf_counter()
            rows, starts, stream = one_process(paths, cfg)
            one_s = time.perf_counter() - t0
        with cluster_env(env) as cenv:
            timing, ray_rows = run_ray_side(cenv, tmp, extra)
            ray_s = timing["seconds"]
            wait = data_wait(cenv, tmp / "corpus", tmp, args.train_steps, extra)
    problem = check_same_stream(ray_rows, stream, starts)
    if problem:
        raise SystemExit(f"bench.data_throughput: Ray Data and one process disagree: {problem}")
    out = summarize(one_s, ray_s, int(stream.size), wait["intervals"])
    out.update({"ray_data_first_s": round(timing["first_s"], 2), "corpus_mb": args.mb,
                "docs": len(starts), "tokens": int(stream.size),
                "rows_one_process": int(rows.shape[0]), "rows_ray": int(ray_rows.shape[0]),
                "train_steps": args.train_steps,
                "train_step_ms": round(float(np.median(wait["step_ms"][1:] or
                                                       wait["step_ms"])), 1),
                "load_avg": round(os.getloadavg()[0], 1)})
    print(json.dumps(out))
    return out



if __name__ == "__main__":
    sys.exit(command(main, "bench.data_throughput"))
