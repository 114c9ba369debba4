"""The Serve config of the `llm` app built from the command's flags (one `LLMConfig` for
`ray.serve.llm`), and validated as Serve and Ray would read it, without vLLM."""

from __future__ import annotations

import sys

import yaml

from rayfleet import catalog
from rayfleet.errors import ConfigError, RayfleetError
from workloads.common.cli import parse_env_pairs
from workloads.serve.llm_lora import check_lora, lora_settings
from workloads.serve.llm_placement import check_placement, gpu_capacity, live_check, node_capacity
from workloads.serve.llm_source import model_source

# Our builder around ray.serve.llm's: one line in `serve status` where vLLM cannot be imported
# or the cluster cannot place a replica (workloads/serve/llm.py).
IMPORT_PATH = "workloads.serve.llm:app_builder"

# How clients reach the engine (workloads/serve/llm.py): vLLM's own server in the engine's
# replica, or Ray's OpenAI ingress deployment in front of it. The first is the default:
# BENCHMARKS.md section 6.
APIS = ("vllm", "ray")
# api ray: Ray 2.60's default (MODEL_RESPONSE_BATCH_TIMEOUT_MS) is 50 ms: a streamed first
# token waits up to that long to be batched with the next (ray issue 59681).
STREAM_BATCHING_MS = 0


def accelerators() -> tuple[str, ...]:
    """The GPUs of the kit's catalog, by Ray accelerator type (`accelerator_type:X`)."""
    return tuple(catalog.data()["gpus"])


def build(args) -> dict:
    """The whole Serve config for the parsed flags; ConfigError on the first that is wrong."""
    _check_flags(args)
    source, note = model_source(args.model_source, args.max_model_len, args.device)
    if note:
        print(f"[rayfleet] note: {note}", file=sys.stderr, flush=True)
    lora = lora_settings(args) if args.lora_path is not None else None
    llm = _llm_config(args, source, _engine_kwargs(args, lora), lora)
    if lora:
        note = check_lora(llm, source)
        if note:
            print(f"[rayfleet] note: {note}", file=sys.stderr, flush=True)
    cpu = args.device == "cpu"
    if cpu and args.cluster_config:
        check_placement([llm], node_capacity(args.cluster_config), args.cluster_config)
    elif cpu:
        live_check(llm)
    return {
        # Loopback: clients come through the SSM/SSH tunnel (rule 22).
        "http_options": {"host": "127.0.0.1", "port": args.port},
        "applications": [{"name": "llm", "route_prefix": "/", "import_path": IMPORT_PATH,
                          "args": {"api": args.api, "llm_configs": [llm]}}],
    }


def _check_flags(args) -> None:
    """The flags argparse cannot check alone, and, on GPU, the GPUs they need."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    # Not an argparse type (at_least) like the other counts: a word given here must keep
    # argparse's own "invalid int value" (tests/unit/test_llm_config.py).
    if tp < 1:
        raise ConfigError("--tensor-parallel-size", "must be at least 1")
    # More than 0, not at least a bound: at_least cannot say it.
    for flag in ("cpus_per_worker", "kv_cache_gib"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}", "must be more than 0")
    if args.stream_batching_ms is not None and args.api != "ray":
        raise ConfigError("--stream-batching-ms", f"batches Ray's OpenAI ingress's stream "
                          f"(--api ray); with --api {args.api}, vLLM's server sends each "
                          "chunk as it comes")
    if args.min_replicas > args.max_replicas:
        raise ConfigError("--min-replicas", f"{args.min_replicas} is more than --max-replicas "
                          f"{args.max_replicas}")
    if args.device == "cpu":
        return
    if args.accelerator_type not in accelerators():
        raise ConfigError("--accelerator-type", "not a GPU type of this kit", accelerators(),
                          args.accelerator_type)
    _check_gpus(args, tp, pp)


def _check_gpus(args, tp: int, pp: int) -> None:
    per_node, total, where = args.gpus_per_node, None, f"--gpus-per-node {args.gpus_per_node}"
    if args.cluster_config:
        per_node, total = gpu_capacity(args.cluster_config)
        where = args.cluster_config
        if per_node == 0:
            raise ConfigError("--cluster-config", f"{where} has no node type with GPU resources")
    if tp > per_node:
        raise ConfigError("--tensor-parallel-size", f"{tp} GPUs but a node has {per_node} "
                          f"({where}): tensor-parallel ranks must share a node; raise "
                          "--pipeline-parallel-size to span nodes instead")
    if total is not None and args.max_replicas * tp * pp > total:
        raise ConfigError("--max-replicas", f"{args.max_replicas} replicas x {tp * pp} GPUs "
                          f"need {args.max_replicas * tp * pp} GPUs; {where} has at most "
                          f"{total}")


def _engine_kwargs(args, lora: dict | None) -> dict:
    """vLLM's engine arguments: parallelism, context, the CPU KV cache, LoRA, then the
    --engine-kwarg ones, which win."""
    engine = {"tensor_parallel_size": args.tensor_parallel_size,
              "pipeline_parallel_size": args.pipeline_parallel_size,
              "max_model_len": args.max_model_len}
    if args.device == "cpu":
        # On CPU, vLLM reserves gpu_memory_utilization (0.92) of the host's RAM unless the KV
        # cache is sized in bytes (vllm/v1/worker/cpu_worker.py), and refuses to start when
        # that much is not free: a shared node never has it.
        engine["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if lora is not None:
        engine.update(enable_lora=True, max_lora_rank=args.max_lora_rank,
                      max_loras=args.max_loras)
    for key, value in parse_env_pairs(args.engine_kwarg, "--engine-kwarg").items():
        engine[key] = yaml.safe_load(value)
    return engine


def _llm_config(args, source: str | dict, engine: dict, lora: dict | None) -> dict:
    """The one LLMConfig mapping of the app (Ray's field order, as the file shows it)."""
    cpu = args.device == "cpu"
    return {
        "model_loading_config": {"model_id": args.model_id, "model_source": source},
        **({} if cpu else {"accelerator_type": args.accelerator_type}),
        "engine_kwargs": engine,
        **({"lora_config": lora} if lora else {}),
        # One bundle per vLLM worker. STRICT_PACK keeps a single-node replica on one node
        # (NVLink); PACK lets pipeline stages spill onto the next node. Ray adds the replica
        # actor's own resources to the first bundle.
        "placement_group_config": {
            "bundle_per_worker": ({"CPU": args.cpus_per_worker} if cpu else {"GPU": 1, "CPU": 1}),
            "strategy": "STRICT_PACK" if args.pipeline_parallel_size == 1 else "PACK"},
        **({"experimental_configs": {"stream_batching_interval_ms": STREAM_BATCHING_MS
                                      if args.stream_batching_ms is None
                                      else args.stream_batching_ms}}
           if args.api == "ray" else {}),
        "deployment_config": {
            **({"ray_actor_options": {"num_cpus": 0}} if cpu else {}),
            "autoscaling_config": {
                "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                "target_ongoing_requests": args.target_ongoing_requests}},
    }


def validate(config: dict) -> None:
    """Serve's deploy schema for the file, Ray's LLMConfig for each model (no vLLM needed)."""
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except Exception as e:  # pydantic's ValidationError, v1 or v2 flavour
        raise ConfigError("serve config", f"rejected by Serve's schema: {_first(e)}") from e
    try:
        from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    except ImportError as e:  # moved in another Ray version: the pin says 2.60.0
        raise RayfleetError(f"cannot import Ray's LLMConfig ({e}); is Ray 2.60.0 installed?") \
            from e
    for app in config["applications"]:
        for llm in app["args"]["llm_configs"]:
            try:
                LLMConfig(**llm)
            except Exception as e:
                raise ConfigError("llm_configs", f"rejected by Ray's LLMConfig: {_first(e)}") \
                    from e


def _first(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[1:3]) if len(lines) > 2 else " ".join(lines)
