"""Run the real Pulumi program (infra/) against moto: mocks whose ``new_resource`` creates each
resource in a moto server and answers with moto's real id.

``tests/infra/harness.py`` runs the same program under mocks that invent ids; here every
registration becomes the boto3 call(s) the AWS provider would make, so the stack outputs the
program exports hold ids that exist: ``rayfleet render`` turns them into a cluster YAML, and
Ray's own AWS bootstrap and node provider launch from it, all in moto. When infra/ changes
what it creates, this follows, because nothing here re-describes the stack.

Mapped (created in moto, real id returned): VPC (+ DNS attributes), the VPC's default security
group (adopted: its rules revoked as the program asks), internet gateway, route tables,
routes, route table associations, Elastic IP, NAT gateway, subnets, S3 gateway endpoint,
flow-log log group (+ retention, KMS key), flow log, IAM roles, inline role policies,
attachments of customer managed policies, instance profiles, security groups, ingress/egress
rules, KMS keys (+ key policy, rotation), S3 buckets, ownership controls, public access block,
versioning, default encryption, lifecycle, server access logging, launch templates, the
budget; with rayfleet:headHa, the ElastiCache subnet group and replication group, the Secrets
Manager secret and its version, and the head address's subnet CIDR reservation.

Placeholders (an id is returned, nothing is created): the ``pulumi:providers:aws`` provider
(its ``defaultTags`` are applied to every resource, as the real provider does), the program's
own component resources, the cluster placement group (moto has no CreatePlacementGroup; the
launch templates still name it), attachments of AWS managed policies (the shared moto server
does not load them; the ARN is checked against moto's copy of AWS's list), and the bucket
policies' Deny statements (moto would apply them without their conditions, refusing
everything; their Allow statements are put, which is what lets moto accept the log bucket as
a server access logging target).

A resource type this module does not know, or an input it does not apply, fails the program
run with a line naming it, so infra/ cannot start creating something the moto chain silently
leaves out.

What the mocks cannot do: Pulumi's engine (diffs, updates, deletes) does not run, and
``get_ami``'s ``owners: [amazon]`` is not applied (an image the test registers belongs to the
test account; the name/architecture/state filters are).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from tests.infra.harness import execute

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
# What a Deep Learning AMI is called; the program finds its image by this name (get_ami).
DLAMI_STANDIN = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20250601"


class NotMapped(Exception):
    """infra/ asked for something these mocks do not create in moto."""


def _plain(value: Any) -> Any:
    """Pulumi hands numbers over as floats (6379.0); AWS wants integers."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class _Inputs:
    """A resource's inputs. Every key must be read by its handler (or ignored with a reason),
    so an input infra/ starts setting that is not applied in moto fails instead of vanishing."""

    def __init__(self, raw: dict):
        self._raw = raw
        self._read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self._read.add(key)
        return _plain(self._raw[key])

    def get(self, key: str, default: Any = None) -> Any:
        self._read.add(key)
        return _plain(self._raw.get(key, default))

    def ignore(self, *keys: str) -> None:
        self._read.update(keys)

    def keys(self) -> list[str]:
        return list(self._raw)

    def unread(self) -> list[str]:
        return sorted(set(self._raw) - self._read)


# Pulumi's marker of a secret value, as the mock monitor hands one over: {SIG: ..., "value": v}.
_SECRET_SIG = "4dabf18193072939515e22adb298388d"


def _unsecret(value: Any) -> Any:
    """The value inside a Pulumi secret (what the provider would send AWS)."""
    if isinstance(value, dict) and _SECRET_SIG in value:
        return value["value"]
    return value


def _ec2_tags(resource_type: str, tags: dict[str, str]) -> list[dict]:
    if not tags:
        return []
    return [{"ResourceType": resource_type,
             "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]


def _pascal(value: Any) -> Any:
    """Terraform-schema inputs (camelCase, "true" strings) -> EC2 API shapes (PascalCase,
    booleans). Anything EC2 does not know is then refused by botocore's parameter
    validation, which is what keeps the launch template mapping honest."""
    renames = {"vpcSecurityGroupIds": "SecurityGroupIds", "securityGroups": "Groups"}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = renames.get(k, k[:1].upper() + k[1:])
            if k == "tags" and isinstance(v, dict):
                out["Tags"] = [{"Key": tk, "Value": tv} for tk, tv in v.items()]
            else:
                out[key] = _pascal(v)
        return out
    if isinstance(value, list):
        return [_pascal(v) for v in value]
    if value in ("true", "false"):
        return value == "true"
    return value


class MotoMocks(pulumi.runtime.Mocks):
    """Creates what the program registers in moto (through ``session``) and answers with the
    real ids, ARNs and names."""

    def __init__(self, session, region: str = REGION):
        self.region = region
        self.ec2 = session.client("ec2", region_name=region)
        self.iam = session.client("iam", region_name=region)
        self.s3 = session.client("s3", region_name=region)
        self.kms = session.client("kms", region_name=region)
        self.logs = session.client("logs", region_name=region)
        self.budgets = session.client("budgets", region_name=region)
        self.elasticache = session.client("elasticache", region_name=region)
        self.secretsmanager = session.client("secretsmanager", region_name=region)
        self.account = session.client("sts", region_name=region).get_caller_identity()["Account"]
        # Pulumi registers resources from a thread pool; moto's backends are not meant for
        # concurrent writers, and the order of creation is easier to read in a failure.
        self._lock = threading.Lock()
        self._default_tags: dict[str, dict[str, str]] = {}
        self.created: list[tuple[str, str, str]] = []  # (type, logical name, moto id)
        self.placeholders: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ invokes

    def call(self, args: pulumi.runtime.MockCallArgs):
        a = _plain(dict(args.args))
        token = args.token
        if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            filters = [{"Name": f["name"], "Values": f["values"]} for f in a.get("filters", [])]
            if a.get("state"):
                filters.append({"Name": "state", "Values": [a["state"]]})
            zones = self.ec2.describe_availability_zones(Filters=filters)["AvailabilityZones"]
            return {"id": self.region, "names": [z["ZoneName"] for z in zones],
                    "zoneIds": [z["ZoneId"] for z in zones]}
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"id": self.account, "accountId": self.account,
                    "arn": f"arn:aws:iam::{self.account}:user/moto", "userId": "moto"}
        if token == "aws:ec2/getAmi:getAmi":
            filters = [{"Name": f["name"], "Values": f["values"]} for f in a.get("filters", [])]
            images = self.ec2.describe_images(Filters=filters)["Images"]
            if not images:
                raise NotMapped(f"get_ami: no image matches {filters}; register one first")
            image = sorted(images, key=lambda i: i.get("CreationDate", ""))[-1] \
                if a.get("mostRecent") else images[0]
            return {"id": image["ImageId"], "imageId": image["ImageId"], "name": image["Name"],
                    "architecture": image["Architecture"],
                    "rootDeviceName": image["RootDeviceName"]}
        raise NotMapped(f"the moto mocks do not answer invoke {token}")

    # ------------------------------------------------------------------ resources

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        with self._lock:
            if not args.custom:  # a ComponentResource of the program: nothing in AWS
                self.placeholders.append((args.typ, args.name))
                return args.name, {}
            handler = _HANDLERS.get(args.typ)
            if handler is None:
                raise NotMapped(f"{args.typ} {args.name!r}: tests/moto/pulumi_moto.py does not "
                                "create this type in moto; map it there")
            inputs = _Inputs(dict(args.inputs))
            provider = (args.provider or "").rsplit("::", 1)[-1]
            rid, outputs = handler(self, args.name, inputs,
                                   {**self._default_tags.get(provider, {}),
                                    **(inputs.get("tags") or {})})
            if inputs.unread():
                raise NotMapped(f"{args.typ} {args.name!r}: inputs {inputs.unread()} are not "
                                "applied in moto; map them in tests/moto/pulumi_moto.py")
            if (args.typ, args.name) not in self.placeholders:
                self.created.append((args.typ, args.name, rid))
            return rid, {**_plain(dict(args.inputs)), **outputs}

    def _arn(self, service: str, resource: str) -> str:
        return f"arn:aws:{service}:{self.region}:{self.account}:{resource}"

    def _provider(self, name, i, tags):
        if i["region"] != self.region:
            raise NotMapped(f"provider region {i['region']} is not the test's {self.region}")
        default = json.loads(i.get("defaultTags") or "{}").get("tags") or {}
        rid = f"provider-{name}"
        self._default_tags[rid] = default
        self.placeholders.append(("pulumi:providers:aws", name))
        # Credentials and region checks of the real provider: moto answers for any.
        i.ignore("skipRegionValidation", "skipCredentialsValidation")
        return rid, {}

    # -- network

    def _vpc(self, name, i, tags):
        vpc = self.ec2.create_vpc(CidrBlock=i["cidrBlock"],
                                  TagSpecifications=_ec2_tags("vpc", tags))["Vpc"]
        vid = vpc["VpcId"]
        for key, attr in (("enableDnsSupport", "EnableDnsSupport"),
                          ("enableDnsHostnames", "EnableDnsHostnames")):
            if i.get(key) is not None:
                self.ec2.modify_vpc_attribute(VpcId=vid, **{attr: {"Value": i[key]}})
        default_sg = self.ec2.describe_security_groups(Filters=[
            {"Name": "vpc-id", "Values": [vid]},
            {"Name": "group-name", "Values": ["default"]}])["SecurityGroups"][0]["GroupId"]
        return vid, {"arn": self._arn("ec2", f"vpc/{vid}"), "ownerId": self.account,
                     "defaultSecurityGroupId": default_sg, "tagsAll": tags}

    def _default_security_group(self, name, i, tags):
        """Adopt the VPC's default group and leave it with exactly the program's rules."""
        vid = i["vpcId"]
        group = self.ec2.describe_security_groups(Filters=[
            {"Name": "vpc-id", "Values": [vid]},
            {"Name": "group-name", "Values": ["default"]}])["SecurityGroups"][0]
        if i.get("ingress") or i.get("egress"):
            raise NotMapped(f"{name}: rules on the default security group")
        if group["IpPermissions"]:
            self.ec2.revoke_security_group_ingress(GroupId=group["GroupId"],
                                                   IpPermissions=group["IpPermissions"])
        if group["IpPermissionsEgress"]:
            self.ec2.revoke_security_group_egress(GroupId=group["GroupId"],
                                                  IpPermissions=group["IpPermissionsEgress"])
        if tags:
            self.ec2.create_tags(Resources=[group["GroupId"]],
                                 Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
        gid = group["GroupId"]
        return gid, {"arn": self._arn("ec2", f"security-group/{gid}"), "name": "default",
                     "tagsAll": tags}

    def _internet_gateway(self, name, i, tags):
        igw = self.ec2.create_internet_gateway(
            TagSpecifications=_ec2_tags("internet-gateway", tags))["InternetGateway"]
        gid = igw["InternetGatewayId"]
        if i.get("vpcId"):
            self.ec2.attach_internet_gateway(InternetGatewayId=gid, VpcId=i["vpcId"])
        return gid, {"arn": self._arn("ec2", f"internet-gateway/{gid}"), "tagsAll": tags}

    def _route_table(self, name, i, tags):
        if i.get("routes"):
            raise NotMapped(f"{name}: inline routes")
        rtb = self.ec2.create_route_table(
            VpcId=i["vpcId"], TagSpecifications=_ec2_tags("route-table", tags))["RouteTable"]
        rid = rtb["RouteTableId"]
        return rid, {"arn": self._arn("ec2", f"route-table/{rid}"), "tagsAll": tags}

    def _route(self, name, i, tags):
        target = {k: i[src] for src, k in (("gatewayId", "GatewayId"),
                                           ("natGatewayId", "NatGatewayId"))
                  if i.get(src)}
        self.ec2.create_route(RouteTableId=i["routeTableId"],
                              DestinationCidrBlock=i["destinationCidrBlock"], **target)
        # The AWS provider's id for a route: "r-" + table id + a hash of the destination.
        return f"r-{i['routeTableId']}{zlib.crc32(i['destinationCidrBlock'].encode())}", {}

    def _route_table_association(self, name, i, tags):
        assoc = self.ec2.associate_route_table(RouteTableId=i["routeTableId"],
                                               SubnetId=i["subnetId"])
        return assoc["AssociationId"], {}

    def _subnet(self, name, i, tags):
        subnet = self.ec2.create_subnet(
            VpcId=i["vpcId"], CidrBlock=i["cidrBlock"], AvailabilityZone=i["availabilityZone"],
            TagSpecifications=_ec2_tags("subnet", tags))["Subnet"]
        sid = subnet["SubnetId"]
        if i.get("mapPublicIpOnLaunch") is not None:
            self.ec2.modify_subnet_attribute(SubnetId=sid, MapPublicIpOnLaunch={
                "Value": i["mapPublicIpOnLaunch"]})
        return sid, {"arn": subnet.get("SubnetArn") or self._arn("ec2", f"subnet/{sid}"),
                     "availabilityZoneId": subnet.get("AvailabilityZoneId", ""),
                     "tagsAll": tags}

    def _eip(self, name, i, tags):
        eip = self.ec2.allocate_address(Domain=i["domain"],
                                        TagSpecifications=_ec2_tags("elastic-ip", tags))
        return eip["AllocationId"], {"allocationId": eip["AllocationId"],
                                     "publicIp": eip["PublicIp"], "tagsAll": tags}

    def _nat_gateway(self, name, i, tags):
        nat = self.ec2.create_nat_gateway(
            SubnetId=i["subnetId"], AllocationId=i["allocationId"],
            TagSpecifications=_ec2_tags("natgateway", tags))["NatGateway"]
        return nat["NatGatewayId"], {"tagsAll": tags}

    def _vpc_endpoint(self, name, i, tags):
        ep = self.ec2.create_vpc_endpoint(
            VpcId=i["vpcId"], ServiceName=i["serviceName"],
            VpcEndpointType=i["vpcEndpointType"], RouteTableIds=i.get("routeTableIds") or [],
            TagSpecifications=_ec2_tags("vpc-endpoint", tags))["VpcEndpoint"]
        eid = ep["VpcEndpointId"]
        return eid, {"arn": self._arn("ec2", f"vpc-endpoint/{eid}"), "tagsAll": tags}

    def _log_group(self, name, i, tags):
        group = i.get("name") or i["namePrefix"] + time.strftime("%Y%m%d%H%M%S") + \
            secrets.token_hex(4)
        self.logs.create_log_group(logGroupName=group, **({"tags": tags} if tags else {}),
                                   **({"kmsKeyId": i["kmsKeyId"]} if i.get("kmsKeyId") else {}))
        if i.get("retentionInDays"):
            self.logs.put_retention_policy(logGroupName=group,
                                           retentionInDays=i["retentionInDays"])
        return group, {"name": group, "arn": self._arn("logs", f"log-group:{group}"),
                       "tagsAll": tags}

    def _flow_log(self, name, i, tags):
        fl = self.ec2.create_flow_logs(
            ResourceIds=[i["vpcId"]], ResourceType="VPC", TrafficType=i["trafficType"],
            LogDestinationType=i["logDestinationType"], LogDestination=i["logDestination"],
            DeliverLogsPermissionArn=i["iamRoleArn"],
            MaxAggregationInterval=i["maxAggregationInterval"],
            TagSpecifications=_ec2_tags("vpc-flow-log", tags))
        if fl.get("Unsuccessful"):
            raise NotMapped(f"{name}: moto refused the flow log: {fl['Unsuccessful']}")
        fid = fl["FlowLogIds"][0]
        return fid, {"arn": self._arn("ec2", f"vpc-flow-log/{fid}"), "tagsAll": tags}

    # -- security groups

    def _security_group(self, name, i, tags):
        if i.get("ingress") or i.get("egress"):
            raise NotMapped(f"{name}: inline security group rules")
        group_name = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        gid = self.ec2.create_security_group(
            GroupName=group_name, Description=i["description"], VpcId=i["vpcId"],
            TagSpecifications=_ec2_tags("security-group", tags))["GroupId"]
        # The AWS provider removes the allow-all egress rule EC2 adds to every new group, so
        # a group has exactly the rules the program declares
        # (https://registry.terraform.io/providers/hashicorp/aws/latest/docs/resources/security_group).
        self.ec2.revoke_security_group_egress(GroupId=gid, IpPermissions=[
            {"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}])
        # Only matters on `pulumi destroy`, which the mocks do not run.
        i.ignore("revokeRulesOnDelete")
        return gid, {"name": group_name, "arn": self._arn("ec2", f"security-group/{gid}"),
                     "ownerId": self.account, "tagsAll": tags}

    def _permission(self, i) -> dict:
        perm: dict[str, Any] = {"IpProtocol": i["ipProtocol"]}
        if i.get("fromPort") is not None:
            perm.update(FromPort=i["fromPort"], ToPort=i["toPort"])
        else:
            i.ignore("toPort")
        desc = {"Description": i["description"]} if i.get("description") else {}
        if i.get("referencedSecurityGroupId"):
            perm["UserIdGroupPairs"] = [{"GroupId": i["referencedSecurityGroupId"], **desc}]
        elif i.get("cidrIpv4"):
            perm["IpRanges"] = [{"CidrIp": i["cidrIpv4"], **desc}]
        elif i.get("cidrIpv6"):
            perm["Ipv6Ranges"] = [{"CidrIpv6": i["cidrIpv6"], **desc}]
        elif i.get("prefixListId"):
            perm["PrefixListIds"] = [{"PrefixListId": i["prefixListId"], **desc}]
        return perm

    def _rule(self, direction: str, name, i, tags):
        call = (self.ec2.authorize_security_group_ingress if direction == "ingress"
                else self.ec2.authorize_security_group_egress)
        out = call(GroupId=i["securityGroupId"], IpPermissions=[self._permission(i)],
                   TagSpecifications=_ec2_tags("security-group-rule", tags))
        rid = out["SecurityGroupRules"][0]["SecurityGroupRuleId"]
        return rid, {"securityGroupRuleId": rid,
                     "arn": self._arn("ec2", f"security-group-rule/{rid}"), "tagsAll": tags}

    def _ingress_rule(self, name, i, tags):
        return self._rule("ingress", name, i, tags)

    def _egress_rule(self, name, i, tags):
        return self._rule("egress", name, i, tags)

    # -- storage

    def _kms_key(self, name, i, tags):
        key = self.kms.create_key(
            Description=i.get("description") or "",
            **({"Policy": i["policy"]} if i.get("policy") else {}),
            Tags=[{"TagKey": k, "TagValue": v} for k, v in tags.items()])["KeyMetadata"]
        if i.get("enableKeyRotation"):
            self.kms.enable_key_rotation(KeyId=key["KeyId"])
        # Only matters on `pulumi destroy`, which the mocks do not run.
        i.ignore("deletionWindowInDays")
        return key["KeyId"], {"keyId": key["KeyId"], "arn": key["Arn"], "tagsAll": tags}

    def _bucket(self, name, i, tags):
        # Pulumi's bucket_prefix: the prefix, then a unique suffix (26 characters).
        bucket = i.get("bucket") or (i["bucketPrefix"] + time.strftime("%Y%m%d%H%M%S")
                                     + secrets.token_hex(6))
        kwargs = {} if self.region == "us-east-1" else {
            "CreateBucketConfiguration": {"LocationConstraint": self.region}}
        self.s3.create_bucket(Bucket=bucket, **kwargs)
        if tags:
            self.s3.put_bucket_tagging(Bucket=bucket, Tagging={
                "TagSet": [{"Key": k, "Value": v} for k, v in tags.items()]})
        # Only matters on `pulumi destroy` (a non-empty bucket is kept), not run here.
        i.ignore("forceDestroy")
        return bucket, {"bucket": bucket, "arn": f"arn:aws:s3:::{bucket}",
                        "bucketDomainName": f"{bucket}.s3.amazonaws.com",
                        "region": self.region, "tagsAll": tags}

    def _ownership(self, name, i, tags):
        self.s3.put_bucket_ownership_controls(Bucket=i["bucket"], OwnershipControls={
            "Rules": [{"ObjectOwnership": i["rule"]["objectOwnership"]}]})
        return i["bucket"], {}

    def _public_access_block(self, name, i, tags):
        flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                 "restrictPublicBuckets")
        self.s3.put_public_access_block(Bucket=i["bucket"], PublicAccessBlockConfiguration={
            f[:1].upper() + f[1:]: bool(i.get(f)) for f in flags})
        return i["bucket"], {}

    def _versioning(self, name, i, tags):
        self.s3.put_bucket_versioning(Bucket=i["bucket"], VersioningConfiguration={
            "Status": i["versioningConfiguration"]["status"]})
        return i["bucket"], {}

    def _encryption(self, name, i, tags):
        rules = []
        for r in i["rules"]:
            d = r["applyServerSideEncryptionByDefault"]
            default = {"SSEAlgorithm": d["sseAlgorithm"]}
            if d.get("kmsMasterKeyId"):
                default["KMSMasterKeyID"] = d["kmsMasterKeyId"]
            rules.append({"ApplyServerSideEncryptionByDefault": default,
                          "BucketKeyEnabled": bool(r.get("bucketKeyEnabled"))})
        self.s3.put_bucket_encryption(Bucket=i["bucket"],
                                      ServerSideEncryptionConfiguration={"Rules": rules})
        return i["bucket"], {}

    def _lifecycle(self, name, i, tags):
        rules = []
        for r in i["rules"]:
            rule = _pascal({k: v for k, v in r.items() if k != "id"})
            rules.append({"ID": r["id"], **rule})
        self.s3.put_bucket_lifecycle_configuration(Bucket=i["bucket"],
                                                   LifecycleConfiguration={"Rules": rules})
        return i["bucket"], {}

    def _bucket_policy(self, name, i, tags):
        """A placeholder: moto evaluates a bucket policy's Deny statements without their
        Condition blocks (moto/iam/access_control.py: "TODO add support for the Resource and
        Condition parts"), so the TLS-only policy would deny every request, HTTPS or not, unlike
        AWS. The policy is parsed and the bucket checked to exist; nothing is put."""
        statements = json.loads(i["policy"])["Statement"]
        if not statements:
            raise NotMapped(f"{name}: an empty bucket policy")
        self.s3.head_bucket(Bucket=i["bucket"])
        allows = [s for s in statements if s.get("Effect") == "Allow"]
        if allows:
            self.s3.put_bucket_policy(Bucket=i["bucket"], Policy=json.dumps(
                {"Version": "2012-10-17", "Statement": allows}))
        self.placeholders.append(("aws:s3/bucketPolicy:BucketPolicy", name))
        return i["bucket"], {}

    def _bucket_logging(self, name, i, tags):
        # moto, like S3, refuses a target whose policy does not let logging.s3.amazonaws.com
        # put objects under the prefix.
        self.s3.put_bucket_logging(Bucket=i["bucket"], BucketLoggingStatus={"LoggingEnabled": {
            "TargetBucket": i["targetBucket"], "TargetPrefix": i["targetPrefix"]}})
        return i["bucket"], {}

    # -- IAM

    def _role(self, name, i, tags):
        role_name = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        role = self.iam.create_role(
            RoleName=role_name, AssumeRolePolicyDocument=i["assumeRolePolicy"],
            Description=i.get("description") or "",
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()])["Role"]
        return role_name, {"name": role_name, "arn": role["Arn"], "uniqueId": role["RoleId"],
                           "tagsAll": tags}

    def _role_policy(self, name, i, tags):
        policy_name = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        self.iam.put_role_policy(RoleName=i["role"], PolicyName=policy_name,
                                 PolicyDocument=i["policy"])
        return f"{i['role']}:{policy_name}", {"name": policy_name}

    def _role_policy_attachment(self, name, i, tags):
        arn = i["policyArn"]
        rid = f"{i['role']}-{secrets.token_hex(4)}"
        aws_managed = re.fullmatch(r"arn:aws:iam::aws:policy/(?:.*/)?([^/]+)", arn)
        if aws_managed:
            # moto knows AWS's managed policies only when its server starts with
            # MOTO_IAM_LOAD_MANAGED_POLICIES=true, which the session's shared server does not.
            # The ARN is checked against moto's copy of AWS's list instead, and recorded as a
            # placeholder: nothing is attached in moto.
            from moto.iam.aws_managed_policies import aws_managed_policies_data

            if aws_managed.group(1) not in json.loads(aws_managed_policies_data):
                raise NotMapped(f"{name}: {arn} is not an AWS managed policy")
            self.placeholders.append(("aws:iam/rolePolicyAttachment:RolePolicyAttachment",
                                      name))
            return rid, {}
        self.iam.attach_role_policy(RoleName=i["role"], PolicyArn=arn)
        return rid, {}

    def _instance_profile(self, name, i, tags):
        profile_name = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        profile = self.iam.create_instance_profile(
            InstanceProfileName=profile_name,
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()])["InstanceProfile"]
        if i.get("role"):
            self.iam.add_role_to_instance_profile(InstanceProfileName=profile_name,
                                                  RoleName=i["role"])
        return profile_name, {"name": profile_name, "arn": profile["Arn"],
                              "uniqueId": profile["InstanceProfileId"], "tagsAll": tags}

    # -- nodes

    def _placement_group(self, name, i, tags):
        """A placeholder: moto (5.2.5) has no CreatePlacementGroup ("not been implemented").
        The name is what the worker templates reference, and moto's RunInstances accepts
        it without looking it up."""
        group_name = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        i.ignore("strategy")
        self.placeholders.append(("aws:ec2/placementGroup:PlacementGroup", name))
        return group_name, {"name": group_name, "placementGroupId": f"pg-{secrets.token_hex(8)}",
                            "arn": self._arn("ec2", f"placement-group/{group_name}"),
                            "tagsAll": tags}

    def _launch_template(self, name, i, tags):
        lt_name = i.get("name") or (i.get("namePrefix") or f"{name}-") + secrets.token_hex(4)[:7]
        # Settings of the template itself, not of the instances it launches. The first
        # version is the default one, so the version settings only matter on updates.
        meta = ("name", "namePrefix", "description", "tags", "updateDefaultVersion",
                "defaultVersion")
        i.ignore(*meta)
        data = _pascal({k: i[k] for k in i.keys() if k not in meta})
        lt = self.ec2.create_launch_template(
            LaunchTemplateName=lt_name, VersionDescription=i.get("description") or "",
            LaunchTemplateData=data,
            TagSpecifications=_ec2_tags("launch-template", tags))["LaunchTemplate"]
        lid = lt["LaunchTemplateId"]
        return lid, {"name": lt_name, "arn": self._arn("ec2", f"launch-template/{lid}"),
                     "latestVersion": lt["LatestVersionNumber"],
                     "defaultVersion": lt["DefaultVersionNumber"], "tagsAll": tags}

    # -- rayfleet:headHa

    def _cache_subnet_group(self, name, i, tags):
        group = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        out = self.elasticache.create_cache_subnet_group(
            CacheSubnetGroupName=group, CacheSubnetGroupDescription=i["description"],
            SubnetIds=i["subnetIds"],
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()])["CacheSubnetGroup"]
        return group, {"name": group, "arn": out.get("ARN") or self._arn(
            "elasticache", f"subnetgroup:{group}"), "tagsAll": tags}

    def _replication_group(self, name, i, tags):
        rgid = i["replicationGroupId"]
        # Settings of the update, not of the group.
        i.ignore("applyImmediately")
        kwargs = {"KmsKeyId": i.get("kmsKeyId")} if i.get("kmsKeyId") else {}
        rg = self.elasticache.create_replication_group(
            ReplicationGroupId=rgid, ReplicationGroupDescription=i["description"],
            Engine=i["engine"], EngineVersion=i["engineVersion"], CacheNodeType=i["nodeType"],
            Port=i["port"], NumCacheClusters=i["numCacheClusters"],
            AutomaticFailoverEnabled=i["automaticFailoverEnabled"],
            MultiAZEnabled=i["multiAzEnabled"], CacheSubnetGroupName=i["subnetGroupName"],
            SecurityGroupIds=i["securityGroupIds"],
            AtRestEncryptionEnabled=i["atRestEncryptionEnabled"],
            TransitEncryptionEnabled=i["transitEncryptionEnabled"],
            TransitEncryptionMode=i["transitEncryptionMode"],
            AuthToken=_unsecret(i["authToken"]),
            SnapshotRetentionLimit=i["snapshotRetentionLimit"],
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()], **kwargs)["ReplicationGroup"]
        groups = rg.get("NodeGroups") or [{}]
        endpoint = (groups[0].get("PrimaryEndpoint") or {}).get("Address") or \
            f"master.{rgid}.moto.use1.cache.amazonaws.com"
        return rgid, {"arn": rg.get("ARN") or self._arn("elasticache", f"replicationgroup:{rgid}"),
                      "primaryEndpointAddress": endpoint, "tagsAll": tags}

    def _secret(self, name, i, tags):
        secret_name = i.get("name") or f"{name}-{secrets.token_hex(4)[:7]}"
        # The deletion window applies when the secret is deleted, which no mock does.
        i.ignore("recoveryWindowInDays")
        kwargs = {"KmsKeyId": i.get("kmsKeyId")} if i.get("kmsKeyId") else {}
        out = self.secretsmanager.create_secret(
            Name=secret_name, Description=i.get("description") or "",
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()], **kwargs)
        # The provider's id of a secret is its ARN.
        return out["ARN"], {"arn": out["ARN"], "name": secret_name, "tagsAll": tags}

    def _secret_version(self, name, i, tags):
        out = self.secretsmanager.put_secret_value(SecretId=i["secretId"],
                                                   SecretString=_unsecret(i["secretString"]))
        return f"{i['secretId']}|{out['VersionId']}", {"versionId": out["VersionId"],
                                                       "arn": out["ARN"]}

    def _subnet_cidr_reservation(self, name, i, tags):
        out = self.ec2.create_subnet_cidr_reservation(
            SubnetId=i["subnetId"], Cidr=i["cidrBlock"], ReservationType=i["reservationType"],
            Description=i.get("description") or "")["SubnetCidrReservation"]
        return out["SubnetCidrReservationId"], {}

    def _budget(self, name, i, tags):
        budget_name = i.get("name") or i["namePrefix"] + secrets.token_hex(4)
        notifications = [{
            "Notification": {"NotificationType": n["notificationType"],
                             "ComparisonOperator": n["comparisonOperator"],
                             "Threshold": float(n["threshold"]),
                             "ThresholdType": n["thresholdType"]},
            "Subscribers": [{"SubscriptionType": "EMAIL", "Address": a}
                            for a in n["subscriberEmailAddresses"]],
        } for n in i.get("notifications") or []]
        self.budgets.create_budget(AccountId=self.account, Budget={
            "BudgetName": budget_name, "BudgetType": i["budgetType"],
            "TimeUnit": i["timeUnit"],
            "BudgetLimit": {"Amount": str(i["limitAmount"]), "Unit": i["limitUnit"]},
        }, NotificationsWithSubscribers=notifications)
        return f"{self.account}:{budget_name}", {
            "name": budget_name, "arn": f"arn:aws:budgets::{self.account}:budget/{budget_name}"}


_HANDLERS = {
    "pulumi:providers:aws": MotoMocks._provider,
    "aws:ec2/vpc:Vpc": MotoMocks._vpc,
    "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup": MotoMocks._default_security_group,
    "aws:ec2/internetGateway:InternetGateway": MotoMocks._internet_gateway,
    "aws:ec2/routeTable:RouteTable": MotoMocks._route_table,
    "aws:ec2/route:Route": MotoMocks._route,
    "aws:ec2/routeTableAssociation:RouteTableAssociation": MotoMocks._route_table_association,
    "aws:ec2/subnet:Subnet": MotoMocks._subnet,
    "aws:ec2/eip:Eip": MotoMocks._eip,
    "aws:ec2/natGateway:NatGateway": MotoMocks._nat_gateway,
    "aws:ec2/vpcEndpoint:VpcEndpoint": MotoMocks._vpc_endpoint,
    "aws:cloudwatch/logGroup:LogGroup": MotoMocks._log_group,
    "aws:ec2/flowLog:FlowLog": MotoMocks._flow_log,
    "aws:ec2/securityGroup:SecurityGroup": MotoMocks._security_group,
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": MotoMocks._ingress_rule,
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": MotoMocks._egress_rule,
    "aws:kms/key:Key": MotoMocks._kms_key,
    "aws:s3/bucket:Bucket": MotoMocks._bucket,
    "aws:s3/bucketOwnershipControls:BucketOwnershipControls": MotoMocks._ownership,
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": MotoMocks._public_access_block,
    "aws:s3/bucketVersioning:BucketVersioning": MotoMocks._versioning,
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration":
        MotoMocks._encryption,
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration": MotoMocks._lifecycle,
    "aws:s3/bucketPolicy:BucketPolicy": MotoMocks._bucket_policy,
    "aws:s3/bucketLogging:BucketLogging": MotoMocks._bucket_logging,
    "aws:iam/role:Role": MotoMocks._role,
    "aws:iam/rolePolicy:RolePolicy": MotoMocks._role_policy,
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment": MotoMocks._role_policy_attachment,
    "aws:iam/instanceProfile:InstanceProfile": MotoMocks._instance_profile,
    "aws:ec2/placementGroup:PlacementGroup": MotoMocks._placement_group,
    "aws:ec2/launchTemplate:LaunchTemplate": MotoMocks._launch_template,
    "aws:budgets/budget:Budget": MotoMocks._budget,
    "aws:elasticache/subnetGroup:SubnetGroup": MotoMocks._cache_subnet_group,
    "aws:elasticache/replicationGroup:ReplicationGroup": MotoMocks._replication_group,
    "aws:secretsmanager/secret:Secret": MotoMocks._secret,
    "aws:secretsmanager/secretVersion:SecretVersion": MotoMocks._secret_version,
    "aws:ec2/subnetCidrReservation:SubnetCidrReservation": MotoMocks._subnet_cidr_reservation,
}


# ---------------------------------------------------------------------- running the program

def run_program(mocks: MotoMocks, config: dict[str, Any], stack: str = "dev") -> dict[str, Any]:
    """Run infra/__main__.py with ``config`` under ``mocks``; return what it exported."""
    return execute(mocks, config, stack=stack)


# ---------------------------------------------------------------------- fixtures

@dataclass
class InfraStack:
    """The example stack, built in moto by infra/ itself."""

    outputs: dict[str, Any]  # the `rayfleet` stack output, with moto's ids
    path: Path  # outputs.json, as `pulumi stack output --json` writes it
    mocks: MotoMocks
    ami_id: str
    key_name: str
    key_material: str = ""


@pytest.fixture
def moto_account(moto_server, monkeypatch):
    """A fresh AWS account of its own on the session's moto server, for this test only.

    moto keeps one state per account; assuming a role in an unused account id gives this
    test empty EC2/IAM/S3 without resetting the server other tests share
    (https://docs.getmoto.org/en/latest/docs/multi_account.html). The environment points every
    boto3 client made in this process (Ray's, rayfleet's) at it, as a real shell would.
    """
    import boto3

    account = f"{secrets.randbelow(9 * 10**11) + 10**11}"
    sts = boto3.client("sts", endpoint_url=moto_server, region_name=REGION,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    creds = sts.assume_role(RoleArn=f"arn:aws:iam::{account}:role/rayfleet-test",
                            RoleSessionName="rayfleet-test")["Credentials"]
    env = {"AWS_ACCESS_KEY_ID": creds["AccessKeyId"],
           "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
           "AWS_SESSION_TOKEN": creds["SessionToken"], "AWS_DEFAULT_REGION": REGION,
           "AWS_ENDPOINT_URL": moto_server}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_EC2",
              "AWS_ENDPOINT_URL_IAM"):
        monkeypatch.delenv(k, raising=False)
    # boto3's default session (used by Ray and rayfleet) keeps the credentials it first
    # resolved; an earlier test's would send this test's calls to another account.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    _forget_ray_clients()
    yield boto3.Session(region_name=REGION)
    # Ray caches boto3 clients per process: one made for this account must not be reused
    # with the next test's credentials.
    _forget_ray_clients()


def _forget_ray_clients() -> None:
    from ray.autoscaler._private.aws import config as ray_aws_config
    from ray.autoscaler._private.aws import utils as ray_aws_utils

    ray_aws_utils.resource_cache.cache_clear()
    ray_aws_utils.client_cache.cache_clear()
    ray_aws_config._get_subnets_or_die.cache_clear()


@pytest.fixture
def infra_stack(moto_account, tmp_path) -> InfraStack:
    """`pulumi up` of Pulumi.dev.yaml, as far as it can go offline (:func:`build_stack`)."""
    return build_stack(moto_account, tmp_path)


def register_dlami(ec2) -> str:
    """The Deep Learning AMI the program looks up by name and architecture (get_ami), as AWS
    publishes it in every region: its id. moto's RegisterImage drops Architecture and
    RootDeviceName; an image baked from an instance has both, as the real one does."""
    builder = ec2.run_instances(ImageId="ami-0123456789abcdef0", MinCount=1,
                                MaxCount=1)["Instances"][0]["InstanceId"]
    ami = ec2.create_image(InstanceId=builder, Name=DLAMI_STANDIN)["ImageId"]
    ec2.terminate_instances(InstanceIds=[builder])
    return ami


def build_stack(session, directory: Path, overrides: dict[str, Any] | None = None
                ) -> InfraStack:
    """infra/__main__.py under :class:`MotoMocks` with Pulumi.dev.yaml's config (plus
    ``overrides``, keys as in that file), so every resource exists in moto; its `rayfleet`
    output in ``directory``/outputs.json. Plus what the README has the user do by hand: the
    operator key pair (its private key in ``key_material``)."""
    ec2 = session.client("ec2")
    ami = register_dlami(ec2)
    config = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())["config"]
    config.update(overrides or {})
    mocks = MotoMocks(session, region=config["rayfleet:region"])
    exported = run_program(mocks, config, stack="dev")
    o = exported["rayfleet"]
    key_name = f"{o['cluster_name']}-operator"
    material = ec2.create_key_pair(KeyName=key_name)["KeyMaterial"]
    path = directory / "outputs.json"
    # `pulumi stack output --json` prints every output; `rayfleet render` reads `rayfleet`.
    path.write_text(json.dumps(exported, indent=2))
    return InfraStack(outputs=o, path=path, mocks=mocks, ami_id=ami, key_name=key_name,
                      key_material=material)


def ray_launch_config(rendered: Path) -> dict:
    """The rendered YAML as `ray up` prepares and bootstraps it, with Ray's own code."""
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.util import prepare_config

    return bootstrap_aws(prepare_config(yaml.safe_load(rendered.read_text())))


def launch_worker(cfg: dict, name: str, ec2) -> dict:
    """Ray's own AWS node provider launches one worker of node type ``name`` from the
    bootstrapped config (ray_launch_config), as the autoscaler would: the instance moto made."""
    import copy

    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    provider = AWSNodeProvider(cfg["provider"], cfg["cluster_name"])
    provider.create_node(copy.deepcopy(cfg["available_node_types"][name]["node_config"]),
                         {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: name}, 1)
    (i,) = [i for r in ec2.describe_instances(Filters=[
        {"Name": f"tag:{TAG_RAY_USER_NODE_TYPE}", "Values": [name]}])["Reservations"]
        for i in r["Instances"]]
    return i


def account_inventory(session) -> dict[str, set[str]]:
    """What Ray's bootstrap would create if the YAML let it: groups, key pairs, roles,
    instance profiles."""
    ec2, iam = session.client("ec2"), session.client("iam")
    return {
        "security groups": {g["GroupId"] for g in
                            ec2.describe_security_groups()["SecurityGroups"]},
        "key pairs": {k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"]},
        "roles": {r["RoleName"] for r in iam.list_roles()["Roles"]},
        "instance profiles": {p["InstanceProfileName"] for p in
                              iam.list_instance_profiles()["InstanceProfiles"]},
    }


def cluster_instances(ec2, cluster: str) -> list[dict]:
    live = ["pending", "running", "stopping", "stopped"]
    return [i for r in ec2.describe_instances(Filters=[
        {"Name": "tag:ray-cluster-name", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": live}])["Reservations"]
        for i in r["Instances"]]



def role_actions(iam, role_arn: str) -> list[str]:
    """Every action the role's inline policies allow (patterns such as ``s3:Get*`` as
    written)."""
    role = role_arn.rsplit("/", 1)[-1]
    return [a for p in iam.list_role_policies(RoleName=role)["PolicyNames"]
            for st in iam.get_role_policy(RoleName=role, PolicyName=p)[
                "PolicyDocument"]["Statement"] if st["Effect"] == "Allow"
            for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])]


def load_agent(name: str):
    """A node agent of rayfleet/agents/, loaded from its file as the node runs it (a script,
    not part of a package)."""
    import importlib.util
    import sys

    path = ROOT / "rayfleet" / "agents" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"rayfleet_agent_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
