"""Fallback AZs (rayfleet:workerFallbackAzs) in the Pulumi program under mocks: each fallback
AZ gets a private subnet, its own cluster placement group and per worker type a spot and an
on-demand template whose EFA interfaces are in that AZ's subnet and whose placement is that
AZ's group; the stack output lists them type-major (p4d in every AZ, then p4de), render and
the scorer follow that order; every security rule holds, and rule 32 catches a fallback
template aimed at another AZ's subnet or group.
"""

from __future__ import annotations

import json

import pulumi
import pytest

from infra.policy_pack import checks as policy
from rayfleet import stack as contract
from rayfleet.agents import fallover
from rayfleet.commands import render
from rayfleet.facts import TAG_AVAILABILITY_ZONE

from .conftest import dev_config
from .harness import Built, run_program
from .test_policy import check, edit

pytestmark = pytest.mark.unit

D = "rayfleet-dev"
# The dev stack puts its workers in us-east-1b and its three subnets in 1b, 1a, 1c; us-east-1d
# is an AZ it would not use, so the fallback takes a subnet's place as a reservation's AZ does.
FALLBACK = "us-east-1d"
SPOT_LT = f"{D}-nodes-worker-p4d-24xlarge-spot-{FALLBACK}"
ONDEMAND_LT = f"{D}-nodes-worker-p4de-24xlarge-ondemand-{FALLBACK}"
GROUP = f"{D}-nodes-workers-{FALLBACK}"


def fallback_config() -> dict:
    """The dev stack (p4d then p4de, workers in us-east-1b) with one fallback AZ."""
    return {**dev_config(), "rayfleet:workerFallbackAzs": [FALLBACK]}


@pytest.fixture(scope="module")
def fallback() -> Built:
    return run_program(fallback_config(), stack="fallback")


def subnets(b: Built) -> dict[str, str]:
    out = b.outputs["rayfleet"]
    return dict(zip(out["availability_zones"], out["private_subnet_ids"], strict=True))


def test_the_fallback_az_gets_a_private_subnet_moving_one_other(fallback):
    # The workers' AZ first as ever; us-east-1d takes the place of the last AZ nothing needs.
    assert fallback.outputs["rayfleet"]["availability_zones"] == \
        ["us-east-1b", "us-east-1a", FALLBACK]


def test_each_fallback_az_has_its_group_and_a_template_per_type_and_market(fallback):
    out = fallback.outputs["rayfleet"]
    subnet = subnets(fallback)
    groups = {pg.name: pg for pg in fallback.of_type("aws:ec2/placementGroup:PlacementGroup")}
    assert set(groups) == {f"{D}-nodes-workers", GROUP}
    assert groups[GROUP].inputs["strategy"] == "cluster"
    assert groups[GROUP].inputs["tags"][TAG_AVAILABILITY_ZONE] == FALLBACK
    assert groups[f"{D}-nodes-workers"].inputs["tags"][TAG_AVAILABILITY_ZONE] == "us-east-1b"
    group_name = {az: groups[n].outputs.get("name", groups[n].inputs.get("name"))
                  for az, n in (("us-east-1b", f"{D}-nodes-workers"), (FALLBACK, GROUP))}
    assert group_name["us-east-1b"] == out["placement_group"]
    for t in ("p4d.24xlarge", "p4de.24xlarge"):
        for market in ("spot", "ondemand"):
            for az in ("us-east-1b", FALLBACK):
                suffix = "" if az == "us-east-1b" else f"-{az}"
                lt = fallback.named(f"{D}-nodes-worker-{t.replace('.', '-')}-{market}{suffix}")
                nics = lt.inputs["networkInterfaces"]
                assert len(nics) == 4 and all(n["subnetId"] == subnet[az]
                                              and n["interfaceType"] == "efa" for n in nics), lt
                assert lt.inputs["placement"]["groupName"] == group_name[az], lt.name
                assert lt.inputs["tags"][TAG_AVAILABILITY_ZONE] == az
                assert ("instanceMarketOptions" in lt.inputs) == (market == "spot")
                # As every template: IMDSv2, encrypted root, no stopped leftovers.
                assert lt.inputs["metadataOptions"]["httpTokens"] == "required"
                assert lt.inputs["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
                assert lt.inputs["instanceInitiatedShutdownBehavior"] == "terminate"
                if suffix:
                    assert f"fallback AZ {az}" in lt.inputs["description"]
    assert len(fallback.of_type(policy.LAUNCH_TEMPLATE)) == 1 + 2 * 2 * 2


def test_the_output_lists_each_type_in_every_az_before_the_next_type(fallback):
    out = fallback.outputs["rayfleet"]
    workers = out["node_types"]["workers"]
    # The order of preference render keeps and the autoscaler's scorer follows: type-major.
    assert [(w["instance_type"], w["market"], w["availability_zone"], w["min_workers"],
             w["max_workers"]) for w in workers] == [
        ("p4d.24xlarge", "spot", "us-east-1b", 0, 1),
        ("p4d.24xlarge", "ondemand", "us-east-1b", 0, 1),
        ("p4d.24xlarge", "spot", FALLBACK, 0, 1),
        ("p4d.24xlarge", "ondemand", FALLBACK, 0, 1),
        ("p4de.24xlarge", "spot", "us-east-1b", 0, 1),
        ("p4de.24xlarge", "ondemand", "us-east-1b", 0, 1),
        ("p4de.24xlarge", "spot", FALLBACK, 0, 1),
        ("p4de.24xlarge", "ondemand", FALLBACK, 0, 1)]
    assert workers[2]["launch_template"]["id"] == fallback.named(SPOT_LT).outputs["id"]
    assert workers[7]["launch_template"]["id"] == fallback.named(ONDEMAND_LT).outputs["id"]
    parsed = contract.parse(json.dumps(fallback.outputs))
    assert parsed.to_dict() == out
    names = [
        "ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
        f"ray.worker.p4d.24xlarge.spot.{FALLBACK}", f"ray.worker.p4d.24xlarge.ondemand.{FALLBACK}",
        "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand",
        f"ray.worker.p4de.24xlarge.spot.{FALLBACK}",
        f"ray.worker.p4de.24xlarge.ondemand.{FALLBACK}"]
    assert [w.ray_name for w in parsed.node_types.workers] == names
    # render writes them in that order, and the scorer's order is the same.
    cfg = render.plain(render.build_config(parsed, "t"))
    assert [n for n in cfg["available_node_types"] if n != "ray.head.default"] == names
    assert f"{fallover.ORDER_ENV}={','.join(names)} " in cfg["head_start_ray_commands"][1]
    nc = cfg["available_node_types"][names[2]]["node_config"]
    assert nc["LaunchTemplate"]["LaunchTemplateId"] == workers[2]["launch_template"]["id"]
    assert "SubnetIds" not in nc and "SecurityGroupIds" not in nc   # the template's


@pytest.mark.parametrize("rule", sorted(policy.CHECKS), ids=lambda n: f"rule-{n}")
def test_every_rule_holds_on_the_fallback_stack(rule, fallback):
    values = fallback_config()
    violations = check(fallback.resources, [rule],
                       operator_cidrs=values["rayfleet:operatorCidrs"])
    assert not violations, "\n".join(map(str, violations))


def _workers_az(b: Built, what: str) -> str:
    """The workers' AZ's private subnet id, or its placement group's name."""
    if what == "subnet":
        return subnets(b)["us-east-1b"]
    (pg,) = [r for r in b.of_type("aws:ec2/placementGroup:PlacementGroup")
             if r.name == f"{D}-nodes-workers"]
    return pg.outputs.get("name", pg.inputs.get("name"))


MUTATIONS = {
    "fallback spot template's interfaces in the workers' AZ's subnet": (lambda b: edit(
        b, SPOT_LT, lambda i: [n.update(subnetId=_workers_az(b, "subnet"))
                               for n in i["networkInterfaces"]]), SPOT_LT,
        f"in a subnet of us-east-1b but was built for {FALLBACK}"),
    "fallback on-demand template placed in the workers' AZ's group": (lambda b: edit(
        b, ONDEMAND_LT, lambda i: i.update(placement={"groupName": _workers_az(b, "group")})),
        ONDEMAND_LT, f"was built for {FALLBACK} but its placement group is the one of "
                     "us-east-1b"),
    "fallback template with no placement group": (lambda b: edit(
        b, SPOT_LT, lambda i: i.pop("placement")), SPOT_LT, "names no placement group"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_rule_32_catches_a_fallback_template_aimed_at_another_az(mutation, fallback):
    mutate, offender, words = MUTATIONS[mutation]
    resources, _ = mutate(fallback)
    violations = [str(v) for v in check(resources, [32])]
    assert any(f"'{offender}'" in v and words in v for v in violations), violations
    assert all(v.startswith("rule 32 (rayfleet): ") for v in violations)


def test_a_fallback_az_the_region_lacks_or_the_workers_own_or_too_many_stop_first():
    """Each one line under `pulumi up`, before any AWS resource."""
    cases = [
        ({"rayfleet:workerFallbackAzs": ["us-east-1f"]}, 5,
         "rayfleet:workerFallbackAzs: lists us-east-1f, not an available AZ of us-east-1"),
        # An empty workerAz becomes the first available AZ only here.
        ({"rayfleet:workerAz": "", "rayfleet:workerFallbackAzs": ["us-east-1a"]}, 6,
         "rayfleet:workerFallbackAzs: lists us-east-1a, the workers' own AZ"),
        ({"rayfleet:workerFallbackAzs": ["us-east-1d", "us-east-1e", "us-east-1f"]}, 6,
         "rayfleet:azCount: is 3 but the workers' AZ and their fallback AZs need 4"),
    ]
    for extra, zones, message in cases:
        with pytest.raises(pulumi.RunError, match=message) as info:
            run_program({**dev_config(), **extra}, zones=zones)
        assert "\n" not in str(info.value).strip()
        assert [r for r in info.value.registrations if r["type"].startswith("aws:")] == []
