"""`make bench`: run benchmarks 1-3 (2 with the byte and a BPE tokenizer) side by side on one
throwaway local cluster, then 5 (spot notice) on two-node ones, and write BENCHMARKS.md (not
tests: nothing asserts these numbers). Sections 4 (GPU), 6 (Serve LLM), 7 (Serve's ingress)
and 8 (Hugging Face memory) come from their own commands and are kept as they are.
BENCHMARKS.md holds the numbers and short captions; what each benchmark means, its goals and
the one-off profiling behind them are in docs/benchmarks.md.

    python -m bench [--quick]      # --quick: fewer steps/requests, for a smoke run
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

from bench import (
    ArgumentParser,
    command,
    data_throughput,
    data_tokenize,
    goal,
    gpu,
    hf_memory,
    ingress,
    llm_report,
    machine,
    serve_latency,
    spot_notice,
    train_overhead,
)
from bench.cluster import local_cluster
from bench.train_overhead import STAGES

REPO = Path(__file__).resolve().parents[1]


def _cell(r: dict | None) -> str:
    return f"{r['p50_ms']} / {r['p99_ms']} ms, {r['rps']} req/s" if r else "-"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def serve_table(s: dict) -> str:
    rows = ["| batching | concurrency | Serve p50 / p99, req/s | bare p50 / p99, req/s "
            "| p50 overhead |", "|---|---|---|---|---|"]
    for b in ("on", "off", "noop"):
        for c, r in s["results"]["serve"].get(b, {}).items():
            rb = s["results"]["bare"][b].get(c)
            rows.append(f"| {b} | {c} | {_cell(r)} | {_cell(rb)} | "
                        f"{s['overhead_p50_ms'].get(f'{b}/c{c}', '-')} ms |")
    return "\n".join(rows)


def bpe_section(b: dict | None) -> str:
    """Benchmark 2 with a BPE tokenizer (bench.data_tokenize), when it ran."""
    if not b:
        return ""
    row = _row("corpus -> packed rows, BPE", f"{b['one_process_s']} s "
               f"({b['one_process_mb_s']} MiB/s)", f"{b['ray_data_s']} s "
               f"({b['ray_data_mb_s']} MiB/s); first run {b['ray_data_first_s']} s",
               f"**{b['speedup']}x**")
    return f"""
With a Hugging Face tokenizer (`--tokenizer FOLDER`: a {b['vocab']}-token byte-level BPE
trained on the standard library, EOS between documents), {b['corpus_mb']} MiB of the same
kind of corpus ({b['docs']} documents, {b['tokens']:,} tokens), the same stage functions in
one process, the tokenizers library's own threads off on both sides (Ray: the actor pool is
the parallelism); with its threads on, the one process takes {b['one_process_threads_s']} s
({b['speedup_vs_threads']}x). Same-stream check as above ({b['rows_ray']:,} rows).

| | one process | Ray Data, second run | ratio |
|---|---|---|---|
{row}

Goal: >= 1.6x on 2 cores — {goal(b['speedup'] >= 1.6, b['load_avg'])}.
"""


def startup_table(t: dict) -> str:
    """Seconds from launch to each start-up stage, both launchers (rank 0's stages are the
    same loop's), and the time each stage took since the one before it on that side."""
    sides = t.get("startup") or {}
    prev: dict[str, float] = {}
    rows = ["| stage | Ray Train: s from launch (+ since previous) | `torchrun` |",
            "|---|---|---|"]
    for key, label in STAGES:
        cells = []
        for side in ("ray", "torchrun"):
            at = sides.get(side, {}).get(key)
            if at is None:
                cells.append("-")
                continue
            since = f" (+{at - prev[side]:.2f})" if side in prev else ""
            cells.append(f"{round(at, 2) + 0.0:.2f}{since}")  # + 0.0: no "-0.00"
            prev[side] = at
        if cells != ["-", "-"]:
            rows.append(_row(label, *cells))
    return "\n".join(rows)


def startup_summary(t: dict) -> str:
    """The cold start in three spans per launcher, from the run's own marks."""
    ray_m = (t.get("startup") or {}).get("ray", {})
    tr_m = (t.get("startup") or {}).get("torchrun", {})

    def span(m: dict, a: str | None, b: str) -> str:
        if b not in m or (a is not None and a not in m):
            return "?"
        return f"{m[b] - (m[a] if a else 0):.1f}"

    return (f"Under Ray Train: launch -> `trainer.fit()` "
            f"{span(ray_m, None, 'driver.fit_called')} s (the driver: Python, torch and "
            "ray.train imports, `ray.init`), `fit()` -> loop "
            f"{span(ray_m, 'driver.fit_called', 'rank0.loop_entered')} s (Ray Train: controller "
            "and helper actors, placement group, worker actors, each a Python process that "
            "imports ray.train; torch and the gloo group in the workers), loop -> step 10 "
            f"logged {span(ray_m, 'rank0.loop_entered', 'rank0.first_logged_step')} s. Under "
            f"torchrun: launch -> loop {span(tr_m, None, 'rank0.loop_entered')} s, loop -> "
            f"step 10 logged {span(tr_m, 'rank0.loop_entered', 'rank0.first_logged_step')} s.")


def train_section(t: dict) -> str:
    rows = "\n".join([
        _row("steady-state step", f"{t['ray_step_ms']} ms", f"{t['torchrun_step_ms']} ms",
             f"**{t['step_ratio']}**"),
        _row("launch -> step 10 logged (cold start)", f"{t['ray_first_s']} s",
             f"{t['torchrun_first_s']} s", t.get("first_ratio", "-")),
        _row("wall incl. start-up and checkpoint", f"{t['ray_wall_s']} s",
             f"{t['torchrun_wall_s']} s", t["wall_ratio"])])
    first = t.get("ray_first_s")
    return f"""## 1. Ray Train overhead vs torchrun (same loop, 2 CPU workers, gloo)

The per-worker loop of `workloads/train/loop.py`, `--model small` (0.84M parameters, seq 128,
batch 16 per worker), {t['steps']} steps, {t['rounds']} round(s) each, Ray then torchrun;
step time = median over logged 10-step intervals after the first (warm-up); checkpoint only
at the end.

| | Ray Train | `torchrun` | ratio |
|---|---|---|---|
{rows}

Goals: steady-state ratio <= 1.02 — {goal(t['step_ratio'] <= 1.02, t['load_avg'])};
<= 10 s from launch to the first logged step under Ray Train —
{goal(first is not None and first <= 10, t['load_avg'])} ({first} s).

Where the cold start goes (medians over the rounds; wall-clock marks printed by the Ray
driver and by rank 0 with `RAYFLEET_TIMING=1`, read against the launch time, and Ray Train's
own stages from Ray's task events; both launchers run rank 0's stages in the same loop).
{startup_summary(t)} The wall-clock gap adds the final checkpoint's upload to storage.

{startup_table(t)}
"""


def render(t: dict, d: dict, s: dict, quick: bool, minutes: float | None = None) -> str:
    import ray
    import torch

    today = datetime.date.today().isoformat()
    took = f"; this run took {minutes:.1f} min" if minutes is not None else ""
    data_row = _row("corpus -> packed rows",
                    f"{d['one_process_s']} s ({d['one_process_mb_s']} MiB/s)",
                    f"{d['ray_data_s']} s ({d['ray_data_mb_s']} MiB/s); first run "
                    f"{d['ray_data_first_s']} s", f"**{d['speedup']}x**")
    ttft, batch = s["ttft_ms"], s["mean_batch_on"]
    serve_rows = "\n".join([
        _row("time to first token, streaming, c=1, batching on", f"{ttft['serve']['on']} ms",
             f"{ttft['bare']['on']} ms"),
        _row("time to first token, streaming, c=1, batching off",
             f"{ttft['serve']['off']} ms", f"{ttft['bare']['off']} ms"),
        _row("req/s batching on / off at c=16", f"**{s['batching_gain_c16'].get('serve')}x**",
             f"{s['batching_gain_c16'].get('bare')}x"),
        _row("mean decode batch with batching on (last 1000)", batch.get("serve"),
             batch.get("bare"))])
    gain = s["batching_gain_c16"]
    over1 = s["overhead_p50_ms"].get("off/c1")
    floor1 = s["overhead_p50_ms"].get("noop/c1")
    lm_adds, vs_bare = s.get("lm_over_floor_p50_ms_c1"), s.get("serve_vs_bare_rps_c16")
    return f"""# Benchmarks

Measured by `make bench`{' --quick' if quick else ''} on {today}: {machine()}; Python
{platform.python_version()}, Ray {ray.__version__}, torch {torch.__version__}. Each ratio is
measured side by side in one run (the two sides interleaved, so machine noise hits both);
they are not tests and nothing asserts them. One-minute load average at the end of each
benchmark: train {t['load_avg']}, data {d['load_avg']}, serve {s['load_avg']} (on
{os.cpu_count()} cores; above ~{os.cpu_count()} the machine was shared and every number is
noisier, Ray's side usually more so because its own processes compete too).

Reproduce: `make bench` (1-3 on one throwaway cluster, then 5; writes this file{took}), or one
at a time: `.venv/bin/python -m bench.train_overhead --steps 150 --rounds 2`,
`python -m bench.data_throughput --mb 24`, `python -m bench.serve_latency --rounds 2`. What each
benchmark measures, its goals, and the one-off profiling behind these numbers:
[docs/benchmarks.md](docs/benchmarks.md).

{train_section(t)}
## 2. Ray Data pipeline vs one process; data wait while streaming into training

`workloads.data`'s stages (JSON read, clean + filter as one batch UDF, tokenizer actor pool of 2,
pack into seq 128+1) on a generated {d['corpus_mb']} MiB JSONL corpus ({d['docs']} documents,
{d['tokens']:,} tokens), vs the same stage functions called in order in one Python process.
Output check: every one of Ray's {d['rows_ray']:,} rows is the one-process token stream at a
document-aligned offset, in order (one process: {d['rows_one_process']:,} rows; the counts
differ only by where packing groups end, which follows Ray Data's block sizes).

| | one process | Ray Data (4 logical CPUs on the cores above), second run | ratio |
|---|---|---|---|
{data_row}

Data wait: `workloads.data` writes the corpus to Parquet, then `workloads.train --dataset`
streams it into 2 workers (`--model small`, {d['train_steps']} steps, median step
{d['train_step_ms']} ms). The loop's `data_wait_frac` (time blocked on the next batch / wall,
per 10-step interval): median **{d['data_wait_median_pct']}%**, worst
{d['data_wait_max_pct']}% after the first interval; the first interval (the stream starting
up) {d['data_wait_first_pct']}%.

Goals: >= 1.7x on 2 cores — {goal(d['speedup'] >= 1.7, d['load_avg'])}; data wait <= 2% —
{goal((d['data_wait_median_pct'] or 0) <= 2, d['load_avg'])} (steady state).
{bpe_section(d.get('bpe'))}
## 3. Serve `lm` vs the same model behind bare FastAPI/uvicorn

The `lm` app from `cluster-configs/serve/lm.yaml` (one replica, through Serve's HTTP proxy) vs
the same `LMServer` class instantiated in a plain uvicorn process (its `@serve.batch` still
batches), `tiny` model, `/v1/completions` with `max_tokens` {s['max_tokens']}, greedy;
batching on = `max_batch_size` 8 with the shipped 50 ms wait, off = `max_batch_size` 1. An
aiohttp client keeps `concurrency` requests in flight; {s['rounds']} interleaved round(s).
Rows `noop` are Serve's floor: `bench/serve_noop.py`, a deployment with `lm`'s route shape
(FastAPI ingress, the same request model) that answers at once, on both sides.

{serve_table(s)}

| | Serve | bare |
|---|---|---|
{serve_rows}

Goals: <= 2 ms p50 overhead —
{goal(over1 is not None and over1 <= 2, s['load_avg'])} at c=1 without batching
({over1} ms; the other cells are in the table); batching >= 3x throughput at
c=16 — {goal((gain.get('serve') or 0) >= 3, s['load_avg'])} under Serve ({gain.get('serve')}x).

Serve's floor at c=1 (no-op p50 gap): {floor1} ms. Goals: `lm` adds <= 1 ms p50
over that floor at c=1 — {goal(lm_adds is not None and lm_adds <= 1, s['load_avg'])}
({lm_adds} ms: {over1} ms overhead minus the {floor1} ms floor); Serve req/s at c=16 with
batching >= 70% of bare — {goal((vs_bare or 0) >= 0.7, s['load_avg'])} ({vs_bare} of bare).
At c=1 with batching on, each request waits the full 50 ms `batch_wait_timeout_s` for company
that never comes: lower it (`args.batch_wait_timeout_s`) for latency-bound traffic.
"""


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="bench")
    ap.add_argument("--quick", action="store_true", help="fewer steps/requests (smoke run)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    with local_cluster() as env:
        t = train_overhead.main(["--steps", "60", "--rounds", "1"] if args.quick else
                                ["--steps", "150", "--rounds", "2"], env=env)
        d = data_throughput.main(["--mb", "6", "--train-steps", "30"] if args.quick else
                                 ["--mb", "24", "--train-steps", "60"], env=env)
        d["bpe"] = data_tokenize.main(["--mb", "2"] if args.quick else [], env=env)
        s = serve_latency.main(["--rounds", "1", "--requests-per-worker", "3"] if args.quick
                               else ["--rounds", "2"], env=env)
    # Benchmark 5 needs two nodes: its own throwaway clusters, after the shared one is down.
    sp = spot_notice.main([])
    text = render(t, d, s, args.quick, (time.perf_counter() - t0) / 60)
    # The GPU section comes from `python -m bench.gpu` on a CUDA machine, the Serve LLM one
    # from `python -m bench.llm_serve --write` (vLLM, ~15 min), the ingress one from
    # `python -m bench.ingress --write`, the Hugging Face memory one from
    # `python -m bench.hf_memory --write`: all kept as they are.
    md = REPO / "BENCHMARKS.md"
    old = md.read_text() if md.exists() else ""
    llm, ing = llm_report.section_of(old), ingress.section_of(old)
    hfm = hf_memory.section_of(old)
    text = (text.rstrip("\n") + "\n\n" + gpu.gpu_section_of(old) + "\n\n"
            + spot_notice.section(sp, sp["notice_at"], sp["kill_at"],
                                  datetime.date.today().isoformat(), machine()) + "\n"
            + (f"\n{llm}\n" if llm else "") + (f"\n{ing}\n" if ing else "")
            + (f"\n{hfm}\n" if hfm else ""))
    md.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(command(main, "bench"))
