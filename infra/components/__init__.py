"""rayfleet's infrastructure, one ComponentResource per concern, each built from a frozen
args dataclass.

:func:`build` wires them together for a validated :class:`~rayfleet.config.StackConfig` and
returns the stack outputs; ``infra/__main__.py`` only loads the config, calls it, and exports.

The one stack output, ``rayfleet``, is what ``rayfleet render`` turns into a cluster-launcher
YAML: a :class:`rayfleet.stack.StackOutputs` (the contract and its schema live there).
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws

from rayfleet import stack as contract
from rayfleet.config import StackConfig
from rayfleet.facts import MANAGED_BY_PULUMI, RAY_PORTS, TAG_CLUSTER, TAG_MANAGED_BY, TAG_STACK

from .budget import Budget, BudgetArgs
from .gcs_store import GcsStore, GcsStoreArgs, HeadAddress, HeadAddressArgs
from .gpu_nodes import GpuNodes, GpuNodesArgs
from .iam import Iam, IamArgs
from .network import Network, NetworkArgs
from .security import Security, SecurityArgs
from .storage import Storage, StorageArgs

__all__ = [
    "Budget", "BudgetArgs", "GcsStore", "GcsStoreArgs", "GpuNodes", "GpuNodesArgs",
    "HeadAddress", "HeadAddressArgs", "Iam", "IamArgs",
    "Network", "NetworkArgs", "Security", "SecurityArgs", "Storage", "StorageArgs", "build",
]


def build(cfg: StackConfig, stack: str | None = None) -> dict[str, Any]:
    """Create every resource of the stack; return ``{"rayfleet": <StackOutputs as a dict>}``."""
    stack = stack or pulumi.get_stack()
    c = cfg.cluster_name
    opts = pulumi.ResourceOptions(providers={"aws": _provider(cfg, stack)})
    network = _network(cfg, opts)
    security = Security(f"{c}-security", SecurityArgs(
        cluster_name=c,
        vpc_id=network.vpc.id,
        operator_cidrs=cfg.access.operator_cidrs,
    ), opts)
    storage = _storage(cfg, opts)
    iam = _iam(cfg, network, storage, opts)
    # One private subnet per AZ, the fallback and reservations' AZs among them (Network made
    # sure); the workers' AZ first.
    subnet_by_az = dict(zip(network.availability_zones, network.private_subnet_ids,
                            strict=True))
    worker_az = network.availability_zones[0]
    nodes = _nodes(cfg, stack, network, security, iam, subnet_by_az, worker_az, opts)
    head_ha = _head_ha(cfg, network, security, iam, opts) if cfg.head_ha else None
    budget = None
    if cfg.budget.enabled:
        budget = Budget(f"{c}-budget", BudgetArgs(
            cluster_name=c, monthly_usd=cfg.budget.monthly_usd, emails=cfg.budget.emails,
        ), opts)
    return {"rayfleet": _stack_outputs(
        cfg, stack, network=network, security=security, storage=storage, iam=iam, nodes=nodes,
        workers=_worker_node_types(cfg, nodes, subnet_by_az, worker_az), budget=budget,
        head_ha=head_ha).to_dict()}


def _provider(cfg: StackConfig, stack: str) -> aws.Provider:
    """The stack's AWS provider."""
    c = cfg.cluster_name
    # An explicit provider: every resource gets the validated region and these tags, whatever
    # aws:region or AWS_REGION the shell happens to hold.
    return aws.Provider(
        f"{c}-aws",
        region=cfg.region,
        default_tags=aws.ProviderDefaultTagsArgs(tags={
            TAG_CLUSTER: c,
            TAG_STACK: stack,
            TAG_MANAGED_BY: MANAGED_BY_PULUMI,
        }),
    )


def _network(cfg: StackConfig, opts: pulumi.ResourceOptions) -> Network:
    c = cfg.cluster_name
    private_cidrs, public_cidrs = cfg.network.subnet_cidrs()
    return Network(f"{c}-network", NetworkArgs(
        cluster_name=c,
        region=cfg.region,
        partition=cfg.partition,
        vpc_cidr=cfg.network.vpc_cidr,
        private_subnet_cidrs=private_cidrs,
        public_subnet_cidrs=public_cidrs,
        nat_gateways=cfg.network.nat_gateways,
        flow_log_retention_days=cfg.network.flow_log_retention_days,
        worker_az=cfg.network.worker_az,
        reserved_azs=cfg.nodes.reserved_azs,
        fallback_azs=cfg.nodes.worker_fallback_azs,
    ), opts)


def _storage(cfg: StackConfig, opts: pulumi.ResourceOptions) -> Storage:
    return Storage(f"{cfg.cluster_name}-storage", StorageArgs(
        cluster_name=cfg.cluster_name,
        region=cfg.region,
        partition=cfg.partition,
        bucket_prefix=cfg.storage.bucket_prefix,
        encryption=cfg.storage.encryption,
        noncurrent_version_days=cfg.storage.noncurrent_version_days,
        abort_multipart_days=cfg.storage.abort_multipart_days,
    ), opts)


def _iam(cfg: StackConfig, network: Network, storage: Storage,
         opts: pulumi.ResourceOptions) -> Iam:
    return Iam(f"{cfg.cluster_name}-iam", IamArgs(
        cluster_name=cfg.cluster_name,
        region=cfg.region,
        partition=cfg.partition,
        vpc_arn=network.vpc.arn,
        bucket_arn=storage.bucket.arn,
        key_prefix=cfg.storage.key_prefix,
        kms_key_arn=storage.kms_key_arn,
        capacity_reservations=tuple(r.target for r in cfg.nodes.capacity_reservations),
    ), opts)


def _nodes(cfg: StackConfig, stack: str, network: Network, security: Security, iam: Iam,
           subnet_by_az: dict[str, Any], worker_az: str,
           opts: pulumi.ResourceOptions) -> GpuNodes:
    return GpuNodes(f"{cfg.cluster_name}-nodes", GpuNodesArgs(
        cluster_name=cfg.cluster_name,
        stack=stack,
        head_instance_type=cfg.nodes.head_instance_type,
        workers=cfg.nodes.workers,
        head_root_volume_gb=cfg.nodes.head_root_volume_gb,
        worker_root_volume_gb=cfg.nodes.worker_root_volume_gb,
        imds_hop_limit=cfg.nodes.imds_hop_limit,
        worker_subnet_id=network.worker_subnet.id,
        cluster_security_group_id=security.cluster.id,
        efa_security_group_id=security.efa.id,
        head_instance_profile_arn=iam.head_profile.arn,
        worker_instance_profile_arn=iam.worker_profile.arn,
        ami_id=cfg.nodes.ami_id,
        reservations=cfg.nodes.capacity_reservations,
        subnet_by_az=subnet_by_az,
        worker_az=worker_az,
        fallback_azs=cfg.nodes.worker_fallback_azs,
    ), opts)


def _head_ha(cfg: StackConfig, network: Network, security: Security, iam: Iam,
             opts: pulumi.ResourceOptions) -> contract.HeadHa:
    """rayfleet:headHa: the GCS's Redis and the head's fixed address (the workers' subnet,
    where the head's GCS is nearest the raylets that dial it)."""
    c = cfg.cluster_name
    store = GcsStore(f"{c}-gcs", GcsStoreArgs(
        cluster_name=c,
        partition=cfg.partition,
        region=cfg.region,
        vpc_id=network.vpc.id,
        private_subnet_ids=network.private_subnet_ids,
        cluster_security_group_id=security.cluster.id,
        head_role_name=iam.head_role.name,
    ), opts)
    address = HeadAddress(f"{c}-head-address", HeadAddressArgs(
        cluster_name=c,
        subnet_id=network.worker_subnet.id,
        subnet_cidr=network.worker_subnet.cidr_block,
    ), opts)
    return contract.HeadHa(
        gcs_store=contract.GcsStore(endpoint=store.endpoint, port=store.port,
                                    auth_secret_arn=store.secret.arn),
        head_address=contract.HeadAddress(private_ip=address.private_ip,
                                          subnet_id=address.subnet_id))


def _worker_node_types(cfg: StackConfig, nodes: GpuNodes, subnet_by_az: dict[str, Any],
                       worker_az: str) -> list[contract.WorkerNodeType]:
    """One worker node type per (allowed type, market, AZ), in the stack's order (the order of
    preference: per type its reservations, spot, on-demand, then spot and on-demand in each
    fallback AZ), each with the template built for it and the AZ it launches in; a
    reservation's also says what it targets, in which AZ and subnet."""
    def reserved(r):
        if r is None:
            return None
        return contract.CapacityReservationTarget(
            availability_zone=r.availability_zone, subnet_id=subnet_by_az[r.availability_zone],
            id=r.id, resource_group_arn=r.resource_group_arn)

    def template(w):
        if w.fallback_az:
            return nodes.fallback_workers[(w.spec.name, w.market, w.fallback_az)]
        return nodes.workers[(w.spec.name, w.market)]

    return [contract.WorkerNodeType(
        instance_type=w.spec.name, market=w.market, vcpus=w.spec.vcpus, gpus=w.spec.gpus,
        accelerator_type=w.spec.accelerator_type, efa_interfaces=w.spec.efa_interfaces,
        min_workers=w.min_workers, max_workers=w.max_workers,
        launch_template=contract.TemplateId(template(w).id),
        capacity_reservation=reserved(w.reservation),
        availability_zone=(w.reservation.availability_zone if w.reservation
                           else w.fallback_az or worker_az),
        workers_az=worker_az)
        for w in cfg.nodes.worker_splits()]


def _stack_outputs(cfg: StackConfig, stack: str, *, network: Network, security: Security,
                   storage: Storage, iam: Iam, nodes: GpuNodes,
                   workers: list[contract.WorkerNodeType], budget: Budget | None,
                   head_ha: contract.HeadHa | None) -> contract.StackOutputs:
    """The stack output ``rayfleet``: what ``rayfleet render`` reads."""
    head = cfg.nodes.head
    return contract.StackOutputs(
        stack=stack,
        cluster_name=cfg.cluster_name,
        region=cfg.region,
        availability_zones=network.availability_zones,
        worker_availability_zone=network.availability_zones[0],
        vpc_id=network.vpc.id,
        private_subnet_ids=network.private_subnet_ids,
        worker_subnet_id=network.worker_subnet.id,
        cluster_security_group_id=security.cluster.id,
        efa_security_group_id=security.efa.id,
        operator_access=cfg.access.mode,
        operator_cidrs=list(cfg.access.operator_cidrs),
        instance_profiles=contract.ByRole(head=contract.Arn(iam.head_profile.arn),
                                          worker=contract.Arn(iam.worker_profile.arn)),
        roles=contract.ByRole(head=contract.Arn(iam.head_role.arn),
                              worker=contract.Arn(iam.worker_role.arn)),
        launch_templates=contract.LaunchTemplates(head=contract.TemplateId(nodes.head.id)),
        node_types=contract.NodeTypes(
            head=contract.HeadNodeType(instance_type=head.name, vcpus=head.vcpus, gpus=0),
            workers=workers),
        max_workers=cfg.nodes.max_workers,
        placement_group=nodes.placement_group.name,
        ami_id=nodes.ami_id,
        imds_hop_limit=cfg.nodes.imds_hop_limit,
        bucket=storage.bucket.bucket,
        bucket_arn=storage.bucket.arn,
        storage_uri=pulumi.Output.concat("s3://", storage.bucket.bucket, "/",
                                         cfg.storage.key_prefix),
        kms_key_arn=storage.kms_key_arn,
        ray_ports={p.name: [p.from_port, p.to_port] for p in RAY_PORTS},
        budget_name=budget.budget.name if budget is not None else None,
        autostop_minutes=cfg.autostop_minutes,
        vllm=cfg.vllm,
        head_ha=head_ha,
    )
