"""Training data: byte-level tokens from a corpus every machine has offline (the Python
standard library's own source, workloads.common.corpus), as a torch Dataset of fixed-length
blocks, or a Ray Data dataset of packed sequences (column ``tokens``, length seq_len + 1)
handed in by the driver."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from workloads.common.corpus import stdlib_corpus


class ByteBlocks(Dataset):
    """Non-overlapping windows of seq_len + 1 bytes: inputs are [:-1], targets [1:]."""

    def __init__(self, corpus: bytes, seq_len: int):
        self.tokens = torch.from_numpy(np.frombuffer(corpus, dtype=np.uint8).astype(np.int64))
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"corpus of {len(corpus)} bytes is shorter than one sequence")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]


class ParquetRows(Dataset):
    """A workloads.data output folder read whole into memory, without Ray Data (the torchrun
    path): rows {"tokens"} (packed text) or {"tokens", "labels"} (instruction data)."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        files = sorted(p for p in Path(path).rglob("*.parquet")
                       if not any(part.startswith((".", "_"))
                                  for part in p.relative_to(path).parts))
        tables = [pq.read_table(f) for f in files]
        self.columns = {name: torch.tensor(np.concatenate(
            [np.stack(t.column(name).to_numpy(zero_copy_only=False)) for t in tables]))
            for name in ("tokens", "labels") if name in tables[0].column_names}

    def __len__(self) -> int:
        return len(self.columns["tokens"])

    def __getitem__(self, i: int) -> dict:
        return {name: col[i] for name, col in self.columns.items()}


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A DataLoader batch (B, T+1) or a dict batch {"tokens": (B, T+1)[, "labels"]} -> (x, y).
    With labels (instruction data) the targets are labels[1:]: -100 where the loss ignores a
    position (prompt and padding)."""
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    tokens = tokens.long()
    if isinstance(batch, dict) and "labels" in batch:
        return tokens[:, :-1], batch["labels"].long()[:, 1:]
    return tokens[:, :-1], tokens[:, 1:]


def stdlib_ray_dataset(max_bytes: int, seq_len: int):
    """The same corpus as a Ray Data dataset of packed sequences (for the streaming path)."""
    import ray.data

    blocks = ByteBlocks(stdlib_corpus(max_bytes), seq_len)
    rows = [{"tokens": blocks[i].numpy()} for i in range(len(blocks))]
    return ray.data.from_items(rows)
