"""What the per-worker training loop is given: its settings (`LoopConfig`) and the context it
runs in (`Context`: rank, world size, device, data, checkpoints, reports), which
`context.RayContext` implements with ray.train and `context.TorchrunContext` without Ray."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from workloads.common.model import GPTConfig
from workloads.train import hangwatch, preempt


@dataclass
class LoopConfig:
    model: dict = field(default_factory=lambda: GPTConfig().to_dict())
    strategy: str = "ddp"
    zero_stage: int = 2
    offload: bool = False
    batch_size: int = 8               # per worker, per micro-step
    grad_accum: int = 1
    lr: float = 3e-3                  # already scaled by world size by the driver
    warmup_steps: int = 10
    max_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    log_every: int = 10
    corpus_bytes: int = 1 << 20
    seed: int = 0
    use_ray_dataset: bool = False
    num_workers: int = 1              # DataLoader worker processes (0 = in the train process)
    compile: bool = False             # torch.compile in place (ddp, fsdp)
    # Hugging Face models (model = HFSpec.to_dict()): weights from hf_source, or fresh from
    # the config when it is None; the tokenizer is exported with the final checkpoint.
    hf_source: str | None = None
    tokenizer: str | None = None
    s3_endpoint: str | None = None
    activation_checkpointing: bool = False
    offload_params: bool = False      # DeepSpeed ZeRO-3: parameters on the host
    deepspeed_config: dict = field(default_factory=dict)   # the user's, merged over the kit's
    dataset_path: str | None = None   # a local Parquet dataset without Ray Data (torchrun)
    lora_merge: bool = False          # LoRA: the final checkpoint's hf/ has the adapter merged
    hf_max_shard_bytes: int | None = None   # the hf/ export's largest file (None: hf_io's)
    # The hang watch (hangwatch.py): its floor in seconds (0: off, as under torchrun) and
    # the factor over the longest gap between steps.
    hang_floor_s: float = 0.0
    hang_factor: float = 10.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Context(Protocol):
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    def prepare_ddp(self, model: torch.nn.Module) -> torch.nn.Module: ...
    def prepare_data_loader(self, loader: DataLoader) -> DataLoader: ...
    def dataset_shard(self) -> Any: ...
    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]: ...
    def report(self, metrics: dict, checkpoint_dir: Path | None) -> None: ...
    def spot_notices(self) -> preempt.Notices: ...
    def hang_watch(self, settings: hangwatch.Settings | None) -> hangwatch.Watch: ...
    def export_metrics(self, metrics: dict) -> None: ...
