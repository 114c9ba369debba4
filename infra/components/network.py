"""The VPC the cluster lives in: nodes in private subnets, egress through NAT, flow logs on.

Layout per AZ: one large private subnet (nodes) and one small public subnet (NAT only). No
subnet maps public IPs on launch, so even a node placed in a public subnet by mistake gets no
public address (rule 7).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from rayfleet.errors import ConfigError
from rayfleet.facts import TAG_TIER

from .storage import stack_key


@dataclass(frozen=True)
class NetworkArgs:
    cluster_name: str
    region: str
    partition: str
    vpc_cidr: str
    private_subnet_cidrs: tuple[str, ...]  # one per AZ, from rayfleet.config.NetworkConfig
    public_subnet_cidrs: tuple[str, ...]
    nat_gateways: str  # "single" | "per-az"
    flow_log_retention_days: int
    worker_az: str | None = None  # None: the first available AZ
    # AZs of rayfleet:capacityReservations: each needs a private subnet (its template's).
    reserved_azs: tuple[str, ...] = ()
    # rayfleet:workerFallbackAzs: each needs a private subnet too (its templates' EFA
    # interfaces), found the same way as a reservation's.
    fallback_azs: tuple[str, ...] = ()


class Network(pulumi.ComponentResource):
    """VPC, subnets, IGW, NAT, routes, S3 gateway endpoint, flow logs, default SG denied."""

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:Network", name, None, opts)
        self.availability_zones = self._zones(args)
        letters = [az[len(args.region):] for az in self.availability_zones]

        self.vpc = self._vpc(name, args)
        igw = self._public_subnets(name, args, letters)
        nats = self._nat_gateways(name, args, letters, igw)
        private_rts = self._private_subnets(name, args, letters, nats)
        self._s3_endpoint(name, args, private_rts)
        self._flow_logs(name, args)

        self.worker_subnet = self.private_subnets[0]
        self.private_subnet_ids = [s.id for s in self.private_subnets]
        self.register_outputs({
            "vpc_id": self.vpc.id,
            "vpc_arn": self.vpc.arn,
            "availability_zones": self.availability_zones,
            "private_subnet_ids": self.private_subnet_ids,
            "public_subnet_ids": [s.id for s in self.public_subnets],
            "worker_subnet_id": self.worker_subnet.id,
        })

    def _vpc(self, name: str, args: NetworkArgs) -> aws.ec2.Vpc:
        """The VPC, and its default security group stripped of every rule."""
        child = pulumi.ResourceOptions(parent=self)
        tag = args.cluster_name
        vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.vpc_cidr,
            # SSM, the S3 endpoint and EFA peers resolve each other through VPC DNS.
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags={"Name": tag},
            opts=child,
        )

        # Adopting the VPC's default group with no rules strips AWS's allow-all-from-self rule,
        # so a node launched without an explicit group talks to nothing (rule 5, EC2.2).
        self.default_security_group = aws.ec2.DefaultSecurityGroup(
            f"{name}-default-sg",
            vpc_id=vpc.id,
            ingress=[],
            egress=[],
            tags={"Name": f"{tag}-default-deny-all"},
            opts=child,
        )
        return vpc

    def _public_subnets(self, name: str, args: NetworkArgs,
                        letters: list[str]) -> aws.ec2.InternetGateway:
        """The internet gateway, the public route table and one public subnet per AZ (in
        ``self.public_subnets``); returns the gateway."""
        child = pulumi.ResourceOptions(parent=self)
        tag = args.cluster_name
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=self.vpc.id,
                                      tags={"Name": tag}, opts=child)
        public_rt = aws.ec2.RouteTable(f"{name}-public", vpc_id=self.vpc.id,
                                       tags={"Name": f"{tag}-public"}, opts=child)
        aws.ec2.Route(f"{name}-public-default", route_table_id=public_rt.id,
                      destination_cidr_block="0.0.0.0/0", gateway_id=igw.id, opts=child)

        self.public_subnets: list[aws.ec2.Subnet] = []
        for az, letter, cidr in zip(self.availability_zones, letters, args.public_subnet_cidrs,
                                    strict=True):
            subnet = aws.ec2.Subnet(
                f"{name}-public-{letter}",
                vpc_id=self.vpc.id,
                availability_zone=az,
                cidr_block=cidr,
                # Only NAT gateways live here, and they bring their own Elastic IP.
                map_public_ip_on_launch=False,
                tags={"Name": f"{tag}-public-{letter}", TAG_TIER: "public"},
                opts=child,
            )
            aws.ec2.RouteTableAssociation(f"{name}-public-{letter}", subnet_id=subnet.id,
                                          route_table_id=public_rt.id, opts=child)
            self.public_subnets.append(subnet)
        return igw

    def _nat_gateways(self, name: str, args: NetworkArgs, letters: list[str],
                      igw: aws.ec2.InternetGateway) -> list[aws.ec2.NatGateway]:
        """One NAT gateway (with its Elastic IP) in the first public subnet, or one in each."""
        child = pulumi.ResourceOptions(parent=self)
        tag = args.cluster_name
        nat_count = len(self.availability_zones) if args.nat_gateways == "per-az" else 1
        nats = []
        for letter, subnet in list(zip(letters, self.public_subnets, strict=True))[:nat_count]:
            eip = aws.ec2.Eip(f"{name}-nat-{letter}", domain="vpc",
                              tags={"Name": f"{tag}-nat-{letter}"}, opts=child)
            nats.append(aws.ec2.NatGateway(
                f"{name}-nat-{letter}",
                allocation_id=eip.allocation_id,
                subnet_id=subnet.id,
                tags={"Name": f"{tag}-nat-{letter}"},
                # A NAT gateway created before the IGW is attached fails to route.
                opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]),
            ))
        return nats

    def _private_subnets(self, name: str, args: NetworkArgs, letters: list[str],
                         nats: list[aws.ec2.NatGateway]) -> list[aws.ec2.RouteTable]:
        """One private subnet per AZ (in ``self.private_subnets``), each with a route table
        leaving through a NAT gateway; returns the route tables."""
        child = pulumi.ResourceOptions(parent=self)
        tag = args.cluster_name
        self.private_subnets: list[aws.ec2.Subnet] = []
        private_rts = []
        for i, (az, letter, cidr) in enumerate(
                zip(self.availability_zones, letters, args.private_subnet_cidrs, strict=True)):
            subnet = aws.ec2.Subnet(
                f"{name}-private-{letter}",
                vpc_id=self.vpc.id,
                availability_zone=az,
                cidr_block=cidr,
                map_public_ip_on_launch=False,
                tags={"Name": f"{tag}-private-{letter}", TAG_TIER: "private"},
                opts=child,
            )
            rt = aws.ec2.RouteTable(f"{name}-private-{letter}", vpc_id=self.vpc.id,
                                    tags={"Name": f"{tag}-private-{letter}"}, opts=child)
            # per-az: each AZ leaves through its own NAT, so losing an AZ loses only its nodes.
            aws.ec2.Route(f"{name}-private-{letter}-default", route_table_id=rt.id,
                          destination_cidr_block="0.0.0.0/0",
                          nat_gateway_id=nats[i % len(nats)].id, opts=child)
            aws.ec2.RouteTableAssociation(f"{name}-private-{letter}", subnet_id=subnet.id,
                                          route_table_id=rt.id, opts=child)
            self.private_subnets.append(subnet)
            private_rts.append(rt)
        return private_rts

    def _s3_endpoint(self, name: str, args: NetworkArgs,
                     private_rts: list[aws.ec2.RouteTable]) -> None:
        """The S3 gateway endpoint on the private route tables."""
        # Checkpoints and data go to S3 without crossing the NAT (no per-GB NAT charge). The
        # endpoint policy stays AWS's default (full access): nodes also read AWS-owned buckets
        # (ECR layers, package mirrors); the roles' IAM policies are what limit the bucket.
        aws.ec2.VpcEndpoint(
            f"{name}-s3",
            vpc_id=self.vpc.id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=[rt.id for rt in private_rts],
            tags={"Name": f"{args.cluster_name}-s3"},
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _zones(self, args: NetworkArgs) -> list[str]:
        """The AZs to use, the workers' AZ first (its private subnet hosts the A100s), and
        every other AZ a worker template needs among them (each of rayfleet:workerFallbackAzs
        and each reservation's: its templates' interfaces live in that AZ's private subnet):
        a needed AZ the first ``azCount`` leave out takes the place of the last one nothing
        needs, so adding one moves as few subnets as it can. Raised before any resource of the
        network: a needed AZ the region does not offer, a fallback AZ that is the workers'
        own (an empty rayfleet:workerAz resolves only here), or more AZs needed than
        rayfleet:azCount."""
        wanted = len(args.private_subnet_cidrs)
        zones = aws.get_availability_zones(
            state="available",
            # Local and Wavelength zones are opt-in and lack p4d; keep to the region's own AZs.
            filters=[aws.GetAvailabilityZonesFilterArgs(name="opt-in-status",
                                                        values=["opt-in-not-required"])],
            opts=pulumi.InvokeOptions(parent=self),
        ).names
        zones = sorted(zones or [])
        if args.worker_az is not None:
            if args.worker_az not in zones:
                raise ConfigError("rayfleet:workerAz",
                                  f"{args.worker_az} is not an available AZ of {args.region}",
                                  allowed=zones, value=args.worker_az)
            zones = [args.worker_az] + [z for z in zones if z != args.worker_az]
        if len(zones) < wanted:
            raise ConfigError("rayfleet:azCount",
                              f"is {wanted} but {args.region} has {len(zones)} available AZs "
                              f"({', '.join(zones)})")
        chosen = zones[:wanted]
        # Each AZ a worker template needs, with the key that asks for it and how it says so.
        extra = [(az, "rayfleet:workerFallbackAzs", "lists") for az in args.fallback_azs] + \
                [(az, "rayfleet:capacityReservations", "a reservation is in")
                 for az in args.reserved_azs]
        needed = [zones[0], *(az for az, _, _ in extra)]
        for az, key, says in extra:
            if az not in zones:
                raise ConfigError(key, f"{says} {az}, not an available AZ of {args.region}",
                                  allowed=zones, value=az)
            if key == "rayfleet:workerFallbackAzs" and az == zones[0]:
                raise ConfigError(key, f"lists {az}, the workers' own AZ (rayfleet:workerAz "
                                       "empty: the region's first available AZ); set "
                                       "rayfleet:workerAz, or name other AZs")
            if az in chosen:
                continue
            spare = [i for i, z in enumerate(chosen) if z not in needed]
            if not spare:
                count = len(set(needed))
                who = " and ".join(["the workers' AZ"]
                                   + ["their fallback AZs"] * bool(args.fallback_azs)
                                   + ["the reservations'"] * bool(args.reserved_azs))
                raise ConfigError("rayfleet:azCount",
                                  f"is {wanted} but {who} need {count} "
                                  f"({', '.join(dict.fromkeys(needed))}); raise "
                                  f"rayfleet:azCount to {count}")
            chosen[spare[-1]] = az
        return chosen

    def _flow_logs(self, name: str, args: NetworkArgs) -> None:
        """Flow logs of every ENI in the VPC to CloudWatch, kept for a retention (rule 8),
        encrypted with a key of the stack (rule 28)."""
        child = pulumi.ResourceOptions(parent=self)
        account = aws.get_caller_identity(opts=pulumi.InvokeOptions(parent=self)).account_id
        prefix = f"/rayfleet/{args.cluster_name}/vpc-flow-logs-"
        # CloudWatch Logs encrypts with a customer-managed key only if the key policy lets the
        # region's Logs service use it, for this account's log groups
        # (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html).
        key = stack_key(
            f"{name}-flow-logs-key", f"rayfleet {args.cluster_name}: VPC flow log group",
            args.partition, account, {
                "Sid": "CloudWatchLogsOfThisStack",
                "Effect": "Allow",
                "Principal": {"Service": f"logs.{args.region}.amazonaws.com"},
                "Action": ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*",
                           "kms:GenerateDataKey*", "kms:Describe*"],
                "Resource": "*",
                "Condition": {"ArnLike": {
                    "kms:EncryptionContext:aws:logs:arn": pulumi.Output.concat(
                        f"arn:{args.partition}:logs:{args.region}:", account,
                        f":log-group:{prefix}*")}},
            }, child)
        log_group = aws.cloudwatch.LogGroup(
            f"{name}-flow-logs",
            name_prefix=prefix,
            retention_in_days=args.flow_log_retention_days,
            kms_key_id=key.arn,
            opts=child,
        )
        # The service may assume the role only on behalf of this account's flow logs
        # (confused-deputy guard, https://docs.aws.amazon.com/vpc/latest/userguide/flow-logs-iam-role.html).
        trust = {
            "Version": "2012-10-17",
            "Statement": [{
                "Effect": "Allow",
                "Principal": {"Service": "vpc-flow-logs.amazonaws.com"},
                "Action": "sts:AssumeRole",
                "Condition": {
                    "StringEquals": {"aws:SourceAccount": account},
                    "ArnLike": {"aws:SourceArn":
                                f"arn:{args.partition}:ec2:{args.region}:{account}:vpc-flow-log/*"},
                },
            }],
        }
        role = aws.iam.Role(
            f"{name}-flow-logs",
            description=f"VPC flow logs of {args.cluster_name} write to their log group",
            assume_role_policy=json.dumps(trust),
            opts=child,
        )
        aws.iam.RolePolicy(
            f"{name}-flow-logs",
            role=role.name,
            policy=pulumi.Output.json_dumps({
                "Version": "2012-10-17",
                "Statement": [{
                    "Effect": "Allow",
                    "Action": ["logs:CreateLogStream", "logs:PutLogEvents",
                               "logs:DescribeLogStreams"],
                    "Resource": [log_group.arn, pulumi.Output.concat(log_group.arn, ":*")],
                }],
            }),
            opts=child,
        )
        aws.ec2.FlowLog(
            f"{name}-flow-log",
            vpc_id=self.vpc.id,
            traffic_type="ALL",
            log_destination_type="cloud-watch-logs",
            log_destination=log_group.arn,
            iam_role_arn=role.arn,
            max_aggregation_interval=60,
            tags={"Name": args.cluster_name},
            opts=child,
        )
        self.flow_log_group = log_group
