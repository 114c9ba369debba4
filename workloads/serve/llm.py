"""`llm`: vLLM behind Ray Serve (`ray.serve.llm`), with the kit's checks where Serve builds the
app, so what would otherwise fail late or never fails at once with one line in `serve status`:

- vLLM cannot be imported where Serve imports the app. Serve's controller builds every app in
  a `num_cpus=0` task it submits itself (`build_serve_application` in
  ray/serve/_private/application_state.py), which runs on the controller's node, the head; so
  the head needs vLLM as much as the replicas' nodes do (`rayfleet render` installs it there).
- A replica the cluster cannot place: Ray would keep its placement group pending forever.
- A model folder vLLM cannot load (unknown architecture; on CPU, an unsupported head size).

Two shapes, by the args' `api` (llm_config.py checks it):

- `vllm` (what the kit generates): the engine's replica is the app's ingress and serves vLLM's
  own OpenAI server (llm_server.py). One model per app.
- `ray`, or no `api` (Ray's own args, as `build_openai_app` takes them): Ray Serve LLM's
  OpenAI ingress deployment in front of one engine deployment per model: several models in
  one app, and Ray's stream batching; a handle call per streamed chunk between the two
  (BENCHMARKS.md section 6 measures what that costs).

The config comes from `python -m workloads.serve.llm_config` (cluster-configs/serve/llm.yaml):

    serve deploy cluster-configs/generated/serve-llm.yaml   # after rayfleet serve-config
"""

import socket

from rayfleet.errors import RayfleetError
from workloads.serve.app_args import builder_errors
# check_args is also what `rayfleet serve-config` calls on this app's args before a deploy.
from workloads.serve.llm_config import check_args
from workloads.serve.llm_placement import cluster_nodes

# By name: that module imports ray.serve.llm's internals, which need vLLM.
INGRESS = "workloads.serve.llm_ingress:OpenAIErrorsIngress"


@builder_errors("llm")
def app_builder(args: dict):
    """Serve config entry point (`import_path: workloads.serve.llm:app_builder`)."""
    try:
        from ray.serve.llm import build_openai_app
    except ImportError as e:
        raise RayfleetError(
            f"vLLM cannot be imported on {socket.gethostname()}, the node where Serve builds "
            f"apps (the head) ({str(e).splitlines()[0]}); install the kit's `llm` extra there "
            "(GPU clusters: rayfleet render does; CPU: `llm-cpu`)") from None
    nodes, where = cluster_nodes()
    checked = check_args(args, nodes, where)
    if checked.pop("api", None) == "vllm":
        return engine_app(checked["llm_configs"][0])
    # OpenAI's error body for an unknown model too (llm_ingress.py), unless the config
    # chose its own ingress.
    checked.setdefault("ingress_cls_config", {"ingress_cls": INGRESS})
    return build_openai_app(checked)


def engine_app(config: dict):
    """The one engine deployment, its replica the ingress (Ray's direct streaming builder,
    without the Lua request router Ray attaches to it)."""
    from ray.llm._internal.serve.core.ingress.builder import \
        _build_direct_streaming_llm_deployment
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig

    from workloads.serve.llm_server import EngineIngress

    # Serve's default request router: behind HAProxy (the kit's ingress) Serve refuses any
    # other on an ingress deployment, and Ray's builder would pick its RoundRobinRouter.
    return _build_direct_streaming_llm_deployment(
        LLMConfig.model_validate(config), deployment_cls=EngineIngress,
        override_serve_options={"request_router_config": RequestRouterConfig()})
