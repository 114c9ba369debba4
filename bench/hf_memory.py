"""Hugging Face models: host memory per rank while loading and while writing the final hf/
export, before (every rank `from_pretrained`s the whole model; the export gathered into rank
0) and after (workloads.train's loading without a full copy per rank, and its shard-by-shard
export), for FSDP2 and DeepSpeed ZeRO-3, with 2 ranks on CPU (gloo), side by side in one run.

    python -m bench.hf_memory [--size 1b|small|tiny] [--strategies fsdp,deepspeed]
                              [--paths before,after] [--write]

The model is a TinyLlama-shaped 1.1B Llama (bench.gpu's), fp32, fresh weights, written with
`save_pretrained` into a temporary folder under /var/tmp (about 4.4 GB; `--size tiny` is a
0.1M-parameter one, for a smoke run; `--size small` the 1.1B's shape with 8 of its layers, to
iterate on). Each case starts 2 fresh processes (`torchrun`'s
environment, the kit's TorchrunContext) that run the kit's own code: `loop.prepare` (with
`full_copy_per_rank` for the before rows), then the final checkpoint's export (before:
`_Engine._save_full` + `hf_model.export`, what the final checkpoint did; after:
`_Engine.export_hf`). Peak memory per process is the kernel's VmHWM (/proc/self/status: the
most resident memory the process had), reset between loading and the export
(/proc/self/clear_refs); the resident memory of the same process before any model existed
(Python, torch, transformers, DeepSpeed imported) is reported beside it. `--write` replaces
BENCHMARKS.md's section of this benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ArgumentParser, command, goal, machine
from bench.gpu import HF_MODELS

REPO = Path(__file__).resolve().parents[1]
SECTION = "## 8. Hugging Face models: host memory per rank, loading and export"
TAG = "RAYFLEET_HF_MEMORY"
WORLD = 2
STRATEGIES = ("fsdp", "deepspeed")
TINY = ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64},
        512)
# --size small: the 1.1B's shape with 8 of its 22 layers (~0.6B, ~2.5 GB), to iterate on.
SMALL_LAYERS = 8
# The goals (docs/benchmarks.md): while loading, a rank other than 0 holds at most its share
# of the model plus 15% of it, rank 0 at most 1.2 x the model; writing the export, no process
# more than 1.2 x the model.
SHARE_SLACK = 0.15
RANK0_MAX = 1.2


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


class AnonPeak:
    """The most anonymous memory (RssAnon: what the process allocated, as opposed to pages of
    mapped files such as safetensors weights, which the kernel can drop and read again) seen
    by a thread sampling /proc/self/status every 20 ms; the kernel keeps no peak of it."""

    def __init__(self):
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, status_kib("RssAnon"))

    def take(self) -> int:
        """The peak since the last take(), and start again from now."""
        peak = max(self.peak, status_kib("RssAnon"))
        self.peak = 0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_model(folder: Path, size: str) -> int:
    """A fresh fp32 Llama of `size` saved into `folder`; its weights' bytes on disk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shape, vocab = TINY if size == "tiny" else HF_MODELS["llama-1b"][:2]
    if size == "small":
        shape = {**shape, "num_hidden_layers": SMALL_LAYERS}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, tie_word_embeddings=False,
                                         dtype="float32", **shape))
    model.save_pretrained(str(folder))
    del model
    gc.collect()
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# ------------------------------------------------------------------------- one rank

def rank_main(spec: dict) -> dict:
    """One rank of one case (RANK, WORLD_SIZE, MASTER_* set by the parent): load the model
    the kit's way for spec["strategy"], then write the export; peak memory of each phase."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from workloads.common import runs
    from workloads.train import hf_model, loop
    from workloads.train.context import TorchrunContext

    torch.set_num_threads(1)
    before = spec["path"] == "before"
    out = Path(spec["out"])
    cfg = loop.LoopConfig(
        model=hf_model.HFSpec(config=AutoConfig.from_pretrained(spec["model"]).to_dict(),
                              seq_len=128, n_params=0).to_dict(),
        hf_source=spec["model"], strategy=spec["strategy"], zero_stage=3, batch_size=1)
    ctx = TorchrunContext(out / "ckpt")
    if cfg.strategy == "deepspeed":
        loop._deepspeed(cfg, False)           # imported before the baseline, as torch is
    # The peak while the model is built, before the strategy wraps it (FSDP2's sharding,
    # deepspeed.initialize and its optimizer partitions): read as _Engine starts.
    built: dict = {}
    engine_init = loop._Engine.__init__

    class BuiltOnly(Exception):
        pass

    def traced(self, *a, **kw):
        built["peak"] = status_kib("VmHWM")
        if spec.get("built_only"):
            raise BuiltOnly
        return engine_init(self, *a, **kw)

    loop._Engine.__init__ = traced
    gc.collect()
    idle = status_kib("VmRSS")
    anon = AnonPeak()
    reset_peak()
    anon.take()
    torch.manual_seed(0)
    try:
        _, engine = loop.prepare(cfg, ctx, full_copy_per_rank=before)
    except BuiltOnly:                  # --until built: the model built, nothing wrapped
        built_anon = anon.take()
        anon.stop()
        dist.barrier()
        dist.destroy_process_group()
        return {"rank": ctx.rank, "idle_kib": idle, "built_peak_kib": built["peak"],
                "built_anon_kib": built_anon}
    loop._Engine.__init__ = engine_init
    gc.collect()
    load_peak, loaded, load_anon = status_kib("VmHWM"), status_kib("VmRSS"), anon.take()
    dist.barrier()
    reset_peak()
    anon.take()
    d = out / f"rank{ctx.rank}"
    d.mkdir(parents=True, exist_ok=True)
    if before:
        full = engine._save_full(d)
        if ctx.rank == 0:
            hf_model.export(full, cfg.model[runs.HF_MODEL_KEY], None, d / runs.HF_DIR)
        del full
    else:
        engine.export_hf(d / runs.HF_DIR)
    gc.collect()
    export_peak, export_anon = status_kib("VmHWM"), anon.take()
    anon.stop()
    files = sorted(p.name for p in (d / runs.HF_DIR).glob("*.safetensors")) \
        if (d / runs.HF_DIR).exists() else []
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": ctx.rank, "idle_kib": idle, "built_peak_kib": built["peak"],
            "load_peak_kib": load_peak, "load_anon_kib": load_anon,
            "export_anon_kib": export_anon,
            "loaded_kib": loaded, "export_peak_kib": export_peak, "shards": files}


# ---------------------------------------------------------------------------- parent

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(model: Path, strategy: str, path: str, tmp: Path, timeout: float,
              built_only: bool = False) -> list[dict]:
    """2 ranks of one case, started as torchrun would start them; each rank's numbers."""
    out = tmp / f"{strategy}-{path}"
    spec = json.dumps({"model": str(model), "strategy": strategy, "path": path,
                       "built_only": built_only,
                       "out": str(out)})
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.hf_memory", "--rank",
                                       spec], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results, errors = [], []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"bench.hf_memory: {strategy}/{path} still running after "
                             f"{timeout:.0f} s") from None
        lines = [ln for ln in stdout.splitlines() if ln.startswith(TAG)]
        if proc.returncode != 0 or not lines:
            errors.append(f"exit {proc.returncode}: {stderr.strip().splitlines()[-1:]}")
        else:
            results.append(json.loads(lines[-1][len(TAG):]))
    shutil.rmtree(out, ignore_errors=True)           # up to 2x the model on disk per case
    if errors:
        raise SystemExit(f"bench.hf_memory: {strategy}/{path} failed: {errors[0]}")
    return sorted(results, key=lambda r: r["rank"])


def summarize(cases: dict, model_bytes: int, world: int = WORLD) -> dict:
    """Per case and rank, the peaks in GB and as a share of the model's bytes; the goals'
    verdicts for the after rows."""
    share = 1 / world + SHARE_SLACK
    out: dict = {"model_gb": round(model_bytes / 1e9, 2), "world": world,
                 "share_goal": round(share, 3), "rank0_goal": RANK0_MAX, "rows": []}
    for (strategy, path), ranks in cases.items():
        for r in ranks:
            load = r["load_peak_kib"] * 1024
            export = r["export_peak_kib"] * 1024
            limit = RANK0_MAX if r["rank"] == 0 else share
            out["rows"].append({
                "strategy": strategy, "path": path, "rank": r["rank"],
                "idle_gb": round(r["idle_kib"] * 1024 / 1e9, 2),
                "built_gb": round(r["built_peak_kib"] * 1024 / 1e9, 2),
                "load_gb": round(load / 1e9, 2), "load_x": round(load / model_bytes, 2),
                "load_anon_gb": round(r.get("load_anon_kib", 0) * 1024 / 1e9, 2),
                "export_anon_gb": round(r.get("export_anon_kib", 0) * 1024 / 1e9, 2),
                "export_gb": round(export / 1e9, 2),
                "export_x": round(export / model_bytes, 2),
                "shards": len(r["shards"]),
                "load_ok": load <= limit * model_bytes,
                "built_ok": r["built_peak_kib"] * 1024 <= limit * model_bytes,
                "export_ok": export <= RANK0_MAX * model_bytes})
    return out


def section(s: dict, date: str, where: str, load_avg: float | None = None) -> str:
    """BENCHMARKS.md's section for a summarize() result."""
    names = {"fsdp": "FSDP2", "deepspeed": "ZeRO-3"}
    rows = []
    for r in s["rows"]:
        rows.append(f"| {names.get(r['strategy'], r['strategy'])} | {r['path']} | {r['rank']} "
                    f"| {r['idle_gb']} | {r['built_gb']} | {r['load_gb']} ({r['load_x']}x) | "
                    f"{r['load_anon_gb']} | {r['export_gb']} ({r['export_x']}x) | "
                    f"{r['export_anon_gb']} | {r['shards']} |")
    after = [r for r in s["rows"] if r["path"] == "after"]
    verdicts = []
    for strategy in dict.fromkeys(r["strategy"] for r in after):
        mine = [r for r in after if r["strategy"] == strategy]
        r0 = [r for r in mine if r["rank"] == 0]
        others = [r for r in mine if r["rank"] != 0]
        verdicts.append(
            f"{names.get(strategy, strategy)}: loading, rank 0 <= {s['rank0_goal']}x — "
            f"{goal(all(r['load_ok'] for r in r0), load_avg)}; the other rank(s) <= "
            f"{s['share_goal']}x — {goal(all(r['load_ok'] for r in others), load_avg)}; "
            f"export, every rank <= {s['rank0_goal']}x — "
            f"{goal(all(r['export_ok'] for r in mine), load_avg)}.")
        if strategy == "deepspeed":
            # ZeRO-3's "wrapped" adds deepspeed.initialize's training state to the loading.
            verdicts.append(
                f"ZeRO-3's loading alone (built: up to deepspeed.initialize), rank 0 <= "
                f"{s['rank0_goal']}x — {goal(all(r['built_ok'] for r in r0), load_avg)}; the "
                f"other rank(s) <= {s['share_goal']}x — "
                f"{goal(all(r['built_ok'] for r in others), load_avg)}.")
    return f"""{SECTION}

Measured by `python -m bench.hf_memory --write` on {date}: {where}. A {s['model_gb']} GB
model (fp32 safetensors on disk: the "model bytes" every share below is of), {s['world']}
ranks on CPU (gloo), each a fresh process running the kit's own loading
(`workloads.train.loop.prepare`) and final export. Peak = the process's VmHWM (most resident
memory, including what Python, torch and the libraries take: the idle column, the same
process before any model existed), reset between loading and the export; "built" is the peak
until the model is built, before the strategy wraps it (FSDP2's sharding, DeepSpeed's engine
with its own fp32 partition of the weights for the optimizer), "wrapped" the peak
of the whole of `prepare`, which the goals judge; "anon" the most anonymous memory (RssAnon,
sampled every 20 ms) in the same phase: the peaks minus it are pages of the memory-mapped
safetensors files (transformers maps them and reads a tensor's pages when it is first used),
which count as resident but which the kernel may drop and read again. Before: every rank
`from_pretrained`s the whole model, and the export is gathered into rank 0 (model.pt +
save_pretrained). After: FSDP2 ranks other than 0 build on the meta device, every rank
reads its own rows of each weight straight from the safetensors files (plain reads: the
pages stay in the page cache, out of the process) and rank 0, whose `from_pretrained` model
is never read through its mapping, keeps only its own rows until it shards; ZeRO-3 builds
under `zero.Init` and every rank reads its own partitions from the files; the export is
written shard by shard by every rank. ZeRO-3's "wrapped" is its loading plus
`deepspeed.initialize`, which allocates the training state beside the weights' partition:
an fp32 copy of the partition for the optimizer and AdamW's two moments (about 3 more
partitions, 1.5x the model per rank with 2 ranks) — accelerator memory on a GPU, but host
memory with DeepSpeed's CPU accelerator, so on CPU that phase cannot fit 1.2x whatever the
loading does; "built" is the loading alone. The export runs with that training state alive.

| strategy | path | rank | idle | built | wrapped (x model) | anon | export (x) | anon | shards |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Goals (the after rows): {' '.join(verdicts)}
"""


def section_of(text: str) -> str:
    """This benchmark's section of an existing BENCHMARKS.md ('' when it has none)."""
    m = re.search(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", text, re.M | re.S)
    return m.group(0).rstrip("\n") if m else ""


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(prog="bench.hf_memory")
    ap.add_argument("--size", choices=("1b", "small", "tiny"), default="1b",
                    help="the 1.1B Llama (~4.4 GB in fp32), the same with 8 of its 22 layers "
                         "(~2.5 GB) or a tiny one (smoke run)")
    ap.add_argument("--paths", default="before,after",
                    help="comma-separated, of: before, after")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="comma-separated, of: " + ", ".join(STRATEGIES))
    ap.add_argument("--tmp", default="/var/tmp",
                    help="where the model folder and the exports are written (~3x the model)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    ap.add_argument("--until", choices=("export", "built"), default="export",
                    help="built: stop each rank once the model is built, before the strategy "
                         "wraps it (DeepSpeed's engine and its training state), and print "
                         "that peak only")
    ap.add_argument("--write", action="store_true", help="replace BENCHMARKS.md's section")
    ap.add_argument("--rank", default=None, help=argparse.SUPPRESS)   # one rank of a case
    args = ap.parse_args(argv)
    if args.rank is not None:
        r = rank_main(json.loads(args.rank))
        print(TAG + json.dumps(r), flush=True)
        return r
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        ap.error(f"--strategies: {bad or 'none'} not among {', '.join(STRATEGIES)}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in ("before", "after") for p in paths):
        ap.error(f"--paths: {args.paths!r}: give before, after or both")
    if args.write and (args.size != "1b" or len(paths) < 2 or args.until != "export"):
        ap.error("--write: only a full run (--size 1b, both --paths, --until export) "
                 "replaces the section")
    if not Path(args.tmp).is_dir():
        ap.error(f"--tmp: {args.tmp} is not a folder")
    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-hfmem-", dir=args.tmp) as t:
        tmp = Path(t)
        model_bytes = make_model(tmp / "model", args.size)
        cases = {}
        for strategy in strategies:
            for path in paths:
                cases[(strategy, path)] = run_ranks(tmp / "model", strategy, path, tmp,
                                                    args.timeout, args.until == "built")
                print(f"[bench.hf_memory] {strategy}/{path}: "
                      + json.dumps(cases[(strategy, path)]), flush=True)
    if args.until == "built":
        rows = [{"strategy": strategy, "path": path, "rank": r["rank"],
                 "idle_gb": round(r["idle_kib"] * 1024 / 1e9, 2),
                 "built_gb": round(r["built_peak_kib"] * 1024 / 1e9, 2),
                 "built_x": round(r["built_peak_kib"] * 1024 / model_bytes, 2),
                 "built_anon_gb": round(r["built_anon_kib"] * 1024 / 1e9, 2)}
                for (strategy, path), ranks in cases.items() for r in ranks]
        s = {"model_gb": round(model_bytes / 1e9, 2), "until": "built", "size": args.size,
             "rows": rows}
        print(json.dumps(s))
        return s
    s = summarize(cases, model_bytes)
    s["size"] = args.size
    s["load_avg"] = round(os.getloadavg()[0], 1)
    print(json.dumps(s))
    if args.write:
        md = REPO / "BENCHMARKS.md"
        old = md.read_text()
        # No load caveat: a process's peak memory does not depend on how busy the cores are.
        new = section(s, datetime.date.today().isoformat(), machine())
        mine = section_of(old)
        md.write_text(old.replace(mine, new) if mine else old.rstrip("\n") + "\n\n" + new)
    return s


if __name__ == "__main__":
    sys.exit(command(main, "bench.hf_memory"))
