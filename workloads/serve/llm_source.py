"""The `llm` app's model source, checked offline: what `model_loading_config.model_source`
becomes for a Hub repo id, a local folder or an s3:// one, and whether the installed vLLM can
load that folder."""

from __future__ import annotations

from pathlib import Path

from rayfleet.errors import ConfigError, StorageError
from workloads.common import hf
from workloads.common.runs import HF_DIR, MARKER, run_latest_checkpoint
from workloads.common.storage import resolve, s3_endpoint


def is_path(source: str) -> bool:
    """A folder rather than a Hub repo id ("Qwen/Qwen2.5-72B-Instruct" has a slash too)."""
    return source.startswith(("s3://", "/", "./", "../", "~", "file://")) or \
        Path(source).expanduser().is_dir()


def s3_reachable(source: str) -> str | None:
    """Why an s3:// source cannot be checked from here (None when it can): no credentials,
    or a bucket these credentials cannot reach. The GPU nodes' own role may still read it."""
    import boto3

    if s3_endpoint() is None and boto3.session.Session().get_credentials() is None:
        return "no AWS credentials here"
    try:
        resolve(source, check_writable=False)
    except StorageError as e:
        return str(e)
    return None


def model_source(source: str, max_model_len: int,
                 device: str = "gpu") -> tuple[str | dict, str | None]:
    """(the LLMConfig `model_source` value, a note on what was not checked).

    A folder (local, or s3:// reachable with the current credentials) is checked offline: it
    holds config.json, safetensors weights and a tokenizer, and --max-model-len fits the
    model's max_position_embeddings; a workloads.train checkpoint is replaced by its `hf/`
    export. An s3:// folder becomes a cloud mirror (`{bucket_uri: ...}`: Ray 2.60 downloads it
    on each replica and loads it by `model_id`), a local one its absolute path. A Hub repo id
    is kept as it is, unchecked."""
    if not is_path(source):
        return source, None
    if source.startswith("s3://"):
        source = "s3://" + source[len("s3://"):].rstrip("/")
        why = s3_reachable(source)
        if why is not None:
            return {"bucket_uri": source}, f"{source} not checked ({why})"
        source = _s3_folder(source)
    else:
        source = _local_folder(source)
    _check_folder(source, max_model_len, device)
    return ({"bucket_uri": source} if source.startswith("s3://") else source), None


def _s3_folder(source: str) -> str:
    """The s3:// folder vLLM loads: a run folder's latest checkpoint, a checkpoint's export."""
    source = run_latest_checkpoint(source) or source   # a run folder: its latest checkpoint

    storage = resolve(source, check_writable=False)
    if storage.fs.get_file_info(storage.join(MARKER)).type.name == "File":
        source = _export_of(source, storage.fs.get_file_info(storage.join(HF_DIR)).type.name
                            == "Directory")
    return source


def _local_folder(source: str) -> str:
    """The local folder vLLM loads, absolute: as _s3_folder, for a folder on this machine."""
    local = Path(source.removeprefix("file://")).expanduser().resolve()
    if not local.is_dir():
        raise ConfigError("--model-source", f"{source} is not a folder (give a Hugging Face "
                                            "model folder, a run's final checkpoint, s3://, or "
                                            "a Hub repo id)")
    source = run_latest_checkpoint(str(local)) or str(local)
    local = Path(source)
    if (local / MARKER).is_file():
        source = _export_of(source, (local / HF_DIR).is_dir())
    return source


def _check_folder(source: str, max_model_len: int, device: str) -> None:
    """A Hugging Face model folder vLLM can load, with a context of max_model_len tokens."""
    flag = "--model-source"
    info = hf.check_model_folder(source, flag)
    if not any(w.endswith(".safetensors") for w in info["weights"]):
        raise ConfigError(flag, f"{source} holds {', '.join(info['weights'])} but no "
                                "*.safetensors weights; save with save_pretrained "
                                "(safe_serialization, the default)")
    refusal = vllm_refusal(info, device, source)
    if refusal:
        raise ConfigError(flag, refusal)
    limit = info["max_position_embeddings"]
    if limit and max_model_len and max_model_len > int(limit):
        raise ConfigError("--max-model-len", f"{max_model_len} is more than the model's "
                                             f"max_position_embeddings {limit} ({source})")


def _export_of(checkpoint: str, has_hf: bool) -> str:
    if not has_hf:
        raise ConfigError("--model-source", f"{checkpoint} is a workloads.train checkpoint "
                                            "without an hf/ export (the kit's byte GPT, which "
                                            "vLLM cannot load); give a final checkpoint of a "
                                            "Hugging Face model run")
    return f"{checkpoint.rstrip('/')}/{HF_DIR}"


def vllm_refusal(info: dict, device: str, source: str) -> str | None:
    """Why vLLM cannot load this model folder (one line), None when it can, as the installed
    vLLM itself says: its model registry's architectures and, on CPU, its CPU attention's
    head sizes. Skipped (None) where vLLM is not installed, as on an operator's laptop."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import ModelRegistry

    archs = info.get("architectures") or []
    known = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in known for a in archs):
        return (f"{source}: vLLM has no implementation of {', '.join(archs)} (its "
                "ModelRegistry lists the architectures it serves)")
    if device == "cpu" and info.get("head_dim"):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if int(info["head_dim"]) not in sizes:
            return (f"{source}: head size {info['head_dim']} (hidden_size / "
                    f"num_attention_heads) is not one vLLM's CPU attention supports "
                    f"({', '.join(map(str, sizes))})")
    return None
