"""GPU benchmark (benchmark 4 in docs/benchmarks.md): the LM training loop on one GPU in bf16
under `torchrun` (no Ray, by design: the GPU machines carry torch but not Ray), tokens/s and
MFU against the GPU's dense bf16 peak (rayfleet/catalog.json) for the 350m and 1b presets and
a 1.1B Hugging Face Llama (`--model-config`, fresh weights), each eager and with `--compile`
(torch.compile in place) side by side in one run.

    python -m bench.gpu                  # where CUDA exists; rewrites BENCHMARKS.md's GPU section

Only the GPU section between the markers is rewritten, so `make bench` (CPU) and this can run
on different machines.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rayfleet.entrypoint import ArgumentParser, run_main

REPO = Path(__file__).resolve().parents[1]
BENCH_MD = REPO / "BENCHMARKS.md"
BEGIN, END = "<!-- gpu-section -->", "<!-- /gpu-section -->"
NO_RUN = f"""{BEGIN}
## 4. GPU: the training loop on one GPU in bf16 (torchrun)

No GPU run exists yet: no machine with CUDA was available to the sessions that wrote this
file. Reproduce on one: `python -m bench.gpu` (needs torch with CUDA; Ray is not needed). It
trains the 350m and 1b presets and a 1.1B Hugging Face Llama for a few dozen steps in bf16
and records tokens/s and MFU against the GPU's dense bf16 peak, eager and with torch.compile.
Goal: >= 45% MFU on an H100.
{END}"""


def gpu_section_of(text: str) -> str:
    """The GPU section of an existing BENCHMARKS.md, or the no-run text."""
    if BEGIN in text and END in text:
        return text[text.index(BEGIN):text.index(END) + len(END)]
    return NO_RUN


# A TinyLlama-shaped 1.1B Llama (22 layers, d 2048, GQA 32/4 heads, SwiGLU 5632): the
# Hugging Face path of the real-models work, fresh weights from its config.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4,
            "max_position_embeddings": 2048}
HF_MODELS = {"llama-1b": (LLAMA_1B, 32000, 2048)}


def prepare_hf(out: Path, shape: dict, vocab: int, seq_len: int, corpus_bytes: int) -> list[str]:
    """A config folder (fresh weights), a BPE tokenizer trained on the standard library, and
    the stdlib corpus tokenized and packed into seq_len + 1 windows with the manifest
    workloads.data writes: the flags that train it with workloads.train.torchrun."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import LlamaConfig

    # Lazy, as the imports above: this runs on a lent GPU machine's own Python (torch, no Ray,
    # maybe not the kit's other dependencies), and only the llama-1b rows need these.
    from workloads.common.corpus import stdlib_corpus
    from workloads.common.hf import tokenizer_identity
    from workloads.common.shards import MANIFEST, shard_name
    from workloads.common.tiny_hf import make_tokenizer

    folder = out / "model"
    tok = make_tokenizer(folder, vocab_size=vocab, corpus_bytes=corpus_bytes)
    LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False, **shape).save_pretrained(str(folder))
    ids = np.array(tok(stdlib_corpus(corpus_bytes).decode("utf-8", "ignore"))["input_ids"],
                   dtype=np.int32)
    n = (len(ids) - 1) // seq_len
    rows = np.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"tokens": pa.array(rows.tolist(), pa.list_(pa.int32()))}),
                   data / f"{shard_name(0)}-000.parquet")
    (data / MANIFEST).write_text(json.dumps({
        "seq_len": seq_len, "shape": "text", "rows": n,
        "tokenizer": tokenizer_identity(tok, str(folder))}))
    return ["--model-config", str(folder), "--dataset", str(data)]


def run_one(model: str, compiled: bool, steps: int, batch: int, out: Path,
            model_flags: list[str] | None = None) -> dict:
    name = f"{model}-{'compile' if compiled else 'eager'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "-m", "workloads.train.torchrun", *(model_flags or ["--model", model]),
           "--use-gpu",
           "--max-steps", str(steps), "--log-every", "10", "--checkpoint-every", str(10 * steps),
           "--batch-size", str(batch), "--output", str(out / name), *(["--compile"] * compiled)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    # The run's final checkpoint is ~16 bytes a parameter (weights + Adam): 1b's is 16 GB, so
    # each run's folder goes before the next one starts.
    shutil.rmtree(out / name, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RAYFLEET_SUMMARY ")]
    if proc.returncode != 0 or not lines:
        # torchrun ends stderr with its own banner; the worker's error is the last line that
        # names one.
        err = [ln for ln in proc.stderr.splitlines() if "Error" in ln] or ["no output"]
        raise SystemExit(f"bench.gpu: {name} failed (exit {proc.returncode}): {err[-1][:500]}")
    summary = json.loads(lines[-1].split(" ", 1)[1])
    steady = [h for h in summary["history"][1:] if h.get("tokens_per_s")] or summary["history"]
    # The first logged interval holds the compile (or CUDA warm-up): steady state is the rest.
    return {"model": model, "compile": compiled, "batch": batch, "steps": steps,
            "tokens_per_s": statistics.median(h["tokens_per_s"] for h in steady),
            "mfu": statistics.median(h.get("mfu", 0.0) for h in steady)}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="bench.gpu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; run it on a GPU machine (BENCHMARKS.md keeps "
              "its GPU section as it is)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="rayfleet-gpu-") as tmp:
        rows = [run_one(m, c, args.steps, args.batch_size, Path(tmp))
                for m in ("350m", "1b") for c in (False, True)]
        shape, vocab, seq_len = HF_MODELS["llama-1b"]
        # Enough tokens for every step's batch without repeating an epoch.
        flags = prepare_hf(Path(tmp) / "llama-1b", shape, vocab, seq_len,
                           corpus_bytes=(args.steps + 2) * args.batch_size * seq_len * 4)
        rows += [run_one("llama-1b", c, args.steps, args.batch_size, Path(tmp), flags)
                 for c in (False, True)]
    eager = {r["model"]: r["tokens_per_s"] for r in rows if not r["compile"]}
    table = "\n".join(f"| {r['model']} | {'torch.compile' if r['compile'] else 'eager'} | "
                      f"{r['batch']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
                      f"{r['tokens_per_s'] / eager[r['model']]:.2f}x |" for r in rows)
    best = max(r["mfu"] for r in rows)
    section = f"""{BEGIN}
## 4. GPU: the training loop on one GPU in bf16 (torchrun)

Last GPU run: {device}; torch {torch.__version__}, Python {platform.python_version()};
`python -m bench.gpu --steps {args.steps} --batch-size {args.batch_size}` (median of the
logged 10-step intervals after the first; no Ray on that machine, by design).

| model | mode | batch (seqs) | tokens/s | MFU (dense bf16 peak) | vs eager |
|---|---|---|---|---|---|
{table}

Goal: >= 45% MFU on an H100 — {"met" if best >= 0.45 else "**missed**"}
(best {100 * best:.1f}%).
{END}"""
    text = BENCH_MD.read_text() if BENCH_MD.exists() else ""
    text = (text.replace(gpu_section_of(text), section) if BEGIN in text
            else text.rstrip("\n") + "\n\n" + section + "\n")
    BENCH_MD.write_text(text)
    print(json.dumps({"device": device, "rows": rows, "host": os.uname().nodename}))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, None, "bench.gpu"))
