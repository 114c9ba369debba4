"""The training flags: the parser, TrainOptions (parsed once, frozen) and the checks that need
nothing but the flags (no file, no network, no Ray)."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from rayfleet.entrypoint import ArgumentParser, at_least, byte_size
from rayfleet.errors import ConfigError
from workloads.common.hf import is_hf_spec
from workloads.common.model import PRESETS, GPTConfig
from workloads.common.storage import default_root
from workloads.train import hangwatch
from workloads.train.hf_model import ALL_LINEAR
from workloads.train.loop import STRATEGIES

PROG = "workloads.train"


# Run names become a folder under --storage-path (and Ray Train's experiment name).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

DEFAULTS = {"model": "small", "batch_size": 16, "max_steps": 200, "checkpoint_every": 50,
            "log_every": 10, "corpus_bytes": 4 << 20, "lr": 1e-3}
SMOKE = {"model": "tiny", "batch_size": 8, "max_steps": 30, "checkpoint_every": 10, "log_every": 5,
         "corpus_bytes": 256 << 10, "lr": 3e-3}


def flag(group: str, **argparse_kwargs) -> Any:
    """A TrainOptions field that is also a flag of ``group``: its name gives the flag
    (``--max-steps`` for max_steps), ``argparse_kwargs`` the rest (a callable default is
    called when the parser is built, so the environment is read then, not at import)."""
    return field(metadata={"group": group, "argparse": argparse_kwargs})


# The flags' groups in --help's order, each group's flags in the dataclass's order: the
# model (a preset or a Hugging Face folder, and how it trains), how it is spread (strategy,
# workers, resources), and the run (schedule, data, storage, the workers' environment).
GROUPS = ("model", "parallel", "run")


@dataclass(frozen=True)
class TrainOptions:
    """The training flags, declared once (each field is its flag: build_parser) and parsed once
    (TrainOptions.from_args): flags left unset take the smoke-test values (tiny, seconds on 2
    CPUs) or the defaults, and flags given explicitly always win, so `--smoke-test --max-steps 3`
    works. Nothing changes it afterwards; paths made absolute are a new TrainOptions
    (`dataclasses.replace`)."""

    smoke_test: bool = flag("", action="store_true",
                            help="tiny model and data, 2 CPU workers, well under a minute")
    model: str | None = flag(
        "model", default=None,
        help=f"size preset of the kit's byte-level GPT: {', '.join(PRESETS)} (default small; "
             "tiny for --smoke-test), or a Hugging Face model folder or s3:// prefix "
             "(AutoModelForCausalLM; needs --dataset tokenized with its tokenizer)")
    model_config: str | None = flag(
        "model", default=None, metavar="FOLDER",
        help="a Hugging Face model config (a folder with config.json, local or s3://): train "
             "that architecture from fresh weights")
    tokenizer: str | None = flag(
        "model", default=None,
        help="Hugging Face models: the tokenizer saved with the final checkpoint's hf/ export "
             "(default: the model folder's, else the dataset's)")
    activation_checkpointing: bool = flag(
        "model", action="store_true",
        help="Hugging Face models: recompute activations in backward (less memory)")
    lora_r: int | None = flag(
        "model", type=at_least(1), default=None, metavar="R",
        help="Hugging Face models: train LoRA adapters of rank R (PEFT) on the frozen base "
             "instead of every weight")
    lora_alpha: float | None = flag(
        "model", type=float, default=None,
        help="LoRA scaling numerator (the update is scaled by alpha / r; default 2r)")
    lora_dropout: float | None = flag("model", type=float, default=None,
                                      help="dropout on the adapters' input (default 0)")
    lora_targets: str | None = flag(
        "model", default=None, metavar="NAMES",
        help="comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear "
             "(default: every linear layer but the output head)")
    lora_merge: bool = flag(
        "model", action="store_true",
        help="LoRA: the final checkpoint also carries hf/, the base with the adapter merged in "
             "(adapter/ is written either way)")
    hf_shard_size: int | None = flag(
        "model", type=byte_size, default=None, metavar="SIZE",
        help="Hugging Face models: the largest safetensors file of the final hf/ export (e.g. "
             "5GB, 500MB; default 2GiB), as save_pretrained's max_shard_size")
    deepspeed_config: str | None = flag(
        "parallel", default=None, metavar="JSON",
        help="DeepSpeed config (file or inline JSON) merged over the kit's defaults")
    offload_params: bool = flag(
        "parallel", action="store_true",
        help="DeepSpeed ZeRO-3: parameters on the host too (with --offload)")
    seq_len: int | None = flag("parallel", type=at_least(1), default=None,
                               help="override the preset's context")
    strategy: str = flag("parallel", default="ddp", help="ddp (default), fsdp or deepspeed")
    zero_stage: int = flag("parallel", type=int, default=2, help="DeepSpeed ZeRO stage: 2 or 3")
    offload: bool = flag("parallel", action="store_true",
                         help="DeepSpeed: optimizer state on CPU")
    num_workers: int = flag("parallel", type=int, default=2, help="training workers (ranks)")
    use_gpu: bool = flag("parallel", action="store_true", help="one GPU per worker")
    cpus_per_worker: float = flag("parallel", type=float, default=1.0)
    resources_per_worker: str | None = flag(
        "parallel", default=None, metavar="JSON",
        help='extra Ray resources per worker, e.g. {"accelerator_type:A100": 0.01}')
    batch_size: int = flag("run", type=at_least(1), default=None,
                           help="sequences per worker per step")
    grad_accum: int = flag("run", type=at_least(1), default=1)
    lr: float = flag("run", type=float, default=None,
                     help="learning rate for ONE worker; scaled linearly by world size")
    max_steps: int = flag("run", type=at_least(1), default=None)
    warmup_steps: int | None = flag("run", type=at_least(0), default=None)
    checkpoint_every: int = flag("run", type=at_least(1), default=None)
    log_every: int = flag("run", type=at_least(1), default=None)
    num_to_keep: int = flag("run", type=at_least(1), default=2,
                            help="checkpoints kept in storage")
    max_failures: int = flag(
        "run", type=at_least(-1), default=3,
        help="worker-group restarts before the run fails (FailureConfig; -1: retry forever)")
    max_hangs: int = flag(
        "run", type=at_least(-1), default=3,
        help="worker-group restarts after a hung rank, counted apart from --max-failures "
             "(-1: forever)")
    hang_floor_s: float = flag(
        "run", type=float, default=hangwatch.DEFAULT_FLOOR_S, metavar="SECONDS",
        help="a run in which no rank advances for max(SECONDS, --hang-factor x its longest "
             f"step) is hung: the group ends and resumes (default {hangwatch.DEFAULT_FLOOR_S:g}; "
             f"at least {hangwatch.MIN_FLOOR_S:g}; 0 turns the watch off)")
    hang_factor: float = flag(
        "run", type=float, default=hangwatch.DEFAULT_FACTOR,
        help="the hang bound's multiple of the longest gap between steps (or checkpoints) "
             f"seen (default {hangwatch.DEFAULT_FACTOR:g}, at least {hangwatch.MIN_FACTOR:g})")
    corpus_bytes: int = flag("run", type=int, default=None)
    dataset: str | None = flag(
        "run", default=None,
        help="stream a Ray Data dataset: 'stdlib' or a folder/s3:// of Parquet with a 'tokens' "
             "column (from workloads.data)")
    storage_path: str = flag("run", default=default_root,
                             help="local folder or s3://bucket/prefix (env RAYFLEET_STORAGE)")
    s3_endpoint: str | None = flag("run", default=None,
                                   help="S3-compatible endpoint URL (env AWS_ENDPOINT_URL_S3)")
    name: str | None = flag(
        "run", default=None,
        help="run name; the same name resumes (default: the job's --submission-id if you gave "
             "one, else smoke-<strategy> for --smoke-test, else gpt-<model>-<strategy>)")
    allow_changes: bool = flag(
        "run", action="store_true",
        help="resume an existing --name although its dataset or strategy differs")
    env: tuple[str, ...] = flag("run", action="append", metavar="KEY=VALUE",
                                help="environment variable for every worker (repeatable)")
    # numpy's seed() refuses negatives, on every worker, after the cluster is booked.
    seed: int = flag("run", type=at_least(0), default=0)
    compile: bool = flag(
        "run", action="store_true",
        help="torch.compile the model in place (ddp, fsdp); the first step compiles")
    gpu_memory_gib: float | None = flag(
        "run", type=float, default=None,
        help="per-GPU memory for the OOM estimate (default: from accelerator type)")

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


def build_parser() -> ArgumentParser:
    """TrainOptions' fields as flags, group by group (GROUPS' order)."""
    p = ArgumentParser(prog=PROG, description="Distributed GPT training with Ray Train.")
    for group in ("", *GROUPS):
        for f in fields(TrainOptions):
            if f.metadata["group"] == group:
                kwargs = dict(f.metadata["argparse"])
                if callable(kwargs.get("default")):
                    kwargs["default"] = kwargs["default"]()
                p.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return p


def check_options(opts: TrainOptions) -> GPTConfig | None:
    """The flags checked; the kit's GPT config, or None for a Hugging Face model (whose config
    and sequence length come from its folder and the dataset: resolve_hf)."""
    hf = is_hf_spec(opts.model, PRESETS) or opts.model_config is not None
    if opts.model_config is not None and opts.model is not None:
        raise ConfigError("--model-config", "give --model (a preset or a model folder) or "
                                            "--model-config (fresh weights), not both")
    if opts.strategy not in STRATEGIES:
        raise ConfigError("--strategy", f"unknown strategy {opts.strategy!r}", STRATEGIES,
                          opts.strategy)
    if not hf and opts.model not in PRESETS:
        raise ConfigError("--model", f"unknown model size {opts.model!r}", PRESETS, opts.model)
    # Checked here, not by an argparse type as the other counts: under torchrun the world size
    # (WORLD_SIZE) is the worker count, not the flag.
    if opts.num_workers < 1:
        raise ConfigError("--num-workers", f"must be at least 1, got {opts.num_workers}")
    check_strategy_options(opts)
    if not hf:
        for flag in ("tokenizer", "activation_checkpointing", "lora_r", "hf_shard_size"):
            if getattr(opts, flag):
                raise ConfigError(f"--{flag.replace('_', '-')}", "is for Hugging Face models "
                                                                 "(--model <folder>)" + (
                                      "; the kit's byte GPT trains all its weights"
                                      if flag == "lora_r" else ""))
    check_lora_options(opts)
    check_values(opts)
    if hf:
        check_hf_data(opts)
        return None
    return gpt_config(opts)


def check_strategy_options(opts: TrainOptions) -> None:
    """The flags that only some strategies take."""
    if opts.compile and opts.strategy == "deepspeed":
        raise ConfigError("--compile", "works with --strategy ddp or fsdp; DeepSpeed wraps the "
                          "model in its own engine, which --compile does not reach")
    if opts.zero_stage not in (2, 3):
        raise ConfigError("--zero-stage", f"must be 2 or 3, got {opts.zero_stage}")
    if opts.offload_params and not (opts.strategy == "deepspeed" and opts.zero_stage == 3):
        raise ConfigError("--offload-params", "needs --strategy deepspeed --zero-stage 3")
    if opts.deepspeed_config and opts.strategy != "deepspeed":
        raise ConfigError("--deepspeed-config", "needs --strategy deepspeed")


def check_values(opts: TrainOptions) -> None:
    """The values argparse's types let through: numbers, the run's name, the worker's extra
    resources."""
    defaults = SMOKE if opts.smoke_test else DEFAULTS
    # `not x > 0` rather than `x <= 0`: argparse's float() accepts "nan", which fails every
    # comparison and would otherwise reach the workers as a NaN learning rate.
    if not 0 < opts.cpus_per_worker < math.inf:
        raise ConfigError("--cpus-per-worker", f"must be more than 0, got {opts.cpus_per_worker}")
    if not 0 < opts.lr < math.inf:
        raise ConfigError("--lr", f"must be a positive finite number, got {opts.lr}; the "
                                  f"default is {defaults['lr']:g}")
    if not (opts.hang_floor_s == 0 or hangwatch.MIN_FLOOR_S <= opts.hang_floor_s < math.inf):
        raise ConfigError("--hang-floor-s", f"must be 0 (no watch) or at least "
                                            f"{hangwatch.MIN_FLOOR_S:g} seconds, got "
                                            f"{opts.hang_floor_s:g}: a shorter bound would "
                                            "end healthy runs between two beats")
    if not hangwatch.MIN_FACTOR <= opts.hang_factor < math.inf:
        raise ConfigError("--hang-factor", f"must be at least {hangwatch.MIN_FACTOR:g}, got "
                                           f"{opts.hang_factor:g}: the bound must exceed the "
                                           "steps it judges")
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


def check_hf_data(opts: TrainOptions) -> None:
    """A Hugging Face model's data flags: a tokenized dataset, whose rows set the length."""
    if opts.dataset in (None, "stdlib"):
        raise ConfigError("--dataset", "a Hugging Face model trains on a dataset tokenized "
                                       "with its tokenizer: python -m workloads.data "
                                       "--tokenizer <model folder> --output <folder>, then "
                                       "--dataset <folder>")
    if opts.seq_len:
        raise ConfigError("--seq-len", "comes from the dataset for Hugging Face models "
                                       "(workloads.data --max-length)")


def gpt_config(opts: TrainOptions) -> GPTConfig:
    """The kit's GPT of --model and --seq-len, checked against the built-in corpus."""
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
