"""Reserved capacity (rayfleet:capacityReservations) in the Pulumi program under mocks: one
launch template per reservation that targets exactly it, in its AZ's private subnet; the stack
output lists them first in their type's order; every security rule holds, and rule 31 catches
a template that lost or changed its target, turned spot, or went missing.

moto (tests/moto) cannot show this on instances: it records neither a launch's
CapacityReservationSpecification nor its InstanceMarketOptions beyond "spot" (moto 5.2.5
marks any market type as a spot lifecycle), so the launch templates are where it is checked.
"""

from __future__ import annotations

import json

import pulumi
import pytest

from infra.policy_pack import checks as policy
from rayfleet import stack as contract
from rayfleet.commands import render
from rayfleet.config import StackConfig
from rayfleet.facts import TAG_CAPACITY_RESERVATION

from .conftest import dev_config
from .harness import Built, run_program
from .test_policy import check, drop, edit

pytestmark = pytest.mark.unit

BLOCK = {"instanceType": "p4d.24xlarge", "availabilityZone": "us-east-1d",
         "id": "cr-0fedcba9876543210", "capacityBlock": True}
GROUP = "arn:aws:resource-groups:us-east-1:123456789012:group/p4de-odcrs"
ODCR = {"instanceType": "p4de.24xlarge", "availabilityZone": "us-east-1b",
        "resourceGroupArn": GROUP}
D = "rayfleet-dev"
BLOCK_LT = f"{D}-nodes-worker-p4d-24xlarge-block"
ODCR_LT = f"{D}-nodes-worker-p4de-24xlarge-reserved"


def reserved_config() -> dict:
    """The dev stack (workers in us-east-1b, three AZs) with a p4d Capacity Block in
    us-east-1d, an AZ the dev stack would not use, and the p4de ODCRs of a resource group."""
    return {**dev_config(), "rayfleet:capacityReservations": [BLOCK, ODCR]}


@pytest.fixture(scope="module")
def reserved() -> Built:
    return run_program(reserved_config(), stack="reserved")


def test_the_reservations_az_gets_a_private_subnet_moving_one_other(reserved, built):
    azs = reserved.outputs["rayfleet"]["availability_zones"]
    # Workers' AZ first as ever; us-east-1d takes the place of the last AZ no reservation needs.
    assert built["dev"].outputs["rayfleet"]["availability_zones"] == \
        ["us-east-1b", "us-east-1a", "us-east-1c"]
    assert azs == ["us-east-1b", "us-east-1a", "us-east-1d"]


def test_each_reservation_has_one_template_targeting_exactly_it(reserved):
    out = reserved.outputs["rayfleet"]
    subnet = dict(zip(out["availability_zones"], out["private_subnet_ids"], strict=True))
    block, odcr = reserved.named(BLOCK_LT), reserved.named(ODCR_LT)
    assert block.inputs["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationId": BLOCK["id"]}}
    assert block.inputs["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert odcr.inputs["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationResourceGroupArn": GROUP}}
    assert "instanceMarketOptions" not in odcr.inputs   # on-demand
    for lt, r in ((block, BLOCK), (odcr, ODCR)):
        assert lt.inputs["instanceType"] == r["instanceType"]
        assert lt.inputs["tags"][TAG_CAPACITY_RESERVATION] == r.get("id", GROUP)
        # The reservation's AZ, not the workers' placement group: AWS placed it already.
        assert "placement" not in lt.inputs
        nics = lt.inputs["networkInterfaces"]
        assert len(nics) == 4 and all(n["subnetId"] == subnet[r["availabilityZone"]]
                                      and n["interfaceType"] == "efa" for n in nics)
        # As every template: IMDSv2, encrypted root, no stopped leftovers, cluster tags.
        assert lt.inputs["metadataOptions"]["httpTokens"] == "required"
        assert lt.inputs["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
        assert lt.inputs["instanceInitiatedShutdownBehavior"] == "terminate"
        specs = {s["resourceType"] for s in lt.inputs["tagSpecifications"]}
        assert specs == {"instance", "volume", "network-interface"}
    assert len(reserved.of_type(policy.LAUNCH_TEMPLATE)) == 1 + 4 + 2


def test_the_output_lists_reservations_first_in_their_types_order(reserved):
    out = reserved.outputs["rayfleet"]
    workers = out["node_types"]["workers"]
    # The order of preference render keeps and the autoscaler's scorer follows.
    assert [(w["instance_type"], w["market"]) for w in workers] == [
        ("p4d.24xlarge", "block"), ("p4d.24xlarge", "spot"), ("p4d.24xlarge", "ondemand"),
        ("p4de.24xlarge", "reserved"), ("p4de.24xlarge", "spot"), ("p4de.24xlarge", "ondemand")]
    subnet = dict(zip(out["availability_zones"], out["private_subnet_ids"], strict=True))
    assert workers[0]["capacity_reservation"] == {
        "availability_zone": "us-east-1d", "subnet_id": subnet["us-east-1d"], "id": BLOCK["id"]}
    assert workers[3]["capacity_reservation"] == {
        "availability_zone": "us-east-1b", "subnet_id": subnet["us-east-1b"],
        "resource_group_arn": GROUP}
    assert all("capacity_reservation" not in w for w in workers if w["market"] in
               ("spot", "ondemand"))
    assert (workers[0]["min_workers"], workers[0]["max_workers"]) == (0, out["max_workers"])
    assert workers[0]["launch_template"]["id"] == reserved.named(BLOCK_LT).outputs["id"]
    parsed = contract.parse(json.dumps(reserved.outputs))
    assert parsed.to_dict() == out
    # render keeps the order and names each node type's market.
    cfg = render.plain(render.build_config(parsed, "t"))
    names = [n for n in cfg["available_node_types"] if n != "ray.head.default"]
    assert names == ["ray.worker.p4d.24xlarge.block", "ray.worker.p4d.24xlarge.spot",
                     "ray.worker.p4d.24xlarge.ondemand", "ray.worker.p4de.24xlarge.reserved",
                     "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand"]
    nc = cfg["available_node_types"]["ray.worker.p4d.24xlarge.block"]["node_config"]
    assert nc["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert nc["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": BLOCK["id"]}}
    assert "SubnetIds" not in nc and "SecurityGroupIds" not in nc   # the template's


@pytest.mark.parametrize("rule", sorted(policy.CHECKS), ids=lambda n: f"rule-{n}")
def test_every_rule_holds_on_the_reservation_stack(rule, reserved):
    values = reserved_config()
    violations = check(reserved.resources, [rule], operator_cidrs=values["rayfleet:operatorCidrs"],
                       capacity_reservations=values["rayfleet:capacityReservations"])
    assert not violations, "\n".join(map(str, violations))


MUTATIONS = {
    "block template lost its target": (lambda b: edit(
        b, BLOCK_LT, lambda i: i.pop("capacityReservationSpecification")), BLOCK_LT,
        "targets no reservation"),
    "ODCR template lost its target": (lambda b: edit(
        b, ODCR_LT, lambda i: i.pop("capacityReservationSpecification")), ODCR_LT,
        f"was built for {GROUP}"),
    "block template turned spot": (lambda b: edit(
        b, BLOCK_LT, lambda i: i.update(instanceMarketOptions={"marketType": "spot"})),
        BLOCK_LT, "is spot"),
    "block template aimed at another reservation": (lambda b: edit(
        b, BLOCK_LT, lambda i: i.update(capacityReservationSpecification={
            "capacityReservationTarget": {"capacityReservationId": "cr-0123456789abcdef0"}})),
        BLOCK_LT, "does not name"),
    "ODCR template launched as a Capacity Block": (lambda b: edit(
        b, ODCR_LT, lambda i: i.update(instanceMarketOptions={"marketType": "capacity-block"})),
        ODCR_LT, "On-Demand Capacity Reservation"),
    "block template dropped": (lambda b: drop(b, BLOCK_LT, BLOCK_LT),
                               f"capacityReservations '{BLOCK['id']}'",
                               "has no launch template built for it"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_rule_31_catches_a_template_that_lost_or_changed_its_target(mutation, reserved):
    mutate, offender, words = MUTATIONS[mutation]
    resources, _ = mutate(reserved)
    violations = [str(v) for v in check(
        resources, [31], capacity_reservations=reserved_config()["rayfleet:capacityReservations"])]
    assert any(offender in v and words in v for v in violations), violations
    assert all(v.startswith("rule 31 (rayfleet): ") for v in violations)


def test_a_reservation_the_region_lacks_or_too_few_azs_stop_the_program_first():
    bad = {**BLOCK, "availabilityZone": "us-east-1f"}
    with pytest.raises(pulumi.RunError, match="rayfleet:capacityReservations: a reservation is "
                                              "in us-east-1f, not an available AZ") as info:
        run_program({**dev_config(), "rayfleet:capacityReservations": [bad]}, zones=5)
    assert [r for r in info.value.registrations if r["type"].startswith("aws:")] == []
    crowded = [BLOCK, {**ODCR, "availabilityZone": "us-east-1c"},
               {"instanceType": "p4de.24xlarge", "availabilityZone": "us-east-1e",
                "id": "cr-0aaaaaaaaaaaaaaaa", "capacityBlock": True}]
    with pytest.raises(pulumi.RunError, match="rayfleet:azCount: is 3 but the workers' AZ and "
                                              "the reservations' need 4") as info:
        run_program({**dev_config(), "rayfleet:capacityReservations": crowded})
    assert [r for r in info.value.registrations if r["type"].startswith("aws:")] == []


def test_the_config_the_program_reads_is_the_stack_files():
    # `pulumi config set --path` stores the list; the program gets it back as JSON text.
    c = StackConfig.from_mapping({k: json.dumps(v) if isinstance(v, list) else v
                                  for k, v in reserved_config().items()})
    assert [r.target for r in c.nodes.capacity_reservations] == [BLOCK["id"], GROUP]


def test_the_head_may_launch_into_its_reservations_or_a_groups_region_wide(reserved, built):
    """RunInstances into a reservation is authorized on the reservation too: a stack of
    reservation ids grants exactly those; one with a resource group (whose members the group
    changes) grants the account's reservations in the region; the dev stack, with none, grants
    no such statement."""
    def statements(b: Built) -> dict:
        doc = json.loads(b.named(f"{D}-iam-head-autoscaler").inputs["policy"])
        return {s["Sid"]: s for s in doc["Statement"]}

    assert "LaunchIntoTheStacksReservations" not in statements(built["dev"])
    grant = statements(reserved)["LaunchIntoTheStacksReservations"]
    # A resource group's members can change: the account's reservations in the region.
    assert grant["Action"] == "ec2:RunInstances"
    assert grant["Resource"] == ["arn:aws:ec2:us-east-1:*:capacity-reservation/*"]
    only_block = run_program({**dev_config(), "rayfleet:capacityReservations": [BLOCK]},
                             stack="block")
    assert statements(only_block)["LaunchIntoTheStacksReservations"]["Resource"] == [
        f"arn:aws:ec2:us-east-1:*:capacity-reservation/{BLOCK['id']}"]
    # The workers may read a reservation's end (a Capacity Block's nodes drain before it),
    # and nothing else of EC2; the dev stack's workers not even that.
    worker = json.loads(only_block.named(f"{D}-iam-worker-reservations").inputs["policy"])
    assert worker["Statement"] == [{"Sid": "ReadTheBlocksEnd", "Effect": "Allow",
                                    "Action": "ec2:DescribeCapacityReservations",
                                    "Resource": "*"}]
    assert not [r for r in built["dev"].resources if "worker-reservations" in str(r.name)]
