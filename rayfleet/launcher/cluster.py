"""The cluster-wide fields: its name and size, the AWS provider, SSH over SSM, and the files
every node gets (the token and the node agents); every ID from the stack's outputs, none
typed by hand (docs/house.md, convention 3), so Ray creates none of its permissive defaults
(rule 3)."""

from __future__ import annotations

from typing import Any

from rayfleet.facts import RAY_CLUSTER_TAG
from rayfleet.launcher.agents import agents_folder
from rayfleet.launcher.options import RenderOptions
from rayfleet.launcher.remote import REMOTE_AGENTS, REMOTE_TOKEN
from rayfleet.launcher.why import Why
from rayfleet.stack import StackOutputs

WHY = {
    "cluster_name": "From the stack output; Ray tags every instance {tag}={name}, the tag the "
                    "head role's EC2 permissions and `rayfleet sweep` key on.",
    "max_workers": "rayfleet:maxWorkers: every worker type together. Each type may grow to its "
                   "own max_workers; this bounds their sum.",
    "idle_timeout_minutes": "An idle GPU worker costs tens of dollars an hour; give it back "
                            "soon.",
    "cache_stopped_nodes": "Terminate, never stop: `ray down` must leave nothing billing "
                           "(stopped nodes keep their EBS volumes, rule 23).",
    "use_internal_ips": "Nodes live in private subnets with no public IP (rule 7); the launcher "
                        "reaches them through SSM instead.",
    "ssh_private_key": "An existing key pair (preflight checks it): without one, Ray creates "
                       "its own ray-autoscaler_* key pair in the account.",
    "ssh_proxy_command": "SSH rides an SSM Session Manager tunnel: no inbound port 22 from "
                         "anywhere (rule 2); needs the AWS CLI and its session-manager-plugin.",
    "ssh_proxy_use_node_id": "SSM targets an instance id, not an address: Ray passes the node's "
                             "id as %h (the head drops the proxy and reaches workers on their "
                             "private IPs).",
    "file_mounts": "The Ray auth token travels over SSH as a file, never in user data or this "
                   "YAML (rules 20, 21); setup makes it 0600. The node agents (auto-stop, log "
                   "shipping, spot notices) are standalone scripts render copied beside it.",
}


def cluster(o: StackOutputs, opts: RenderOptions) -> dict[str, Any]:
    """The fragment: the cluster's name, size and idle timeout, its provider, its SSH."""
    c = o.cluster_name
    ssm = (f"aws ssm start-session --region {o.region} --target %h "
           "--document-name AWS-StartSSHSession --parameters portNumber=%p")
    return {
        "cluster_name": Why(c, WHY["cluster_name"].format(tag=RAY_CLUSTER_TAG, name=c)),
        "max_workers": Why(o.max_workers, WHY["max_workers"]),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": Why(opts.idle_timeout_minutes, WHY["idle_timeout_minutes"]),
        "provider": {
            "type": "aws",
            "region": o.region,
            "cache_stopped_nodes": Why(False, WHY["cache_stopped_nodes"]),
            "use_internal_ips": Why(True, WHY["use_internal_ips"]),
        },
        "auth": {
            "ssh_user": "ubuntu",
            "ssh_private_key": Why(f"~/.ssh/{opts.key(o)}.pem", WHY["ssh_private_key"]),
            "ssh_proxy_command": Why(ssm, WHY["ssh_proxy_command"]),
            "ssh_proxy_use_node_id": Why(True, WHY["ssh_proxy_use_node_id"]),
        },
    }


def mounts(o: StackOutputs, opts: RenderOptions) -> dict[str, Any]:
    """The fragment: the token and the node agents on every node; nothing else synced."""
    return {
        "file_mounts": Why({REMOTE_TOKEN: opts.token_file,
                            REMOTE_AGENTS: agents_folder(opts.token_file)}, WHY["file_mounts"]),
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
    }
