"""Each rank's random state in a checkpoint (`rng_rank{r}.pt`, workloads.common.runs): a
resumed run draws the same dropout masks and data order as one that never stopped."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from workloads.common.runs import rng_file


def save_rng(dirpath: Path, rank: int) -> None:
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               dirpath / rng_file(rank))


def load_rng(dirpath: Path, rank: int) -> bool:
    path = dirpath / rng_file(rank)
    if not path.exists():
        return False
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True
