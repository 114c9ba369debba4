"""The stack-output contract (rayfleet/stack.py): the example output is exactly its shape,
an older schema is refused in one line, and render trusts the node types the stack
declares."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from rayfleet import stack
from rayfleet.commands import cli, render
from rayfleet.errors import RayfleetError
from tests.fallback_azs import fallback_names, with_fallback_az

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
    o["node_types"]["workers"][0].update(memory_gib=1152, gpu_memory_gib=40)
    texts = [render.render_text(stack.parse(json.dumps(d)), "t") for d in (outputs, old)]
    assert texts[0] == texts[1]


def test_render_trusts_the_stacks_node_types(outputs):
    # A stack deployed when the catalog said otherwise: render declares what was deployed.
    outputs["rayfleet"]["node_types"]["workers"][0].update(vcpus=48, gpus=4)
    outputs["rayfleet"]["node_types"]["head"]["vcpus"] = 6
    cfg = render.plain(render.build_config(stack.parse(json.dumps(outputs)), "t"))
    types = cfg["available_node_types"]
    assert types["ray.worker.p4d.24xlarge.spot"]["resources"]["CPU"] == 48
    assert types["ray.worker.p4d.24xlarge.spot"]["resources"]["GPU"] == 4
    assert types["ray.worker.p4d.24xlarge.ondemand"]["resources"]["CPU"] == 96
    assert types["ray.head.default"]["resources"]["CPU"] == 6


@pytest.mark.parametrize("mutate,expected", [
    (lambda o: o["node_types"]["workers"][0].update(vcpus="96"),
     "node_types.workers[0].vcpus: must be a whole number >= 1"),
    (lambda o: o["node_types"]["workers"][1].update(gpus=0),
     "node_types.workers[1].gpus: must be a whole number >= 1"),
    (lambda o: o["node_types"]["head"].pop("vcpus"), "lacks node_types.head.vcpus"),
    (lambda o: o["node_types"]["workers"][0].update(efa_interfaces=-1),
     "node_types.workers[0].efa_interfaces"),
    (lambda o: o["node_types"]["workers"][2].pop("launch_template"),
     "lacks node_types.workers[2].launch_template.id"),
    (lambda o: o["node_types"]["workers"][3].update(market="dedicated"),
     "node_types.workers[3].market: 'dedicated' is not a market; allowed: block, reserved, "
     "spot, ondemand"),
    # Reserved capacity: a block or reserved node type names its AZ, subnet and one target.
    (lambda o: o["node_types"]["workers"][3].update(market="reserved"),
     "node_types.workers[3].capacity_reservation: must name the reserved node type's "
     "availability_zone and subnet_id"),
    (lambda o: o["node_types"]["workers"][0].update(market="block", capacity_reservation={
        "availability_zone": "us-east-1b", "subnet_id": "subnet-1",
        "resource_group_arn": "arn:aws:resource-groups:us-east-1:123456789012:group/g"}),
     "node_types.workers[0].capacity_reservation: a Capacity Block is launched into by its id"),
    (lambda o: o["node_types"]["workers"][0].update(capacity_reservation={
        "availability_zone": "us-east-1b", "subnet_id": "subnet-1", "id": "cr-1"}),
     "node_types.workers[0].capacity_reservation: is set on a spot node type"),
    (lambda o: o["node_types"]["workers"].append(dict(o["node_types"]["workers"][0])),
     "node_types.workers[4]: p4d.24xlarge spot appears twice"),
    # Fallback AZs: an entry's AZ is one of the stack's, and (type, market, AZ) is unique.
    (lambda o: o["node_types"]["workers"][0].update(availability_zone="us-east-1f"),
     "node_types.workers[0].availability_zone: 'us-east-1f' is not one of the stack's "
     "availability_zones"),
    (lambda o: o["node_types"]["workers"].extend(
        [dict(o["node_types"]["workers"][0], availability_zone="us-east-1c")] * 2),
     "node_types.workers[5]: p4d.24xlarge spot in us-east-1c appears twice"),
    (lambda o: o["node_types"].update(workers=[]), "lacks node_types.workers"),
    (lambda o: o.pop("max_workers"), "lacks max_workers"),
    (lambda o: o.update(vllm="rocm"), "vllm: 'rocm' is not a vLLM build (rayfleet:vllm); "
     "allowed: cuda, cpu, none"),
    # A schema-1 output (one worker type, two markets): refused in one line, what to do.
    (lambda o: o.update(schema_version=1), "schema_version 1 is older than 2"),
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


def test_the_doc_page_and_the_required_keys_follow_the_dataclass(outputs):
    """The contract is written once: docs/node-types.md's stack-output section names every
    field, and every key render requires is a field."""
    exported = stack.parse(json.dumps(outputs)).to_dict()
    page = (REPO / "docs" / "node-types.md").read_text()
    section = re.search(r"^## The stack output\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    assert section, "docs/node-types.md lost its '## The stack output' section"

    def keys(d: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k != "ray_ports":
                out |= keys(v, f"{prefix}{k}.")
        return out

    every = keys(exported) | keys(exported["node_types"]["workers"][0], "node_types.workers.")
    assert set(stack.REQUIRED_KEYS) <= every
    for key in every:
        assert re.search(rf"\b{key.rsplit('.', 1)[-1]}\b", section.group(1)), key


@pytest.mark.parametrize("where,keys", [
    ("", stack.REQUIRED_KEYS), ("node_types.workers.1.", stack.WORKER_KEYS),
    ("head_ha.", stack.HEAD_HA_KEYS)])
def test_each_key_render_reads_is_refused_by_name_when_missing(where, keys, outputs):
    """The keys render requires come from the dataclasses' metadata; parse refuses an output
    without any one of them in one line naming it."""
    outputs["rayfleet"]["head_ha"] = {
        "gcs_store": {"endpoint": "gcs.example", "port": 6380, "auth_secret_arn": "arn:aws:x"},
        "head_address": {"private_ip": "10.42.31.228",
                         "subnet_id": outputs["rayfleet"]["private_subnet_ids"][0]}}
    stack.parse(json.dumps(outputs))
    named = where.replace(".1.", "[1].")
    for key in set(keys) - {"schema_version"}:   # an output without it is refused before
        o = copy.deepcopy(outputs["rayfleet"])
        *path, last = (where + key).split(".")
        d = o
        for part in path:
            d = d[int(part)] if part.isdigit() else d[part]
        del d[last]
        with pytest.raises(RayfleetError,
                           match=rf"^o: stack output `rayfleet` lacks {re.escape(named + key)};"):
            stack.parse(json.dumps(o), "o")


def fallback_outputs(outputs: dict) -> dict:
    """The example output as a stack with fallback AZ us-east-1c exports it."""
    return {"rayfleet": with_fallback_az(outputs["rayfleet"])}


def test_a_fallback_entry_names_its_node_type_after_its_az(outputs):
    parsed = stack.parse(json.dumps(fallback_outputs(outputs)))
    assert [w.ray_name for w in parsed.node_types.workers] == [
        "ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
        "ray.worker.p4d.24xlarge.spot.us-east-1c", "ray.worker.p4d.24xlarge.ondemand.us-east-1c",
        "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand",
        "ray.worker.p4de.24xlarge.spot.us-east-1c",
        "ray.worker.p4de.24xlarge.ondemand.us-east-1c"] == fallback_names()
    assert parsed.to_dict() == fallback_outputs(outputs)["rayfleet"]
    # The example stack's own output names no AZ per entry (made before fallback AZs): every
    # entry is read as the workers' AZ, under the name it always had.
    assert [w.fallback_az for w in stack.parse(json.dumps(outputs)).node_types.workers] == \
        [None] * 4


def test_an_older_render_refuses_a_fallback_output_rather_than_misread_it(outputs, tmp_path,
                                                                          capsys):
    """Schema 2 was kept (stack.py's docstring says why): a render from before fallback AZs
    ignores availability_zone, so it sees each fallback entry as a repeat of the workers'
    AZ's (type, market), which it refuses in one line; never two node types under one
    name. Dropping the key shows this render what such a render sees."""
    older_view = fallback_outputs(outputs)
    for w in older_view["rayfleet"]["node_types"]["workers"]:
        del w["availability_zone"]
    src = tmp_path / "o.json"
    src.write_text(json.dumps(older_view))
    assert cli.main(["render", str(src), "-o", str(tmp_path / "x.yaml"),
                     "--token-file", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "node_types.workers[2]: p4d.24xlarge spot appears twice" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.yaml").exists()
