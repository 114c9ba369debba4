"""A run's inputs checked and prepared before anything starts, the same for the Ray driver and
torchrun: the dataset (its Parquet, its manifest), the model (the kit's GPT, or a Hugging Face
folder with its tokenizer), the DeepSpeed config, and the per-worker LoopConfig."""

from __future__ import annotations

import json
from dataclasses import replace

from rayfleet.errors import ConfigError, StorageError
from rayfleet.facts import is_bucket_name
from workloads.common import hf
from workloads.common.hf import is_hf_spec
from workloads.common.model import PRESETS, GPTConfig
from workloads.common.shards import MANIFEST
from workloads.common.storage import resolve, s3_endpoint, user_path
from workloads.train import ds_config
from workloads.train.hf_model import HFSpec, count_params
from workloads.train.loop import LoopConfig
from workloads.train.options import TrainOptions, lora_targets


def prepare_inputs(opts: TrainOptions, model: GPTConfig | None):
    """The dataset and the model checked together (check_options' `model`: None for a Hugging
    Face one). Returns (the model's config, the Hugging Face source or None, the tokenizer spec
    or None)."""
    check_dataset(opts.dataset)
    check_deepspeed(opts)
    manifest = dataset_manifest(opts.dataset, opts.s3_endpoint)
    if model is None:
        return resolve_hf(opts, manifest)
    check_byte_dataset(opts.dataset, manifest)
    return model, None, None


def lora_settings(opts: TrainOptions, source: str, fingerprint: str) -> dict:
    """What a LoRA run is (part of the model in its identity and model_config.json)."""
    return {"r": opts.lora_r,
            "alpha": opts.lora_alpha if opts.lora_alpha is not None else 2.0 * opts.lora_r,
            "dropout": opts.lora_dropout or 0.0, "targets": lora_targets(opts.lora_targets),
            "base": {"source": source, "fingerprint": fingerprint}}


def check_dataset(spec: str | None) -> None:
    """--dataset checked before Ray starts: a local folder must exist and hold Parquet with a
    'tokens' column (an s3:// one is checked when Ray Data reads it). Reads footers only."""
    if spec is None or spec == "stdlib":
        return
    if spec.startswith("s3://"):
        bucket = spec[len("s3://"):].split("/", 1)[0]
        if not is_bucket_name(bucket):
            raise StorageError(f"--dataset {spec}: {bucket!r} is not a valid S3 bucket name "
                               "(3-63 lowercase letters, digits, dots, hyphens)")
        return
    from pathlib import Path

    root = Path(spec.removeprefix("file://")).expanduser()
    if not root.exists():
        raise ConfigError("--dataset", f"{spec} does not exist; give 'stdlib' or the --output "
                                       "folder of workloads.data")
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*.parquet")
        if not any(part.startswith((".", "_")) for part in p.relative_to(root).parts))
    if not files:
        raise ConfigError("--dataset", f"{spec} holds no .parquet files; produce them with "
                                       "python -m workloads.data --output " + spec)
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(files[0]).names
    except (OSError, pa.ArrowException) as e:
        raise ConfigError("--dataset", f"{files[0]} is not a readable Parquet file "
                                       f"({str(e).splitlines()[0][:120]})") from None
    if "tokens" not in names:
        raise ConfigError("--dataset", f"{files[0]} has no 'tokens' column (columns: "
                                       f"{', '.join(names)}); produce it with workloads.data")


def dataset_manifest(spec: str | None, endpoint: str | None = None) -> dict | None:
    """The `_manifest.json` workloads.data writes beside its shards (what made the dataset:
    the tokenizer, the sequence length), or None for the built-in corpus or a dataset made
    some other way."""
    if spec in (None, "stdlib"):
        return None
    if spec.startswith("s3://"):
        storage = resolve(spec, endpoint=endpoint, check_writable=False)
        try:
            raw = storage.read_bytes(storage.join(MANIFEST))
        except (FileNotFoundError, OSError):
            return None
    else:
        from pathlib import Path

        root = Path(spec.removeprefix("file://")).expanduser()
        path = (root if root.is_dir() else root.parent) / MANIFEST
        if not path.is_file():
            return None
        raw = path.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise ConfigError("--dataset", f"{spec}/{MANIFEST} is not JSON; re-run "
                                       "workloads.data to rewrite it") from None
    return manifest if isinstance(manifest, dict) else None


def check_byte_dataset(spec: str | None, manifest: dict | None) -> None:
    """The kit's GPT reads bytes: a dataset tokenized otherwise is refused before Ray starts."""
    tok = (manifest or {}).get("tokenizer")
    if tok and tok.get("sha256") != "byte":
        raise ConfigError("--dataset", f"{spec} was tokenized with {tok.get('name')} "
                                       f"(vocabulary {tok.get('vocab_size')}), and the kit's "
                                       "GPT reads bytes: train that tokenizer's model (--model "
                                       "<Hugging Face folder>) or make the data without "
                                       "--tokenizer")


def resolve_hf(opts: TrainOptions, manifest: dict | None):
    """A Hugging Face run checked before Ray starts: the model folder (or config) loads, the
    dataset was made with this model's tokenizer, fits its vocabulary and its context.
    Returns (HFSpec, source or None, tokenizer spec)."""
    endpoint = opts.s3_endpoint
    if opts.model_config is not None:
        flag, source = "--model-config", None
        config = hf.load_config(opts.model_config, flag, endpoint)
        folder = None
    else:
        flag, source = "--model", opts.model
        folder = hf.fetch(opts.model, flag, endpoint)
        if not hf.has_model(folder):
            raise ConfigError(flag, f"{opts.model} holds no model (config.json and "
                                    "*.safetensors weights, as save_pretrained writes them); "
                                    "give a model folder, a preset, or --model-config for fresh "
                                    "weights")
        config = hf.load_config(opts.model, flag, endpoint)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(flag, f"model type {config.model_type!r} is not a causal LM "
                                "transformers knows (AutoModelForCausalLM)")
    config_d = hf.config_dict(config)
    data_tok = (manifest or {}).get("tokenizer")
    if not data_tok or data_tok.get("sha256") == "byte":
        raise ConfigError("--dataset", f"{opts.dataset} was not tokenized with a Hugging Face "
                                       "tokenizer (no tokenizer in its _manifest.json); make "
                                       "it with python -m workloads.data --tokenizer "
                                       f"{source or '<tokenizer folder>'}")
    tokenizer = opts.tokenizer or (source if folder is not None and hf.has_tokenizer(folder)
                                   else None) or data_tok.get("name")
    tok = hf.load_tokenizer(tokenizer, "--tokenizer", endpoint)
    ident = hf.tokenizer_identity(tok, tokenizer)
    if ident["sha256"] != data_tok.get("sha256"):
        raise ConfigError("--dataset", f"{opts.dataset} was tokenized with another tokenizer "
                                       f"({data_tok.get('name')}, {data_tok.get('sha256')}) "
                                       f"than this model's ({tokenizer}, {ident['sha256']}); "
                                       "re-tokenize it with workloads.data --tokenizer "
                                       f"{tokenizer}")
    vocab = int(config_d.get("vocab_size") or 0)
    if max(ident["vocab_size"], int(data_tok.get("vocab_size") or 0)) > vocab:
        raise ConfigError(flag, f"the tokenizer has {ident['vocab_size']} tokens but the model's "
                                f"vocabulary is {vocab}: token ids past it cannot be embedded "
                                "(resize the model's embeddings, or use its own tokenizer)")
    seq_len = int((manifest or {}).get("seq_len") or 0)
    if seq_len < 1:
        raise ConfigError("--dataset", f"{opts.dataset}/{MANIFEST} records no seq_len; re-run "
                                       "workloads.data")
    lora = None
    if opts.lora_r is not None:
        lora = lora_settings(opts, source, hf.weights_fingerprint(source, flag, endpoint))
    try:
        n_params, n_trainable = count_params(config_d, lora)
    except ValueError as e:   # LoRA's targets match no module of this model
        raise ConfigError("--lora-targets", f"{e} ({opts.model}: {config.model_type})") \
            from None
    spec = HFSpec(config=config_d, seq_len=seq_len, n_params=n_params, lora=lora,
                  n_trainable=n_trainable if lora else None)
    if spec.max_positions and seq_len > spec.max_positions:
        raise ConfigError("--dataset", f"rows of {seq_len} tokens are longer than the model's "
                                       f"context ({spec.max_positions}); re-run workloads.data "
                                       f"with --max-length {spec.max_positions} or less")
    return spec, source, tokenizer


def absolute_hf_paths(opts: TrainOptions) -> TrainOptions:
    """--model / --model-config / --tokenizer folders made absolute (the workers do not run in
    this folder; inside a Ray job a relative one must have been uploaded with it)."""
    paths = {}
    for flag in ("model", "model_config", "tokenizer"):
        value = getattr(opts, flag)
        if value is not None and (flag != "model" or is_hf_spec(value, PRESETS)):
            paths[flag] = user_path(value, f"--{flag.replace('_', '-')}", output=False)
    return replace(opts, **paths)


def loop_config(opts: TrainOptions, model, hf_source: str | None, tokenizer: str | None, world: int,
                data_workers: int, ray_dataset: bool) -> LoopConfig:
    """The per-worker options of a run (the Ray driver's and torchrun's alike)."""
    return LoopConfig(
        model=model.to_dict(), strategy=opts.strategy, zero_stage=opts.zero_stage,
        offload=opts.offload, batch_size=opts.batch_size, grad_accum=opts.grad_accum,
        lr=opts.lr * world,  # linear LR scaling (Goyal et al. 2017)
        warmup_steps=opts.warmup_steps if opts.warmup_steps is not None
        else max(1, min(100, opts.max_steps // 10)),
        max_steps=opts.max_steps, checkpoint_every=opts.checkpoint_every,
        log_every=opts.log_every, corpus_bytes=opts.corpus_bytes, seed=opts.seed,
        use_ray_dataset=ray_dataset, compile=opts.compile, num_workers=data_workers,
        hf_source=hf_source, tokenizer=tokenizer, s3_endpoint=s3_endpoint(opts.s3_endpoint),
        activation_checkpointing=opts.activation_checkpointing,
        offload_params=opts.offload_params,
        deepspeed_config=ds_config.load(opts.deepspeed_config),
        dataset_path=None if ray_dataset or opts.dataset in (None, "stdlib") else opts.dataset,
        lora_merge=opts.lora_merge, hf_max_shard_bytes=opts.hf_shard_size,
        hang_floor_s=opts.hang_floor_s, hang_factor=opts.hang_factor)


def check_deepspeed(opts: TrainOptions) -> None:
    if opts.strategy == "deepspeed" and opts.deepspeed_config:
        ds_config.check(ds_config.load(opts.deepspeed_config),
                        {"batch_size": opts.batch_size, "grad_accum": opts.grad_accum,
                         "grad_clip": LoopConfig.grad_clip})
