"""The head node type: a CPU node on the stack's head launch template, in its private
subnets (or, under rayfleet:headHa, at its fixed address), in the cluster's security group
with the head's profile. It has no EFA, so, unlike a worker type, it names its subnets and
security groups itself."""

from __future__ import annotations

from typing import Any

from rayfleet.launcher.headha import head_placement
from rayfleet.launcher.options import RenderOptions
from rayfleet.launcher.why import Why
from rayfleet.stack import StackOutputs

HEAD_TYPE = "ray.head.default"

WHY = {
    "resources": "The CPU head runs drivers and light CPU tasks; it has no GPU, so no GPU task "
                 "is ever placed here.",
    "LaunchTemplate": "AMI, IMDSv2, encrypted root and tags come from the stack's head launch "
                      "template.",
    "SecurityGroupIds": "The stack's cluster group; without it Ray creates ray-autoscaler-* "
                        "with SSH open to the world (rule 3).",
    "IamInstanceProfile": "The head role: EC2 actions limited to this cluster's tag, PassRole "
                          "on the worker role only.",
}


def head_type(o: StackOutputs, opts: RenderOptions) -> dict[str, Any]:
    """The head node type's resources and node_config."""
    head = o.node_types.head
    return {
        "resources": Why({"CPU": head.vcpus, "GPU": 0}, WHY["resources"]),
        "node_config": {
            "InstanceType": head.instance_type,
            "LaunchTemplate": Why({"LaunchTemplateId": o.launch_templates.head.id,
                                   "Version": "$Default"}, WHY["LaunchTemplate"]),
            **head_placement(o),
            "SecurityGroupIds": Why([o.cluster_security_group_id], WHY["SecurityGroupIds"]),
            "IamInstanceProfile": Why({"Arn": o.instance_profiles.head.arn},
                                      WHY["IamInstanceProfile"]),
            "KeyName": opts.key(o),
        },
    }
