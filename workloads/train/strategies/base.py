"""The protocol every training strategy implements, and what the torch-native ones (DDP,
FSDP2) share. A strategy wraps the model its way, makes its optimizer, takes a micro-step and
saves and loads a checkpoint's model and optimizer state; `engine.Engine` calls only these."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from workloads.common import runs
from workloads.train.loopconfig import Context, LoopConfig


class Strategy(Protocol):
    model: nn.Module                      # the model as wrapped for training
    optimizer: torch.optim.Optimizer

    def __init__(self, cfg: LoopConfig, ctx: Context, model: nn.Module, *, lora: bool,
                 trainable: set[str], from_rank0: bool = False) -> None: ...

    @classmethod
    def build_kwargs(cls, cfg: LoopConfig, ctx: Context, sharded: bool) -> tuple[dict, bool]:
        """(hf_model.build's keyword arguments for this rank, whether rank 0 then scatters
        the weights into the others' shards) for a model sharded over ranks or not."""
        ...

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool,
                   autocast: contextlib.AbstractContextManager) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """(logits, loss) of one micro-step; the optimizer steps on the `last` of a step."""
        ...

    def save_state(self, d: Path, gather_full: bool) -> dict | None:
        """Write this rank's part of the model and optimizer state into `d`; with
        `gather_full` also the full weights (gather_full). Rank 0 gets the full weights back
        where it has them."""
        ...

    def gather_full(self, d: Path) -> dict | None:
        """Full fp32 weights on rank 0 (a collective): rank 0 writes model.pt (not LoRA's)
        and gets the state dict back; the other ranks get None."""
        ...

    def load_state(self, d: Path) -> None: ...

    def unwrapped(self) -> nn.Module:
        """The module whose parameters carry the model's own names."""
        ...

    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The full value of one of the model's tensors on this rank (a collective where the
        strategy shards it)."""
        ...


def keep_full(sd: dict, d: Path, rank: int, lora: bool) -> dict | None:
    """Rank 0's fp32 CPU copy of the gathered state dict `sd`, written as model.pt unless
    LoRA's (the adapter/ folder is what is served); None on the other ranks."""
    if rank != 0:
        return None
    full = {k: v.detach().float().cpu() for k, v in sd.items()}
    if not lora:
        torch.save(full, d / runs.FULL_WEIGHTS)
    return full


class TorchNative:
    """DDP's and FSDP2's common ground: torch.compile in place, torch's AdamW and a micro-step
    that accumulates gradients and steps on the last. A subclass wraps the model (`wrap`)."""

    def __init__(self, cfg: LoopConfig, ctx: Context, model: nn.Module, *, lora: bool,
                 trainable: set[str], from_rank0: bool = False):
        self.cfg, self.ctx, self.lora, self.trainable, self.raw = cfg, ctx, lora, trainable, model
        cuda = ctx.device.type == "cuda"
        if cfg.compile:
            # In place (nn.Module.compile): parameter names and state_dict keys stay as they
            # are, so compiled and eager runs read each other's checkpoints.
            for module in self.compile_units(model):
                module.compile()
        self.model = self.wrap(model, from_rank0)
        groups = [{"params": [p for n, p in self.model.named_parameters()
                              if p.requires_grad and p.dim() >= 2],
                   "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in self.model.named_parameters()
                              if p.requires_grad and p.dim() < 2],
                   "weight_decay": 0.0}]
        # Fused AdamW where the device has the kernel (CUDA); foreach elsewhere.
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95),
                                           fused=True if cuda else None)

    @classmethod
    def build_kwargs(cls, cfg: LoopConfig, ctx: Context, sharded: bool) -> tuple[dict, bool]:
        return {}, False

    def compile_units(self, model: nn.Module) -> list[nn.Module]:
        return [model]

    def wrap(self, model: nn.Module, from_rank0: bool) -> nn.Module:
        raise NotImplementedError

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def micro_step(self, x, y, last, autocast):
        with self.no_sync(last):
            with autocast:
                logits, loss = self.model(x, y)
            (loss / self.cfg.grad_accum).backward()
        if last:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return logits, loss
