"""Fallback AZs (rayfleet:workerFallbackAzs) on moto: infra/ builds each fallback AZ's launch
templates in moto, in that AZ's private subnet and placement group; the rendered YAML lints
clean, preflights, costs without counting a worker twice, and Ray's own bootstrap and AWS node
provider launch a fallback node type's worker in the fallback AZ's subnet. A type the
fallback AZ does not offer fails preflight's offering check in one line.

moto 5.2.5 offers p4d.24xlarge in us-east-1a-d and p4de.24xlarge in us-east-1b and 1c only
(DescribeInstanceTypeOfferings), and has no CreatePlacementGroup: tests/moto/pulumi_moto.py
stands a name in for each group, which RunInstances accepts without looking it up.
"""

from __future__ import annotations


import pytest

from rayfleet.commands import cli, cost, lint, render

pytestmark = pytest.mark.moto

# Pulumi.dev.yaml puts the workers in us-east-1b and its subnets in us-east-1b, 1a, 1c.
FALLBACK = "us-east-1c"
NAMES = ["ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
         f"ray.worker.p4d.24xlarge.spot.{FALLBACK}",
         f"ray.worker.p4d.24xlarge.ondemand.{FALLBACK}",
         "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand",
         f"ray.worker.p4de.24xlarge.spot.{FALLBACK}",
         f"ray.worker.p4de.24xlarge.ondemand.{FALLBACK}"]


def test_the_program_builds_fallback_templates_ray_launches_from(moto_account, tmp_path,
                                                                 capsys):
    from .pulumi_moto import build_stack, launch_worker, ray_launch_config

    stack = build_stack(moto_account, tmp_path, {"rayfleet:workerFallbackAzs": [FALLBACK]})
    o = stack.outputs
    ec2 = moto_account.client("ec2")
    subnet = dict(zip(o["availability_zones"], o["private_subnet_ids"], strict=True))
    assert o["availability_zones"] == ["us-east-1b", "us-east-1a", FALLBACK]
    fallbacks = [w for w in o["node_types"]["workers"] if w["availability_zone"] == FALLBACK]
    assert [(w["instance_type"], w["market"]) for w in fallbacks] == [
        ("p4d.24xlarge", "spot"), ("p4d.24xlarge", "ondemand"),
        ("p4de.24xlarge", "spot"), ("p4de.24xlarge", "ondemand")]
    # Each fallback template exists in moto, its interfaces in the fallback AZ's subnet and
    # its placement another group than the workers' AZ's.
    for w in fallbacks:
        (version,) = ec2.describe_launch_template_versions(
            LaunchTemplateId=w["launch_template"]["id"], Versions=["$Default"],
        )["LaunchTemplateVersions"]
        data = version["LaunchTemplateData"]
        assert {n["SubnetId"] for n in data["NetworkInterfaces"]} == {subnet[FALLBACK]}
        assert data["Placement"]["GroupName"] not in ("", o["placement_group"])
        assert data["MetadataOptions"]["HttpTokens"] == "required"
        assert ("InstanceMarketOptions" in data) == (w["market"] == "spot")

    rendered = render.render(str(stack.path), out=str(tmp_path / "c.yaml"),
                             token_file=str(tmp_path / "token"))
    assert lint.lint_file(str(rendered)) == []
    cfg = ray_launch_config(rendered)
    assert [n for n in cfg["available_node_types"] if n != "ray.head.default"] == NAMES
    assert cli.main(["preflight", str(rendered), "--num-gpus", "8"]) == 0, \
        capsys.readouterr().out
    out = capsys.readouterr().out
    assert any(ln.startswith("PASS") and "p4de.24xlarge offered" in ln
               and f"in us-east-1b, {FALLBACK}" in ln for ln in out.splitlines()), out

    # Ray's own node provider launches the fallback node type's worker in the fallback AZ.
    i = launch_worker(cfg, f"ray.worker.p4d.24xlarge.spot.{FALLBACK}", ec2)
    tags = {t["Key"]: t["Value"] for t in i["Tags"]}
    assert tags["aws:ec2launchtemplate:id"] == fallbacks[0]["launch_template"]["id"]
    assert i["SubnetId"] == subnet[FALLBACK]
    assert i["Placement"]["AvailabilityZone"] == FALLBACK

    # cost: the fallback node types are priced as their type and market, and the ceiling
    # still holds max_workers workers (the dearest first), never one per node type.
    e = cost.estimate(cfg)
    rows = {r["node_type"]: r for r in e["rows"]}
    for here, there in ((0, 2), (1, 3), (4, 6), (5, 7)):    # the same type and market
        assert (rows[NAMES[there]]["market"], rows[NAMES[there]]["price"]) == \
            (rows[NAMES[here]]["market"], rows[NAMES[here]]["price"]), NAMES[there]
    head = rows["ray.head.default"]["price"]
    od = rows[NAMES[1]]["on_demand_price"]
    assert e["max_workers"] == o["max_workers"] == 2
    # onDemandWorkers bounds each on-demand node type: one in us-east-1b and one in 1c.
    assert e["by_type"]["p4d.24xlarge"]["max"] == pytest.approx(head + 2 * od, abs=0.01)


def test_a_type_the_fallback_az_does_not_offer_fails_preflight_in_one_line(moto_account,
                                                                          tmp_path, capsys):
    from .pulumi_moto import build_stack

    # moto offers p4de.24xlarge in us-east-1b and 1c only.
    stack = build_stack(moto_account, tmp_path, {"rayfleet:workerFallbackAzs": ["us-east-1a"]})
    rendered = render.render(str(stack.path), out=str(tmp_path / "c.yaml"),
                             token_file=str(tmp_path / "token"))
    assert cli.main(["preflight", str(rendered)]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert "p4de.24xlarge offered" in line and "not in us-east-1a" in line, line
    assert "rayfleet:workerFallbackAzs" in line, line
    assert any(ln.startswith("PASS") and "p4d.24xlarge offered" in ln
               and "us-east-1a, us-east-1b" in ln for ln in out.splitlines()), out
