"""The stack-output contract (rayfleet/stack.py): the example output is exactly its shape,
outputs of older stacks still render, and render trusts the node types the stack declares."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from rayfleet import stack
from rayfleet.commands import cli, render

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "cluster-configs" / "examples" / "dev-outputs.json"


@pytest.fixture
def outputs() -> dict:
    return json.loads(EXAMPLE.read_text())


def test_the_example_is_exactly_the_contract(outputs):
    assert stack.parse(json.dumps(outputs)).to_dict() == outputs["rayfleet"]


def test_the_schema_version_is_defined_once():
    found = [str(p.relative_to(REPO)) for folder in ("rayfleet", "infra", "workloads")
             for p in (REPO / folder).rglob("*.py")
             if re.search(r"^SCHEMA_VERSION\s*=", p.read_text(), re.M)]
    assert found == ["rayfleet/stack.py"]


def test_an_older_stacks_extra_keys_are_ignored(outputs, tmp_path):
    old = copy.deepcopy(outputs)
    o = old["rayfleet"]
    o["bucket_key_prefix"] = "rayfleet/"
    o["instance_profiles"]["head"]["name"] = "rayfleet-dev-head"
    o["node_types"]["worker_spot"].update(memory_gib=1152, gpu_memory_gib=40, market="spot")
    texts = [render.render_text(stack.parse(json.dumps(d)), "t") for d in (outputs, old)]
    assert texts[0] == texts[1]


def test_render_trusts_the_stacks_node_types(outputs):
    # A stack deployed when the catalog said otherwise: render declares what was deployed.
    outputs["rayfleet"]["node_types"]["worker_spot"].update(vcpus=48, gpus=4)
    outputs["rayfleet"]["node_types"]["head"]["vcpus"] = 6
    cfg = render.plain(render.build_config(stack.parse(json.dumps(outputs)), "t"))
    types = cfg["available_node_types"]
    assert types["ray.worker.a100.spot"]["resources"]["CPU"] == 48
    assert types["ray.worker.a100.spot"]["resources"]["GPU"] == 4
    assert types["ray.worker.a100.ondemand"]["resources"]["CPU"] == 96
    assert types["ray.head.default"]["resources"]["CPU"] == 6


@pytest.mark.parametrize("mutate,expected", [
    (lambda o: o["node_types"]["worker_spot"].update(vcpus="96"),
     "node_types.worker_spot.vcpus: must be a whole number >= 1"),
    (lambda o: o["node_types"]["worker_ondemand"].update(gpus=0),
     "node_types.worker_ondemand.gpus: must be a whole number >= 1"),
    (lambda o: o["node_types"]["head"].pop("vcpus"), "lacks node_types.head.vcpus"),
    (lambda o: o["node_types"]["worker_spot"].update(efa_interfaces=-1),
     "node_types.worker_spot.efa_interfaces"),
])
def test_bad_node_types_are_one_line_exit_2(mutate, expected, outputs, tmp_path, capsys):
    mutate(outputs["rayfleet"])
    src = tmp_path / "o.json"
    src.write_text(json.dumps(outputs))
    assert cli.main(["render", str(src), "-o", str(tmp_path / "x.yaml"),
                     "--token-file", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.yaml").exists()


def test_rendered_example_still_loads_as_ray_sees_it(outputs):
    text = render.render_text(stack.parse(json.dumps(outputs)), "t")
    assert yaml.safe_load(text)["cluster_name"] == "rayfleet-dev"


def test_the_docstring_and_the_required_keys_follow_the_dataclass(outputs):
    """The contract is written once: its docstring names every field, and every key render
    requires is a field."""
    exported = stack.parse(json.dumps(outputs)).to_dict()

    def keys(d: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k != "ray_ports":
                out |= keys(v, f"{prefix}{k}.")
        return out

    every = keys(exported)
    assert set(stack.REQUIRED_KEYS) <= every
    for key in every:
        assert re.search(rf"\b{key.rsplit('.', 1)[-1]}\b", stack.__doc__), key
