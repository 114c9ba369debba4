"""The worker node types: one Ray node type per (allowed GPU type, market, AZ) of the stack, in
the stack's order (``rayfleet:workerInstanceTypes``, each type's Capacity Block, reservation,
spot, on-demand, then spot and on-demand in each of ``rayfleet:workerFallbackAzs``), named
``ray.worker.<instance type>.<block|reserved|spot|ondemand>`` (``.<az>`` after it in a fallback
AZ), each on its own launch template, with the stack's resources (GPUs,
``accelerator_type:<A100|H100|H200>``). The cluster's max_workers bounds them all together.
"""

from __future__ import annotations

from typing import Any

from rayfleet.launcher.nodesetup import gpu_type_setup
from rayfleet.launcher.options import RenderOptions
from rayfleet.launcher.reserved import reservation_options
from rayfleet.launcher.why import Why
from rayfleet.stack import StackOutputs, WorkerNodeType

WHY = {
    "LaunchTemplate":
        "The launch template brings the AMI, IMDSv2, encrypted roots, the placement "
        "group and the EFA interfaces with their subnet and security groups; Ray's "
        "bootstrap copies those up, and raises ValueError if SubnetIds or "
        "SecurityGroupIds are also set here, so they are left out on purpose.",
    # A fallback AZ's node type says so where it differs: its template's AZ.
    "fallback":
        " This node type is {type} in fallback AZ {az} (rayfleet:workerFallbackAzs), tried "
        "after this type's node types in the workers' AZ {home}: its template's EFA "
        "interfaces are in that AZ's private subnet and its placement group is that AZ's own, "
        "as Ray moves a node type with EFA interfaces to no other subnet; EFA does not cross "
        "AZs, so a job with workers here and in another AZ runs NCCL without EFA between "
        "them.",
    "IamInstanceProfile":
        "Set explicitly so Ray never attaches its default ray-autoscaler-v1 role "
        "(EC2 and S3 full access); the worker role reaches only the bucket prefix.",
    "InstanceMarketOptions":
        "Spot, one-time, terminate on interruption: a reclaimed worker is gone and "
        "the autoscaler replaces it; nothing stopped lingers to bill EBS.",
    "resources":
        "Declared, not detected: a job asking for GPUs or {accelerator} is matched to this "
        "type before any instance exists.",
}


def node_config(o: StackOutputs, t: WorkerNodeType, opts: RenderOptions) -> dict[str, Any]:
    """A worker type's node_config: its launch template, the worker profile, its market."""
    fallback = ("" if t.fallback_az is None else WHY["fallback"].format(
        type=t.instance_type, az=t.fallback_az, home=t.workers_az))
    config: dict[str, Any] = {
        "InstanceType": t.instance_type,
        "LaunchTemplate": Why({"LaunchTemplateId": t.launch_template.id, "Version": "$Default"},
                              WHY["LaunchTemplate"] + fallback),
        "IamInstanceProfile": Why({"Arn": o.instance_profiles.worker.arn},
                                  WHY["IamInstanceProfile"]),
        "KeyName": opts.key(o),
    }
    if t.market == "spot":
        config["InstanceMarketOptions"] = Why(
            {"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time",
                                                   "InstanceInterruptionBehavior": "terminate"}},
            WHY["InstanceMarketOptions"])
    if t.capacity_reservation is not None:
        config.update(reservation_options(t))
    return config


def worker_type(o: StackOutputs, t: WorkerNodeType, opts: RenderOptions) -> dict[str, Any]:
    """One worker node type, its resources as the stack declares them: what was deployed,
    not what this version of the kit would deploy today."""
    accelerator = f"accelerator_type:{t.accelerator_type}"
    resources = {"CPU": t.vcpus, "GPU": t.gpus, accelerator: 1}
    return {
        "min_workers": t.min_workers,
        "max_workers": t.max_workers,
        "resources": Why(resources, WHY["resources"].format(accelerator=accelerator)),
        "node_config": node_config(o, t, opts),
        **gpu_type_setup(o, t, opts),
    }


def worker_types(o: StackOutputs, opts: RenderOptions) -> dict[str, Any]:
    """Every worker node type, by its Ray name, in the stack's order."""
    return {t.ray_name: worker_type(o, t, opts) for t in o.node_types.workers}
