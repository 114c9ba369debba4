"""The `llm` app's Serve config (vLLM via ray.serve.llm): generated from options, validated
offline by Serve's deploy schema and Ray's LLMConfig, and checked against the A100 capacity
of a rendered cluster YAML. vLLM itself cannot run here; nothing imports it."""

from __future__ import annotations

import shlex
import sys

import pytest
import yaml

from tests.conftest import REPO
from workloads.serve import llm_config

COMMITTED = REPO / "cluster-configs" / "serve" / "llm.yaml"
CLUSTER = REPO / "cluster-configs" / "aws-a100.example.yaml"


def _generate(tmp_path, *args: str) -> tuple[int, dict | None]:
    out = tmp_path / "llm.yaml"
    rc = llm_config.main([*args, "--output", str(out)])
    return rc, (yaml.safe_load(out.read_text()) if out.exists() else None)


def test_committed_config_is_what_its_recorded_command_generates(tmp_path):
    header = COMMITTED.read_text().splitlines()[1]
    argv = shlex.split(header.split("python -m workloads.serve.llm_config", 1)[1])
    rc, _ = _generate(tmp_path, *argv)
    assert rc == 0
    assert (tmp_path / "llm.yaml").read_text() == COMMITTED.read_text()


def test_generated_config_passes_serves_schema_and_llmconfig(tmp_path):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    rc, cfg = _generate(tmp_path, "--model-id", "m", "--model-source", "s3://b/models/m",
                        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
                        "--max-model-len", "4096", "--cluster-config", str(CLUSTER),
                        "--max-replicas", "1", "--engine-kwarg", "gpu_memory_utilization=0.9")
    assert rc == 0
    ServeDeploySchema.model_validate(cfg)
    app = cfg["applications"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    assert cfg["http_options"]["host"] == "127.0.0.1"     # rule 22: no public listener
    llm = LLMConfig(**app["args"]["llm_configs"][0])
    assert llm.engine_kwargs == {"tensor_parallel_size": 8, "pipeline_parallel_size": 2,
                                 "max_model_len": 4096, "gpu_memory_utilization": 0.9}
    assert llm.accelerator_type == "A100"
    # Pipeline stages may spill onto a second node; tensor-parallel ranks never do.
    assert llm.placement_group_config["strategy"] == "PACK"
    assert llm.deployment_config["autoscaling_config"]["max_replicas"] == 1
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("args,expected", [
    (["--tensor-parallel-size", "16"], "--tensor-parallel-size: 16 GPUs but a node has 8"),
    (["--min-replicas", "5"], "--min-replicas: 5 is more than --max-replicas 4"),
    (["--accelerator-type", "A1000"], 'did you mean "A100"'),
    (["--max-model-len", "0"], "--max-model-len: must be at least 1"),
    (["--cluster-config", "cluster-configs/aws-a100.example.yaml", "--tensor-parallel-size",
      "8", "--max-replicas", "3"],
     "need 24 GPUs; cluster-configs/aws-a100.example.yaml has at most 16"),
    (["--cluster-config", "nowhere.yaml"], "nowhere.yaml does not exist"),
    (["--engine-kwarg", "no-equals"], "--engine-kwarg expects KEY=VALUE"),
    (["--tensor-parallel-size", "two"], "invalid int value"),
])
def test_bad_options_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch, args,
                                                    expected):
    monkeypatch.chdir(REPO)
    rc, cfg = _generate(tmp_path, "--model-id", "m", "--model-source", "m", *args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and cfg is None
    assert len(err.splitlines()) == 1 and expected in err, err
