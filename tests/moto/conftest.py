"""moto fixtures, one resource per fixture, chained.

- ``moto_account`` / ``infra_stack`` (tests/moto/pulumi_moto.py): a fresh account on the
  session's moto server, and the example stack built in it by the Pulumi program itself. The
  launch chain (test_chain.py) and the interrupted-launch fault use these.
- ``aws`` / ``ec2`` / ``stack`` / ``rendered``: in-process ``mock_aws`` and a boto3-built copy
  of the stack, for the many small preflight and sweep cases that each need a fresh account
  in milliseconds rather than a program run (a few seconds).
"""

from __future__ import annotations

import pytest

from .pulumi_moto import infra_stack, moto_account  # noqa: F401 (fixtures)

REGION = "us-east-1"


@pytest.fixture
def aws(monkeypatch):
    """Fake credentials and an in-process moto for every AWS service; nothing leaves the box."""
    from moto import mock_aws

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
                 # moto's 1,300 default AMIs take seconds per test to load; tests register
                 # the one image they use (the `ami` fixture).
                 "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(k, raising=False)
    with mock_aws():
        yield


@pytest.fixture
def ec2(aws):
    import boto3

    return boto3.client("ec2", region_name=REGION)


@pytest.fixture
def ami(ec2) -> str:
    """A registered image, standing in for the Deep Learning AMI."""
    return ec2.register_image(Name="dlami-standin", RootDeviceName="/dev/sda1",
                              Architecture="x86_64")["ImageId"]


@pytest.fixture
def stack(ec2, ami, tmp_path):
    """The example stack's resources in moto (VPC, private subnets in three AZs, cluster + EFA
    groups, profiles, launch templates as infra/ makes them, bucket, key pair) and its
    ``rayfleet`` outputs with the real moto ids, written to outputs.json.

    Hand-written, so it can drift from infra/: the preflight tests use it because they need
    a fresh stack per case cheaply. ``infra_stack`` is the one built by the program, and
    test_chain.py checks that `rayfleet preflight` passes on it too."""
    import json
    from pathlib import Path

    import boto3

    repo = Path(__file__).resolve().parents[2]
    o = json.loads((repo / "cluster-configs/examples/dev-outputs.json").read_text())["rayfleet"]
    c = o["cluster_name"]
    pulumi_tags = [{"Key": "rayfleet:managed-by", "Value": "pulumi"},
                   {"Key": "rayfleet:cluster", "Value": c}]
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.42.{32 * i}.0/19",
                                 AvailabilityZone=az)["Subnet"]["SubnetId"]
               for i, az in enumerate(o["availability_zones"])]
    sg = ec2.create_security_group(GroupName=f"{c}-cluster", Description="cluster", VpcId=vpc,
                                   TagSpecifications=[{"ResourceType": "security-group",
                                                       "Tags": pulumi_tags}])["GroupId"]
    efa = ec2.create_security_group(GroupName=f"{c}-efa", Description="efa", VpcId=vpc,
                                    TagSpecifications=[{"ResourceType": "security-group",
                                                        "Tags": pulumi_tags}])["GroupId"]
    iam = boto3.client("iam")
    profiles = {}
    for kind in ("head", "worker"):
        iam.create_role(RoleName=f"{c}-{kind}", AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action":
                                                    "sts:AssumeRole", "Principal": {
                                                        "Service": "ec2.amazonaws.com"}}]}))
        p = iam.create_instance_profile(InstanceProfileName=f"{c}-{kind}")["InstanceProfile"]
        iam.add_role_to_instance_profile(InstanceProfileName=f"{c}-{kind}",
                                         RoleName=f"{c}-{kind}")
        profiles[kind] = {"arn": p["Arn"], "name": p["InstanceProfileName"]}
    ray_tags = [{"Key": "ray-cluster-name", "Value": c}]
    imds = {"HttpTokens": "required", "HttpPutResponseHopLimit": 1, "HttpEndpoint": "enabled"}
    head_lt = ec2.create_launch_template(LaunchTemplateName=f"{c}-head", LaunchTemplateData={
        "ImageId": ami, "InstanceType": o["node_types"]["head"]["instance_type"],
        "SecurityGroupIds": [sg], "IamInstanceProfile": {"Arn": profiles["head"]["arn"]},
        "MetadataOptions": imds,
        "TagSpecifications": [{"ResourceType": "instance", "Tags": ray_tags}],
    }, TagSpecifications=[{"ResourceType": "launch-template", "Tags": pulumi_tags}])
    lts = {"head": head_lt["LaunchTemplate"]}
    for w in o["node_types"]["workers"]:
        data = {
            "ImageId": ami, "InstanceType": w["instance_type"],
            "IamInstanceProfile": {"Arn": profiles["worker"]["arn"]}, "MetadataOptions": imds,
            # One EFA per card on p4d; moto launches one interface, which is what the
            # subnet/group bookkeeping needs.
            "NetworkInterfaces": [{"DeviceIndex": 0, "SubnetId": subnets[0],
                                   "Groups": [sg, efa], "InterfaceType": "efa",
                                   "DeleteOnTermination": True}],
            "TagSpecifications": [{"ResourceType": "instance", "Tags": ray_tags}],
        }
        if w["market"] == "spot":
            data["InstanceMarketOptions"] = {"MarketType": "spot"}
        lt = ec2.create_launch_template(
            LaunchTemplateName=f"{c}-{w['instance_type']}-{w['market']}",
            LaunchTemplateData=data,
            TagSpecifications=[{"ResourceType": "launch-template", "Tags": pulumi_tags}],
        )["LaunchTemplate"]
        w["launch_template"] = {"id": lt["LaunchTemplateId"]}
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=o["bucket"])
    ec2.create_key_pair(KeyName=f"{c}-operator")
    o.update(vpc_id=vpc, private_subnet_ids=subnets, worker_subnet_id=subnets[0],
             cluster_security_group_id=sg, efa_security_group_id=efa, ami_id=ami,
             instance_profiles=profiles,
             launch_templates={k: {"id": v["LaunchTemplateId"], "name": v["LaunchTemplateName"]}
                               for k, v in lts.items()})   # the head's; workers' in node_types
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"rayfleet": o}))
    return {"outputs": o, "path": path}


@pytest.fixture
def rendered(stack, tmp_path):
    """The stack rendered to a cluster YAML (token created in tmp_path)."""
    from rayfleet.commands import render

    return render.render(str(stack["path"]), out=str(tmp_path / "cluster.yaml"),
                         token_file=str(tmp_path / "token"))
