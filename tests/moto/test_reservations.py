"""Reserved capacity through `rayfleet preflight` on moto: one line per reservation, and each
reservation a launch could not use refused in one line (exit 2) before any other check.

moto 5.2.5 implements neither CreateCapacityReservation nor DescribeCapacityReservations (so no
ReservationType capacity-block, StartDate or EndDate), and answers Resource Groups'
ListGroupResources "Not yet implemented": those two calls are answered here through botocore's
``before-call`` event on just those operations (still counted by ``aws_calls``), and moto
serves everything else: subnets, launch templates, groups, profiles, key pair, bucket.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from datetime import datetime, timedelta, timezone

import boto3
import pytest
import yaml

from rayfleet.commands import cli, cost, lint, preflight, render
from tests.reservations import BLOCK_ID, BLOCK_NAME, GROUP, RESERVED_NAME, with_reservations

from .conftest import REGION

pytestmark = pytest.mark.moto

ODCR_IDS = ["cr-0aaaaaaaaaaaaaaa1", "cr-0aaaaaaaaaaaaaaa2"]
NOW = datetime.now(timezone.utc).replace(microsecond=0)


def reservation(rid: str, itype: str, az: str, **extra) -> dict:
    """A reservation as DescribeCapacityReservations returns it (botocore-parsed)."""
    return {"CapacityReservationId": rid, "InstanceType": itype, "AvailabilityZone": az,
            "State": "active", "TotalInstanceCount": 2, "AvailableInstanceCount": 2,
            "ReservationType": "default", "InstancePlatform": "Linux/UNIX", **extra}


@pytest.fixture
def reserved(stack, ec2, ami, tmp_path):
    """The example stack with a p4d Capacity Block and the p4de ODCRs of a resource group:
    their launch templates in moto as infra/ makes them, the outputs, the rendered YAML, and
    the reservations AWS would describe (a block from an hour ago for 24 hours)."""
    o = stack["outputs"]
    az, subnet = o["availability_zones"][0], o["worker_subnet_id"]
    templates = {}
    for market, itype, target in (("block", "p4d.24xlarge", {"CapacityReservationId": BLOCK_ID}),
                                  ("reserved", "p4de.24xlarge",
                                   {"CapacityReservationResourceGroupArn": GROUP})):
        data = {"ImageId": ami, "InstanceType": itype,
                "IamInstanceProfile": {"Arn": o["instance_profiles"]["worker"]["arn"]},
                "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 1},
                "NetworkInterfaces": [{"DeviceIndex": 0, "SubnetId": subnet, "InterfaceType":
                                       "efa", "Groups": [o["cluster_security_group_id"],
                                                         o["efa_security_group_id"]]}],
                "CapacityReservationSpecification": {"CapacityReservationTarget": target}}
        if market == "block":
            data["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
        templates[market] = ec2.create_launch_template(
            LaunchTemplateName=f"{o['cluster_name']}-{itype}-{market}",
            LaunchTemplateData=data)["LaunchTemplate"]["LaunchTemplateId"]
    path = tmp_path / "reserved-outputs.json"
    path.write_text(json.dumps({"rayfleet": with_reservations(o, templates)}))
    yaml_path = render.render(str(path), out=str(tmp_path / "reserved.yaml"),
                              token_file=str(tmp_path / "token"))
    found = {BLOCK_ID: reservation(BLOCK_ID, "p4d.24xlarge", az,
                                   ReservationType="capacity-block",
                                   StartDate=NOW - timedelta(hours=1),
                                   EndDate=NOW + timedelta(hours=23)),
             **{rid: reservation(rid, "p4de.24xlarge", az) for rid in ODCR_IDS}}
    return {"yaml": yaml_path, "found": found, "groups": {GROUP: list(ODCR_IDS)}, "az": az}


class _Http:
    def __init__(self, status: int):
        self.status_code = status


def session_for(reserved) -> boto3.session.Session:
    """moto for everything, but DescribeCapacityReservations and ListGroupResources answered
    from ``reserved`` (moto lacks both)."""
    s = boto3.session.Session(region_name=REGION)

    def describe(params, **_):
        body = params["body"]
        ids = [v for k, v in body.items() if k.startswith("CapacityReservationId.")]
        missing = [i for i in ids if i not in reserved["found"]]
        if missing:
            return _Http(400), {"Error": {"Code": "InvalidCapacityReservationId.NotFound",
                                          "Message": f"{missing[0]} not found"}}
        return _Http(200), {"CapacityReservations": [reserved["found"][i] for i in ids]}

    def members(params, **_):
        group = json.loads(params["body"])["Group"]
        arn = f"arn:aws:ec2:{REGION}:123456789012:capacity-reservation/"
        return _Http(200), {"Resources": [
            {"Identifier": {"ResourceArn": arn + rid,
                            "ResourceType": "AWS::EC2::CapacityReservation"}}
            for rid in reserved["groups"].get(group, [])]}

    s.events.register("before-call.ec2.DescribeCapacityReservations", describe)
    s.events.register("before-call.resource-groups.ListGroupResources", members)
    return s


def run(reserved, *, hours: float = preflight.DEFAULT_HOURS) -> tuple[int, str]:
    out = io.StringIO()
    rc = preflight.main(str(reserved["yaml"]), session=session_for(reserved), out=out,
                        hours=hours)
    return rc, out.getvalue()


def _as_block(commands: list[str]) -> list[str]:
    """The spot type's setup list as the block's type runs it: the GPU health gate's
    expectation names the block's type (its verdicts count against it)."""
    return [c.replace('"ray.worker.p4d.24xlarge.spot"', f'"{BLOCK_NAME}"') for c in commands]


def test_a_stack_with_a_capacity_block_renders_preflights_costs_and_lints_clean(reserved):
    text = reserved["yaml"].read_text()
    cfg = yaml.safe_load(text)
    assert list(cfg["available_node_types"])[1:3] == [BLOCK_NAME, "ray.worker.p4d.24xlarge.spot"]
    # The block's nodes know their block (the spot agent reads its end from EC2), then set up
    # as the type's other nodes do; no other type's nodes are told of a block.
    types = cfg["available_node_types"]
    first, *rest = types[BLOCK_NAME]["worker_setup_commands"]
    assert first == f"mkdir -p ~/.rayfleet && echo {BLOCK_ID} > ~/.rayfleet/capacity-block"
    assert rest == _as_block(types["ray.worker.p4d.24xlarge.spot"]["worker_setup_commands"])
    assert "capacity-block" not in yaml.safe_dump({n: t for n, t in types.items()
                                                   if n != BLOCK_NAME})
    # Lint: no finding at all.
    assert lint.lint_config(cfg, text) == []
    # Preflight: one line per reservation (the group's two ODCRs), nothing failed.
    rc, out = run(reserved)
    assert rc == 0, out
    lines = out.splitlines()
    block = next(ln for ln in lines if f"reservation {BLOCK_ID}" in ln)
    assert block.startswith("PASS") and "active, p4d.24xlarge in us-east-1" in block
    assert "2/2 available" in block
    assert f"Capacity Block {(NOW - timedelta(hours=1)):%Y-%m-%d %H:%M} UTC to " \
           f"{(NOW + timedelta(hours=23)):%Y-%m-%d %H:%M} UTC" in block
    assert all(any(f"reservation {rid}" in ln and ln.startswith("PASS") for ln in lines)
               for rid in ODCR_IDS)
    assert "0 failed" in out
    # Cost: the block's workers prepaid, the ODCR's at the on-demand rate it bills anyway.
    report = io.StringIO()
    assert cost.main(str(reserved["yaml"]), out=report) == 0
    assert f"{BLOCK_NAME} runs in a Capacity Block" in report.getvalue()
    assert f"{RESERVED_NAME} targets an On-Demand Capacity Reservation" in report.getvalue()


@pytest.mark.parametrize("change,hours,expected", [
    (lambda f, az: f.pop(BLOCK_ID), 1,
     f"{BLOCK_NAME}: capacity reservation {BLOCK_ID} not found (InvalidCapacityReservationId"
     ".NotFound) in us-east-1"),
    (lambda f, az: f[BLOCK_ID].update(State="expired"), 1,
     f"{BLOCK_ID} is expired, not active or scheduled"),
    (lambda f, az: f[BLOCK_ID].update(InstanceType="p5.48xlarge"), 1,
     f"{BLOCK_ID} reserves p5.48xlarge but the node type launches p4d.24xlarge"),
    (lambda f, az: f[BLOCK_ID].update(AvailabilityZone="us-east-1f"), 1,
     f"{BLOCK_ID} is in us-east-1f, where the stack has no private subnet"),
    # Ends in 23 hours: a day's run does not fit.
    (lambda f, az: None, 24, f"{BLOCK_ID} ends "),
    (lambda f, az: f[BLOCK_ID].update(ReservationType="default"), 1,
     "is not a Capacity Block but the node type is launched as capacity-block"),
    # Through a group, one usable member is enough; none usable is refused.
    (lambda f, az: [f[r].update(State="cancelled") for r in ODCR_IDS], 1,
     f"{RESERVED_NAME}: {ODCR_IDS[0]} is cancelled, not active"),
])
def test_a_reservation_a_launch_cannot_use_is_one_line_before_anything_else(
        change, hours, expected, reserved, aws_calls, capsys, monkeypatch):
    change(reserved["found"], reserved["az"])
    session = session_for(reserved)
    monkeypatch.setattr(boto3.session, "Session", lambda **kw: session)
    aws_calls.clear()
    assert cli.main(["preflight", str(reserved["yaml"]), "--hours", str(hours)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and expected in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    # Nothing else was checked: no quota, bucket, key pair or profile call was made.
    assert not {"GetServiceQuota", "HeadBucket", "PutObject", "DescribeKeyPairs",
                "GetInstanceProfile", "DescribeImages"} & set(aws_calls), aws_calls


def test_one_usable_reservation_of_a_group_is_enough(reserved):
    reserved["found"][ODCR_IDS[0]].update(State="expired")
    rc, out = run(reserved)
    assert rc == 0, out
    assert any(ODCR_IDS[0] in ln and "not usable by it: is expired" in ln
               for ln in out.splitlines()), out


@pytest.mark.parametrize("argv,expected", [
    (["--hours", "0"], "argument --hours: must be more than 0 and at most 4368, got 0"),
    (["--hours", "soon"], "argument --hours: expected a number, got 'soon'"),
])
def test_bad_hours_is_one_line_no_aws_call(argv, expected, reserved, aws_calls, capsys):
    aws_calls.clear()
    assert cli.main(["preflight", str(reserved["yaml"]), *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert aws_calls == []


def test_the_program_builds_reservation_templates_ray_launches_from(moto_account, tmp_path):
    """infra/ itself, in moto: each reservation's template holds its target and market, and
    Ray's own bootstrap and node provider launch a worker of each reserved node type from it,
    in the reservation's AZ. moto records neither a launch's CapacityReservationSpecification
    nor a capacity-block market on the instance (moto 5.2.5 keeps only "a market type was
    given", shown as InstanceLifecycle spot), so the target is read from the template version
    the instance came from."""
    from .pulumi_moto import build_stack, launch_worker, ray_launch_config

    block = {"instanceType": "p4d.24xlarge", "availabilityZone": "us-east-1c", "id": BLOCK_ID,
             "capacityBlock": True}
    odcr = {"instanceType": "p4de.24xlarge", "availabilityZone": "us-east-1b",
            "resourceGroupArn": GROUP}
    stack = build_stack(moto_account, tmp_path,
                        {"rayfleet:capacityReservations": [block, odcr]})
    o = stack.outputs
    ec2 = moto_account.client("ec2")
    rendered = render.render(str(stack.path), out=str(tmp_path / "c.yaml"),
                             token_file=str(tmp_path / "token"))
    assert lint.lint_file(str(rendered)) == []
    # Preflight of what the program built (its templates, profiles, subnets in moto), AWS
    # describing the block and the group's one ODCR in their AZs.
    rc, out = run({"yaml": rendered, "groups": {GROUP: [ODCR_IDS[0]]}, "found": {
        BLOCK_ID: reservation(BLOCK_ID, "p4d.24xlarge", "us-east-1c",
                              ReservationType="capacity-block",
                              StartDate=NOW - timedelta(hours=1),
                              EndDate=NOW + timedelta(hours=47)),
        ODCR_IDS[0]: reservation(ODCR_IDS[0], "p4de.24xlarge", "us-east-1b")}})
    assert rc == 0 and "0 failed" in out, out
    for rid, az in ((BLOCK_ID, "us-east-1c"), (ODCR_IDS[0], "us-east-1b")):
        assert any(ln.startswith("PASS") and f"reservation {rid}" in ln and az in ln
                   for ln in out.splitlines()), out
    cfg = ray_launch_config(rendered)
    subnet = dict(zip(o["availability_zones"], o["private_subnet_ids"], strict=True))
    for name, r, target in ((BLOCK_NAME, block, {"CapacityReservationId": BLOCK_ID}),
                            (RESERVED_NAME, odcr,
                             {"CapacityReservationResourceGroupArn": GROUP})):
        i = launch_worker(cfg, name, ec2)
        tags = {t["Key"]: t["Value"] for t in i["Tags"]}
        market = "block" if r.get("capacityBlock") else "reserved"
        (w,) = [w for w in o["node_types"]["workers"]
                if (w["instance_type"], w["market"]) == (r["instanceType"], market)]
        assert tags["aws:ec2launchtemplate:id"] == w["launch_template"]["id"], name
        assert i["SubnetId"] == subnet[r["availabilityZone"]], name
        assert i["Placement"]["AvailabilityZone"] == r["availabilityZone"], name
        version = ec2.describe_launch_template_versions(
            LaunchTemplateId=w["launch_template"]["id"],
            Versions=[tags["aws:ec2launchtemplate:version"]],
        )["LaunchTemplateVersions"][0]["LaunchTemplateData"]
        assert version["CapacityReservationSpecification"] == {
            "CapacityReservationTarget": target}, name
        assert version.get("InstanceMarketOptions", {}).get("MarketType") == (
            "capacity-block" if r.get("capacityBlock") else None), name
        assert "Placement" not in version or not version["Placement"].get("GroupName"), name


def test_reserved_workers_need_no_more_on_demand_quota(reserved):
    """An ODCR took its On-Demand quota when it was made and a Capacity Block is bought
    outside it: the P quota covers only the on-demand node types (here one p4d and one p4de
    of the cluster's four workers), not the reservations' workers."""
    cfg = yaml.safe_load(reserved["yaml"].read_text())
    cfg["max_workers"] = 4
    reserved["yaml"].write_text(yaml.safe_dump(cfg))

    class Quotas:
        def get_service_quota(self, ServiceCode, QuotaCode):  # noqa: N803 (boto3's names)
            return {"Quota": {"Value": 192.0}}

    session = session_for(reserved)
    real = session.client
    session.client = lambda name, **kw: Quotas() if name == "service-quotas" else real(name, **kw)
    out = io.StringIO()
    assert preflight.main(str(reserved["yaml"]), session=session, out=out) == 0, out.getvalue()
    assert any(ln.startswith("PASS") and "On-Demand P" in ln and "need 192" in ln
               for ln in out.getvalue().splitlines()), out.getvalue()


@pytest.mark.parametrize("vllm", ["cpu", "none"])
def test_a_blocks_nodes_run_their_types_list_after_its_id_whatever_the_vllm(
        reserved, tmp_path, vllm):
    """Without CUDA vLLM a GPU type still has a list of its own (the GPU health gate's): a
    block's type runs the same, after its id."""
    out = render.render(str(reserved["yaml"].with_name("reserved-outputs.json")),
                        out=str(tmp_path / f"{vllm}.yaml"), token_file=str(tmp_path / "token"),
                        vllm=vllm)
    cfg = yaml.safe_load(Path(out).read_text())
    types = cfg["available_node_types"]
    assert all("worker_setup_commands" in t for n, t in types.items() if n.startswith("ray.w"))
    assert types[BLOCK_NAME]["worker_setup_commands"] == [
        f"mkdir -p ~/.rayfleet && echo {BLOCK_ID} > ~/.rayfleet/capacity-block",
        *_as_block(types["ray.worker.p4d.24xlarge.spot"]["worker_setup_commands"])]
