"""The `llm` app's builder (workloads/serve/llm.py) on generated configs, without a cluster:
`api: vllm` builds the engine's deployment as the app's ingress (the kit's EngineIngress,
Serve's default request router, not Ray's RoundRobinRouter, which HAProxy refuses there);
`api: ray` builds Ray's OpenAI ingress (the kit's error bodies) in front of the engine's.
Deployed for real: api vllm by the fake-cloud rehearsal (LoRA, errors, streaming:
tests/fakecloud/llm_checks.py) and docs/workloads.md's Hugging Face line; both shapes side by
side by bench.llm_serve."""

from __future__ import annotations

import types
from unittest import mock

import yaml

from workloads.serve import llm, llm_config

NODES = ([{"CPU": 8.0, "memory": 16e9}], "a test cluster")


def _built(tmp_path, hf_model_dir, *flags: str):
    out = tmp_path / "llm.yaml"
    assert llm_config.main(["--device", "cpu", "--model-id", "m", "--model-source",
                            str(hf_model_dir), "--max-model-len", "128", *flags,
                            "--output", str(out)]) == 0
    args = yaml.safe_load(out.read_text())["applications"][0]["args"]
    # What Serve's build task runs with (Ray's builder reads it): the app's runtime_env.
    context = types.SimpleNamespace(runtime_env={})
    with mock.patch.object(llm, "cluster_nodes", return_value=NODES), \
            mock.patch("ray.get_runtime_context", return_value=context):
        return llm.app_builder(args)


def test_api_vllm_builds_the_engine_as_the_ingress(tmp_path, hf_model_dir):
    from ray.serve.config import RequestRouterConfig

    from workloads.serve.llm_server import EngineIngress

    d = _built(tmp_path, hf_model_dir)._bound_deployment
    assert d.name == "EngineIngress:m" and issubclass(d.func_or_class, EngineIngress)
    router = d._deployment_config.request_router_config.request_router_class
    assert router == RequestRouterConfig().request_router_class and "RoundRobin" not in router


def test_api_ray_builds_rays_openai_ingress_with_the_kits_errors(tmp_path, hf_model_dir):
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    from workloads.serve.llm_ingress import OpenAIErrorsIngress
    from workloads.serve.llm_server import EngineIngress

    app = _built(tmp_path, hf_model_dir, "--api", "ray", "--stream-batching-ms", "10")
    ingress = app._bound_deployment
    assert issubclass(ingress.func_or_class, OpenAIErrorsIngress)
    (engine,) = ingress.init_kwargs["llm_deployments"].values()
    cls = engine._bound_deployment.func_or_class
    assert issubclass(cls, LLMServer) and not issubclass(cls, EngineIngress)
