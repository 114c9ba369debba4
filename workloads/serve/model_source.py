"""What an `lm` replica serves: a workloads.train checkpoint (the kit's byte GPT, or the
Hugging Face export in a final checkpoint's `hf/`) or any Hugging Face causal LM folder
(config.json + safetensors + tokenizer), in a local folder or under s3:// alike."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from rayfleet.errors import CheckpointError, ConfigError
from workloads.common import hf, runs
from workloads.common.storage import resolve
from workloads.serve.engines import Engine, HFEngine


def _location(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) of a local folder or an s3:// prefix."""
    if path.startswith("s3://"):
        storage = resolve(path, check_writable=False)
        return storage.fs, storage.path
    return pafs.LocalFileSystem(), str(Path(path).expanduser().resolve())


def check_checkpoint(path: str) -> dict:
    """Validate what `checkpoint` names (local folder or s3://) without loading weights: the
    builder calls this so `serve run`/`serve deploy` fail with one line, not a crashing replica.

    - a workloads.train final checkpoint: its marker and files; served from its `hf/`
      Hugging Face export when it has one, else the byte GPT's model.pt;
    - a Hugging Face model folder (config.json + weights + tokenizer, as save_pretrained
      writes it).
    Returns the marker (if any) plus `engine` ("byte" or "hf") and `source`, the folder the
    replica loads."""
    if not path:
        raise ConfigError("checkpoint", "no checkpoint given; pass args.checkpoint "
                          "(a folder or s3:// path written by workloads.train, or a Hugging "
                          "Face model folder)")
    fs, inner = _location(path)
    listing = runs.list_files(fs, inner)
    if not listing:
        raise CheckpointError(f"checkpoint {path} does not exist")
    if runs.MARKER in listing:
        marker = runs.validate_on(fs, inner, path, listing=listing)
        if any(k.startswith(f"{runs.HF_DIR}/") for k in listing):
            source = f"{path.rstrip('/')}/{runs.HF_DIR}"
            return {**marker, "engine": "hf", "source": source,
                    **hf.check_model_folder(source, "args.checkpoint")}
        if runs.FULL_WEIGHTS not in listing or runs.MODEL_CONFIG not in listing:
            raise CheckpointError(f"checkpoint {path} holds no full weights "
                                  f"({runs.FULL_WEIGHTS}) and no {runs.HF_DIR}/ export; serve "
                                  "the run's final checkpoint")
        model_config = json.loads(runs.read_file(fs, f"{inner}/{runs.MODEL_CONFIG}") or b"{}")
        if runs.HF_MODEL_KEY in model_config:
            # A Hugging Face run's intermediate checkpoint: its export is written at the end.
            raise CheckpointError(f"checkpoint {path} is an intermediate checkpoint of a "
                                  "Hugging Face run (no hf/ export); serve the run's final "
                                  "checkpoint")
        return {**marker, "engine": "byte", "source": path}
    if "config.json" in listing or any(k.endswith(hf.MODEL_WEIGHTS) and "/" not in k
                                       for k in listing):
        return {"engine": "hf", "source": path,
                **hf.check_model_folder(path, "args.checkpoint")}
    if runs.FULL_WEIGHTS in listing or any(k.startswith(f"{runs.DCP_DIR}/") for k in listing):
        runs.parse_marker(path, None)   # a workloads.train checkpoint never finished
    raise CheckpointError(f"checkpoint {path} holds no model: neither a workloads.train "
                          f"checkpoint ({runs.MARKER}) nor a Hugging Face model folder "
                          "(config.json + *.safetensors + tokenizer)")


def hf_source(path: str) -> str | None:
    """The Hugging Face folder a replica loads for `path` (itself, or a run checkpoint's
    `hf/` export), or None for a byte GPT checkpoint. Cheap: no validation."""
    fs, inner = _location(path)
    for folder, at in ((path, inner), (f"{path.rstrip('/')}/{runs.HF_DIR}",
                                       f"{inner}/{runs.HF_DIR}")):
        if fs.get_file_info(f"{at}/config.json").type == pafs.FileType.File:
            return folder
    return None


def load_checkpoint(path: str) -> tuple[dict, dict]:
    """(model_config, state_dict); an s3:// checkpoint is copied to a temp folder first."""
    if not path.startswith("s3://"):
        return runs.load_full_weights(Path(path).expanduser())
    fs, inner = _location(path)
    local = Path(tempfile.mkdtemp(prefix="rayfleet-serve-"))
    try:
        pafs.copy_files(inner, str(local), source_filesystem=fs,
                        destination_filesystem=pafs.LocalFileSystem())
        return runs.load_full_weights(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)   # the weights are in memory now


def load_engine(checkpoint: str) -> Engine | HFEngine:
    """The engine for what check_checkpoint accepted: a Hugging Face model (a folder, or a run
    checkpoint's `hf/` export) or the byte GPT of a workloads.train checkpoint."""
    folder = hf_source(checkpoint)
    if folder is not None:
        return HFEngine.load(folder)
    return Engine(*load_checkpoint(checkpoint))
