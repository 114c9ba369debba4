"""FSDP2: every block and then the root sharded over the ranks (`fully_shard`); each rank
saves its own shard of the model and optimizer state (torch.distributed.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from workloads.common import runs
from workloads.train import hf_io
from workloads.train.loopconfig import Context, LoopConfig
from workloads.train.strategies.base import TorchNative, keep_full


class FSDP(TorchNative):
    @classmethod
    def build_kwargs(cls, cfg: LoopConfig, ctx: Context, sharded: bool) -> tuple[dict, bool]:
        # Rank 0 builds the model, the others on the meta device; rank 0 scatters the weights.
        return ({"meta": ctx.rank != 0}, True) if sharded else ({}, False)

    def compile_units(self, model: nn.Module) -> list[nn.Module]:
        # Per block, before sharding: each block's all-gather stays outside its graph.
        return list(model.blocks)

    def wrap(self, model: nn.Module, from_rank0: bool) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        mp = None
        if self.ctx.device.type == "cuda":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def shard(model):
            # FSDP2: shard each block, then the root (embeddings, final norm).
            for block in model.blocks:
                fully_shard(block, mp_policy=mp) if mp else fully_shard(block)
            fully_shard(model, mp_policy=mp) if mp else fully_shard(model)

        if next(model.parameters()).is_meta:
            # Built on the meta device (prepare): this rank allocates only its shards and
            # gets their values from rank 0, which shards its own copy afterwards.
            shard(model)
            model.to_empty(device=self.ctx.device)
            hf_io.scatter_into_shards(model, self.ctx.rank, self.ctx.device)
        else:
            model = model.to(self.ctx.device)
            if from_rank0:
                hf_io.scatter_into_shards(model, self.ctx.rank, self.ctx.device)
            shard(model)
        return model

    def _sd_options(self, **kw):
        """torch.distributed.checkpoint's state-dict options: LoRA leaves the frozen base out."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.lora, **kw)

    def save_state(self, d: Path, gather_full: bool) -> dict | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer, options=self._sd_options())
        # Each rank writes only its own shard (rank 0 adds .metadata); Ray merges the
        # per-rank folders into one checkpoint in storage.
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / runs.DCP_DIR))
        return self.gather_full(d) if gather_full else None

    def gather_full(self, d: Path) -> dict | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.model, options=self._sd_options(
            full_state_dict=True, cpu_offload=True))
        return keep_full(sd, d, self.ctx.rank, self.lora)

    def load_state(self, d: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer, options=self._sd_options())
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(d / runs.DCP_DIR))
        # LoRA: dcp.load has already refused a checkpoint missing any adapter tensor; the
        # frozen base is absent from it by design (not strict about those).
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=self._sd_options(strict=not self.lora))

    def unwrapped(self) -> nn.Module:
        return self.model

    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t.detach()
