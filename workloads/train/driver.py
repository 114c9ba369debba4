"""`python -m workloads.train`: the Ray Train driver.

    ray job submit --working-dir . -- python -m workloads.train --smoke-test
    ray job submit --working-dir . -- python -m workloads.train \
        --model 125m --strategy fsdp --num-workers 8 --use-gpu \
        --storage-path s3://my-bucket/runs --name gpt-125m

Re-running with the same --name and --storage-path resumes from the run's latest checkpoint
(Ray Train V2). Before `fit()` the request is checked against the cluster (fail fast rather
than hang) and a per-worker memory estimate is compared with what a worker has.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, fields, replace

from rayfleet import capacity, catalog
from rayfleet.agents import fallover
from rayfleet.errors import (
    CheckpointError,
    ClusterError,
    ConfigError,
    RayfleetError,
    StorageError,
)
from rayfleet.entrypoint import ArgumentParser, at_least, byte_size, run_main
from rayfleet.facts import BOOTSTRAP_CONFIG, is_bucket_name
from workloads.common import hf, runs
from workloads.common.cli import parse_env_pairs
from workloads.common.deps import require
from workloads.common.hf import is_hf_spec
from workloads.common.model import PRESETS, GPTConfig
from workloads.common.shards import MANIFEST
from workloads.common.storage import default_root, resolve, s3_endpoint, user_path
from workloads.train import ds_config, failures, runinfo
from workloads.train.context import TIMING_ENV, RayContext, ray_train_marks, startup
from workloads.train.datasets import load_dataset
from workloads.train.hf_model import ALL_LINEAR, HFSpec, count_params
from workloads.train.loop import STRATEGIES, LoopConfig, train_loop

PROG = "workloads.train"


# Run names become a folder under --storage-path (and Ray Train's experiment name).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

DEFAULTS = {"model": "small", "batch_size": 16, "max_steps": 200, "checkpoint_every": 50,
            "log_every": 10, "corpus_bytes": 4 << 20, "lr": 1e-3}
SMOKE = {"model": "tiny", "batch_size": 8, "max_steps": 30, "checkpoint_every": 10, "log_every": 5,
         "corpus_bytes": 256 << 10, "lr": 3e-3}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Distributed GPT training with Ray Train.")
    p.add_argument("--smoke-test", action="store_true",
                   help="tiny model and data, 2 CPU workers, well under a minute")
    p.add_argument("--model", default=None,
                   help=f"size preset of the kit's byte-level GPT: {', '.join(PRESETS)} (default "
                        "small; tiny for --smoke-test), or a Hugging Face model folder or "
                        "s3:// prefix (AutoModelForCausalLM; needs --dataset tokenized with "
                        "its tokenizer)")
    p.add_argument("--model-config", default=None, metavar="FOLDER",
                   help="a Hugging Face model config (a folder with config.json, local or "
                        "s3://): train that architecture from fresh weights")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face models: the tokenizer saved with the final checkpoint's "
                        "hf/ export (default: the model folder's, else the dataset's)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="Hugging Face models: recompute activations in backward (less memory)")
    p.add_argument("--lora-r", type=at_least(1), default=None, metavar="R",
                   help="Hugging Face models: train LoRA adapters of rank R (PEFT) on the frozen "
                        "base instead of every weight")
    p.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA scaling numerator (the update is scaled by alpha / r; default 2r)")
    p.add_argument("--lora-dropout", type=float, default=None,
                   help="dropout on the adapters' input (default 0)")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="comma-separated module names to adapt (e.g. q_proj,v_proj), or "
                        "all-linear (default: every linear layer but the output head)")
    p.add_argument("--lora-merge", action="store_true",
                   help="LoRA: the final checkpoint also carries hf/, the base with the adapter "
                        "merged in (adapter/ is written either way)")
    p.add_argument("--hf-shard-size", type=byte_size, default=None, metavar="SIZE",
                   help="Hugging Face models: the largest safetensors file of the final hf/ "
                        "export (e.g. 5GB, 500MB; default 2GiB), as save_pretrained's "
                        "max_shard_size")
    p.add_argument("--deepspeed-config", default=None, metavar="JSON",
                   help="DeepSpeed config (file or inline JSON) merged over the kit's defaults")
    p.add_argument("--offload-params", action="store_true",
                   help="DeepSpeed ZeRO-3: parameters on the host too (with --offload)")
    p.add_argument("--seq-len", type=at_least(1), default=None,
                   help="override the preset's context")
    p.add_argument("--strategy", default="ddp", help="ddp (default), fsdp or deepspeed")
    p.add_argument("--zero-stage", type=int, default=2, help="DeepSpeed ZeRO stage: 2 or 3")
    p.add_argument("--offload", action="store_true", help="DeepSpeed: optimizer state on CPU")
    p.add_argument("--num-workers", type=int, default=2, help="training workers (ranks)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--resources-per-worker", default=None, metavar="JSON",
                   help='extra Ray resources per worker, e.g. {"accelerator_type:A100": 0.01}')
    p.add_argument("--batch-size", type=at_least(1), default=None,
                   help="sequences per worker per step")
    p.add_argument("--grad-accum", type=at_least(1), default=1)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for ONE worker; scaled linearly by world size")
    p.add_argument("--max-steps", type=at_least(1), default=None)
    p.add_argument("--warmup-steps", type=at_least(0), default=None)
    p.add_argument("--checkpoint-every", type=at_least(1), default=None)
    p.add_argument("--log-every", type=at_least(1), default=None)
    p.add_argument("--num-to-keep", type=at_least(1), default=2,
                   help="checkpoints kept in storage")
    p.add_argument("--max-failures", type=at_least(-1), default=3,
                   help="worker-group restarts before the run fails (FailureConfig; -1: "
                        "retry forever)")
    p.add_argument("--corpus-bytes", type=int, default=None)
    p.add_argument("--dataset", default=None,
                   help="stream a Ray Data dataset: 'stdlib' or a folder/s3:// of Parquet "
                        "with a 'tokens' column (from workloads.data)")
    p.add_argument("--storage-path", default=default_root(),
                   help="local folder or s3://bucket/prefix (env RAYFLEET_STORAGE)")
    p.add_argument("--s3-endpoint", default=None,
                   help="S3-compatible endpoint URL (env AWS_ENDPOINT_URL_S3)")
    p.add_argument("--name", default=None, help="run name; the same name resumes (default: "
                   "the job's --submission-id if you gave one, else smoke-<strategy> for "
                   "--smoke-test, else gpt-<model>-<strategy>)")
    p.add_argument("--allow-changes", action="store_true",
                   help="resume an existing --name although its dataset or strategy differs")
    p.add_argument("--env", action="append", metavar="KEY=VALUE",
                   help="environment variable for every worker (repeatable)")
    # numpy's seed() refuses negatives, on every worker, after the cluster is booked.
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model in place (ddp, fsdp); the first step compiles")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="per-GPU memory for the OOM estimate (default: from accelerator type)")
    return p


@dataclass(frozen=True)
class TrainOptions:
    """The training flags, parsed once (TrainOptions.from_args): flags left unset take the
    smoke-test values (tiny, seconds on 2 CPUs) or the defaults, and flags given explicitly
    always win, so `--smoke-test --max-steps 3` works. Nothing changes it afterwards; paths
    made absolute are a new TrainOptions (`dataclasses.replace`)."""

    smoke_test: bool
    model: str | None
    model_config: str | None
    tokenizer: str | None
    activation_checkpointing: bool
    lora_r: int | None
    lora_alpha: float | None
    lora_dropout: float | None
    lora_targets: str | None
    lora_merge: bool
    hf_shard_size: int | None
    deepspeed_config: str | None
    offload_params: bool
    seq_len: int | None
    strategy: str
    zero_stage: int
    offload: bool
    num_workers: int
    use_gpu: bool
    cpus_per_worker: float
    resources_per_worker: str | None
    batch_size: int
    grad_accum: int
    lr: float
    max_steps: int
    warmup_steps: int | None
    checkpoint_every: int
    log_every: int
    num_to_keep: int
    max_failures: int
    corpus_bytes: int
    dataset: str | None
    storage_path: str
    s3_endpoint: str | None
    name: str | None
    allow_changes: bool
    env: tuple[str, ...]
    seed: int
    compile: bool
    gpu_memory_gib: float | None

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given) -> TrainOptions:
        """From build_parser()'s namespace (other flags a caller added are left out);
        `given` overrides flags before the defaults are applied (torchrun's world size)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)} | given
        defaults = SMOKE if values["smoke_test"] else DEFAULTS
        for key, value in defaults.items():
            # --model-config names the architecture: no preset is filled in beside it.
            if values[key] is None and not (key == "model" and values["model_config"]):
                values[key] = value
        if values["smoke_test"] and values["num_workers"] >= 1:
            values["num_workers"] = min(values["num_workers"], 2)
        values["env"] = tuple(values["env"] or ())
        return cls(**values)

    @classmethod
    def parse(cls, argv: list[str] | None) -> TrainOptions:
        return cls.from_args(build_parser().parse_args(argv))


def check_options(opts: TrainOptions) -> GPTConfig | None:
    """The flags checked; the kit's GPT config, or None for a Hugging Face model (whose config
    and sequence length come from its folder and the dataset: resolve_hf)."""
    hf = is_hf_spec(opts.model, PRESETS) or opts.model_config is not None
    if opts.model_config is not None and opts.model is not None:
        raise ConfigError("--model-config", "give --model (a preset or a model folder) or "
                                            "--model-config (fresh weights), not both")
    defaults = SMOKE if opts.smoke_test else DEFAULTS
    if opts.strategy not in STRATEGIES:
        raise ConfigError("--strategy", f"unknown strategy {opts.strategy!r}", STRATEGIES,
                          opts.strategy)
    if not hf and opts.model not in PRESETS:
        raise ConfigError("--model", f"unknown model size {opts.model!r}", PRESETS, opts.model)
    # Checked here, not by an argparse type as the other counts: under torchrun the world size
    # (WORLD_SIZE) is the worker count, not the flag.
    if opts.num_workers < 1:
        raise ConfigError("--num-workers", f"must be at least 1, got {opts.num_workers}")
    if opts.compile and opts.strategy == "deepspeed":
        raise ConfigError("--compile", "works with --strategy ddp or fsdp; DeepSpeed wraps the "
                          "model in its own engine, which --compile does not reach")
    if opts.zero_stage not in (2, 3):
        raise ConfigError("--zero-stage", f"must be 2 or 3, got {opts.zero_stage}")
    if opts.offload_params and not (opts.strategy == "deepspeed" and opts.zero_stage == 3):
        raise ConfigError("--offload-params", "needs --strategy deepspeed --zero-stage 3")
    if opts.deepspeed_config and opts.strategy != "deepspeed":
        raise ConfigError("--deepspeed-config", "needs --strategy deepspeed")
    if not hf:
        for flag in ("tokenizer", "activation_checkpointing", "lora_r", "hf_shard_size"):
            if getattr(opts, flag):
                raise ConfigError(f"--{flag.replace('_', '-')}", "is for Hugging Face models "
                                                                 "(--model <folder>)" + (
                                      "; the kit's byte GPT trains all its weights"
                                      if flag == "lora_r" else ""))
    check_lora_options(opts)
    # `not x > 0` rather than `x <= 0`: argparse's float() accepts "nan", which fails every
    # comparison and would otherwise reach the workers as a NaN learning rate.
    if not 0 < opts.cpus_per_worker < math.inf:
        raise ConfigError("--cpus-per-worker", f"must be more than 0, got {opts.cpus_per_worker}")
    if not 0 < opts.lr < math.inf:
        raise ConfigError("--lr", f"must be a positive finite number, got {opts.lr}; the "
                                  f"default is {defaults['lr']:g}")
    if opts.gpu_memory_gib is not None and not 0 < opts.gpu_memory_gib < math.inf:
        raise ConfigError("--gpu-memory-gib", f"must be more than 0, got {opts.gpu_memory_gib}")
    if opts.name is not None and not RUN_NAME.fullmatch(opts.name):
        # The name is a folder under --storage-path; "../x" or "a/b" would write outside it.
        raise ConfigError("--name", f"{opts.name!r} must be letters, digits, - _ . (no "
                                    "slashes), starting with a letter or digit")
    if opts.resources_per_worker:
        # Not an `assert`: `python -O` would drop it and let a list or a string through.
        try:
            extra = json.loads(opts.resources_per_worker)
        except ValueError:
            extra = None
        if not isinstance(extra, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in extra.values()):
            raise ConfigError("--resources-per-worker",
                              'must be a JSON object of numbers, e.g. {"memory": 4e9}')
    if hf:
        if opts.dataset in (None, "stdlib"):
            raise ConfigError("--dataset", "a Hugging Face model trains on a dataset tokenized "
                                           "with its tokenizer: python -m workloads.data "
                                           "--tokenizer <model folder> --output <folder>, then "
                                           "--dataset <folder>")
        if opts.seq_len:
            raise ConfigError("--seq-len", "comes from the dataset for Hugging Face models "
                                           "(workloads.data --max-length)")
        return None
    model = PRESETS[opts.model]
    if opts.seq_len:
        model = GPTConfig.from_dict({**model.to_dict(), "seq_len": opts.seq_len})
    if opts.dataset is None:
        # The built-in corpus is cut into seq_len+1 windows and split over the workers; with
        # fewer windows than one batch per worker every rank fails its first epoch, and
        # FailureConfig would restart the group --max-failures times before giving up.
        windows = max(0, (opts.corpus_bytes - 1) // model.seq_len)
        need = opts.batch_size * opts.num_workers
        if windows < need:
            raise ConfigError("--corpus-bytes", f"{opts.corpus_bytes} bytes make {windows} "
                                                f"sequences of {model.seq_len + 1} tokens, fewer "
                                                f"than one batch ({opts.batch_size}) per worker "
                                                f"({opts.num_workers}); use at least "
                                                f"{need * model.seq_len + 1}")
    return model


def check_lora_options(opts: TrainOptions) -> None:
    """The LoRA flags on their own (the targets are checked against the model in resolve_hf)."""
    if opts.lora_r is None:
        for flag in ("lora_alpha", "lora_dropout", "lora_targets", "lora_merge"):
            if getattr(opts, flag) not in (None, False):
                raise ConfigError(f"--{flag.replace('_', '-')}", "needs --lora-r (LoRA's rank)")
        return
    if opts.model_config is not None:
        raise ConfigError("--lora-r", "adapts pretrained weights: give --model <folder>, not "
                                      "--model-config (fresh weights would train frozen noise)")
    if opts.lora_alpha is not None and not 0 < opts.lora_alpha < math.inf:
        raise ConfigError("--lora-alpha", f"must be more than 0, got {opts.lora_alpha}")
    if opts.lora_dropout is not None and not 0 <= opts.lora_dropout < 1:
        raise ConfigError("--lora-dropout", f"must be in [0, 1), got {opts.lora_dropout}")
    if opts.lora_targets is not None and not lora_targets(opts.lora_targets):
        raise ConfigError("--lora-targets", "give module names, e.g. q_proj,v_proj, or "
                                            "all-linear")
    if isinstance(targets := lora_targets(opts.lora_targets), list) and ALL_LINEAR in targets:
        # PEFT takes "all-linear" only as the whole value; in a list it is a module name.
        raise ConfigError("--lora-targets", f"{ALL_LINEAR} stands alone (every linear layer "
                                            "but the output head); to add lm_head or others, "
                                            "list the module names instead, e.g. "
                                            "q_proj,k_proj,v_proj,o_proj,lm_head")


def lora_targets(value: str | None) -> str | list[str]:
    if value is None or value.strip() == ALL_LINEAR:
        return ALL_LINEAR
    return [name.strip() for name in value.split(",") if name.strip()]


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


def cluster_address_env(environ=os.environ) -> dict | None:
    """This cluster's GCS address for the run's actors (the job's runtime env), or None.

    Ray Train V2's PlacementGroupCleaner, a detached actor on the head, asks the state API
    about the controller every second with no address (ray/train/v2/_internal/execution/
    controller/placement_group_cleaner.py). Ray then guesses the cluster: RAY_ADDRESS, else
    /tmp/ray/ray_current_cluster, else every GCS that `ps` shows. Neither the local cluster
    (its own temp dir) nor the job's processes give it this cluster: with a second Ray
    instance on the machine the cleaner's thread dies with "Found multiple active Ray
    instances", with a stale ray_current_cluster it blocks on a dead GCS, and either way the
    controller prints a traceback after every successful run (`_stop_cleaner`: GetTimeoutError,
    "Monitor thread did not exit within 12.00 seconds"). The driver knows the address (the
    job supervisor or `rayfleet local env` set RAY_ADDRESS): the run's actors get it too."""
    address = environ.get("RAY_ADDRESS", "")
    if not re.fullmatch(r"[\w.:\[\]-]+:\d+", address):
        return None  # none, "auto", or a ray:// client address: nothing better to give
    job = json.loads(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    if "RAY_ADDRESS" in ((job.get("runtime_env") or {}).get("env_vars") or {}):
        return None  # the job set it itself (a second value would be refused as a conflict)
    return {"env_vars": {"RAY_ADDRESS": address}}


def absolute_hf_paths(opts: TrainOptions) -> TrainOptions:
    """--model / --model-config / --tokenizer folders made absolute (the workers do not run in
    this folder; inside a Ray job a relative one must have been uploaded with it)."""
    paths = {}
    for flag in ("model", "model_config", "tokenizer"):
        value = getattr(opts, flag)
        if value is not None and (flag != "model" or is_hf_spec(value, PRESETS)):
            paths[flag] = user_path(value, f"--{flag.replace('_', '-')}", output=False)
    return replace(opts, **paths)


def run_name(opts: TrainOptions, hf_source: str | None) -> str:
    if opts.name:
        return opts.name
    # A job submitted with --submission-id ID is run ID: its checkpoints, metrics.csv and
    # loss.png land beside the job's logs (the head's log shipper writes <storage>/runs/ID/).
    submitted = runinfo.chosen_submission_id()
    if submitted and RUN_NAME.fullmatch(submitted):
        return submitted
    if opts.smoke_test and hf_source is None and opts.model_config is None:
        return f"smoke-{opts.strategy}"
    if opts.model_config is not None or hf_source is not None:
        base = (hf_source or opts.model_config).rstrip("/").rsplit("/", 1)[-1]
        base = re.sub(r"[^A-Za-z0-9_.-]", "-", base).strip("-.") or "model"
        return f"hf-{base}-{opts.strategy}"[:128]
    return f"gpt-{opts.model}-{opts.strategy}"


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
        lora_merge=opts.lora_merge, hf_max_shard_bytes=opts.hf_shard_size)


def check_deepspeed(opts: TrainOptions) -> None:
    if opts.strategy == "deepspeed" and opts.deepspeed_config:
        ds_config.check(ds_config.load(opts.deepspeed_config),
                        {"batch_size": opts.batch_size, "grad_accum": opts.grad_accum,
                         "grad_clip": LoopConfig.grad_clip})


def worker_bundle(opts: TrainOptions) -> dict[str, float]:
    bundle = {"CPU": opts.cpus_per_worker}
    if opts.use_gpu:
        bundle["GPU"] = 1.0
    if opts.resources_per_worker:
        bundle.update(json.loads(opts.resources_per_worker))
    return bundle


AUTOSCALER_CONFIG = BOOTSTRAP_CONFIG
# How long a run waits for its workers to be placed when the autoscaler may add the nodes.
AUTOSCALE_START_TIMEOUT_S = 900


def autoscaler_config(path: str = AUTOSCALER_CONFIG) -> dict:
    """The head's autoscaling config ({} on a cluster that does not autoscale)."""
    from pathlib import Path

    import yaml

    try:
        return yaml.safe_load(Path(path).expanduser().read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def worker_types(cfg: dict) -> dict[str, dict]:
    """The autoscaler's worker node types that may launch at all, in the YAML's order, by name
    -> their declared resources."""
    return {name: dict(t.get("resources") or {})
            for name, t in (cfg.get("available_node_types") or {}).items()
            if name != cfg.get("head_node_type") and int(t.get("max_workers", 0) or 0) > 0}


def launchable_nodes(cfg: dict) -> list[dict]:
    """The workers the cluster's autoscaler may still start, as ``ray.nodes()`` entries: one
    per allowed instance of each worker type of the head's autoscaling config, within the
    cluster's max_workers (none on a cluster that does not autoscale). A job asking for what
    only such a node has must wait for the autoscaler, not fail."""
    types = cfg.get("available_node_types") or {}
    left = int(cfg.get("max_workers") or 0)
    out = []
    for name, resources in worker_types(cfg).items():
        for _ in range(min(int(types[name].get("max_workers", 0) or 0), left)):
            out.append({"Alive": True, "Resources": dict(resources), "Launchable": name})
            left -= 1
    return out


def fitting_types(opts: TrainOptions, types: dict[str, dict]) -> list[str]:
    """The autoscaler's node types (:func:`worker_types`) that could hold one of this run's
    workers, in the cluster YAML's order: every one of them, not only those the cluster's
    max_workers leaves room for in :func:`launchable_nodes` (p4de is a fallback for p4d even
    when max_workers is spent on p4d's spot and on-demand types)."""
    bundle = worker_bundle(opts)
    return [name for name, res in types.items()
            if all(res.get(k, 0) >= v for k, v in bundle.items() if v > 0)]


def _stop_run(line: str) -> None:
    """End the driver with ``line``, as run_main ends it on a ClusterError (one line, exit 2).

    Not through the main thread: Ray Train V2 owns the driver's SIGINT (its handler aborts the
    run and the process exits 1, saying nothing of why). Nothing of the run exists yet to save:
    no worker was ever placed, so no checkpoint is being written; Ray ends the job's actors
    with its driver."""
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(ClusterError.exit_code)


class LaunchWatch:
    """While the run waits for nodes the autoscaler must launch, read the autoscaler's report
    (the GCS KV, rayfleet/capacity.py) every ``poll_s``; when every node type that could hold
    a worker has failed its last launch (EC2: no capacity, quota, ...), and none is running or
    launching, end the run with that in one line (``on_fail``), instead of Ray Train waiting
    out its placement timeout (15 min) while the autoscaler retries."""

    def __init__(self, candidates: list[str], read, poll_s: float = 5.0, on_fail=_stop_run):
        import threading

        self.candidates, self.read, self.poll_s = candidates, read, poll_s
        self.on_fail = on_fail
        self.line: str | None = None
        # Only launches tried for this run count (capacity.all_failing's `since`).
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayfleet-launch-watch",
                                        daemon=True)

    def __enter__(self) -> LaunchWatch:
        if self.candidates:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def check(self) -> str | None:
        rows = capacity.all_failing(capacity.report(self.read()), self.candidates,
                                    since=self.started)
        return capacity.failing_line(rows) if rows else None

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.poll_s):
            try:
                line = self.check()
            except Exception as e:   # noqa: BLE001  (a report it cannot read is no verdict)
                if not warned:   # but said, once: the run then waits out Ray Train's timeout
                    warned = True
                    print(f"[rayfleet] cannot read the autoscaler's report ("
                          f"{type(e).__name__}: {e}); a type that cannot launch is not "
                          "noticed, the run waits on Ray Train's placement timeout",
                          flush=True)
                continue
            if line and not self._stop.is_set():
                self.line = line
                self.on_fail(line)
                return


def autoscaler_report() -> bytes | None:
    """The autoscaler's last report, from the GCS this driver is connected to."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(DEBUG_AUTOSCALING_STATUS)


def check_resources(opts: TrainOptions, nodes: list[dict], total: dict) -> None:
    """Fail in seconds, naming what is missing, when no placement can exist (instead of
    Ray Train waiting forever for resources)."""
    bundle = worker_bundle(opts)
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    for key, need in bundle.items():
        if need > 0 and total.get(key, 0) == 0:
            what = {"GPU": "GPUs (use_gpu)", "CPU": "CPUs"}.get(key, f"resource {key!r}")
            raise ClusterError(
                f"the job asks for {opts.num_workers} workers with {need:g} {what} each, "
                f"but the cluster has no {key} at all; drop --use-gpu or add GPU nodes"
                if key == "GPU" else
                f"the job asks for {key}={need:g} per worker, but no node has {key}")
    fits = sum(min(math.floor(res.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0)
               for res in alive)
    if fits < opts.num_workers:
        largest = max(alive, key=lambda r: r.get("GPU", 0) * 1000 + r.get("CPU", 0), default={})
        have = ", ".join(f"{k} {largest.get(k, 0):g}" for k in bundle)
        totals = ", ".join(f"{k} {total.get(k, 0):g}" for k in bundle)
        raise ClusterError(
            f"the job needs {opts.num_workers} workers x {_fmt(bundle)} but the cluster fits "
            f"only {fits} (cluster total: {totals}; largest node: {have}); lower "
            "--num-workers or the per-worker resources, or add nodes")


def _fmt(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def memory_estimate_bytes(model: GPTConfig, opts: TrainOptions) -> dict[str, float]:
    """Per-worker bytes: parameters, gradients, optimizer state (AdamW: 2 fp32 moments)
    for the strategy, plus activations (Korthikanti et al. 2022: ~34·s·b·h per layer)."""
    n, w = model.num_params(), opts.num_workers
    # Gradients and optimizer state only for what trains (LoRA: the adapters).
    t = model.trainable_params() if hasattr(model, "trainable_params") else n
    p, g, o = 4.0 * n, 4.0 * t, 8.0 * t  # fp32 master weights, grads, Adam moments
    if opts.strategy == "fsdp":
        p, g, o = p / w, g / w, o / w
    elif opts.strategy == "deepspeed":
        g, o = g / w, o / w
        if opts.zero_stage == 3:
            p = p / w
        if opts.offload:
            o = 0.0  # on the host instead
        if opts.offload_params:
            p = 0.0
    act = 34.0 * model.seq_len * opts.batch_size * model.d_model * model.n_layer
    if opts.activation_checkpointing:
        act /= 17  # only each layer's input (2·s·b·h) is kept; the rest is recomputed
    if opts.use_gpu:
        act /= 2  # bf16 activations
    return {"params": p, "grads": g, "optimizer": o, "activations": act,
            "total": p + g + o + act}


def check_memory(model: GPTConfig, opts: TrainOptions, nodes: list[dict]) -> str | None:
    est = memory_estimate_bytes(model, opts)
    if opts.use_gpu:
        have = opts.gpu_memory_gib
        if have is None:
            kinds = [k.split(":", 1)[1] for n in nodes for k in n.get("Resources", {})
                     if k.startswith("accelerator_type:")]
            have = max((catalog.gpu_memory_gib(k) for k in kinds), default=0) or None
        where = "GPU"
        have_b = have * 2**30 if have else None
    else:
        alive = [n["Resources"] for n in nodes if n.get("Alive")]
        per_node = [r.get("memory", 0) / max(1, math.floor(r.get("CPU", 1) / opts.cpus_per_worker))
                    for r in alive]
        have_b, where = (max(per_node) if per_node else None), "host"
    if not have_b:
        return None
    if est["total"] > 0.9 * have_b:
        return (f"warning: estimated {est['total'] / 2**30:.1f} GiB per worker "
                f"(params {est['params'] / 2**30:.1f}, grads {est['grads'] / 2**30:.1f}, "
                f"optimizer {est['optimizer'] / 2**30:.1f}, activations "
                f"{est['activations'] / 2**30:.1f}) vs {have_b / 2**30:.1f} GiB of {where} "
                f"memory: expect OOM; try --strategy fsdp, deepspeed --zero-stage 3 "
                f"--offload, or a smaller --batch-size")
    return None


def _root_cause(err: BaseException) -> BaseException | None:
    """The first RayfleetError in a Ray exception chain (worker errors are wrapped)."""
    found = next((e for e in failures.causes(err) if isinstance(e, RayfleetError)), None)
    if found is not None:
        return found
    text = str(err)
    if "CheckpointError" in text:
        line = next((ln for ln in text.splitlines() if "CheckpointError" in ln), text)
        return CheckpointError(line.split("CheckpointError:", 1)[-1].strip())
    return None


def _train_func(config: dict) -> dict:
    # Runs on every Ray Train worker; rank 0's return value is Result.return_value.
    return train_loop(LoopConfig(**config), RayContext())


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


def _main(argv: list[str] | None) -> int:
    opts = TrainOptions.parse(argv)
    model = check_options(opts)
    env_vars = parse_env_pairs(list(opts.env))
    opts = absolute_hf_paths(replace(
        opts, storage_path=user_path(opts.storage_path, "--storage-path", output=True),
        **({"dataset": user_path(opts.dataset, "--dataset", output=False)}
           if opts.dataset not in (None, "stdlib") else {})))
    check_dataset(opts.dataset)
    check_deepspeed(opts)
    manifest = dataset_manifest(opts.dataset, opts.s3_endpoint)
    hf_source = tokenizer = None
    if model is None:
        model, hf_source, tokenizer = resolve_hf(opts, manifest)
    else:
        check_byte_dataset(opts.dataset, manifest)
    storage = resolve(opts.storage_path, endpoint=opts.s3_endpoint)
    name = run_name(opts, hf_source)
    # A corrupt latest checkpoint, or one of another run under the same name, stops the run
    # here, before Ray is started, before any worker starts and before anything in storage is
    # overwritten; a finished run says so and trains nothing.
    identity = runinfo.run_identity({**model.to_dict(), **({"source": hf_source or "fresh"}
                                                            if tokenizer else {})},
                                    opts.strategy, opts.zero_stage, opts.dataset)
    try:
        runinfo.check_run(storage, name, identity, opts.max_steps, opts.allow_changes)
    except runinfo.RunFinished as done:
        print(f"[rayfleet] {done}", flush=True)
        return 0
    startup.mark("inputs_checked")

    # Everything this run will import, on this node, once the inputs are known good and before
    # anything is trained: the summary's PNG (matplotlib) would otherwise fail after the last
    # step, DeepSpeed only inside a worker.
    require({"ray.train": "ray[train]", "torch": "torch", "pyarrow": "pyarrow",
             "matplotlib": "matplotlib",
             **({"transformers": "transformers", "safetensors": "safetensors"}
                if tokenizer else {}),
             **({"peft": "peft"} if opts.lora_r else {}),
             **({"deepspeed": "deepspeed"} if opts.strategy == "deepspeed" else {})},
            f"workloads.train --strategy {opts.strategy}")
    # Imported late: `--help` and bad flags answer without paying for Ray.
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    startup.mark("imports_done")
    if os.environ.get(TIMING_ENV) == "1":
        env_vars.setdefault(TIMING_ENV, "1")  # rank 0 reports its start-up marks too (bench/)
    # Train V2 propagates these from the driver to its controller and workers: poll the
    # workers' result queues every second (default 2 s stalls short runs at each report),
    # and print worker output once (the print patch would echo it through the logger too).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1.0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(logging_level="ERROR", log_to_driver=True, runtime_env=cluster_address_env())
    startup.mark("ray_connected")
    nodes, total = ray.nodes(), ray.cluster_resources()
    autoscaling = autoscaler_config()
    launchable = launchable_nodes(autoscaling)
    if not fallover.wants_accelerator(worker_bundle(opts)):
        # The head's scorer starts no GPU worker for CPU-only work (rayfleet/agents/
        # fallover.py): such a run fits what is running, or nothing.
        launchable = [n for n in launchable if not n["Resources"].get("GPU")]
    capacity = dict(total)
    for n in launchable:
        for k, v in n["Resources"].items():
            capacity[k] = capacity.get(k, 0) + v
    check_resources(opts, nodes + launchable, capacity)
    if launchable and failures.START_TIMEOUT_ENV not in os.environ:
        # Ray Train gives a worker group 60 s to be placed; a node the autoscaler launches
        # for it takes minutes (boot, setup commands, `ray start`).
        os.environ[failures.START_TIMEOUT_ENV] = str(AUTOSCALE_START_TIMEOUT_S)
    warning = check_memory(model, opts, nodes + launchable)
    if warning:
        print(f"[rayfleet] {warning}", flush=True)

    world = opts.num_workers
    # A DataLoader worker process only where the accelerator leaves host cores free (GPU).
    # On CPU it competes with the training processes for the same cores, and each batch
    # costs a socket round-trip to receive the worker's shared-memory fds (bench/: ~3% of
    # every step on 2 cores, and torchrun's loop does not pay it).
    cfg = loop_config(opts, model, hf_source, tokenizer, world,
                      data_workers=1 if opts.use_gpu and not opts.smoke_test else 0,
                      ray_dataset=opts.dataset is not None)
    lr = cfg.lr
    global_batch = opts.batch_size * opts.grad_accum * world
    print(f"[rayfleet] run {name}: {model.num_params() / 1e6:.2f}M params, strategy "
          f"{opts.strategy}, {world} workers x {_fmt(worker_bundle(opts))}, global batch "
          f"{global_batch} seqs = {opts.batch_size} x {opts.grad_accum} accum x {world} "
          f"workers ({global_batch * model.seq_len:,} tokens), lr {opts.lr:g} x {world} = "
          f"{lr:g}", flush=True)

    datasets = None
    if opts.dataset:
        datasets = {"train": load_dataset(opts.dataset, model.seq_len, opts.corpus_bytes,
                                          opts.s3_endpoint)}
    trainer = TorchTrainer(
        _train_func,
        train_loop_config=cfg.to_dict(),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=opts.use_gpu,
                                     resources_per_worker=worker_bundle(opts)),
        run_config=RunConfig(
            name=name, storage_path=storage.path, storage_filesystem=storage.filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=opts.num_to_keep),
            # A finite controller_failure_limit: Ray's default (-1) retries a worker group
            # that cannot be placed (a node it needs is gone) forever, a silent hang.
            failure_config=FailureConfig(max_failures=opts.max_failures,
                                         controller_failure_limit=failures.PLACEMENT_RETRIES),
            worker_runtime_env={"env_vars": env_vars} if env_vars else None,
            logging_config=LoggingConfig(log_level="WARNING")),
        datasets=datasets,
    )
    runs.record_run(storage, name, identity)
    started = time.time()
    startup.mark("fit_called")
    watch = LaunchWatch(fitting_types(opts, worker_types(autoscaling)) if launchable else [],
                        autoscaler_report)
    try:
        with watch:
            result = trainer.fit()
    except Exception as e:
        cause = failures.explain(e, storage=storage, name=name, workers=world,
                                 bundle=worker_bundle(opts), nodes_at_start=nodes) \
            or _root_cause(e)
        if cause is not None:
            raise cause from None
        raise
    summary = runinfo.summarize(result, storage, name, started, global_batch, cfg)
    print(runinfo.format_summary(summary), flush=True)
    print("RAYFLEET_SUMMARY " + json.dumps(summary), flush=True)
    startup.marks.update(ray_train_marks())  # after the summary: bench/ times the run to it
    startup.emit("driver")
    return 0


if __name__ == "__main__":
    sys.exit(main())
