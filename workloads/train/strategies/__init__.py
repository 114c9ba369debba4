"""The training strategies by the name `--strategy` takes, each a peer behind
`base.Strategy`: a new strategy is a new module here and an entry in REGISTRY."""

from __future__ import annotations

from workloads.train.strategies.base import Strategy
from workloads.train.strategies.ddp import DDP
from workloads.train.strategies.deepspeed import DeepSpeed
from workloads.train.strategies.fsdp import FSDP

# In --strategy's order (its help and its "did you mean").
REGISTRY: dict[str, type[Strategy]] = {"ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}


def get(name: str) -> type[Strategy]:
    return REGISTRY[name]
