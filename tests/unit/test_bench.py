"""The benchmark modules import, and the arithmetic behind the ratios BENCHMARKS.md prints is
right. No timings are asserted (benchmarks are not tests): these check the bookkeeping only."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import data_throughput, data_tokenize, serve_latency, train_overhead


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert serve_latency.percentile(values, 50) == 50.0
    assert serve_latency.percentile(values, 99) == 99.0
    assert serve_latency.percentile(values, 100) == 100.0
    assert serve_latency.percentile([7.0], 99) == 7.0
    assert serve_latency.percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input


def test_cell_stats_and_serve_comparison():
    cell = serve_latency.cell_stats([0.010] * 99 + [0.200], wall_s=2.0)
    assert cell == {"n": 100, "p50_ms": 10.0, "p99_ms": 10.0, "rps": 50.0}

    def r(p50, rps):
        return {"p50_ms": p50, "p99_ms": p50, "rps": rps, "n": 10}

    results = {"serve": {"on": {16: r(30.0, 90.0)}, "off": {16: r(12.5, 30.0), 1: r(9.0, 100)}},
               "bare": {"on": {16: r(28.0, 120.0)}, "off": {16: r(10.0, 60.0), 1: r(8.0, 120)}}}
    out = serve_latency.compare(results)
    assert out["overhead_p50_ms"] == {"on/c16": 2.0, "off/c1": 1.0, "off/c16": 2.5}
    assert out["batching_gain_c16"] == {"serve": 3.0, "bare": 2.0}
    assert out["serve_vs_bare_rps_c16"] == 0.75 and "lm_over_floor_p50_ms_c1" not in out
    # With the no-op floor measured, lm's own share is its overhead minus the floor's.
    results["serve"]["noop"], results["bare"]["noop"] = {1: r(3.5, 280)}, {1: r(3.0, 330)}
    out = serve_latency.compare(results)
    assert out["overhead_p50_ms"]["noop/c1"] == 0.5 and out["lm_over_floor_p50_ms_c1"] == 0.5


def test_data_summary_ratios_and_wait_share():
    s = data_throughput.summarize(one_s=6.0, ray_s=2.0, tokens=3 * 2**20,
                                  waits=[0.5, 0.01, 0.03, 0.02])
    assert s["speedup"] == 3.0
    assert s["one_process_mb_s"] == 0.5 and s["ray_data_mb_s"] == 1.5
    # The first interval (stream start-up) is reported apart from the steady state.
    assert s["data_wait_first_pct"] == 50.0
    assert s["data_wait_median_pct"] == 2.0 and s["data_wait_max_pct"] == 3.0


def test_bpe_summary_and_its_section_in_benchmarks_md():
    b = data_tokenize.summarize(one_s=8.0, ray_s=4.0, corpus_bytes=16 * 2**20, threads_s=5.0)
    assert b == {"one_process_s": 8.0, "ray_data_s": 4.0, "one_process_mb_s": 2.0,
                 "ray_data_mb_s": 4.0, "speedup": 2.0, "one_process_threads_s": 5.0,
                 "speedup_vs_threads": 1.25}
    b.update({"ray_data_first_s": 9.0, "corpus_mb": 16, "vocab": 2048, "docs": 10,
              "tokens": 1000, "rows_ray": 7, "load_avg": 1.0})
    text = bench_main.bpe_section(b)
    assert "| corpus -> packed rows, BPE | 8.0 s (2.0 MiB/s) | 4.0 s (4.0 MiB/s)" in text
    assert "**2.0x**" in text and ">= 1.6x on 2 cores — met" in text
    b["speedup"] = 1.5
    assert ">= 1.6x on 2 cores — **missed**" in bench_main.bpe_section(b)
    assert bench_main.bpe_section(None) == ""


def test_output_check_accepts_regrouped_packing_and_catches_a_changed_token(tmp_path):
    paths = data_throughput.make_corpus(tmp_path, megabytes=0.05, files=2)
    args = data_throughput.pipeline_args(["--seq-len", "16", "--pack-rows", "8"])
    rows, starts, stream = data_throughput.one_process(paths, args)
    assert data_throughput.check_same_stream(rows, stream, starts) is None
    # Ray Data groups documents differently (block sizes): pack the same stream in groups
    # of 5 documents instead of 8; still the same data.
    from workloads.data.pipeline import make_packer

    pack, ends = make_packer(16), starts[1:] + [len(stream)]
    regrouped = np.concatenate([pack({"ids": [stream[starts[j]:ends[j]]
                                              for j in range(i, min(i + 5, len(starts)))]})
                                ["tokens"] for i in range(0, len(starts), 5)])
    assert data_throughput.check_same_stream(regrouped, stream, starts) is None
    broken = regrouped.copy()
    broken[len(broken) // 2, 3] ^= 1
    problem = data_throughput.check_same_stream(broken, stream, starts)
    assert problem is not None and f"row {len(broken) // 2}" in problem


def test_benchmarks_md_renders_goals_from_the_numbers():
    t = {"steps": 150, "rounds": 2, "ray_step_ms": 102.0, "torchrun_step_ms": 100.0,
         "step_ratio": 1.02, "ray_wall_s": 40.0, "torchrun_wall_s": 20.0, "wall_ratio": 2.0,
         "ray_first_s": 15.0, "torchrun_first_s": 5.0, "first_ratio": 3.0, "load_avg": 1.0,
         "startup": {"ray": {"driver.process_start": 0.05, "driver.ray_connected": 3.5,
                             "rank0.process_start": 6.0, "rank0.first_logged_step": 14.9},
                     "torchrun": {"rank0.process_start": 1.0, "rank0.first_logged_step": 4.9}}}
    d = {"corpus_mb": 24, "docs": 10, "tokens": 1000, "rows_ray": 7, "rows_one_process": 8,
         "one_process_s": 1.0, "ray_data_s": 2.0, "ray_data_first_s": 9.0,
         "one_process_mb_s": 1, "ray_data_mb_s": 0.5,
         "speedup": 0.5, "train_steps": 60, "train_step_ms": 99.0, "data_wait_median_pct": 0.5,
         "data_wait_max_pct": 1.0, "data_wait_first_pct": 80.0, "load_avg": 1.0}
    cell = {"p50_ms": 10.0, "p99_ms": 20.0, "rps": 50.0, "n": 20}
    s = {"results": {side: {b: {1: cell, 16: cell} for b in ("on", "off")}
                     for side in ("serve", "bare")},
         "overhead_p50_ms": {"off/c1": 3.5}, "batching_gain_c16": {"serve": 3.2, "bare": 3.0},
         "ttft_ms": {side: {"on": 55.0, "off": 5.0} for side in ("serve", "bare")},
         "mean_batch_on": {"serve": 7.5, "bare": 8.0}, "rounds": 2, "max_tokens": 8,
         "load_avg": 1.0}
    text = bench_main.render(t, d, s, quick=False)
    assert "steady-state ratio <= 1.02 — met" in text
    assert ">= 1.7x on 2 cores — **missed**" in text
    assert "<= 2 ms p50 overhead —\n**missed** at c=1" in text and "(3.5 ms" in text
    assert "c=16 — met under Serve (3.2x)" in text
    assert "adds <= 1 ms p50\nover that floor at c=1 — **missed**\n(None ms" in text
    assert "| on | 16 | 10.0 / 20.0 ms, 50.0 req/s |" in text
    assert "which says little" not in text
    # The cold start's stages, seconds from launch and since the stage before, both sides.
    assert "<= 10 s from launch to the first logged step under Ray Train —\n**missed** (15.0 s)" \
        in text
    assert "| driver: `ray.init` connected | 3.50 (+3.45) | - |" in text
    assert "| rank 0 process started (placement group placed) | 6.00 (+2.50) | 1.00 |" in text
    assert "| rank 0: step 10 logged | 14.90 (+8.90) | 4.90 (+3.90) |" in text
    # A verdict measured on a busy machine says so.
    t["load_avg"] = 10.0 * (os.cpu_count() or 1)
    text = bench_main.render(t, d, s, quick=False)
    assert "ratio <= 1.02 — met (as measured at load" in text and "which says little" in text


def test_train_overhead_measures_both_sides_with_the_same_loop_flags():
    args = train_overhead.loop_args(42)
    assert args[args.index("--max-steps") + 1] == "42"
    # A checkpoint only at the end, so step times hold no checkpoint work.
    assert args[args.index("--checkpoint-every") + 1] == "42"
    assert train_overhead.FIRST_STEP == "[rayfleet] step 10/"


def test_start_up_stages_are_read_from_the_driver_and_rank_0_lines():
    """Both processes' RAYFLEET_TIMING lines, rank 0's with the prefix Ray puts on worker
    output, become seconds from launch per stage; other output is ignored."""
    out = "\n".join([
        "[rayfleet] run gpt-small-ddp: 0.84M params",
        '(RayTrainWorker pid=42) RAYFLEET_TIMING {"side": "rank0", "process_start": 1012.5, '
        '"loop_entered": 1020.0, "first_logged_step": 1030.25}',
        '(RayTrainWorker pid=42) [rayfleet] step 10/150 loss 3.0',
        'RAYFLEET_TIMING {"side": "driver", "process_start": 1000.1, "ray_connected": 1004.0, '
        '"kit_imported": 1002.0}'])
    stages = train_overhead.parse_startup(out, launch=1000.0)
    assert stages == {"rank0.process_start": 12.5, "rank0.loop_entered": 20.0,
                      "rank0.first_logged_step": 30.25, "driver.process_start": 0.1,
                      "driver.ray_connected": 4.0, "driver.kit_imported": 2.0}
    # Every stage the loop and the driver mark has a row, in the order a run passes them.
    keys = [k for k, _ in train_overhead.STAGES]
    assert keys.index("driver.fit_called") < keys.index("rank0.process_start") \
        < keys.index("rank0.loop_entered") < keys.index("rank0.first_batch")
    runs = [stages, {**stages, "rank0.loop_entered": 22.0}]
    med = train_overhead.median_stages(runs)
    assert med["rank0.loop_entered"] == 21.0 and list(med) == [k for k in keys if k in med]


def test_ray_train_stages_come_from_the_first_or_last_task_event():
    from workloads.train.context import ray_marks_of_tasks

    def task(name, **events):
        return {"name": name, "events": [{"state": k, "created_ms": v} for k, v in
                                         events.items()]}

    tasks = [task("TrainController.__init__", PENDING_ARGS_AVAIL=1000, RUNNING=3000,
                  FINISHED=5000),
             task("RayTrainWorker.__init__", RUNNING=7000, FINISHED=9000),
             task("RayTrainWorker.__init__", RUNNING=7500, FINISHED=9500),
             task("RayTrainWorker.poll_status", RUNNING=20000, FINISHED=20001)]
    assert ray_marks_of_tasks(tasks) == {
        "ray_controller_start": 3.0, "ray_controller_ready": 5.0,
        "ray_workers_start": 7.0, "ray_workers_ready": 9.5}  # the last worker's


def test_start_up_marks_print_one_line_only_when_asked(monkeypatch, capsys):
    from workloads.train.context import TIMING_ENV, Startup, process_start_time

    s = Startup()
    s.mark("loop_entered")
    first = s.marks["loop_entered"]
    s.mark("loop_entered")  # the first time a stage is reached is what counts
    assert s.marks["loop_entered"] == first
    monkeypatch.delenv(TIMING_ENV, raising=False)
    s.emit("rank0")
    assert capsys.readouterr().out == ""  # normal runs print nothing
    monkeypatch.setenv(TIMING_ENV, "1")
    s = Startup()
    s.mark("first_batch")
    s.emit("rank0")
    s.emit("rank0")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("RAYFLEET_TIMING {")
    started = process_start_time()
    assert started is None or started <= s.marks["first_batch"]


def test_bad_flags_are_one_line_and_exit_2():
    import subprocess
    import sys

    for module, flags, says in [("bench.train_overhead", ["--steps", "5"], "at least 20"),
                                ("bench.data_throughput", ["--mb", "nan"], "at least 0.1"),
                                ("bench.data_tokenize", ["--vocab", "10"], "at least 300"),
                                ("bench.serve_latency", ["--rounds", "x"], "expected a number")]:
        proc = subprocess.run([sys.executable, "-m", module, *flags], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, (module, proc.stderr)
        assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
        assert proc.stdout == ""  # refused before any cluster or corpus exists


def test_gpu_section_survives_a_cpu_bench_and_says_when_no_run_exists(capsys):
    import torch

    from bench import gpu

    assert gpu.gpu_section_of("# Benchmarks\n").startswith(gpu.BEGIN)
    assert "No GPU run exists yet" in gpu.gpu_section_of("")
    measured = f"{gpu.BEGIN}\n## 4. GPU\nLast GPU run: NVIDIA H100\n{gpu.END}"
    assert gpu.gpu_section_of(f"# B\n\n{measured}\n") == measured
    if not torch.cuda.is_available():
        assert gpu.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_gpu_bench_hugging_face_row_trains_on_cpu(tmp_path):
    """bench.gpu's Llama row end to end on CPU with a tiny shape: the config folder, the
    tokenizer and the packed data it prepares train under workloads.train.torchrun with the
    same flags (the GPU run only adds --use-gpu and the 1.1B shape)."""
    from bench import gpu
    from tests.conftest import BIN, run, summary_of

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    flags = gpu.prepare_hf(tmp_path, tiny, vocab=300, seq_len=32, corpus_bytes=60_000)
    proc = run([str(BIN / "python"), "-m", "workloads.train.torchrun", *flags, "--max-steps",
                "4", "--log-every", "2", "--checkpoint-every", "4", "--batch-size", "4",
                "--lr", "3e-3", "--output", str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = summary_of(proc.stdout)
    assert [h["step"] for h in s["history"]] == [2, 4] and s["history"][-1]["loss"] < 6.0
    assert list((tmp_path / "out").glob("checkpoint_*/hf/model.safetensors"))
    assert gpu.HF_MODELS["llama-1b"][0]["num_hidden_layers"] == 22


def test_spot_notice_work_redone_ratio_and_its_section():
    from bench import spot_notice

    def run(resumed, lost, ms, **extra):
        return {"resumed_from": resumed, "lost_at": lost, "redone_steps": lost - resumed,
                "redone_s": round((lost - resumed) * ms / 1000, 2), "step_ms": ms,
                "wall_s": 90.0, **extra}

    s = spot_notice.summarize(run(27, 33, 500, checkpoint_step=27, notice_to_checkpoint_s=0.8),
                              run(20, 33, 500))
    assert s["ratio"] == 2.2 and s["with"]["redone_steps"] == 6
    assert s["without"]["redone_s"] == 6.5 and s["with"]["checkpoint_step"] == 27
    text = spot_notice.section(s, 25, 32, "2026-11-23", "2 cores")
    assert "| with the notice | 27 (the notice's checkpoint: step 27, 0.8 s after" in text
    assert "| without | 20 | 33 | 13 steps, 6.5 s | 90.0 s |" in text
    assert "**2.2x** less" in text
    # Its section is replaced in place, the rest of the file kept.
    md = f"# B\n\nbefore\n\n{text}\n\nafter\n"
    assert spot_notice.section_of(md) == text and spot_notice.section_of("# B\n") == ""
    # Nothing redone with the notice: no ratio to divide by.
    assert spot_notice.summarize(run(33, 33, 500, checkpoint_step=33,
                                     notice_to_checkpoint_s=0.8), run(20, 33, 500))["ratio"] is None


def test_llm_serve_ratios_and_its_section():
    from bench import llm_report, llm_serve

    def r(ttft, rps, serving=3.0, stream=90.0):
        return {"n": 20, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "latency_p50_ms": stream,
                "rps": rps, "tok_s": 32 * rps, "tokens_per_request": 32.0,
                "cpu_serving_ms_per_req": serving, "cpu_engine_ms_per_req": 9.5}

    cell = llm_serve.cell_stats([{"ttft": 0.010, "latency": 0.050, "tokens": 32}] * 9
                                + [{"ttft": None, "latency": 0.100, "tokens": 0}],
                                [1.5, 0.5], [0.5, 1.0])
    assert cell["ttft_p50_ms"] == 10.0 and cell["latency_p50_ms"] == 50.0
    assert cell["rps"] == 5.0 and cell["tok_s"] == 144.0 and cell["tokens_per_request"] == 28.8
    assert cell["rps_rounds"] == [3.3, 10.0]
    assert cell["cpu_serving_ms_per_req"] == 50.0 and cell["cpu_engine_ms_per_req"] == 100.0
    assert llm_report.sides_of((0, 50)) == ("bare", "llm", "ray0", "ray50", "lm")
    results = {"bare": {1: r(20.0, 25.0, stream=80.0), 32: r(100.0, 200.0, serving=2.0)},
               "llm": {1: r(23.0, 20.0, stream=95.0), 32: r(110.0, 190.0, serving=3.9)},
               "ray0": {1: r(26.0, 21.0), 32: r(300.0, 100.0, serving=20.0)},
               "ray50": {1: r(70.0, 15.0), 32: r(200.0, 150.0)},
               "lm": {1: r(60.0, 10.0), 32: r(400.0, 95.0)}}
    cmp = llm_serve.compare(results, "llm")
    assert cmp["ttft_p50_over_bare_ms"]["llm/c1"] == 3.0
    assert cmp["ttft_p99_over_bare_ms"]["ray50/c1"] == 100.0
    assert cmp["rps_vs_bare"]["ray50/c32"] == 0.75 and "bare/c1" not in cmp["rps_vs_bare"]
    assert cmp["lm_vs_llm"]["c32"] == {"rps": 0.5, "ttft_p50_ms": 290.0}
    out = {"command": "python -m bench.llm_serve", "results": results, **cmp,
           "stream_ms": [0, 50], "startup": {"eager": {"median_s": 40.0, "runs_s": [40.0]}},
           "rounds": 2, "ttft_requests": 50, "requests_per_worker": 4, "max_tokens": 32,
           "model": {"hidden": 64, "layers": 2}, "engine_kwargs": {"dtype": "float32"},
           "load_before": 0.5, "load_avg": 9.0, "others_cpu_pct": 2.0}
    # Each goal per side: met or missed from the measured cells, the measure beside it.
    got = {text.split(" ")[0]: (ok, what) for text, ok, what in llm_report.goals(out)}
    assert got["serving"] == (True, "1.9x (3.9 vs 2 ms)")
    assert got["requests/s"] == (True, "0.95x")
    assert got["TTFT"] == (True, "+3 ms p50, +6 ms p99")
    assert got["a"] == (True, "1.19x (95 ms vs 80 ms)")
    assert [ok for _, ok, _ in llm_report.goals(out, "ray0")] == [False, False, False, True]
    text = llm_report.section(out, "2026-11-25", "2 cores")
    assert "| `llm`, `api: ray`, 50 ms (Ray's default) | 32 | 200 ms / 400 ms | 90 ms | 150.0 |" \
        in text
    assert "| 3200.0 | 20 + 9.5 | +200 ms, 0.5x |" in text           # ray0 at c=32
    assert "| serving CPU per request at c=32 <= 2x bare's | met: 1.9x (3.9 vs 2 ms) | " \
           "**missed**: 10.0x (20 vs 2 ms) |" in text
    assert "once per `stream_batching_interval_ms` (0 and 50)" in text
    # Busy means other work's CPU share, not the load average (which counts the run itself).
    assert "says little" not in text
    out["others_cpu_pct"] = 20.0
    assert "**missed** (with other work taking 20.0% of the CPU, which says little" \
        in llm_report.section(out, "2026-11-25", "2 cores")
    assert "| `enforce_eager: true`, empty cache | 40.0 s | 40.0 s |" in text
    # Its section is replaced in place, the rest of the file kept; make bench keeps it.
    md = f"# B\n\nbefore\n\n{text}\n\nafter\n"
    assert llm_report.section_of(md) == text and llm_report.section_of("# B\n") == ""


def test_llm_serve_bare_server_gets_the_generated_engine_arguments():
    from pathlib import Path

    from bench import llm_serve

    cmd = llm_serve.bare_command(Path("/m"), 8001, {
        "tensor_parallel_size": 1, "max_model_len": 256, "kv_cache_memory_bytes": 536870912,
        "dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False})
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = cmd[cmd.index("8001") + 1:]
    assert flags == ["--tensor-parallel-size", "1", "--max-model-len", "256",
                     "--kv-cache-memory-bytes", "536870912", "--dtype", "float32",
                     "--enforce-eager"]
    assert llm_serve.stream_list("50,0, 10") == (0.0, 10.0, 50.0)
    assert llm_serve.stream_list("") == ()


def test_llm_serve_counts_cpu_of_its_own_sides_processes():
    from bench import llm_serve, procs

    table = {10: (1, "python -m vllm.entrypoints.openai.api_server --model m"),
             11: (10, "VLLM::EngineCore"), 12: (11, "VLLM::Worker"),
             20: (2, "ray::ProxyActor"),
             21: (2, "ray::ServeReplica:llm-ray-0ms:OpenAIErrorsIngress"),
             22: (2, "ray::ServeReplica:llm-ray-0ms:LLMServer:tiny"), 23: (22, "VLLM::EngineCore"),
             24: (23, "VLLM::Worker"), 25: (2, "ray::ServeReplica:llm:EngineIngress:tiny"),
             26: (2, "ray::ServeReplica:lm:LMServer"), 27: (25, "VLLM::EngineCore")}
    assert llm_serve.side_processes("bare", 10, None, table) == {"serving": [10],
                                                                 "engine": [11, 12]}
    got = llm_serve.side_processes("ray0", 10, None, table)
    assert sorted(got["serving"]) == [20, 21, 22] and sorted(got["engine"]) == [23, 24]
    got = llm_serve.side_processes("llm", 10, None, table)
    assert sorted(got["serving"]) == [20, 25] and got["engine"] == [27]
    assert sorted(llm_serve.side_processes("lm", 10, None, table)["serving"]) == [20, 26]
    assert procs.cpu_seconds([os.getpid()]) > 0
    assert procs.cpu_seconds([2**22 + 7]) == 0.0  # gone: nothing to count


def test_llm_serve_bad_flags_are_one_line_and_exit_2():
    import subprocess
    import sys

    for flags, says in [(["--rounds", "1"], "at least 2"), (["--stream-ms", "x"], "0,50"),
                        (["--stream-ms", "0,-5"], "0 ms or more")]:
        proc = subprocess.run([sys.executable, "-m", "bench.llm_serve", *flags],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
        assert proc.stdout == ""


@pytest.mark.slow   # four processes, each importing torch and transformers
def test_hf_memory_measures_the_kits_loading_and_export_on_a_tiny_model(tmp_path):
    """bench.hf_memory's measuring code end to end on a tiny Llama (2 gloo ranks per case, the
    kit's loop.prepare and export), and its table: the verdicts follow the goals."""
    from bench import hf_memory

    s = hf_memory.main(["--size", "tiny", "--strategies", "fsdp", "--tmp", str(tmp_path)])
    rows = {(r["path"], r["rank"]): r for r in s["rows"]}
    assert set(rows) == {("before", 0), ("before", 1), ("after", 0), ("after", 1)}
    for r in rows.values():
        # Peaks are the process's own (Python and torch at least), never below its idle size.
        assert 0.05 < r["idle_gb"] <= r["built_gb"] <= r["load_gb"]
        assert r["idle_gb"] <= r["export_gb"]
        assert 0 < r["load_anon_gb"] <= r["load_gb"] and 0 < r["export_anon_gb"] <= r["export_gb"]
    # The tiny model fits one shard: rank 0 writes it, in both paths.
    assert rows[("after", 0)]["shards"] == rows[("before", 0)]["shards"] == 1
    assert rows[("after", 1)]["shards"] == 0

    def row(path, rank, load_x, export_x):
        return {"strategy": "fsdp", "path": path, "rank": rank, "idle_kib": 0,
                "built_peak_kib": int(0.5 * 1e9 / 1024), "load_anon_kib": int(0.3 * 1e9 / 1024),
                "export_anon_kib": int(0.4 * 1e9 / 1024),
                "load_peak_kib": int(load_x * 1e9 / 1024), "export_peak_kib":
                int(export_x * 1e9 / 1024), "shards": ["a"] if rank == 0 else []}

    cases = {("fsdp", "before"): [row("before", 0, 1.6, 1.9), row("before", 1, 1.5, 0.6)],
             ("fsdp", "after"): [row("after", 0, 1.1, 0.9), row("after", 1, 0.7, 0.8)]}
    s = hf_memory.summarize(cases, model_bytes=10**9)
    text = hf_memory.section(s, "2026-01-01", "a test machine")
    assert text.startswith(hf_memory.SECTION)
    assert "| FSDP2 | after | 1 | 0.0 | 0.5 | 0.7 (0.7x) | 0.3 | 0.8 (0.8x) | 0.4 | 0 |" in text
    assert "rank 0 <= 1.2x — met" in text and "the other rank(s) <= 0.65x — **missed**" in text
    assert "export, every rank <= 1.2x — met" in text
    assert hf_memory.section_of(f"# B\n\n{text}\n## 9. next\n") == text.rstrip("\n")


def test_llm_profile_reads_py_spys_raw_stacks():
    """bench.llm_profile's summary of py-spy's raw output: shares per thread, per library
    nearest the leaf (walking up past asyncio and threading), and per leaf."""
    from bench import llm_profile

    raw = "\n".join([
        "process 1:\"x\";thread (0x1): MainThread;main_loop (ray/_private/worker.py:847) 30",
        "thread (0x2): AsyncIO;run (threading.py:1);send (uvicorn/protocols/http/h.py:5) 50",
        "thread (0x2): AsyncIO;serve (vllm/entrypoints/x.py:3);_run (asyncio/events.py:9) 20",
        "not a sample line"])
    got = llm_profile.summarize(raw)
    assert got["samples"] == 100
    assert got["threads"] == [("thread (0x2): AsyncIO", 70.0), ("thread (0x1): MainThread", 30.0)]
    assert got["libraries"] == [("uvicorn/starlette/fastapi", 50.0), ("ray core", 30.0),
                                ("vllm", 20.0)]
    assert got["leaves"][0] == ("send (uvicorn/protocols/http/h.py:5)", 50.0)
