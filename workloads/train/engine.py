"""The model in training, whatever the strategy: bf16 autocast on GPU, the micro-step and the
checkpoint's files, with the strategy-specific parts (wrapping, stepping, state) delegated to
the run's strategy (workloads/train/strategies/) and the final Hugging Face export written
by every rank."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from workloads.common import runs
from workloads.train import hf_io, hf_model, strategies
from workloads.train.loopconfig import Context, LoopConfig


class Engine:
    """The strategy-specific parts behind one face: wrapping, stepping, saving and loading."""

    def __init__(self, cfg: LoopConfig, ctx: Context, model: torch.nn.Module,
                 from_rank0: bool = False):
        self.cfg, self.ctx = cfg, ctx
        cuda = ctx.device.type == "cuda"
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                         else contextlib.nullcontext())
        # What the forward pass actually computed in (the logits' dtype), for the summary:
        # bf16 on GPU is measured, not assumed from the settings.
        self.compute_dtype = ""
        self.files_elsewhere: dict[str, int] = {}   # the final hf/ shards other ranks wrote

        # LoRA: the frozen base has no gradients and no optimizer state; checkpoints hold
        # only what trains (the base is loaded from its source again on resume).
        self.lora = hf_model.is_hf(cfg.model) and bool(cfg.model.get("lora"))
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.raw = model
        self.strategy = strategies.get(cfg.strategy)(
            cfg, ctx, model, lora=self.lora, trainable=self.trainable, from_rank0=from_rank0)
        self.model, self.optimizer = self.strategy.model, self.strategy.optimizer

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        logits, loss = self.strategy.micro_step(x, y, last, self.autocast)
        self.compute_dtype = str(logits.dtype).removeprefix("torch.")
        return loss.detach()

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, d: Path, final: bool) -> None:
        # A Hugging Face run's final checkpoint (not LoRA's): hf/ is its full-weight export,
        # written shard by shard by every rank (export_hf), never gathered into one process.
        hf_full = final and hf_model.is_hf(self.cfg.model) and not self.lora
        self.files_elsewhere = {}
        full = self.strategy.save_state(d, gather_full=final and not hf_full)
        if hf_full:
            # The run's result in Hugging Face format: what `lm`, vLLM and from_pretrained
            # load.
            self.export_hf(d / runs.HF_DIR,
                           self.cfg.hf_max_shard_bytes or hf_io.MAX_SHARD_BYTES)
        elif final and self.ctx.rank == 0 and self.lora:
            # The adapter (PEFT's folder), and with --lora-merge the base with it merged in.
            lora = self.cfg.model["lora"]
            hf_model.export_adapter(full, lora, self.cfg.tokenizer, d / runs.ADAPTER_DIR,
                                    self.cfg.s3_endpoint)
            if self.cfg.lora_merge:
                hf_model.export_merged(d / runs.ADAPTER_DIR, self.cfg.model[runs.HF_MODEL_KEY],
                                       self.cfg.tokenizer, d / runs.HF_DIR, self.cfg.s3_endpoint)

    def export_hf(self, out: Path, max_shard_bytes: int = hf_io.MAX_SHARD_BYTES) -> None:
        """Write the model as a Hugging Face folder at `out` (hf_io.export_sharded): every rank
        calls it and writes its shards; rank 0 learns the others' files and sizes
        (files_elsewhere, for the checkpoint's marker). The files land in each rank's own
        checkpoint folder, which Ray (or TorchrunContext) merges into one."""
        written = hf_io.export_sharded(
            self._full_tensors(), self.cfg.model[runs.HF_MODEL_KEY], self.cfg.tokenizer, out,
            rank=self.ctx.rank, world_size=self.ctx.world_size,
            endpoint=self.cfg.s3_endpoint, max_shard_bytes=max_shard_bytes)
        self.files_elsewhere = {}
        if self.ctx.world_size > 1:
            every: list = [None] * self.ctx.world_size
            dist.all_gather_object(every, written)
            rel = out.name
            self.files_elsewhere = {f"{rel}/{f}": size for r, w in enumerate(every)
                                    if r != self.ctx.rank for f, size in w.items()}

    def _full_tensors(self):
        """full(name): the full value of the model's tensor `name` (save_pretrained's key) on
        this rank; a collective for sharded weights (FSDP2's DTensors, ZeRO-3's partitions),
        so every rank asks for every tensor in the same order."""
        module = self.strategy.unwrapped()
        # Tied tensors under each of their names.
        named = {**dict(module.named_parameters(remove_duplicate=False)),
                 **dict(module.named_buffers(remove_duplicate=False))}

        def full(name: str) -> torch.Tensor:
            return self.strategy.full_tensor(named[f"lm.{name}"])

        return full

    def _save_full(self, d: Path) -> dict | None:
        """Gather full fp32 weights onto rank 0 (a collective: every rank calls it); rank 0
        writes model.pt and gets the state dict back. LoRA: the adapter's weights only, for
        its export (no model.pt: the adapter/ folder is what is served)."""
        return self.strategy.gather_full(d)

    def load(self, d: Path) -> None:
        self.strategy.load_state(d)
