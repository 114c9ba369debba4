"""Security groups: Ray's ports open only between the cluster's own nodes.

The cluster group admits each port of ``rayfleet.facts.RAY_PORTS`` from itself alone
(rule 4), never from 0.0.0.0/0 (rules 1, 2). Operators reach the head through SSM Session
Manager, which needs no inbound rule at all; only when ``rayfleet:operatorCidrs`` names ranges
(a VPN, an office) do SSH and the dashboard also open to exactly those ranges. Every group and
rule carries a description (rule 6) in the character set EC2 accepts.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from rayfleet.facts import OPERATOR_PORTS, RAY_PORTS, RayPort, port


@dataclass(frozen=True)
class SecurityArgs:
    cluster_name: str
    vpc_id: pulumi.Input[str]
    operator_cidrs: tuple[str, ...] = ()
    ray_ports: tuple[RayPort, ...] = RAY_PORTS


class Security(pulumi.ComponentResource):
    """The cluster security group (all nodes) and the EFA group (A100 workers)."""

    def __init__(self, name: str, args: SecurityArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:Security", name, None, opts)
        self.cluster = self._cluster_group(name, args)
        self._ray_port_rules(name, args)
        self._operator_rules(name, args)
        self._cluster_egress(name)
        self.efa = self._efa_group(name, args)
        self.register_outputs({
            "cluster_security_group_id": self.cluster.id,
            "efa_security_group_id": self.efa.id,
        })

    def _cluster_group(self, name: str, args: SecurityArgs) -> aws.ec2.SecurityGroup:
        """The group every node of the cluster carries."""
        return aws.ec2.SecurityGroup(
            f"{name}-cluster",
            description=(f"Ray nodes of {args.cluster_name}: Ray ports from this group only, "
                         "no inbound from the internet"),
            vpc_id=args.vpc_id,
            # Rules live in their own resources; never mix them with inline rules.
            revoke_rules_on_delete=True,
            tags={"Name": f"{args.cluster_name}-cluster"},
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _ray_port_rules(self, name: str, args: SecurityArgs) -> None:
        """Each of Ray's ports, from the cluster group itself only."""
        child = pulumi.ResourceOptions(parent=self)
        for ray_port in args.ray_ports:
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-{ray_port.name}",
                security_group_id=self.cluster.id,
                referenced_security_group_id=self.cluster.id,
                ip_protocol="tcp",
                from_port=ray_port.from_port,
                to_port=ray_port.to_port,
                description=f"{ray_port.why} - from cluster nodes only",
                opts=child,
            )

    def _operator_rules(self, name: str, args: SecurityArgs) -> None:
        """SSH and the dashboard from each of rayfleet:operatorCidrs, if it names any."""
        child = pulumi.ResourceOptions(parent=self)
        for i, cidr in enumerate(args.operator_cidrs):
            v6 = ipaddress.ip_network(cidr).version == 6
            for port_name, what in OPERATOR_PORTS:
                number = port(port_name)
                aws.vpc.SecurityGroupIngressRule(
                    f"{name}-operator-{number}-{i}",
                    security_group_id=self.cluster.id,
                    cidr_ipv4=None if v6 else cidr,
                    cidr_ipv6=cidr if v6 else None,
                    ip_protocol="tcp",
                    from_port=number,
                    to_port=number,
                    description=f"{what} from operator range {cidr} (rayfleet:operatorCidrs)",
                    opts=child,
                )

    def _cluster_egress(self, name: str) -> None:
        """All outbound from the cluster group."""
        # Egress stays open: nodes pull wheels, images and models, and call the SSM, EC2 (the
        # autoscaler) and S3 APIs, all through the NAT gateway or the S3 endpoint. Egress opens
        # no listener; what can reach the nodes is decided by the ingress rules.
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-egress-all",
            security_group_id=self.cluster.id,
            cidr_ipv4="0.0.0.0/0",
            ip_protocol="-1",
            description="All outbound via NAT or the S3 endpoint: packages, models, SSM, EC2, S3",
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _efa_group(self, name: str, args: SecurityArgs) -> aws.ec2.SecurityGroup:
        """The EFA group, with all traffic in from and out to itself."""
        child = pulumi.ResourceOptions(parent=self)
        # EFA requires a group that admits all traffic from and to itself
        # (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html#efa-start-security).
        # It sits only on the A100 workers' EFA interfaces, next to the cluster group; NCCL's
        # bootstrap sockets between workers use ephemeral ports it also covers.
        efa = aws.ec2.SecurityGroup(
            f"{name}-efa",
            description=(f"EFA and NCCL between A100 workers of {args.cluster_name}: all "
                         "traffic from and to this group only"),
            vpc_id=args.vpc_id,
            revoke_rules_on_delete=True,
            tags={"Name": f"{args.cluster_name}-efa"},
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-efa-in",
            security_group_id=efa.id,
            referenced_security_group_id=efa.id,
            ip_protocol="-1",
            description="EFA: all traffic from A100 workers in this group",
            opts=child,
        )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-efa-out",
            security_group_id=efa.id,
            referenced_security_group_id=efa.id,
            ip_protocol="-1",
            description="EFA: all traffic to A100 workers in this group",
            opts=child,
        )
        return efa
