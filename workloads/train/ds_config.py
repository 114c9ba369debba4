"""The DeepSpeed config a run uses: the kit's defaults from the training flags, with a user's
`--deepspeed-config` (the dict Ray's and DeepSpeed's guides pass to `deepspeed.initialize`)
merged over them, checked on the driver before any worker starts. DeepSpeed itself ignores a
top-level key it does not know, so a typo ("zero_optimisation") would silently train without
ZeRO; here it is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rayfleet.errors import ConfigError, did_you_mean

FLAG = "--deepspeed-config"
TOP_LEVEL = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "flops_profiler", "comms_logger", "autotuning",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "tensorboard", "wandb", "csv_monitor", "aio", "data_types", "communication_data_type",
    "seq_parallel_communication_data_type", "checkpoint", "data_efficiency",
    "curriculum_learning", "compression_training", "elasticity", "disable_allgather",
    "pipeline", "timers", "compile", "gradient_allreduce_op", "graph_harvesting",
    "use_data_before_expert_parallelism", "load_universal_checkpoint", "dataloader_drop_last",
})
# Set by the kit's flags; a config may repeat them as "auto" or with the same value.
OWNED = {"train_micro_batch_size_per_gpu": ("batch_size", "--batch-size"),
         "gradient_accumulation_steps": ("grad_accum", "--grad-accum"),
         "gradient_clipping": ("grad_clip", None)}


def defaults(*, batch_size: int, grad_accum: int, grad_clip: float, zero_stage: int,
             offload: bool, offload_params: bool, cuda: bool) -> dict:
    zero: dict = {"stage": zero_stage}
    if zero_stage == 3:
        # Communication overlapped with compute, gradients in one contiguous buffer (what the
        # ZeRO-3 guides set for A100s).
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        # bf16 only where the hardware has it; the CPU accelerator trains in fp32.
        "bf16": {"enabled": cuda},
        # A torch AdamW with ZeRO-Offload: DeepSpeedCPUAdam needs a compiled op.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }


def merge(base: dict, user: dict) -> dict:
    out = dict(base)
    for key, value in user.items():
        if value == "auto":
            continue  # the kit's value (Hugging Face Trainer's convention)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load(spec: str | None) -> dict:
    """`--deepspeed-config`: a JSON file or an inline JSON object."""
    if not spec:
        return {}
    text = spec
    if not spec.lstrip().startswith("{"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(FLAG, f"{spec} is neither a JSON file nor an inline JSON object")
        text = path.read_text()
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(FLAG, f"not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(value, dict):
        raise ConfigError(FLAG, f"must be a JSON object, got a {type(value).__name__}")
    return value


def check(user: dict, flags: dict) -> None:
    """One line for what DeepSpeed would ignore or reject later in every worker: an unknown
    key (top level, or inside zero_optimization by DeepSpeed's own schema), or a batch
    setting that contradicts the kit's flags."""
    for key in user:
        if key not in TOP_LEVEL:
            raise ConfigError(FLAG, f"unknown DeepSpeed key {key!r}{did_you_mean(key, TOP_LEVEL)}")
    for key, (field, flag) in OWNED.items():
        value = user.get(key, "auto")
        if value != "auto" and value != flags[field]:
            where = f"set it with {flag}" if flag else "the kit clips gradients at 1.0"
            raise ConfigError(FLAG, f"{key} {value!r} differs from the run's {flags[field]!r}; "
                                    f"{where} or write \"auto\"")
    if "train_batch_size" in user and user["train_batch_size"] != "auto":
        raise ConfigError(FLAG, "train_batch_size is --batch-size x --grad-accum x "
                                "--num-workers; write \"auto\" or leave it out")
    zero = user.get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, dict):
        raise ConfigError(FLAG, "zero_optimization must be an object")
    if not _has_cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # said, not guessed (no GPU warning)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise ConfigError(FLAG, f"zero_optimization.{where}: {err.get('msg')}") from None


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
