"""Node roles: least privilege for what Ray's head and workers actually do (rules 16-19, 26).

Ray's own launcher attaches AmazonEC2FullAccess and AmazonS3FullAccess to its default roles;
here the head may launch, tag and terminate only instances carrying the cluster's
``ray-cluster-name`` tag and pass only the worker role, and both roles reach only the bucket's
key prefix. Both trust ec2.amazonaws.com alone. SSM Session Manager access comes from AWS's
AmazonSSMManagedInstanceCore, the documented minimum for managed nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from rayfleet.facts import RAY_CLUSTER_TAG, TAG_NODE_ROLE

# The EC2 reads Ray 2.60's AWS node provider makes with the head's credentials
# (ray/autoscaler/_private/aws/node_provider.py): DescribeInstances to list and re-read its
# nodes, DescribeInstanceTypes to fill in a node type's resources, DescribeImages for its
# CloudWatch-agent check. Nothing else on the head calls EC2. `ec2:Describe*` would add every
# other Describe action, DescribeInstanceAttribute among them (any instance's user data).
# tests/infra/test_program.py compares this list with the provider's source, and the moto
# chain (tests/moto/test_chain.py) the calls it makes with what the head role grants.
HEAD_DESCRIBE_ACTIONS = ("ec2:DescribeInstances", "ec2:DescribeInstanceTypes",
                         "ec2:DescribeImages")

EC2_TRUST = json.dumps({
    "Version": "2012-10-17",
    "Statement": [{
        "Effect": "Allow",
        "Principal": {"Service": "ec2.amazonaws.com"},
        "Action": "sts:AssumeRole",
    }],
})


@dataclass(frozen=True)
class IamArgs:
    cluster_name: str
    region: str
    partition: str
    vpc_arn: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    key_prefix: str  # e.g. "rayfleet/": the only part of the bucket the nodes may touch
    kms_key_arn: pulumi.Input[str] | None = None
    # rayfleet:capacityReservations' targets (cr-... ids, resource group ARNs) the head's
    # autoscaler launches into.
    capacity_reservations: tuple[str, ...] = ()


class Iam(pulumi.ComponentResource):
    """Head and worker roles, their policies, and their instance profiles."""

    def __init__(self, name: str, args: IamArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:Iam", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        ssm_core = f"arn:{args.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"

        self.worker_role = aws.iam.Role(
            f"{name}-worker",
            description=f"Ray A100 workers of {args.cluster_name}: bucket prefix and SSM only",
            assume_role_policy=EC2_TRUST,
            tags={TAG_NODE_ROLE: "worker"},
            opts=child,
        )
        self.head_role = aws.iam.Role(
            f"{name}-head",
            description=(f"Ray head of {args.cluster_name}: launches and ends its own "
                         "tagged workers, bucket prefix, SSM"),
            assume_role_policy=EC2_TRUST,
            tags={TAG_NODE_ROLE: "head"},
            opts=child,
        )

        storage = _storage_policy(args)
        for role_name, role in (("head", self.head_role), ("worker", self.worker_role)):
            aws.iam.RolePolicy(f"{name}-{role_name}-storage", role=role.name, policy=storage,
                               opts=child)
            aws.iam.RolePolicyAttachment(f"{name}-{role_name}-ssm", role=role.name,
                                         policy_arn=ssm_core, opts=child)
        aws.iam.RolePolicy(f"{name}-head-autoscaler", role=self.head_role.name,
                           policy=_autoscaler_policy(args, self.worker_role.arn), opts=child)
        if args.capacity_reservations:
            # A Capacity Block's workers read its end (rayfleet/agents/spot.py): EC2 starts
            # terminating them 30 minutes before it. Describe actions take no resource scope.
            aws.iam.RolePolicy(f"{name}-worker-reservations", role=self.worker_role.name,
                               policy=json.dumps({"Version": "2012-10-17", "Statement": [{
                                   "Sid": "ReadTheBlocksEnd", "Effect": "Allow",
                                   "Action": "ec2:DescribeCapacityReservations",
                                   "Resource": "*"}]}), opts=child)

        self.head_profile = aws.iam.InstanceProfile(f"{name}-head", role=self.head_role.name,
                                                    opts=child)
        self.worker_profile = aws.iam.InstanceProfile(f"{name}-worker",
                                                      role=self.worker_role.name, opts=child)
        self.register_outputs({
            "head_role_arn": self.head_role.arn,
            "worker_role_arn": self.worker_role.arn,
            "head_instance_profile_arn": self.head_profile.arn,
            "worker_instance_profile_arn": self.worker_profile.arn,
        })


def _storage_policy(args: IamArgs) -> pulumi.Output[str]:
    """Read/write under the key prefix of the one bucket (rule 17)."""
    prefix = args.key_prefix
    statements: list[dict] = [
        {
            "Sid": "ListClusterPrefix",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": args.bucket_arn,
            # IfExists: HeadBucket and S3's 404 for a missing key need a ListBucket that names
            # no prefix (docs/security.md, rule 17, says why and what it costs).
            "Condition": {"StringLikeIfExists": {"s3:prefix": [f"{prefix}*",
                                                               prefix.rstrip("/")]}},
        },
        {
            # pyarrow and boto3 ask where the bucket is and list unfinished uploads to resume.
            "Sid": "BucketMetadata",
            "Effect": "Allow",
            "Action": ["s3:GetBucketLocation", "s3:ListBucketMultipartUploads"],
            "Resource": args.bucket_arn,
        },
        {
            "Sid": "ReadWriteClusterPrefix",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:GetObjectVersion", "s3:PutObject",
                       "s3:DeleteObject", "s3:AbortMultipartUpload",
                       "s3:ListMultipartUploadParts"],
            "Resource": pulumi.Output.concat(args.bucket_arn, f"/{prefix}*"),
        },
    ]
    if args.kms_key_arn is not None:
        statements.append({
            # The bucket's key, and only when S3 uses it on the node's behalf.
            "Sid": "UseBucketKeyThroughS3",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": args.kms_key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": f"s3.{args.region}.amazonaws.com"}},
        })
    return pulumi.Output.json_dumps({"Version": "2012-10-17", "Statement": statements})


def _reserved_launch(args: IamArgs, ec2: str) -> list[dict]:
    """A launch into a capacity reservation is authorized on the reservation too (RunInstances'
    capacity-reservation resource): the stack's own reservations only. A resource group's
    members are the group's to change, so a group target allows the account's reservations in
    this region; none configured, no statement."""
    if not args.capacity_reservations:
        return []
    groups = any(not t.startswith("cr-") for t in args.capacity_reservations)
    resources = [f"{ec2}:*:capacity-reservation/*"] if groups else [
        f"{ec2}:*:capacity-reservation/{t}" for t in args.capacity_reservations]
    return [{"Sid": "LaunchIntoTheStacksReservations", "Effect": "Allow",
             "Action": "ec2:RunInstances", "Resource": resources}]


def _autoscaler_policy(args: IamArgs, worker_role_arn: pulumi.Output[str]) -> pulumi.Output[str]:
    """What the autoscaler on the head calls (ray/autoscaler/_private/aws/node_provider.py)."""
    ec2 = f"arn:{args.partition}:ec2:{args.region}"
    return pulumi.Output.json_dumps({
        "Version": "2012-10-17",
        "Statement": _reserved_launch(args, ec2) + [
            {
                # The instance itself must carry the cluster tag in the launch request; Ray
                # always sends it. Without it RunInstances is denied as a whole.
                "Sid": "LaunchOnlyClusterTaggedInstances",
                "Effect": "Allow",
                "Action": "ec2:RunInstances",
                "Resource": f"{ec2}:*:instance/*",
                "Condition": {"StringEquals": {f"aws:RequestTag/{RAY_CLUSTER_TAG}":
                                               args.cluster_name}},
            },
            {
                "Sid": "LaunchIntoClusterVpcOnly",
                "Effect": "Allow",
                "Action": "ec2:RunInstances",
                "Resource": [f"{ec2}:*:subnet/*", f"{ec2}:*:security-group/*"],
                "Condition": {"ArnEquals": {"ec2:Vpc": args.vpc_arn}},
            },
            {
                # The other resources one RunInstances touches cannot carry the request tag;
                # they are usable only inside a launch the first statement allowed.
                "Sid": "LaunchSupportingResources",
                "Effect": "Allow",
                "Action": "ec2:RunInstances",
                "Resource": [f"{ec2}::image/*", f"{ec2}:*:volume/*",
                             f"{ec2}:*:network-interface/*", f"{ec2}:*:key-pair/*",
                             f"{ec2}:*:placement-group/*", f"{ec2}:*:launch-template/*",
                             f"{ec2}:*:spot-instances-request/*"],
            },
            {
                "Sid": "TagOnlyAtLaunch",
                "Effect": "Allow",
                "Action": "ec2:CreateTags",
                "Resource": [f"{ec2}:*:instance/*", f"{ec2}:*:volume/*",
                             f"{ec2}:*:network-interface/*",
                             f"{ec2}:*:spot-instances-request/*"],
                "Condition": {"StringEquals": {"ec2:CreateAction": "RunInstances"}},
            },
            {
                # Ray re-tags its nodes (status, launch config) and terminates them. Stop and
                # start are left out: rayfleet sets cache_stopped_nodes: false (rule 23).
                "Sid": "ManageOnlyClusterInstances",
                "Effect": "Allow",
                "Action": ["ec2:CreateTags", "ec2:TerminateInstances"],
                "Resource": f"{ec2}:*:instance/*",
                "Condition": {"StringEquals": {f"ec2:ResourceTag/{RAY_CLUSTER_TAG}":
                                               args.cluster_name}},
            },
            {
                # EC2 Describe calls support no resource-level permissions or conditions
                # (https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonec2.html),
                # so they are listed one by one instead (rule 26).
                "Sid": "DescribeWhatTheNodeProviderReads",
                "Effect": "Allow",
                "Action": list(HEAD_DESCRIBE_ACTIONS),
                "Resource": "*",
            },
            {
                "Sid": "PassOnlyTheWorkerRole",
                "Effect": "Allow",
                "Action": "iam:PassRole",
                "Resource": worker_role_arn,
                "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
            },
        ],
    })
