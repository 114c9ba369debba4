"""Launch templates the Ray autoscaler launches nodes from: the CPU head and the GPU workers,
one template per allowed worker type and market (spot, on-demand).

Ray's cluster launcher references these by id (``node_config: LaunchTemplate``) and adds the
subnet, security groups and instance profile itself (rule 3), so what lives here is what must
hold for every node however it is launched: the Deep Learning AMI, IMDSv2 (rule 9), encrypted
gp3 roots (rule 10), no public address (rule 7), the cluster tags that the head role's
permissions hinge on, and for the GPU workers their type's EFA interfaces (one per network
card: p4d 4, p5 32) and the one cluster placement group every worker type shares.

Reserved capacity (rayfleet:capacityReservations) gets one more worker template per
reservation: on-demand, or ``capacity-block`` for a Capacity Block, targeting exactly that
reservation (its id or resource group), its interfaces in the private subnet of the
reservation's AZ and without the placement group: a reservation is capacity in one AZ that
AWS already holds, and a cluster placement group in another AZ, or one the reserved instances
do not fit, would only make the launch fail.

Fallback AZs (rayfleet:workerFallbackAzs) get, each, a cluster placement group of their own
and per worker type one more spot and one more on-demand template, their EFA interfaces in
that AZ's private subnet and their placement that AZ's group: Ray rotates a node config's
SubnetIds on a launch error only when it names no NetworkInterfaces, so a template with EFA
interfaces stays in its one AZ, and the autoscaler reaches another AZ only through another
node type. A cluster placement group lives in one AZ, hence one per AZ. Every worker template
and placement group but a reservation's is tagged with its AZ, which the policy pack holds
its interfaces and group to (rule 32).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from rayfleet.catalog import InstanceSpec
from rayfleet.reservations import CapacityReservation
from rayfleet.facts import (
    CAPACITY_BLOCK_MARKET_TYPE,
    MARKETS,
    RAY_CLUSTER_TAG,
    TAG_AVAILABILITY_ZONE,
    TAG_CAPACITY_RESERVATION,
    TAG_CLUSTER,
    TAG_NODE_KIND,
    TAG_STACK,
)
# Module-level, so a test can swap it and watch the policy pack notice.
from rayfleet.facts import TAG_HOP_LIMIT_REASON as HOP_LIMIT_REASON_TAG

# AWS Deep Learning AMI with the open-source NVIDIA driver, CUDA, EFA installer, NCCL and
# PyTorch preinstalled (https://docs.aws.amazon.com/dlami/latest/devguide/appendix-ami-release-notes.html).
# The same image on the head keeps Python and Ray identical on every node (rule 25).
DLAMI_NAME_FILTER = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *"


@dataclass(frozen=True)
class GpuNodesArgs:
    cluster_name: str
    stack: str
    head_instance_type: str
    workers: tuple[InstanceSpec, ...]   # rayfleet:workerInstanceTypes, most preferred first
    head_root_volume_gb: int
    worker_root_volume_gb: int
    imds_hop_limit: int
    worker_subnet_id: pulumi.Input[str]
    cluster_security_group_id: pulumi.Input[str]
    efa_security_group_id: pulumi.Input[str]
    head_instance_profile_arn: pulumi.Input[str]
    worker_instance_profile_arn: pulumi.Input[str]
    ami_id: str | None = None  # None: the newest DLAMI
    # rayfleet:capacityReservations, and the private subnet of each AZ they are in.
    reservations: tuple[CapacityReservation, ...] = ()
    subnet_by_az: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    # The workers' AZ (worker_subnet_id's, resolved by Network) and rayfleet:workerFallbackAzs,
    # each of which subnet_by_az gives a private subnet.
    worker_az: str | None = None
    fallback_azs: tuple[str, ...] = ()


def user_data(cluster_name: str, node_kind: str) -> str:
    """The boot script, base64 as EC2 wants it. Settings only, never a credential (rule 20).

    User data is readable by anyone allowed ec2:DescribeInstanceAttribute and by every process
    on the node through IMDS; the Ray auth token therefore arrives later, over SSH, as a file
    with mode 0600 (rule 21), and never through here.
    """
    script = f"""#!/bin/bash
set -euo pipefail
install -d -m 0755 /etc/rayfleet
cat > /etc/rayfleet/node.env <<'ENV'
RAYFLEET_CLUSTER_NAME={cluster_name}
RAYFLEET_NODE_KIND={node_kind}
RAY_AUTH_MODE=token
ENV
chmod 0644 /etc/rayfleet/node.env
echo 'set -a; . /etc/rayfleet/node.env; set +a' > /etc/profile.d/rayfleet.sh
"""
    return base64.b64encode(script.encode()).decode()


def template_suffix(instance_type: str, market: str, az: str | None = None) -> str:
    """The worker template's name after the component's: ``worker-p5-48xlarge-spot``, and
    in a fallback AZ ``worker-p5-48xlarge-spot-us-east-1c``."""
    return f"worker-{instance_type.replace('.', '-')}-{market}" + (f"-{az}" if az else "")


class GpuNodes(pulumi.ComponentResource):
    """Cluster placement group and launch templates: the head, and per allowed worker type one
    template per reservation of it, one spot and one on-demand (``self.workers[(type,
    market)]``, in the stack's order); per fallback AZ a placement group
    (``self.fallback_placement_groups[az]``) and per type one spot and one on-demand template
    (``self.fallback_workers[(type, market, az)]``)."""

    def __init__(self, name: str, args: GpuNodesArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:GpuNodes", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        ami = self._ami(args)
        self.ami_id = ami.id
        root_device = ami.root_device_name or "/dev/sda1"

        # All GPU workers in one rack-level group: NCCL all-reduce over EFA needs the lowest
        # latency between nodes. A cluster group lives in one AZ, hence one worker subnet. Every
        # worker type shares it: AWS allows several types in a cluster group, though one type
        # has the best odds of capacity
        # (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/placement-strategies.html).
        self.placement_group = aws.ec2.PlacementGroup(
            f"{name}-workers",
            strategy="cluster",
            tags={"Name": f"{args.cluster_name}-workers", **_az_tag(args.worker_az)},
            opts=child,
        )
        # A fallback AZ's workers get a group of their own there: a cluster group is one AZ's.
        self.fallback_placement_groups: dict[str, aws.ec2.PlacementGroup] = {
            az: aws.ec2.PlacementGroup(
                f"{name}-workers-{az}",
                strategy="cluster",
                tags={"Name": f"{args.cluster_name}-workers-{az}", **_az_tag(az)},
                opts=child,
            ) for az in args.fallback_azs}

        self.head = aws.ec2.LaunchTemplate(
            f"{name}-head",
            description=f"Ray head (CPU) of {args.cluster_name}",
            instance_type=args.head_instance_type,
            vpc_security_group_ids=[args.cluster_security_group_id],
            user_data=user_data(args.cluster_name, "head"),
            block_device_mappings=[_root(root_device, args.head_root_volume_gb, 3000, 250)],
            tag_specifications=_tag_specs(args, "head", spot=False, efa=False),
            **self._common(args, "head", args.head_instance_profile_arn),
            opts=child,
        )

        # One template per (type, market): a template names one instance type, and its network
        # interfaces must match that type's network cards.
        self.workers: dict[tuple[str, str], aws.ec2.LaunchTemplate] = {}
        for worker in args.workers:
            for r in args.reservations:
                if r.instance_type == worker.name:
                    self.workers[(worker.name, r.market)] = self._reserved(
                        name, args, worker, r, root_device, child)
            for market in MARKETS:
                self.workers[(worker.name, market)] = self._worker(
                    name, args, worker, market, root_device, child)
        self.fallback_workers: dict[tuple[str, str, str], aws.ec2.LaunchTemplate] = {
            (worker.name, market, az): self._worker(name, args, worker, market, root_device,
                                                    child, az)
            for worker in args.workers for az in args.fallback_azs for market in MARKETS}

        self.register_outputs({
            "ami_id": self.ami_id,
            "placement_group": self.placement_group.name,
            "fallback_placement_groups": {az: pg.name for az, pg in
                                          self.fallback_placement_groups.items()},
            "head_launch_template_id": self.head.id,
            "worker_launch_template_ids": [lt.id for lt in [*self.workers.values(),
                                                            *self.fallback_workers.values()]],
        })

    def _worker(self, name: str, args: GpuNodesArgs, worker: InstanceSpec, market: str,
                root_device: str, child: pulumi.ResourceOptions,
                fallback_az: str | None = None) -> aws.ec2.LaunchTemplate:
        """A spot or on-demand template: in the workers' AZ, or in ``fallback_az`` (that AZ's
        private subnet and placement group)."""
        spot = market == "spot"
        where = f", fallback AZ {fallback_az}" if fallback_az else ""
        group = (self.fallback_placement_groups[fallback_az] if fallback_az
                 else self.placement_group)
        common = self._common(args, "worker", args.worker_instance_profile_arn)
        common["tags"] = {**common["tags"], **_az_tag(fallback_az or args.worker_az)}
        return aws.ec2.LaunchTemplate(
            f"{name}-{template_suffix(worker.name, market, fallback_az)}",
            description=(f"Ray {worker.name} worker ({'spot' if spot else 'on-demand'}{where}) "
                         f"of {args.cluster_name}"),
            instance_type=worker.name,
            network_interfaces=_efa_interfaces(
                args, worker, args.subnet_by_az[fallback_az] if fallback_az else None),
            placement=aws.ec2.LaunchTemplatePlacementArgs(group_name=group.name),
            instance_market_options=aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(
                market_type="spot",
                spot_options=aws.ec2.LaunchTemplateInstanceMarketOptionsSpotOptionsArgs(
                    # One-time and terminate: a reclaimed worker is gone, and the
                    # autoscaler replaces it; nothing stopped lingers to bill EBS.
                    spot_instance_type="one-time",
                    instance_interruption_behavior="terminate",
                ),
            ) if spot else None,
            user_data=user_data(args.cluster_name, "worker"),
            # Models, container images and wheels on a fast root; scratch data belongs on
            # the workers' local NVMe drives (p4d 8 x 1 TB, p5 8 x 3.84 TB), which the
            # DLAMI mounts at /opt/dlami/nvme.
            block_device_mappings=[_root(root_device, args.worker_root_volume_gb, 6000, 500)],
            tag_specifications=_tag_specs(args, "worker", spot=spot, efa=True),
            **common,
            opts=child,
        )

    def _reserved(self, name: str, args: GpuNodesArgs, worker: InstanceSpec,
                  r: CapacityReservation, root_device: str,
                  child: pulumi.ResourceOptions) -> aws.ec2.LaunchTemplate:
        """A template that launches only into reservation ``r``: by its id, or into any
        reservation of its resource group."""
        what = "Capacity Block" if r.capacity_block else "capacity reservation"
        common = self._common(args, "worker", args.worker_instance_profile_arn)
        # The target, tagged as well: what the template is for survives an edit that drops
        # the target, and the policy pack names such a template (rule 31).
        common["tags"] = {**common["tags"], TAG_CAPACITY_RESERVATION: r.target}
        return aws.ec2.LaunchTemplate(
            f"{name}-{template_suffix(worker.name, r.market)}",
            description=f"Ray {worker.name} worker ({what} {r.target}) of {args.cluster_name}",
            instance_type=worker.name,
            network_interfaces=_efa_interfaces(args, worker,
                                               args.subnet_by_az[r.availability_zone]),
            # A Capacity Block is launched with market type capacity-block and its reservation
            # id; an ODCR is on-demand (no market options) with its target. Neither is spot.
            instance_market_options=aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(
                market_type=CAPACITY_BLOCK_MARKET_TYPE) if r.capacity_block else None,
            capacity_reservation_specification=(
                aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
                    capacity_reservation_target=(
                        aws.ec2.LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs(
                            capacity_reservation_id=r.id,
                            capacity_reservation_resource_group_arn=r.resource_group_arn)))),
            user_data=user_data(args.cluster_name, "worker"),
            block_device_mappings=[_root(root_device, args.worker_root_volume_gb, 6000, 500)],
            tag_specifications=_tag_specs(args, "worker", spot=False, efa=True),
            **common,
            opts=child,
        )

    def _ami(self, args: GpuNodesArgs) -> aws.ec2.AwaitableGetAmiResult:
        invoke = pulumi.InvokeOptions(parent=self)
        if args.ami_id:
            # A pinned image is still looked up: it must exist and we need its root device.
            return aws.ec2.get_ami(filters=[aws.ec2.GetAmiFilterArgs(
                name="image-id", values=[args.ami_id])], opts=invoke)
        return aws.ec2.get_ami(
            most_recent=True,
            owners=["amazon"],
            filters=[
                aws.ec2.GetAmiFilterArgs(name="name", values=[DLAMI_NAME_FILTER]),
                aws.ec2.GetAmiFilterArgs(name="architecture", values=["x86_64"]),
                aws.ec2.GetAmiFilterArgs(name="state", values=["available"]),
            ],
            opts=invoke,
        )

    def _common(self, args: GpuNodesArgs, kind: str, profile_arn: pulumi.Input[str]) -> dict:
        tags = {"Name": f"{args.cluster_name}-{kind}", TAG_NODE_KIND: kind}
        if args.imds_hop_limit > 1:
            tags[HOP_LIMIT_REASON_TAG] = ("rayInDocker: Ray runs in containers, one network hop "
                                          "further from IMDS than the host")
        return {
            "image_id": self.ami_id,
            "iam_instance_profile": aws.ec2.LaunchTemplateIamInstanceProfileArgs(arn=profile_arn),
            "ebs_optimized": "true",
            # IMDSv2 only (session tokens defeat SSRF-style credential theft); hop limit 1
            # unless Ray runs in containers (rule 9, EC2.8).
            "metadata_options": aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled",
                http_tokens="required",
                http_put_response_hop_limit=args.imds_hop_limit,
                instance_metadata_tags="disabled",
            ),
            # `shutdown -h` on a node ends it instead of leaving a stopped instance that still
            # bills for its volumes (the same reason as cache_stopped_nodes: false).
            "instance_initiated_shutdown_behavior": "terminate",
            # New versions become the default, which is what Ray launches from.
            "update_default_version": True,
            "tags": tags,
        }


def _az_tag(az: str | None) -> dict[str, str]:
    """The AZ a worker template or placement group was built for, as a tag (rule 32)."""
    return {TAG_AVAILABILITY_ZONE: az} if az else {}


def _root(device: str, size_gb: int, iops: int, throughput: int):
    return aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name=device,
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
            volume_type="gp3",
            volume_size=size_gb,
            iops=iops,
            throughput=throughput,
            # The account's aws/ebs key: a customer key here would also need kms:CreateGrant
            # for the head role, for no gain over the bucket's key.
            encrypted="true",
            delete_on_termination="true",
        ),
    )


def _efa_interfaces(args: GpuNodesArgs, worker: InstanceSpec,
                    subnet_id: pulumi.Input[str] | None = None) -> list:
    """One EFA per network card (p4d: 4, p5 and p5e: 32, p5en: 16). Card 0 carries the primary
    interface (device 0), the others device index 1, as AWS documents for multi-card instances
    (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html). In the
    workers' subnet unless ``subnet_id`` (a reservation's or a fallback AZ's) says otherwise."""
    return [
        aws.ec2.LaunchTemplateNetworkInterfaceArgs(
            network_card_index=card,
            device_index=0 if card == 0 else 1,
            interface_type="efa",
            subnet_id=subnet_id if subnet_id is not None else args.worker_subnet_id,
            security_groups=[args.cluster_security_group_id, args.efa_security_group_id],
            # Rule 7 holds without associate_public_ip_address: EC2 never auto-assigns a public
            # IPv4 to an instance launched with several interfaces, and refuses the parameter
            # altogether in that case (InvalidParameterCombination).
            delete_on_termination="true",
            description=f"{args.cluster_name} {worker.name} worker EFA {card}",
        )
        for card in range(worker.efa_interfaces)
    ]


def _tag_specs(args: GpuNodesArgs, kind: str, spot: bool, efa: bool) -> list:
    # Tags ray-cluster-name too, so an instance launched from a template by hand is still
    # one `rayfleet sweep` finds and the head may terminate.
    tags = {RAY_CLUSTER_TAG: args.cluster_name, TAG_CLUSTER: args.cluster_name,
            TAG_STACK: args.stack, TAG_NODE_KIND: kind}
    kinds = ["instance", "volume"] + (["network-interface"] if efa else []) + \
        (["spot-instances-request"] if spot else [])
    return [aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=k, tags=tags)
            for k in kinds]
