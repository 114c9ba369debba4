"""The chain on moto: the example stack's resources -> `rayfleet render` -> Ray's own AWS
bootstrap and node provider launch the head and a worker from the rendered YAML -> Ray created
no security group, role or key pair -> `ray down`'s leftovers -> `rayfleet sweep` -> empty."""

from __future__ import annotations

import copy

import pytest
import yaml

from rayfleet import cli, sweep

pytestmark = pytest.mark.moto


def test_render_launch_sweep(stack, rendered, ec2, capsys):
    import boto3
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler._private.util import prepare_config
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    o = stack["outputs"]
    iam = boto3.client("iam")
    before = {
        "sgs": {g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]},
        "keys": {k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"]},
        "roles": {r["RoleName"] for r in iam.list_roles()["Roles"]},
        "profiles": {p["InstanceProfileName"]
                     for p in iam.list_instance_profiles()["InstanceProfiles"]},
    }
    cfg = bootstrap_aws(prepare_config(yaml.safe_load(rendered.read_text())))
    provider = AWSNodeProvider(cfg["provider"], cfg["cluster_name"])
    for node_type, kind in (("ray.head.default", "head"), ("ray.worker.a100.ondemand",
                                                           "worker")):
        provider.create_node(copy.deepcopy(cfg["available_node_types"][node_type]["node_config"]),
                             {TAG_RAY_NODE_KIND: kind, TAG_RAY_USER_NODE_TYPE: node_type}, 1)

    # Ray created nothing of its permissive defaults.
    assert {g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]} == \
        before["sgs"]
    assert {k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"]} == before["keys"]
    assert {r["RoleName"] for r in iam.list_roles()["Roles"]} == before["roles"]
    assert {p["InstanceProfileName"]
            for p in iam.list_instance_profiles()["InstanceProfiles"]} == before["profiles"]

    instances = [i for r in ec2.describe_instances(Filters=[
        {"Name": "tag:ray-cluster-name", "Values": [o["cluster_name"]]}])["Reservations"]
        for i in r["Instances"]]
    assert len(instances) == 2
    profiles = {o["instance_profiles"][k]["arn"] for k in ("head", "worker")}
    for i in instances:
        assert i["SubnetId"] in o["private_subnet_ids"]
        assert "PublicIpAddress" not in i or not i["PublicIpAddress"]
        groups = {g["GroupId"] for g in i["SecurityGroups"]} | {
            g["GroupId"] for n in i.get("NetworkInterfaces", []) for g in n.get("Groups", [])}
        assert o["cluster_security_group_id"] in groups, (i["InstanceType"], i)
        assert i["IamInstanceProfile"]["Arn"] in profiles
        assert i["ImageId"] == o["ami_id"]
        assert i["KeyName"] == f"{o['cluster_name']}-operator"

    # `ray down` with cache_stopped_nodes: false terminates; simulate an interrupted one that
    # left the worker stopped, plus an orphaned volume.
    worker = next(i["InstanceId"] for i in instances if i["InstanceType"] == "p4d.24xlarge")
    ec2.stop_instances(InstanceIds=[worker])
    ec2.create_volume(AvailabilityZone=o["availability_zones"][0], Size=500, TagSpecifications=[
        {"ResourceType": "volume", "Tags": [{"Key": "ray-cluster-name",
                                             "Value": o["cluster_name"]}]}])
    assert cli.main(["sweep", "--cluster-name", o["cluster_name"], "--region", o["region"],
                     "--delete"]) == 0
    assert sweep.find(ec2, o["cluster_name"]) == []
    # The stack's own resources stay for `pulumi destroy`.
    assert o["cluster_security_group_id"] in {
        g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]}
