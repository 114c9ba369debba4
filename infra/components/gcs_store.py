"""rayfleet:headHa: losing the head is not losing the cluster.

Two components, built only when the stack turns the setting on:

- :class:`GcsStore`, the Redis the head's GCS keeps its tables in (Ray's GCS fault tolerance,
  https://docs.ray.io/en/latest/ray-core/fault_tolerance/gcs.html): an ElastiCache replication
  group in the private subnets, encrypted at rest, TLS required in transit, behind an auth
  token; its own security group admits its port from the cluster's group and nothing else
  (rule 33). With subnets in two or more AZs it keeps a replica in another AZ and fails over
  to it. The token is drawn once, kept in Secrets Manager and in Pulumi's state as a secret,
  and only the head role may read it (rule 33).
- :class:`HeadAddress`, the private address every head launches at: an explicit subnet CIDR
  reservation in the workers' subnet, which EC2 never hands out on its own, and the address
  inside it that render puts in the head's node config (``PrivateIpAddress``). A replaced head
  comes back where the workers' raylets look for their GCS.

Why not a network interface of its own, which an instance could be launched onto: Ray 2.60's
AWS bootstrap (ray/autoscaler/_private/aws/config.py,
_configure_subnets_and_groups_from_network_interfaces) requires every NetworkInterfaces entry
of a node config to name a SubnetId and Groups, and EC2's RunInstances refuses an entry that
names both a NetworkInterfaceId and a subnet ("A network interface may not specify both a
network interface ID and a subnet"). An instance-level PrivateIpAddress with one SubnetIds
entry passes both.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from rayfleet.facts import GCS_STORE_NODE_TYPE, GCS_STORE_PORT

# ElastiCache's Redis OSS engine; 7.1 is the newest Redis OSS ElastiCache offers, and Ray's GCS
# uses plain commands any of them answer.
ENGINE = "redis"
ENGINE_VERSION = "7.1"
# An auth token is 16-128 printable characters without @, " or / (ElastiCache's AUTH rules);
# 32 random bytes as hex are 64 of them.
AUTH_TOKEN_BYTES = 32
# The reservation the head's address sits in: a /28, the size AWS's own examples reserve,
# taken from the top of the subnet but one (the last /28 holds the address AWS keeps for
# itself, the subnet's last).
RESERVATION_PREFIX = 28


def head_address(subnet_cidr: str) -> tuple[str, str]:
    """(the reservation's CIDR, the head's address in it) for a private subnet's CIDR."""
    net = ipaddress.ip_network(subnet_cidr)
    blocks = list(net.subnets(new_prefix=RESERVATION_PREFIX))
    block = blocks[-2]
    return str(block), str(block.network_address + 4)


@dataclass(frozen=True)
class GcsStoreArgs:
    cluster_name: str
    partition: str
    region: str
    vpc_id: pulumi.Input[str]
    private_subnet_ids: Sequence[pulumi.Input[str]]   # one per AZ
    cluster_security_group_id: pulumi.Input[str]
    head_role_name: pulumi.Input[str]
    port: int = GCS_STORE_PORT
    node_type: str = GCS_STORE_NODE_TYPE


class GcsStore(pulumi.ComponentResource):
    """The GCS's Redis: subnet group, security group, auth token secret, replication group,
    and the head role's permission to read the token."""

    def __init__(self, name: str, args: GcsStoreArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:GcsStore", name, None, opts)
        self.subnet_group = aws.elasticache.SubnetGroup(
            f"{name}-subnets",
            description=f"GCS store of {args.cluster_name}: the private subnets only",
            subnet_ids=list(args.private_subnet_ids),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.security_group = self._security_group(name, args)
        self.secret, self.secret_version = self._auth_token(name, args)
        self.replication_group = self._replication_group(name, args)
        self.head_policy = self._head_policy(name, args)

        self.endpoint = self.replication_group.primary_endpoint_address
        self.port = args.port
        self.register_outputs({
            "endpoint": self.endpoint,
            "port": self.port,
            "auth_secret_arn": self.secret.arn,
            "security_group_id": self.security_group.id,
        })

    def _security_group(self, name: str, args: GcsStoreArgs) -> aws.ec2.SecurityGroup:
        """The store's group: its port from the cluster's group, nothing else (rule 33)."""
        child = pulumi.ResourceOptions(parent=self)
        group = aws.ec2.SecurityGroup(
            f"{name}-sg",
            description=(f"GCS store of {args.cluster_name}: Redis from the cluster security "
                         "group only, no other inbound, no outbound"),
            vpc_id=args.vpc_id,
            revoke_rules_on_delete=True,
            tags={"Name": f"{args.cluster_name}-gcs-store"},
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-redis-from-cluster",
            security_group_id=group.id,
            referenced_security_group_id=args.cluster_security_group_id,
            ip_protocol="tcp",
            from_port=args.port,
            to_port=args.port,
            description="Redis over TLS for the GCS on the head - from cluster nodes only",
            opts=child,
        )
        return group

    def _auth_token(self, name: str, args: GcsStoreArgs) -> tuple[
            aws.secretsmanager.Secret, aws.secretsmanager.SecretVersion]:
        """The auth token's secret and its one version, the token drawn once."""
        secret = aws.secretsmanager.Secret(
            f"{name}-auth",
            description=(f"Auth token of the GCS store of {args.cluster_name}: read by the head "
                         "role only, at boot, into a 0600 file"),
            # AWS's aws/secretsmanager key: the stack's own key serves S3 alone (its key policy
            # allows no other service, rule 29), and the head needs no KMS grant for this one.
            recovery_window_in_days=7,
            opts=pulumi.ResourceOptions(parent=self),
        )
        # Drawn once: the version keeps its first value (ignore_changes), and the cache takes
        # its token from the version's state, so both hold the same one on every later `pulumi
        # up`, a replaced cache included. pulumi_random is not a dependency of the kit; the
        # secrets module is the standard library's CSPRNG.
        version = aws.secretsmanager.SecretVersion(
            f"{name}-auth",
            secret_id=secret.id,
            secret_string=pulumi.Output.secret(secrets.token_hex(AUTH_TOKEN_BYTES)),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["secretString"]),
        )
        return secret, version

    def _replication_group(self, name: str,
                           args: GcsStoreArgs) -> aws.elasticache.ReplicationGroup:
        """The Redis itself: encrypted, TLS required, behind the token; with a replica in
        another AZ when the subnets span two or more."""
        c = args.cluster_name
        multi_az = len(args.private_subnet_ids) >= 2
        return aws.elasticache.ReplicationGroup(
            f"{name}-redis",
            # ElastiCache ids are at most 40 characters; a cluster name is at most 32.
            replication_group_id=f"{c}-gcs",
            description=f"GCS fault tolerance of {c}: the GCS tables outlive the head",
            engine=ENGINE,
            engine_version=ENGINE_VERSION,
            node_type=args.node_type,
            port=args.port,
            num_cache_clusters=2 if multi_az else 1,
            automatic_failover_enabled=multi_az,
            multi_az_enabled=multi_az,
            subnet_group_name=self.subnet_group.name,
            security_group_ids=[self.security_group.id],
            # ElastiCache's own key, for the reason the secret has AWS's.
            at_rest_encryption_enabled=True,
            transit_encryption_enabled=True,
            transit_encryption_mode="required",
            auth_token=pulumi.Output.secret(self.secret_version.secret_string),
            snapshot_retention_limit=1,
            apply_immediately=True,
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _head_policy(self, name: str, args: GcsStoreArgs) -> aws.iam.RolePolicy:
        """The head role's permission to read the token (rule 33)."""
        statements = [{
            "Sid": "ReadTheGcsStoreToken",
            "Effect": "Allow",
            "Action": "secretsmanager:GetSecretValue",
            "Resource": self.secret.arn,
        }]
        return aws.iam.RolePolicy(
            f"{name}-head-token",
            role=args.head_role_name,
            policy=pulumi.Output.json_dumps({"Version": "2012-10-17",
                                             "Statement": statements}),
            opts=pulumi.ResourceOptions(parent=self),
        )


@dataclass(frozen=True)
class HeadAddressArgs:
    cluster_name: str
    subnet_id: pulumi.Input[str]
    subnet_cidr: pulumi.Input[str]


class HeadAddress(pulumi.ComponentResource):
    """The head's fixed private address: an explicit CIDR reservation in its subnet (EC2 hands
    none of it out by itself) and the address inside it every head launches at."""

    def __init__(self, name: str, args: HeadAddressArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:HeadAddress", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        where = pulumi.Output.from_input(args.subnet_cidr).apply(head_address)
        self.reservation = aws.ec2.SubnetCidrReservation(
            f"{name}-reservation",
            subnet_id=args.subnet_id,
            cidr_block=where.apply(lambda w: w[0]),
            reservation_type="explicit",
            description=(f"Head of {args.cluster_name}: a replaced head comes back at the "
                         "same address; EC2 assigns none of these by itself"),
            opts=child,
        )
        self.private_ip = where.apply(lambda w: w[1])
        self.subnet_id = args.subnet_id
        self.register_outputs({"private_ip": self.private_ip, "subnet_id": self.subnet_id})
