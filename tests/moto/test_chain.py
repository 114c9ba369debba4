"""The chain on moto, from the Pulumi program itself: infra/ builds the example stack in moto
(tests/moto/pulumi_moto.py) -> its stack output -> `rayfleet render` -> `rayfleet preflight`
passes -> Ray's own AWS bootstrap and node provider launch a head and both A100 worker types
from the rendered YAML -> every node sits where the stack says, with IMDSv2 and encrypted
roots, and Ray created no security group, role or key pair -> `rayfleet sweep CLUSTER_YAML
--delete` leaves nothing tagged, and the stack's own resources stay for `pulumi destroy`."""

from __future__ import annotations

import copy
import fnmatch
import json

import boto3
import pytest

from rayfleet.commands import cli, sweep

from .pulumi_moto import account_inventory, cluster_instances, ray_launch_config, role_actions

pytestmark = pytest.mark.moto

def _tags(resource: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags") or []}


def node_types(o: dict) -> dict[str, tuple[dict, str, str]]:
    """Ray node type -> (its launch template, instance profile, market) for the stack's
    outputs: the head, and one per allowed worker type and market."""
    out = {"ray.head.default": (o["launch_templates"]["head"], "head", "ondemand")}
    for w in o["node_types"]["workers"]:
        out[f"ray.worker.{w['instance_type']}.{w['market']}"] = (
            w["launch_template"], "worker", w["market"])
    return out


def test_infra_stack_renders_launches_and_sweeps_clean(infra_stack, moto_account, tmp_path,
                                                       capsys):
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    o = infra_stack.outputs
    c = o["cluster_name"]
    ec2 = moto_account.client("ec2")
    # Every id the program exported is moto's own, not a mock's invention.
    assert {s["SubnetId"] for s in ec2.describe_subnets(
        SubnetIds=o["private_subnet_ids"])["Subnets"]} == set(o["private_subnet_ids"])
    created = infra_stack.mocks.created
    by_type = node_types(o)
    assert {lt["id"] for lt, _, _ in by_type.values()} == {
        rid for typ, _, rid in created if typ == "aws:ec2/launchTemplate:LaunchTemplate"}
    # What the program asked for but moto could not hold is exactly what pulumi_moto.py
    # documents as placeholders; everything else exists in moto.
    assert {typ for typ, _ in infra_stack.mocks.placeholders if typ.startswith("aws:")} == {
        "aws:ec2/placementGroup:PlacementGroup", "aws:s3/bucketPolicy:BucketPolicy",
        "aws:iam/rolePolicyAttachment:RolePolicyAttachment"}

    # The stack's hardening as moto now holds it: the VPC's default group empty (rule 5), the
    # cluster group admitting only itself and the operator ranges (rules 1, 2, 4), the bucket
    # private, versioned and encrypted with the stack's key (rules 11, 12, 14).
    groups = {g["GroupId"]: g for g in ec2.describe_security_groups(Filters=[
        {"Name": "vpc-id", "Values": [o["vpc_id"]]}])["SecurityGroups"]}
    default = next(g for g in groups.values() if g["GroupName"] == "default")
    assert default["IpPermissions"] == [] and default["IpPermissionsEgress"] == []
    cluster_in = groups[o["cluster_security_group_id"]]["IpPermissions"]
    assert {u["GroupId"] for p in cluster_in for u in p["UserIdGroupPairs"]} == {
        o["cluster_security_group_id"]}
    assert {r["CidrIp"] for p in cluster_in for r in p["IpRanges"]} | {
        r["CidrIpv6"] for p in cluster_in for r in p["Ipv6Ranges"]} <= set(o["operator_cidrs"])
    s3 = moto_account.client("s3")
    assert all(s3.get_public_access_block(Bucket=o["bucket"])[
        "PublicAccessBlockConfiguration"].values())
    assert s3.get_bucket_versioning(Bucket=o["bucket"])["Status"] == "Enabled"
    (sse,) = s3.get_bucket_encryption(Bucket=o["bucket"])[
        "ServerSideEncryptionConfiguration"]["Rules"]
    assert sse["ApplyServerSideEncryptionByDefault"]["KMSMasterKeyID"] == o["kms_key_arn"]
    # Its access logged into a log bucket S3 can deliver to: SSE-S3 and a policy letting the
    # logging service write (moto refuses the target otherwise) (rule 27). The flow-log group
    # encrypted with the stack's own key (rule 28); both keys with a policy of their own
    # (rule 29).
    target = s3.get_bucket_logging(Bucket=o["bucket"])["LoggingEnabled"]["TargetBucket"]
    (log_sse,) = s3.get_bucket_encryption(Bucket=target)[
        "ServerSideEncryptionConfiguration"]["Rules"]
    assert log_sse["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    (group,) = moto_account.client("logs").describe_log_groups(
        logGroupNamePrefix=f"/rayfleet/{c}/")["logGroups"]
    kms = moto_account.client("kms")
    for key in (group["kmsKeyId"], o["kms_key_arn"]):
        policy = json.loads(kms.get_key_policy(KeyId=key, PolicyName="default")["Policy"])
        # Not AWS's default policy, which gives the account kms:* (everything to IAM).
        assert policy["Statement"] and all("kms:*" not in s["Action"]
                                           for s in policy["Statement"]), key

    rendered = tmp_path / "cluster.yaml"
    assert cli.main(["render", str(infra_stack.path), "-o", str(rendered),
                     "--token-file", str(tmp_path / "token")]) == 0
    assert cli.main(["preflight", str(rendered), "--num-gpus", "8"]) == 0, \
        capsys.readouterr().out

    before = account_inventory(moto_account)
    # Every EC2 call Ray makes through boto3's default session, by operation name.
    called: set[str] = set()
    boto3.setup_default_session()
    boto3.DEFAULT_SESSION.events.register(
        "before-call.ec2", lambda model, **_: called.add(f"ec2:{model.name}"))
    cfg = ray_launch_config(rendered)  # `ray up` on the operator's machine, its credentials
    called.clear()
    provider = AWSNodeProvider(cfg["provider"], cfg["cluster_name"])
    for node_type in by_type:
        kind = "head" if node_type == cfg["head_node_type"] else "worker"
        provider.create_node(copy.deepcopy(cfg["available_node_types"][node_type]["node_config"]),
                             {TAG_RAY_NODE_KIND: kind, TAG_RAY_USER_NODE_TYPE: node_type}, 1)
    provider.non_terminated_nodes({})  # the autoscaler's poll
    # What the provider called is what the head role grants (rules 17 and 26: its EC2 reads
    # are listed one by one). Tag conditions are not evaluated here; tests/infra checks them.
    granted = role_actions(moto_account.client("iam"), o["roles"]["head"]["arn"])
    assert {"ec2:RunInstances", "ec2:DescribeInstances"} <= called
    assert not [c for c in called if not any(fnmatch.fnmatchcase(c, g) for g in granted)], \
        (called, granted)

    # Ray created none of its permissive defaults (rule 3): no ray-autoscaler-* group with SSH
    # from the world, no ray-autoscaler-v1 role with EC2/S3 full access, no key pair.
    assert account_inventory(moto_account) == before

    instances = {_tags(i)[TAG_RAY_USER_NODE_TYPE]: i for i in cluster_instances(ec2, c)}
    assert set(instances) == set(by_type)
    public_subnets = {s["SubnetId"] for s in ec2.describe_subnets(Filters=[
        {"Name": "tag:rayfleet:tier", "Values": ["public"]}])["Subnets"]}
    for node_type, i in instances.items():
        lt, profile, market = by_type[node_type]
        tags = _tags(i)
        where = f"{node_type} {i['InstanceId']}"
        # Private subnets only, no public address (rule 7).
        assert i["SubnetId"] in o["private_subnet_ids"], where
        assert i["SubnetId"] not in public_subnets, where
        assert not i.get("PublicIpAddress"), where
        assert not any(n.get("Association", {}).get("PublicIp")
                       for n in i["NetworkInterfaces"]), where
        # Launched from the stack's own template, image and key pair, tagged for the sweep.
        assert tags["aws:ec2launchtemplate:id"] == lt["id"], where
        assert tags["ray-cluster-name"] == c, where
        assert i["ImageId"] == o["ami_id"] == infra_stack.ami_id, where
        assert i["KeyName"] == infra_stack.key_name, where
        assert i["IamInstanceProfile"]["Arn"] == o["instance_profiles"][profile]["arn"], where
        groups = {g["GroupId"] for n in i["NetworkInterfaces"] for g in n["Groups"]}
        assert o["cluster_security_group_id"] in groups, where
        version = ec2.describe_launch_template_versions(
            LaunchTemplateId=lt["id"], Versions=[tags["aws:ec2launchtemplate:version"]],
        )["LaunchTemplateVersions"][0]["LaunchTemplateData"]
        if profile == "worker":
            # Every interface in the cluster and EFA groups. moto keys interfaces by DeviceIndex
            # and reports InterfaceType "interface", so a p4d's four EFAs (cards 0-3, device
            # indexes 0, 1, 1, 1) show as two plain ones: count and type are checked on the
            # template version the worker was launched from.
            nics = i["NetworkInterfaces"]
            assert nics and all({g["GroupId"] for g in n["Groups"]} == {
                o["cluster_security_group_id"], o["efa_security_group_id"]} for n in nics), where
            efas = version["NetworkInterfaces"]
            (w,) = [w for w in o["node_types"]["workers"]
                    if w["launch_template"]["id"] == lt["id"]]
            assert len(efas) == w["efa_interfaces"], where
            assert all(n["InterfaceType"] == "efa" for n in efas), where
            assert i["Placement"]["AvailabilityZone"] == o["worker_availability_zone"], where
            assert (i.get("InstanceLifecycle") == "spot") == (market == "spot"), where
        # IMDSv2 required, hop limit from the stack (rule 9). On the instance, moto shows what
        # the RunInstances call asked for: Ray's bootstrap copies the template's data, IMDS
        # options included, into every launch. moto itself does not apply a launch template's
        # MetadataOptions, so the template version the instance came from is checked too.
        assert i["MetadataOptions"]["HttpEndpoint"] == "enabled", where
        assert i["MetadataOptions"]["HttpTokens"] == "required", where
        assert i["MetadataOptions"]["HttpPutResponseHopLimit"] == o["imds_hop_limit"], where
        assert version["MetadataOptions"]["HttpTokens"] == "required", where
        # Encrypted gp3 roots (rule 10).
        volumes = ec2.describe_volumes(VolumeIds=[
            b["Ebs"]["VolumeId"] for b in i["BlockDeviceMappings"]])["Volumes"]
        assert volumes and all(v["Encrypted"] and v["VolumeType"] == "gp3"
                               for v in volumes), (where, volumes)

    # `ray down` with cache_stopped_nodes: false terminates; an interrupted one can leave a
    # stopped worker behind (its EBS still bills) and an orphaned volume.
    worker = instances["ray.worker.p4d.24xlarge.ondemand"]["InstanceId"]
    ec2.stop_instances(InstanceIds=[worker])
    ec2.create_volume(AvailabilityZone=o["worker_availability_zone"], Size=500,
                      TagSpecifications=[{"ResourceType": "volume", "Tags": [
                          {"Key": "ray-cluster-name", "Value": c}]}])
    capsys.readouterr()
    # The cluster's name and region from the rendered YAML, as README's last step runs it.
    assert cli.main(["sweep", str(rendered), "--delete"]) == 0
    assert sweep.find(ec2, c) == []
    assert cli.main(["sweep", "--cluster-name", c, "--region", o["region"]]) == 0
    assert f"nothing tagged ray-cluster-name={c} is left in {o['region']}" in \
        capsys.readouterr().out
    # The stack's own resources stay for `pulumi destroy`.
    assert {o["cluster_security_group_id"], o["efa_security_group_id"]} <= {
        g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    assert len(ec2.describe_launch_templates(LaunchTemplateIds=[
        lt["id"] for lt, _, _ in by_type.values()])["LaunchTemplates"]) == len(by_type)
