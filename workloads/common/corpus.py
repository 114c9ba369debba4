"""A corpus every machine has offline: the Python standard library's own source, in a fixed
order. workloads.train trains the byte GPT on it, workloads.data and workloads.embed read it
as their `stdlib` inputs, and the tiny Hugging Face tokenizer is trained on it."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

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
