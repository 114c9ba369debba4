"""What an `lm` replica serves: a workloads.train checkpoint (the kit's byte GPT, the Hugging
Face export in a final checkpoint's `hf/`, or a LoRA run's base + its `adapter/`) or any
Hugging Face causal LM folder (config.json + safetensors + tokenizer), optionally with a PEFT
LoRA adapter on top, in a local folder or under s3:// alike."""

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
    - a LoRA run's final checkpoint (adapter/ and no hf/): the base its adapter names
      (rayfleet_base.json), checked to be the weights it was trained on, plus the adapter;
    - a Hugging Face model folder (config.json + weights + tokenizer, as save_pretrained
      writes it).
    Returns the marker (if any) plus `engine` ("byte" or "hf"), `source`, the folder the
    replica loads, and `adapter`, the LoRA adapter folder it applies ("" for none)."""
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
            # A LoRA run with --lora-merge: hf/ is the base with the adapter merged in.
            source = f"{path.rstrip('/')}/{runs.HF_DIR}"
            return {**marker, "engine": "hf", "source": source, "adapter": "",
                    **hf.check_model_folder(source, "args.checkpoint")}
        if f"{runs.ADAPTER_DIR}/{hf.ADAPTER_CONFIG}" in listing:
            adapter = f"{path.rstrip('/')}/{runs.ADAPTER_DIR}"
            info = hf.check_adapter_folder(adapter, "args.checkpoint")
            base = (info["base"] or {}).get("source")
            if not base:
                raise CheckpointError(f"checkpoint {path}: its adapter does not name its base "
                                      f"({runs.ADAPTER_DIR}/{hf.ADAPTER_BASE_FILE})")
            return {**marker, **check_adapter(adapter, base, "args.checkpoint", info),
                    "engine": "hf", "source": base}
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
        return {**marker, "engine": "byte", "source": path, "adapter": ""}
    if "config.json" in listing or any(k.endswith(hf.MODEL_WEIGHTS) and "/" not in k
                                       for k in listing):
        return {"engine": "hf", "source": path, "adapter": "",
                **hf.check_model_folder(path, "args.checkpoint")}
    if runs.FULL_WEIGHTS in listing or any(k.startswith(f"{runs.DCP_DIR}/") for k in listing):
        runs.parse_marker(path, None)   # a workloads.train checkpoint never finished
    raise CheckpointError(f"checkpoint {path} holds no model: neither a workloads.train "
                          f"checkpoint ({runs.MARKER}) nor a Hugging Face model folder "
                          "(config.json + *.safetensors + tokenizer)")


def check_adapter(adapter: str, model: str, key: str = "args.adapter",
                  info: dict | None = None) -> dict:
    """A LoRA adapter (a PEFT folder, or a LoRA run's final checkpoint holding one in
    adapter/; local or s3://) for the Hugging Face model folder `model`: a LoRA adapter folder,
    trained on those weights when the kit trained it (its fingerprint), and the model a
    servable one. Returns the model folder's checks plus `adapter`, the folder to apply."""
    if info is None:
        fs, inner = _location(adapter)
        if fs.get_file_info(f"{inner}/{runs.MARKER}").type == pafs.FileType.File:
            adapter = f"{adapter.rstrip('/')}/{runs.ADAPTER_DIR}"   # a LoRA run's checkpoint
        info = hf.check_adapter_folder(adapter, key)
    found = hf.check_model_folder(model, key)
    hf.check_adapter_base(info, adapter, model, key)
    return {**found, "adapter": adapter, "lora_r": info["r"]}


def check_served(checkpoint: str, adapter: str = "") -> dict:
    """What an app serves, checked: `checkpoint` (check_checkpoint) with the LoRA `adapter`
    on top when one is given. Returns check_checkpoint's dict, whose `source` and `adapter`
    are what a replica loads (load_engine)."""
    found = check_checkpoint(checkpoint)
    if not adapter:
        return found
    if found["adapter"]:
        raise ConfigError("args.adapter", f"{checkpoint} is a LoRA run's checkpoint, which "
                                          f"brings its own adapter ({found['adapter']}); give "
                                          "args.checkpoint its base instead, or no adapter")
    if found["engine"] != "hf":
        raise ConfigError("args.adapter", f"LoRA adapters apply to Hugging Face models; "
                                          f"{checkpoint} is the kit's byte GPT")
    return {**found, **check_adapter(adapter, found["source"])}


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


def load_engine(checkpoint: str, adapter: str = "") -> Engine | HFEngine:
    """The engine for what check_checkpoint accepted: a Hugging Face model (a folder, or a run
    checkpoint's `hf/` export), with `adapter`'s LoRA merged in when given, or the byte GPT of
    a workloads.train checkpoint."""
    folder = hf_source(checkpoint)
    if folder is not None:
        return HFEngine.load(folder, adapter or None)
    return Engine(*load_checkpoint(checkpoint))
