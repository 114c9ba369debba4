"""LoRA adapters on the `llm` app: Ray's `lora_config` from the command's flags, and the
adapters under its path checked against the model served, where they can be read from here."""

from __future__ import annotations

from rayfleet.errors import ConfigError
from workloads.common import hf
from workloads.common.storage import resolve
from workloads.serve.llm_source import is_path, s3_reachable

# The cloud storage Ray 2.60's Serve LLM fetches LoRA adapters from (its LoraConfig refuses any
# other dynamic_lora_loading_path, a local folder included).
LORA_SCHEMES = ("s3://", "gs://", "abfss://", "azure://")
# vLLM 0.29's max_lora_rank values (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_settings(args) -> dict:
    """Ray's lora_config for --lora-path, the flags checked on their own."""
    path = args.lora_path.rstrip("/")
    if not path.startswith(LORA_SCHEMES):
        schemes = ", ".join(LORA_SCHEMES)
        raise ConfigError("--lora-path", f"{args.lora_path}: Ray 2.60's Serve LLM fetches LoRA "
                                         f"adapters from cloud storage only ({schemes}), and "
                                         "refuses a local folder: copy the adapter folders "
                                         "there (e.g. aws s3 sync) and give that prefix")
    if ":" in args.model_id:
        raise ConfigError("--model-id", f"{args.model_id!r}: with --lora-path, clients ask for "
                                        "<model-id>:<adapter>, so the model id may not hold ':'")
    if args.max_lora_rank not in LORA_RANKS:
        raise ConfigError("--max-lora-rank", f"vLLM takes one of {', '.join(map(str, LORA_RANKS))}"
                                             f", got {args.max_lora_rank}")
    return {"dynamic_lora_loading_path": path,
            "max_num_adapters_per_replica": args.max_adapters_per_replica}


def check_lora(llm: dict, source) -> str | None:
    """The adapters under an LLMConfig's lora_config path, where it can be read from here: each
    subfolder a PEFT LoRA adapter folder, of a rank vLLM's max_lora_rank admits, trained on
    the model served (when the kit trained it: rayfleet_base.json's weights fingerprint
    against the model folder's). One line (ConfigError) otherwise; returns a note on what was
    not checked (None when everything was)."""
    path = ((llm.get("lora_config") or {}).get("dynamic_lora_loading_path") or "").rstrip("/")
    if not path.startswith("s3://"):
        return f"LoRA adapters under {path} not checked (only s3:// is read from here)"
    why = s3_reachable(path)
    if why is not None:
        return f"LoRA adapters under {path} not checked ({why})"
    adapters = _adapter_folders(path)
    rank = int((llm.get("engine_kwargs") or {}).get("max_lora_rank") or 16)
    model = source.get("bucket_uri") if isinstance(source, dict) else source
    folder = model if isinstance(model, str) and is_path(model) else None
    for name in adapters:
        info = hf.check_adapter_folder(f"{path}/{name}", "--lora-path")
        if info["r"] > rank:
            raise ConfigError("--max-lora-rank", f"{path}/{name} has rank {info['r']}, more than "
                                                 f"{rank}: raise --max-lora-rank")
        if folder is not None:
            hf.check_adapter_base(info, f"{path}/{name}", folder, "--lora-path")
    return None if folder is not None else \
        f"the adapters' base not compared with {model} (a Hub id)"


def _adapter_folders(path: str) -> list[str]:
    """The names of the adapter folders right under an s3:// `path`, sorted; at least one."""
    import pyarrow.fs as pafs

    storage = resolve(path, check_writable=False)
    infos = storage.fs.get_file_info(pafs.FileSelector(storage.path, allow_not_found=True))
    if any(i.base_name == hf.ADAPTER_CONFIG for i in infos):
        raise ConfigError("--lora-path", f"{path} is itself an adapter folder: give the folder "
                                         "that holds it (clients ask for <model-id>:<its name>)")
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
    adapters = [n for n in names if storage.fs.get_file_info(
        f"{storage.path}/{n}/{hf.ADAPTER_CONFIG}").type == pafs.FileType.File]
    if not adapters:
        raise ConfigError("--lora-path", f"{path} holds no adapter folders (subfolders with "
                                         f"{hf.ADAPTER_CONFIG}); copy a LoRA run's adapter/ "
                                         f"there, e.g. to {path}/my-adapter")
    return adapters
