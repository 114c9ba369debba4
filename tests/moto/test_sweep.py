"""`rayfleet sweep` on moto: every leftover tagged with the cluster is listed, removed only
with --delete, and the stack's own (Pulumi-managed) resources are never touched; the cluster's
name and region come from its YAML, or from --cluster-name and --region, both."""

from __future__ import annotations

import pytest

from rayfleet.commands import cli, sweep

pytestmark = pytest.mark.moto

CLUSTER = "rayfleet-dev"


def _tags(extra: dict | None = None) -> list[dict]:
    tags = {"ray-cluster-name": CLUSTER, **(extra or {})}
    return [{"Key": k, "Value": v} for k, v in tags.items()]


@pytest.fixture
def vpc(ec2):
    vpc_id = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc_id, CidrBlock="10.42.0.0/19")["Subnet"]["SubnetId"]
    return vpc_id, subnet


@pytest.fixture
def stack_sg(ec2, vpc):
    """The stack's cluster group: tagged with the cluster AND managed by Pulumi."""
    return ec2.create_security_group(
        GroupName="rayfleet-dev-cluster", Description="stack", VpcId=vpc[0],
        TagSpecifications=[{"ResourceType": "security-group",
                            "Tags": _tags({"rayfleet:managed-by": "pulumi"})}])["GroupId"]


@pytest.fixture
def leftovers(ec2, vpc, stack_sg, ami):
    """What an interrupted `ray up` + `ray down` with Ray's defaults leaves behind."""
    vpc_id, subnet = vpc
    running = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="m5.large",
                                SubnetId=subnet, TagSpecifications=[
                                    {"ResourceType": "instance", "Tags": _tags()}])
    stopped = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="m5.large",
                                SubnetId=subnet, TagSpecifications=[
                                    {"ResourceType": "instance", "Tags": _tags()}])
    stopped_id = stopped["Instances"][0]["InstanceId"]
    ec2.stop_instances(InstanceIds=[stopped_id])
    vol = ec2.create_volume(AvailabilityZone="us-east-1a", Size=100, TagSpecifications=[
        {"ResourceType": "volume", "Tags": _tags()}])["VolumeId"]
    eni = ec2.create_network_interface(SubnetId=subnet, TagSpecifications=[
        {"ResourceType": "network-interface", "Tags": _tags()}])["NetworkInterface"][
        "NetworkInterfaceId"]
    # Ray's own group: named ray-autoscaler-<cluster>, tagged ray-cluster-name.
    ray_sg = ec2.create_security_group(GroupName=f"ray-autoscaler-{CLUSTER}",
                                       Description="Auto-created security group",
                                       VpcId=vpc_id)["GroupId"]
    ec2.create_key_pair(KeyName="leftover-key", TagSpecifications=[
        {"ResourceType": "key-pair", "Tags": _tags()}])
    # Someone else's cluster: never found, never removed.
    other = ec2.create_volume(AvailabilityZone="us-east-1a", Size=1, TagSpecifications=[
        {"ResourceType": "volume", "Tags": [{"Key": "ray-cluster-name", "Value": "other"}]}])
    OTHER_VOLUMES[:] = [other["VolumeId"]]
    return {"instance": {running["Instances"][0]["InstanceId"], stopped_id},
            "volume": {vol}, "network-interface": {eni}, "security-group": {ray_sg},
            "key-pair": {"leftover-key"}}


OTHER_VOLUMES: list[str] = []  # the other cluster's volume, set by the leftovers fixture


def _other_cluster_intact(ec2) -> bool:
    ids = {v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]}
    return bool(OTHER_VOLUMES) and set(OTHER_VOLUMES) <= ids


def _found(ec2) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for x in sweep.find(ec2, CLUSTER):
        out.setdefault(x.kind, set()).add(x.id)
    return out


def test_lists_every_leftover_but_not_the_stack_or_other_clusters(ec2, leftovers, stack_sg):
    found = _found(ec2)
    # Exactly our leftovers: nothing of the stack, nothing of another cluster. (The instances'
    # root volumes carry no cluster tag here; they go with their instances.)
    assert found == leftovers
    assert stack_sg not in found["security-group"]
    assert not set(OTHER_VOLUMES) & found["volume"]


def _yaml(tmp_path, region: str = "us-east-1", name: str = CLUSTER, kind: str = "aws") -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"cluster_name: {name}\nprovider: {{type: {kind}, region: {region}}}\n")
    return str(path)


def test_without_delete_nothing_is_removed(ec2, leftovers, capsys):
    assert cli.main(["sweep", "--cluster-name", CLUSTER, "--region", "us-east-1"]) == 1
    out = capsys.readouterr().out
    assert "--delete" in out and "stopped" in out
    # Every leftover is still there, volumes included.
    found = _found(ec2)
    for kind, ids in leftovers.items():
        assert ids <= found.get(kind, set()), kind
    assert _other_cluster_intact(ec2)


def test_delete_removes_everything_and_leaves_the_stack(ec2, leftovers, stack_sg, capsys):
    assert cli.main(["sweep", "--cluster-name", CLUSTER, "--region", "us-east-1",
                     "--delete"]) == 0
    assert _found(ec2) == {}
    groups = {g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    assert stack_sg in groups
    assert _other_cluster_intact(ec2)  # another cluster's volume is not ours to delete
    assert cli.main(["sweep", "--cluster-name", CLUSTER, "--region", "us-east-1"]) == 0
    assert "nothing tagged" in capsys.readouterr().out


def test_the_yaml_names_the_cluster_and_its_region(ec2, leftovers, tmp_path, monkeypatch,
                                                   capsys):
    """The AWS profile's region is another one: the YAML's provider.region is searched, and
    the line says which region it searched."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert cli.main(["sweep", _yaml(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"leftover(s) of {CLUSTER} in us-east-1" in out and "stopped" in out
    # The same cluster name in a region where it left nothing: that region, and nothing there.
    assert cli.main(["sweep", _yaml(tmp_path, region="us-west-2")]) == 0
    assert capsys.readouterr().out == \
        f"nothing tagged ray-cluster-name={CLUSTER} is left in us-west-2\n"
    assert cli.main(["sweep", _yaml(tmp_path), "--delete"]) == 0
    assert _found(ec2) == {}
    assert _other_cluster_intact(ec2)


def test_an_instance_ec2_will_not_terminate_stops_nothing_else(ec2, leftovers, vpc, ami,
                                                                 capsys):
    """A leftover with termination protection: one line for it, no traceback, and every
    other leftover still goes (the other instances, volumes, interfaces, groups, keys)."""
    protected = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, SubnetId=vpc[1],
                                  TagSpecifications=[{"ResourceType": "instance",
                                                      "Tags": _tags()}])[
        "Instances"][0]["InstanceId"]
    ec2.modify_instance_attribute(InstanceId=protected, DisableApiTermination={"Value": True})
    assert cli.main(["sweep", "--cluster-name", CLUSTER, "--region", "us-east-1",
                     "--delete"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"could not delete instance {protected}: OperationNotPermitted"]
    assert _found(ec2) == {"instance": {protected}}
    ec2.modify_instance_attribute(InstanceId=protected, DisableApiTermination={"Value": False})
    ec2.terminate_instances(InstanceIds=[protected])


@pytest.mark.parametrize("argv,expected", [
    (["--cluster-name", "rayfleet dev", "--region", "us-east-1"], "not a Ray cluster name"),
    (["--cluster-name", "*", "--region", "us-east-1"], "not a Ray cluster name"),
    (["--cluster-name", CLUSTER, "--region", "us-east1"], 'did you mean "us-east-1"'),
    # The bug this refuses: the profile's region searched, "nothing left" and exit 0.
    (["--cluster-name", CLUSTER], "--region: required with --cluster-name"),
    (["--region", "us-east-1"], "which cluster: rayfleet sweep CLUSTER_YAML"),
    ([], "which cluster: rayfleet sweep CLUSTER_YAML"),
    (["{yaml}", "--region", "us-west-2"], "the YAML names the cluster and its region"),
    (["{yaml}", "--cluster-name", CLUSTER], "the YAML names the cluster and its region"),
    (["{tmp}/none.yaml"], "none.yaml: no such file"),
    (["{yaml:us-east1}"], 'provider.region: \'us-east1\' is not an AWS region (did you mean'),
    (["{yaml:us-east-1:Bad Name}"], "cluster_name: 'Bad Name' is not a Ray cluster name"),
    (["{yaml:us-east-1:c:local}"], "sweep looks for what a cluster left on AWS"),
])
def test_bad_input_one_line_no_aws_call(argv, expected, aws, aws_calls, capsys, tmp_path):
    def arg(a: str) -> str:
        if a.startswith("{yaml"):
            return _yaml(tmp_path, *a.strip("{}").split(":")[1:])
        return a.format(tmp=tmp_path)

    assert cli.main(["sweep", *map(arg, argv)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert aws_calls == []


@pytest.mark.parametrize("body,expected", [
    ("provider: {type: aws, region: us-east-1}\n", "cluster_name: "),
    ("cluster_name: c\nprovider: {type: aws}\n", "provider.region: "),
])
def test_a_yaml_without_name_or_region_is_one_line(body, expected, aws, aws_calls, capsys,
                                                   tmp_path):
    (tmp_path / "c.yaml").write_text(body)
    assert cli.main(["sweep", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rayfleet: error: {expected}") and err.count("\n") == 1, err
    assert aws_calls == []
