"""Hugging Face models and tokenizers, from a local folder or an s3:// prefix, through the same
`from_pretrained` paths a user's model takes (data, train and serve all load them here).

A folder is what `save_pretrained` writes: `config.json` plus weights (`*.safetensors`) for a
model, `tokenizer.json` / `tokenizer_config.json` for a tokenizer; one folder may hold both.
An s3:// prefix is copied once per process into a local cache folder first (what
`ray.serve.llm` and vLLM do with cloud model sources).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from rayfleet.errors import ConfigError, StorageError
from workloads.common.storage import resolve

BYTE_TOKENIZER = {"name": "byte", "vocab_size": 256, "sha256": "byte"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_WEIGHTS = (".safetensors", ".bin")
# A PEFT adapter folder (save_pretrained of a PeftModel), and the kit's note beside them of the
# base it was trained on (workloads.train writes it; serving compares it with what it serves).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BASE_FILE = "rayfleet_base.json"
# weights_fingerprint: how many tensors, and how many leading values of each, it reads.
FINGERPRINT_TENSORS = 4
FINGERPRINT_VALUES = 4096

_fetched: dict[str, Path] = {}


def is_hf_spec(spec: str | None, presets=()) -> bool:
    """A value that names a folder / s3:// prefix rather than a preset (one of `presets`): a
    path-looking value, or the name of a folder that exists here."""
    if not spec or spec in presets:
        return False
    return (spec.startswith(("s3://", "/", "./", "../", "~", "file://")) or os.sep in spec
            or Path(spec).is_dir())


def fetch(spec: str, flag: str, endpoint: str | None = None) -> Path:
    """A local folder holding `spec`'s files: the folder itself, or an s3:// prefix copied
    into a per-process temporary folder (once)."""
    if not spec.startswith("s3://"):
        local = Path(spec.removeprefix("file://")).expanduser()
        if not local.is_dir():
            raise ConfigError(flag, f"{spec} is not a folder (give a Hugging Face model or "
                                    "tokenizer folder, as save_pretrained writes it, or s3://)")
        return local.resolve()
    if spec in _fetched and _fetched[spec].is_dir():
        return _fetched[spec]
    import pyarrow.fs as pafs

    storage = resolve(spec, endpoint=endpoint, check_writable=False)
    info = storage.fs.get_file_info(storage.path)
    if info.type != pafs.FileType.Directory:
        raise ConfigError(flag, f"{spec} holds nothing (no objects under that prefix)")
    local = Path(tempfile.mkdtemp(prefix="rayfleet-hf-"))
    # This process made it and alone reads it: gone when the process ends (a job, a replica),
    # not left in the node's /tmp for every model a run fetched.
    atexit.register(shutil.rmtree, local, True)
    try:
        pafs.copy_files(storage.path, str(local), source_filesystem=storage.fs,
                        destination_filesystem=pafs.LocalFileSystem())
    except OSError as e:
        raise StorageError(f"{spec}: could not copy it from S3: {str(e).splitlines()[0]}") \
            from e
    _fetched[spec] = local
    return local


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def has_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(
        p.name.endswith(MODEL_WEIGHTS) for p in folder.iterdir())


def load_tokenizer(spec: str, flag: str = "--tokenizer", endpoint: str | None = None):
    """AutoTokenizer.from_pretrained of a local folder or s3:// prefix; one line if it is not
    a tokenizer folder. The tokenizer gets a pad token (its EOS) when it has none."""
    folder = fetch(spec, flag, endpoint)
    if not has_tokenizer(folder):
        raise ConfigError(flag, f"{spec} holds no Hugging Face tokenizer (no "
                                f"{' or '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for bad folders
        raise ConfigError(flag, f"{spec}: not a loadable tokenizer "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from e
    if not getattr(tok, "is_fast", False):
        raise ConfigError(flag, f"{spec}: a slow (Python) tokenizer; save a fast one "
                                "(tokenizer.json)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_identity(tok, spec: str) -> dict:
    """What a dataset records about the tokenizer that made it, and what training compares:
    the vocabulary size and a hash of the tokenizer's full definition (vocab, merges,
    normalizer, special tokens) and its chat template."""
    h = hashlib.sha256(tok.backend_tokenizer.to_str().encode())
    h.update(str(getattr(tok, "chat_template", None) or "").encode())
    return {"name": spec, "vocab_size": len(tok), "sha256": h.hexdigest()[:16]}


def load_config(spec: str, flag: str, endpoint: str | None = None):
    """AutoConfig of a model folder (or of a folder holding only config.json)."""
    folder = fetch(spec, flag, endpoint)
    if not (folder / "config.json").is_file():
        raise ConfigError(flag, f"{spec} holds no Hugging Face model (no config.json)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ConfigError(flag, f"{spec}: config.json is not a model config transformers "
                                f"knows ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:160]})") from e


def config_dict(config) -> dict:
    """A JSON-able dict of a transformers config (what checkpoints and run files record)."""
    return json.loads(config.to_json_string(use_diff=False))


def _meta_files(spec: str, flag: str, endpoint: str | None, dest: Path) -> tuple[Path, set[str]]:
    """(a local folder holding spec's configuration and tokenizer files, the names of all of
    spec's top-level files). An s3:// prefix is listed and only its small files copied into
    `dest`: the weights are what a check must not download."""
    if not spec.startswith("s3://"):
        folder = fetch(spec, flag, endpoint)
        return folder, {p.name for p in folder.iterdir() if p.is_file()}
    import pyarrow.fs as pafs

    storage = resolve(spec, endpoint=endpoint, check_writable=False)
    try:
        infos = storage.fs.get_file_info(pafs.FileSelector(storage.path, allow_not_found=True))
    except OSError as e:
        raise StorageError(f"{spec}: could not list it: {str(e).splitlines()[0]}") from e
    names = {i.base_name for i in infos if i.type == pafs.FileType.File}
    if not names:
        raise ConfigError(flag, f"{spec} holds nothing (no objects under that prefix)")
    for name in names:
        if not name.endswith(MODEL_WEIGHTS):
            with storage.fs.open_input_stream(f"{storage.path}/{name}") as src:
                (dest / name).write_bytes(src.read())
    return dest, names


def check_model_folder(spec: str, flag: str, endpoint: str | None = None) -> dict:
    """Check, without loading (or, for s3://, downloading) weights, that `spec` is a servable
    Hugging Face causal LM: config.json, weights, a tokenizer whose vocabulary fits the
    model's embedding. One line (ConfigError) otherwise. Returns what the checks read:
    model_type, architectures, head_dim, vocab_size, tokenizer_size, max_position_embeddings,
    chat_template, weights."""
    import shutil

    tmp = Path(tempfile.mkdtemp(prefix="rayfleet-hf-meta-"))
    try:
        folder, names = _meta_files(spec, flag, endpoint, tmp)
        if "config.json" not in names:
            raise ConfigError(flag, f"{spec} holds no Hugging Face model (no config.json; "
                                    "give the folder save_pretrained wrote)")
        if not any(n.endswith(MODEL_WEIGHTS) for n in names):
            raise ConfigError(flag, f"{spec} holds a config.json but no weights "
                                    "(*.safetensors); save the model with save_pretrained")
        if not any(n in names for n in TOKENIZER_FILES):
            raise ConfigError(flag, f"{spec} holds a model but no tokenizer (no "
                                    f"{' or '.join(TOKENIZER_FILES)}); save the tokenizer "
                                    "into the same folder (tokenizer.save_pretrained)")
        try:
            config = load_config(str(folder), flag)
            tok = load_tokenizer(str(folder), flag)
        except ConfigError as e:   # name what the user gave, not the temporary copy
            raise ConfigError(flag, str(e).split(": ", 1)[1].replace(str(folder), spec)) \
                from None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        if vocab and len(tok) > int(vocab):
            raise ConfigError(flag, f"{spec}: the tokenizer has {len(tok)} tokens but the "
                                    f"model's vocab_size is {vocab} (a tokenizer from another "
                                    "model?); ids past the embedding cannot be served")
        heads = getattr(text, "num_attention_heads", None)
        head_dim = getattr(text, "head_dim", None) or (
            getattr(text, "hidden_size", 0) // heads if heads else None)
        return {"model_type": getattr(config, "model_type", None), "vocab_size": vocab,
                "architectures": list(getattr(config, "architectures", None) or []),
                "head_dim": head_dim,
                "tokenizer_size": len(tok),
                "max_position_embeddings": getattr(text, "max_position_embeddings", None),
                "chat_template": bool(getattr(tok, "chat_template", None)),
                "weights": sorted(n for n in names if n.endswith(MODEL_WEIGHTS))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- LoRA bases

def _location(spec: str, endpoint: str | None = None):
    """(pyarrow filesystem, path on it) of a local folder or an s3:// prefix."""
    import pyarrow.fs as pafs

    if spec.startswith("s3://"):
        storage = resolve(spec, endpoint=endpoint, check_writable=False)
        return storage.fs, storage.path
    return pafs.LocalFileSystem(), str(Path(spec.removeprefix("file://")).expanduser().resolve())


def _bf16_bits(raw: bytes, dtype: str):
    """Values of a safetensors dtype rounded to bfloat16, as uint16 (numpy has no bf16): the
    same base saved in fp32, fp16 or bf16 gives the same bits."""
    import numpy as np

    if dtype == "BF16":
        return np.frombuffer(raw, dtype="<u2")
    kind = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}.get(dtype)
    if kind is None:
        return np.frombuffer(raw, dtype=np.uint8)      # integer / quantized: the bytes
    u = np.frombuffer(raw, dtype=kind).astype("<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")   # round to nearest even


def weights_fingerprint(spec: str, flag: str, endpoint: str | None = None) -> str:
    """A fingerprint of a Hugging Face model folder's weights (local or s3://), read without
    loading them: the first FINGERPRINT_VALUES values, rounded to bf16, of FINGERPRINT_TENSORS
    of its matrices spread over the model, by name and shape. Two models differ in it when
    their weights differ there (another model, a full fine-tune, a merged adapter), and one
    model saved in another float dtype does not. Reads a few KiB per tensor (ranged reads on
    S3). ConfigError when the folder has no safetensors weights."""
    import struct

    fs, root = _location(spec, endpoint)
    try:
        import pyarrow.fs as pafs

        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as e:
        raise StorageError(f"{spec}: could not list it: {str(e).splitlines()[0]}") from e
    files = sorted(i.path for i in infos if i.base_name.endswith(".safetensors")
                   and i.type == pafs.FileType.File)
    if not files:
        raise ConfigError(flag, f"{spec} holds no *.safetensors weights to compare an "
                                "adapter's base with")
    tensors = []
    for path in files:
        with fs.open_input_file(path) as f:
            (n,) = struct.unpack("<Q", f.read_at(8, 0))
            header = json.loads(f.read_at(n, 8))
        header.pop("__metadata__", None)
        tensors += [(name, path, 8 + n, h) for name, h in header.items()
                    if len(h.get("shape", [])) >= 2]
    tensors.sort()
    step = max(1, len(tensors) // FINGERPRINT_TENSORS)
    h = hashlib.sha256()
    for name, path, data_start, info in tensors[::step][:FINGERPRINT_TENSORS]:
        begin, end = info["data_offsets"]
        size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(info["dtype"], 1)
        with fs.open_input_file(path) as f:
            raw = f.read_at(min(end - begin, FINGERPRINT_VALUES * size), data_start + begin)
        h.update(f"{name}{info['shape']}".encode())
        h.update(_bf16_bits(raw, info["dtype"]).tobytes())
    return h.hexdigest()[:16]


def check_adapter_folder(spec: str, flag: str, endpoint: str | None = None) -> dict:
    """Check, without loading weights, that `spec` (local or s3://) is a PEFT LoRA adapter
    folder: adapter_config.json of a LoRA adapter and adapter_model.safetensors. Returns
    {"r", "alpha", "targets", "base"}: base is rayfleet_base.json ({"source", "fingerprint"})
    when the kit trained it, else None. ConfigError (one line) otherwise."""
    fs, root = _location(spec, endpoint)

    def read(name: str) -> bytes | None:
        try:
            with fs.open_input_stream(f"{root}/{name}") as f:
                return f.read()
        except (FileNotFoundError, OSError):
            return None

    raw = read(ADAPTER_CONFIG)
    if raw is None:
        raise ConfigError(flag, f"{spec} is not a LoRA adapter folder (no {ADAPTER_CONFIG}, as "
                                "PeftModel.save_pretrained or workloads.train --lora-r write "
                                "it)")
    try:
        cfg = json.loads(raw)
    except ValueError:
        raise ConfigError(flag, f"{spec}/{ADAPTER_CONFIG} is not JSON") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise ConfigError(flag, f"{spec}: {ADAPTER_CONFIG} is not a LoRA adapter's (peft_type "
                                f"{cfg.get('peft_type') if isinstance(cfg, dict) else None!r})")
    import pyarrow.fs as pafs

    if fs.get_file_info(f"{root}/{ADAPTER_WEIGHTS}").type != pafs.FileType.File:
        raise ConfigError(flag, f"{spec} has an {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    base = read(ADAPTER_BASE_FILE)
    try:
        base = json.loads(base) if base else None
    except ValueError:
        base = None
    targets = cfg.get("target_modules")
    return {"r": int(cfg.get("r") or 0), "alpha": cfg.get("lora_alpha"),
            "targets": sorted(targets) if isinstance(targets, list) else targets,
            "base": base if isinstance(base, dict) else None}


def check_adapter_base(adapter: dict, adapter_spec: str, model_spec: str, flag: str,
                       endpoint: str | None = None) -> None:
    """Refuse, in one line, an adapter trained on another base than the model `model_spec`
    (by the weights fingerprint the kit recorded). An adapter from elsewhere (no
    rayfleet_base.json) is not checked: PEFT records only a name for its base."""
    base = adapter.get("base")
    if not base or not base.get("fingerprint"):
        return
    served = weights_fingerprint(model_spec, flag, endpoint)
    if served != base["fingerprint"]:
        raise ConfigError(flag, f"the adapter {adapter_spec} was trained on {base.get('source')} "
                                f"(weights {base['fingerprint']}), not on {model_spec} (weights "
                                f"{served}): serve it on its own base, or train one for this "
                                "model")


def merge_adapter(model, adapter: Path):
    """`model` (a transformers causal LM) with the PEFT adapter in folder `adapter` merged into
    its weights (PeftModel.from_pretrained, then merge_and_unload): a plain model again, which
    decodes as fast as the base."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings():
        # transformers 5 deprecates a name PEFT 0.21 still reads (is_gradient_checkpointing).
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
