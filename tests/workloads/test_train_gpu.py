"""GPU checks of the same loop under `torchrun` (docs/house.md, convention 5): no Ray needed.
Skipped without CUDA (conftest)."""

import os
import shutil

import pytest

from tests.conftest import BIN, run, summary_of

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy,compile",
                         [("ddp", False), ("fsdp", False), ("ddp", True), ("fsdp", True)])
def test_torchrun_on_cuda_learns_in_bf16(tmp_path, strategy, compile):
    import torch

    nproc = min(2, torch.cuda.device_count())
    torchrun = shutil.which("torchrun") or str(BIN / "torchrun")
    proc = run([torchrun, f"--nproc-per-node={nproc}", "-m", "workloads.train.torchrun",
                "--model", "small", "--strategy", strategy, "--max-steps", "60",
                "--checkpoint-every", "30", "--log-every", "10", "--batch-size", "32",
                "--output", str(tmp_path), *(["--compile"] * compile)],
               env=dict(os.environ), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = summary_of(proc.stdout)
    assert s["device"].startswith("cuda")
    assert s["compute_dtype"] == "bfloat16"  # the logits' dtype, measured in the loop
    assert s["history"][-1]["loss"] < s["history"][0]["loss"]
    assert s["mfu"] > 0  # measured against the GPU's peak bf16 FLOP/s


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_hugging_face_llama_on_cuda_learns_in_bf16(tmp_path, strategy):
    """A Llama from its config (fresh weights) on bench.gpu's packed stdlib data: FSDP2 per
    decoder layer, or ZeRO-3 with CPU offload; bf16 compute, the hf/ export written."""
    import torch

    from bench import gpu

    shape = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}
    flags = gpu.prepare_hf(tmp_path / "prep", shape, vocab=2000, seq_len=256,
                           corpus_bytes=2_000_000)
    extra = ["--zero-stage", "3", "--offload", "--offload-params"] if strategy == "deepspeed" \
        else []
    nproc = min(2, torch.cuda.device_count())
    torchrun = shutil.which("torchrun") or str(BIN / "torchrun")
    proc = run([torchrun, f"--nproc-per-node={nproc}", "-m", "workloads.train.torchrun", *flags,
                "--use-gpu", "--strategy", strategy, *extra, "--max-steps", "40",
                "--checkpoint-every", "40", "--log-every", "10", "--batch-size", "8",
                "--lr", "1e-3", "--output", str(tmp_path / "out")],
               env=dict(os.environ), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = summary_of(proc.stdout)
    assert s["compute_dtype"] == "bfloat16"
    assert s["history"][-1]["loss"] < s["history"][0]["loss"]
    assert list((tmp_path / "out").glob("checkpoint_*/hf/model.safetensors"))
