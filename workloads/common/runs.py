"""Checkpoint layout, writing and validation.

A checkpoint is a directory; under Ray Train each rank writes its part into its own temporary
directory and Ray merges them into one folder in storage. Layout:

    rayfleet_checkpoint.json  marker, written last by rank 0: step, strategy, world size,
                              and the size of every file rank 0 wrote
    model_config.json         GPTConfig (what workloads.serve needs to rebuild the model), or
                              for a Hugging Face model {"hf": its config, "seq_len", "n_params"}
    trainer_state.json        step, epoch, batch-in-epoch, LR schedule, metrics history
    rng_rank{r}.pt            each rank's RNG state (torch, numpy, python)
    ddp:        model.pt, optim.pt                     (rank 0)
    fsdp:       dcp/  torch.distributed.checkpoint     (each rank its shard, rank 0 .metadata)
    deepspeed:  ds/   DeepSpeed's own layout           (each rank its partition)
    model.pt    full weights, also for fsdp/deepspeed on the final checkpoint (for serving)
    hf/         Hugging Face models, final checkpoint: save_pretrained (safetensors) of the
                gathered weights plus the tokenizer (from_pretrained, `lm`, vLLM)

A checkpoint without a valid marker, or whose files are missing or short, is never resumed
from (fault 4 of docs/faults.md): the marker is the last thing written and records the sizes.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch

from rayfleet.errors import CheckpointError

MARKER = "rayfleet_checkpoint.json"
FORMAT_VERSION = 1


def history_csv(history: list[dict]) -> str:
    """metrics.csv: one row per logged step (it travels inside every checkpoint, so the
    loss curve of a resumed run is whole)."""
    if not history:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(history[0].keys()))
    w.writeheader()
    w.writerows(history)
    return buf.getvalue()


def read_history(text: str) -> list[dict]:
    ints = {"step", "epoch"}
    return [{k: int(float(v)) if k in ints else float(v) for k, v in row.items()}
            for row in csv.DictReader(io.StringIO(text))]


def save_rng(dirpath: Path, rank: int) -> None:
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               dirpath / f"rng_rank{rank}.pt")


def load_rng(dirpath: Path, rank: int) -> bool:
    path = dirpath / f"rng_rank{rank}.pt"
    if not path.exists():
        return False
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


def write_marker(dirpath: Path, *, step: int, strategy: str, world_size: int,
                 final: bool) -> None:
    files = {str(p.relative_to(dirpath)): p.stat().st_size
             for p in sorted(dirpath.rglob("*")) if p.is_file() and p.name != MARKER}
    tmp = dirpath / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "strategy": strategy,
                               "world_size": world_size, "final": final, "files": files},
                              indent=1))
    os.replace(tmp, dirpath / MARKER)


def read_file(fs: pafs.FileSystem, path: str) -> bytes | None:
    """A file's bytes on any pyarrow filesystem, or None when it cannot be read."""
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError):
        return None


def list_files(fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """{relative path: size} of every file under `path` ({} when there is no such folder)."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except NotADirectoryError:
        return {}
    return {i.path[len(path):].lstrip("/"): i.size for i in infos
            if i.type == pafs.FileType.File}


def check_listing(where: str, marker: dict, listing: dict[str, int],
                  expect_strategy: str | None = None) -> dict:
    """Raise CheckpointError unless every file the marker lists is present and whole.
    `listing` maps relative path -> size, from a local folder or any pyarrow filesystem."""
    for rel, size in marker.get("files", {}).items():
        if rel not in listing:
            raise CheckpointError(f"checkpoint {where} is incomplete: {rel} is missing")
        if listing[rel] != size:
            raise CheckpointError(f"checkpoint {where} is corrupt: {rel} is {listing[rel]} "
                                  f"bytes, expected {size}")
    ws = marker.get("world_size", 1)
    if marker.get("strategy") == "fsdp":
        missing = [r for r in range(ws)
                   if not any(k.startswith(f"dcp/__{r}_") for k in listing)]
        if missing or "dcp/.metadata" not in listing:
            raise CheckpointError(f"checkpoint {where} is incomplete: FSDP shards of ranks "
                                  f"{missing or '?'} are missing")
    if expect_strategy and marker.get("strategy") != expect_strategy and "model.pt" not in listing:
        raise CheckpointError(
            f"checkpoint {where} was written by --strategy {marker.get('strategy')} and holds "
            f"no full weights; resume with --strategy {marker.get('strategy')}")
    return marker


def validate_on(fs: pafs.FileSystem, path: str, where: str, *,
                expect_strategy: str | None = None,
                listing: dict[str, int] | None = None) -> dict:
    """The checkpoint at `path` on `fs` (a local folder or an s3:// prefix alike): its marker
    parses and every file it lists is there, whole. Returns the marker; CheckpointError naming
    `where` (the path as the user wrote it) otherwise. `listing`: one already taken."""
    if listing is None:
        listing = list_files(fs, path)
    marker = parse_marker(where, read_file(fs, f"{path.rstrip('/')}/{MARKER}"))
    return check_listing(where, marker, listing, expect_strategy)


def validate(dirpath: Path | str, *, expect_strategy: str | None = None) -> dict:
    """validate_on for a local folder."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        raise CheckpointError(f"checkpoint {dirpath} does not exist")
    return validate_on(pafs.LocalFileSystem(), str(dirpath.resolve()), str(dirpath),
                       expect_strategy=expect_strategy)


def parse_marker(where: str, raw: bytes | None) -> dict:
    if raw is None:
        raise CheckpointError(f"checkpoint {where} is incomplete (no {MARKER}); "
                              "it was never finished and will not be used")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {where} is corrupt ({MARKER} is not JSON); "
                              "delete it or point at an earlier one") from None


def load_full_weights(dirpath: Path | str) -> tuple[dict, dict]:
    """(model_config, state_dict) of a finished checkpoint, for serving and evaluation."""
    dirpath = Path(dirpath)
    validate(dirpath)
    if not (dirpath / "model.pt").exists():
        raise CheckpointError(f"checkpoint {dirpath} holds sharded weights only; serve the "
                              "run's final checkpoint, which carries model.pt")
    try:
        cfg = json.loads((dirpath / "model_config.json").read_text())
        state = torch.load(dirpath / "model.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a torch/pickle error means the bytes are damaged
        raise CheckpointError(f"checkpoint {dirpath} is corrupt: cannot load model.pt "
                              f"({type(e).__name__})") from e
    return cfg, state
