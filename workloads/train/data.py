"""Training data: byte-level tokens from a corpus every machine has offline (the Python
standard library's own source), as a torch Dataset of fixed-length blocks, or a Ray Data
dataset of packed sequences (column ``tokens``, length seq_len + 1) handed in by the driver."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


# Left out of the corpus: they differ between installs and would make runs unrepeatable.
_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _stdlib_walk(folder: str) -> Iterator[Path]:
    """.py files under folder in sorted-Path order (by path parts: a folder's files and
    sub-folders interleaved by name), lazily: the loop's 1 MiB corpus needs a few dozen files
    of the top folder, not a walk of the whole standard library first."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_dir(follow_symlinks=False):  # as rglob: symlinked folders are not entered
            if e.name not in _SKIP:
                yield from _stdlib_walk(e.path)
        elif e.name.endswith(".py"):
            yield Path(e.path)


def stdlib_files() -> list[Path]:
    """Every .py file of this interpreter's standard library, in a fixed order (sorted
    paths), tests and site-packages left out."""
    return list(_stdlib_walk(sysconfig.get_paths()["stdlib"]))


def stdlib_corpus(max_bytes: int) -> bytes:
    out, size = [], 0
    for path in _stdlib_walk(sysconfig.get_paths()["stdlib"]):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


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
