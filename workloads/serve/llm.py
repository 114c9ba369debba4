"""`llm`: vLLM behind Ray Serve's OpenAI-compatible API (`ray.serve.llm.build_openai_app`),
with the kit's checks where Serve builds the app, so what would otherwise fail late or never
fails at once with one line in `serve status`:

- vLLM cannot be imported where Serve imports the app. Serve's controller builds every app in
  a `num_cpus=0` task it submits itself (`build_serve_application` in
  ray/serve/_private/application_state.py), which runs on the controller's node, the head; so
  the head needs vLLM as much as the replicas' nodes do (`rayfleet render` installs it there).
- A replica the cluster cannot place: Ray would keep its placement group pending forever.
- A model folder vLLM cannot load (unknown architecture; on CPU, an unsupported head size).

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
    # OpenAI's error body for an unknown model too (llm_ingress.py), unless the config
    # chose its own ingress.
    checked.setdefault("ingress_cls_config", {"ingress_cls": INGRESS})
    return build_openai_app(checked)
