"""DDP: a full copy of the model on every rank (the context wraps it), gradients all-reduced;
rank 0 saves the whole model and optimizer state."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from rayfleet.errors import CheckpointError
from workloads.common import runs
from workloads.train.strategies.base import TorchNative, keep_full


class DDP(TorchNative):
    def wrap(self, model: nn.Module, from_rank0: bool) -> nn.Module:
        return self.ctx.prepare_ddp(model)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        if not last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()  # skip the all-reduce on accumulation micro-steps
        return contextlib.nullcontext()

    def _own_state(self) -> dict:
        full = self.raw.state_dict()
        if self.lora:
            full = {k: v for k, v in full.items() if k in self.trainable}
        return full

    def save_state(self, d: Path, gather_full: bool) -> dict | None:
        # Every rank holds it all: rank 0 writes it, whether final or not.
        if self.ctx.rank != 0:
            return None
        full = self._own_state()
        torch.save(full, d / runs.FULL_WEIGHTS)
        torch.save(self.optimizer.state_dict(), d / runs.OPTIMIZER)
        return full

    def gather_full(self, d: Path) -> dict | None:
        return keep_full(self._own_state(), d, self.ctx.rank, self.lora)

    def load_state(self, d: Path) -> None:
        sd = torch.load(d / runs.FULL_WEIGHTS, map_location=self.ctx.device, weights_only=True)
        if self.lora:
            # The adapter only: the frozen base came from its source.
            if set(sd) != self.trainable:
                raise CheckpointError(f"checkpoint {d} does not hold this run's LoRA "
                                      f"adapter ({len(set(sd) & self.trainable)} of "
                                      f"{len(self.trainable)} adapter tensors)")
            self.raw.load_state_dict(sd, strict=False)
        else:
            self.raw.load_state_dict(sd)
        self.optimizer.load_state_dict(torch.load(d / runs.OPTIMIZER,
                                                  map_location=self.ctx.device,
                                                  weights_only=False))

    def unwrapped(self) -> nn.Module:
        return self.raw

    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()
