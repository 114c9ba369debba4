"""The stack configuration: the one place it is parsed and validated.

Every consumer — the Pulumi program in ``infra/``, and ``rayfleet render / preflight / cost`` —
gets the same typed, frozen :class:`StackConfig`, built by one of three entry points:

- :meth:`StackConfig.from_mapping` — a plain dict, keys ``"rayfleet:azCount"`` or ``"azCount"``,
  values typed (``3``) or as Pulumi stores them (``"3"``, ``'["10.0.0.0/8"]'``);
- :func:`load_stack_file` — a ``Pulumi.<stack>.yaml`` file, without the Pulumi CLI;
- :func:`load_stack_config` — inside the Pulumi program, from ``pulumi.Config``.

Everything is checked before any resource or API call exists; each failure is a
:class:`~rayfleet.errors.ConfigError` whose one line names the key, what is allowed and, where
one is close, the value that was probably meant. ``SCHEMA`` lists every key with its type,
default and description; ``Pulumi.yaml``'s ``config:`` block mirrors it (a test keeps them equal).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayfleet import catalog
from rayfleet.catalog import InstanceSpec
from rayfleet.errors import ConfigError, did_you_mean
from rayfleet.facts import (
    BUCKET_PREFIX_MAX,
    CLUSTER_NAME,
    IMDS_HOP_LIMIT,
    IMDS_HOP_LIMIT_CONTAINERS,
    MARKET_BLOCK,
    MARKET_RESERVED,
    MARKETS,
    RAY_CLUSTER_TAG,
    RAY_PORTS,
    RayPort,
    port,
)
from rayfleet.rules import rule

NAMESPACE = "rayfleet"


# ----------------------------------------------------------------------------- tables

# Commercial and GovCloud regions, for "did you mean" on typos (us-east1 -> us-east-1).
AWS_REGIONS = (
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "us-gov-east-1", "us-gov-west-1",
    "ca-central-1", "ca-west-1", "mx-central-1", "sa-east-1",
    "eu-central-1", "eu-central-2", "eu-west-1", "eu-west-2", "eu-west-3", "eu-south-1",
    "eu-south-2", "eu-north-1", "il-central-1", "me-south-1", "me-central-1", "af-south-1",
    "ap-east-1", "ap-east-2", "ap-south-1", "ap-south-2", "ap-northeast-1", "ap-northeast-2",
    "ap-northeast-3", "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4",
    "ap-southeast-5", "ap-southeast-7",
)

# Regions that offer each GPU worker type, and what each node type offers: the catalog's.
WORKER_REGIONS: Mapping[str, tuple[str, ...]] = catalog.worker_regions()
WORKER_INSTANCE_TYPES: Mapping[str, InstanceSpec] = catalog.worker_types()
HEAD_INSTANCE_TYPES: Mapping[str, InstanceSpec] = catalog.head_types()

# The only values CloudWatch Logs accepts for retentionInDays (PutRetentionPolicy API);
# 0 ("never expire") is left out on purpose: rule 8 wants a retention.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096,
                      1827, 2192, 2557, 2922, 3288, 3653)


# ----------------------------------------------------------------------------- schema

@dataclass(frozen=True)
class ConfigKey:
    """One stack config key as Pulumi.yaml declares it: type, default, description."""

    name: str
    # Pulumi's project config types: string, integer, boolean, array (of strings); "objects"
    # is a list of objects, which Pulumi.yaml can only declare untyped (a project's config
    # types are those four, an array's items one of them), so this module checks its shape.
    type: str
    default: Any
    description: str

    @property
    def qualified(self) -> str:
        return f"{NAMESPACE}:{self.name}"


SCHEMA: tuple[ConfigKey, ...] = (
    ConfigKey("clusterName", "string", "rayfleet",
              "Ray cluster name: the ray-cluster-name tag on every node and the prefix of "
              "resource names; 3-32 lowercase letters, digits, hyphens."),
    ConfigKey("region", "string", "us-east-1",
              "AWS region for every resource (the stack uses an explicit provider; aws:region "
              "is not read). Must offer every type of workerInstanceTypes."),
    ConfigKey("azCount", "integer", 3,
              "Availability zones to spread public and private subnets over (3-6)."),
    ConfigKey("workerAz", "string", "",
              "AZ for the GPU workers (every type) and their cluster placement group (e.g. "
              "us-east-1b); empty means the first available AZ."),
    ConfigKey("workerFallbackAzs", "array", [],
              "Other AZs of region the GPU workers may launch in when workerAz has no "
              "capacity, in order (e.g. [us-east-1c]): each gets its own cluster placement "
              "group and per worker type a spot and an on-demand launch template and Ray node "
              "type, after that type's in workerAz. EFA does not cross AZs: a multi-node job "
              "whose workers land in two AZs runs NCCL without EFA between them. Empty "
              "(default) keeps every worker in workerAz."),
    ConfigKey("vpcCidr", "string", "10.42.0.0/16",
              "Private IPv4 CIDR of the VPC, /16 to /22."),
    ConfigKey("natGateways", "string", "single",
              "NAT gateways: single (one, cheapest) or per-az (one per AZ, survives an AZ "
              "outage)."),
    ConfigKey("flowLogRetentionDays", "integer", 90,
              "Days CloudWatch keeps VPC flow logs (a CloudWatch retention value)."),
    ConfigKey("operatorCidrs", "array", [],
              f"CIDRs allowed SSH (22) and dashboard ({port('dashboard')}) to the nodes, e.g. a "
              "VPN range. "
              "Empty (default) means SSM Session Manager only. 0.0.0.0/0 and ::/0 are refused."),
    ConfigKey("headInstanceType", "string", "m6i.2xlarge",
              "Instance type of the CPU head node."),
    ConfigKey("workerInstanceTypes", "array", ["p4d.24xlarge"],
              "GPU worker instance types the cluster may launch, most preferred first, each "
              "once: " + ", ".join(
                  f"{name} ({t.gpus}x {t.accelerator_type} {t.gpu_memory_gib} GB)"
                  for name, t in WORKER_INSTANCE_TYPES.items()) + ". Each gets a launch "
              "template per market (on-demand, spot) and a Ray node type per market, in this "
              "order."),
    ConfigKey("minWorkers", "integer", 0,
              "GPU workers the autoscaler keeps running, all of the first worker type."),
    ConfigKey("maxWorkers", "integer", 2,
              "Most GPU workers the autoscaler may launch, all types together (1-64)."),
    ConfigKey("onDemandWorkers", "integer", 0,
              "How many of maxWorkers may run on-demand, per worker type; the rest are spot. "
              "0 means all spot, maxWorkers means no spot."),
    ConfigKey("capacityReservations", "objects", [],
              "Reserved capacity the GPU workers launch into before spot and on-demand, each "
              "an object: instanceType (one of workerInstanceTypes), availabilityZone, id "
              "(cr-...) or resourceGroupArn, capacityBlock (true for a Capacity Block for ML, "
              "which needs id; default false). Each gets its own launch template and Ray node "
              "type, first in its type's order; one Capacity Block and one On-Demand Capacity "
              "Reservation per type (a resource group targets several)."),
    ConfigKey("headRootVolumeGb", "integer", 200,
              "Encrypted gp3 root volume of the head, GiB."),
    ConfigKey("workerRootVolumeGb", "integer", 500,
              "Encrypted gp3 root volume of each GPU worker, GiB (models, images, wheels)."),
    ConfigKey("amiId", "string", "",
              "Pin the node image (ami-...); empty means the newest AWS Deep Learning AMI "
              "(OSS Nvidia driver, PyTorch, Ubuntu 22.04)."),
    ConfigKey("rayInDocker", "boolean", False,
              "Ray runs in Docker on the nodes (cluster YAML docker: section): IMDSv2 hop "
              "limit becomes 2 so containers can reach the instance role."),
    ConfigKey("bucketPrefix", "string", "rayfleet-data-",
              "Prefix of the checkpoint/data bucket name (AWS appends a unique suffix); "
              f"lowercase letters, digits, hyphens, at most {BUCKET_PREFIX_MAX} characters."),
    ConfigKey("bucketKeyPrefix", "string", "rayfleet/",
              "Key prefix inside the bucket that the node roles may read and write; ends "
              "with /."),
    ConfigKey("bucketEncryption", "string", "kms",
              "Bucket encryption: kms (a customer-managed key of this stack, rotated "
              "yearly) or s3 (S3-managed AES256)."),
    ConfigKey("noncurrentVersionDays", "integer", 30,
              "Days after which overwritten or deleted object versions expire."),
    ConfigKey("abortMultipartDays", "integer", 7,
              "Days after which incomplete multipart uploads are aborted."),
    ConfigKey("autostopMinutes", "integer", 0,
              "Tear the whole cluster down, head included, after this many idle minutes "
              "(no job, Serve app or user actor); 0 means never. `rayfleet render "
              "--autostop-minutes` overrides it."),
    ConfigKey("headHa", "boolean", False,
              "Losing the head is not losing the cluster: the GCS keeps its state in an "
              "encrypted, TLS-only, auth-token ElastiCache Redis in the private subnets "
              "(reachable from the cluster security group only), the head launches at a fixed "
              "private address in the workers' AZ, and every node waits "
              "rayfleet.raystart.GCS_RECONNECT_TIMEOUT_S for a replaced head "
              "(docs/nodes.md). Off by default: the Redis nodes cost by the hour."),
    ConfigKey("budgetMonthlyUsd", "integer", 0,
              "Monthly AWS Budgets limit in USD; 0 means no budget."),
    ConfigKey("budgetEmails", "array", [],
              "Addresses alerted at 80% actual, 100% actual and 100% forecast spend."),
)

SCHEMA_BY_NAME: Mapping[str, ConfigKey] = {k.name: k for k in SCHEMA}
DEFAULTS: Mapping[str, Any] = {k.name: k.default for k in SCHEMA}


# ----------------------------------------------------------------------------- typed config

@dataclass(frozen=True)
class NetworkConfig:
    vpc_cidr: str
    az_count: int
    nat_gateways: str  # "single" | "per-az"
    flow_log_retention_days: int
    worker_az: str | None  # None: the first available AZ

    def subnet_cidrs(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(private, public) CIDRs, one each per AZ.

        The VPC splits into eight blocks: the first ``az_count`` are the (large) private
        subnets where nodes live; the last block is cut into eight small public subnets,
        which only hold NAT gateways.
        """
        vpc = ipaddress.ip_network(self.vpc_cidr)
        blocks = list(vpc.subnets(new_prefix=vpc.prefixlen + 3))
        public = list(blocks[-1].subnets(new_prefix=blocks[-1].prefixlen + 3))
        return (tuple(str(b) for b in blocks[: self.az_count]),
                tuple(str(b) for b in public[: self.az_count]))


@dataclass(frozen=True)
class AccessConfig:
    operator_cidrs: tuple[str, ...]

    @property
    def mode(self) -> str:
        """``ssm`` (Session Manager only) or ``ssm+cidr`` (plus SSH and the dashboard from
        named CIDRs)."""
        return "ssm+cidr" if self.operator_cidrs else "ssm"


@dataclass(frozen=True)
class CapacityReservation:
    """One entry of rayfleet:capacityReservations: reserved capacity of one worker type in one
    AZ, targeted by reservation id or by resource group (exactly one of the two)."""

    instance_type: str
    availability_zone: str
    id: str | None                   # cr-<17 hex digits>
    resource_group_arn: str | None   # arn:<partition>:resource-groups:<region>:<account>:group/..
    capacity_block: bool = False

    @property
    def market(self) -> str:
        """``block`` (a Capacity Block) or ``reserved`` (an On-Demand Capacity Reservation)."""
        return MARKET_BLOCK if self.capacity_block else MARKET_RESERVED

    @property
    def target(self) -> str:
        """What the launch template targets: the id, or the resource group's ARN."""
        return self.id or self.resource_group_arn or ""


@dataclass(frozen=True)
class WorkerSplit:
    """One (worker type, market, AZ) of the cluster: a launch template and a Ray node type."""

    spec: InstanceSpec
    market: str          # "spot" | "ondemand" | "block" | "reserved"
    min_workers: int
    max_workers: int
    reservation: CapacityReservation | None = None   # for "block" and "reserved"
    # One of rayfleet:workerFallbackAzs for a spot or on-demand split there; None: the
    # workers' AZ (rayfleet:workerAz, or the first available one), or the reservation's.
    fallback_az: str | None = None


@dataclass(frozen=True)
class NodesConfig:
    head_instance_type: str
    worker_instance_types: tuple[str, ...]   # most preferred first
    min_workers: int
    max_workers: int
    on_demand_workers: int
    head_root_volume_gb: int
    worker_root_volume_gb: int
    ami_id: str | None
    ray_in_docker: bool
    capacity_reservations: tuple[CapacityReservation, ...] = ()
    # rayfleet:workerFallbackAzs, in order: where spot and on-demand workers go when the
    # workers' AZ has no capacity.
    worker_fallback_azs: tuple[str, ...] = ()

    @property
    def head(self) -> InstanceSpec:
        return HEAD_INSTANCE_TYPES[self.head_instance_type]

    @property
    def workers(self) -> tuple[InstanceSpec, ...]:
        """The allowed worker types, most preferred first."""
        return tuple(WORKER_INSTANCE_TYPES[t] for t in self.worker_instance_types)

    @property
    def imds_hop_limit(self) -> int:
        return IMDS_HOP_LIMIT_CONTAINERS if self.ray_in_docker else IMDS_HOP_LIMIT

    # Each worker type gets two Ray node types from these: on-demand (min_workers fill it
    # first), spot for the rest. Only the preferred (first) type keeps a minimum; every type
    # may grow to these maxima, and the cluster-wide max_workers bounds them all together.
    @property
    def on_demand_min(self) -> int:
        return min(self.min_workers, self.on_demand_workers)

    @property
    def on_demand_max(self) -> int:
        return self.on_demand_workers

    @property
    def spot_min(self) -> int:
        return self.min_workers - self.on_demand_min

    @property
    def spot_max(self) -> int:
        return self.max_workers - self.on_demand_workers

    def reservations_of(self, instance_type: str) -> tuple[CapacityReservation, ...]:
        """The type's reservations in the order its node types are written: a Capacity Block
        first (paid in full already, and it ends), then its On-Demand Capacity Reservation."""
        return tuple(sorted((r for r in self.capacity_reservations
                             if r.instance_type == instance_type),
                            key=lambda r: not r.capacity_block))

    def worker_splits(self) -> tuple[WorkerSplit, ...]:
        """Every (type, market, AZ) in the stack's order, which is the order of preference:
        per type (rayfleet:workerInstanceTypes' order) its reservations, then its spot, then
        its on-demand in the workers' AZ, then for each of rayfleet:workerFallbackAzs in order
        its spot and on-demand there; then the next type. Type-major: a type with capacity in
        any AZ comes before the next type, as the issue asks (p4d in every AZ, then p4de).

        A reservation's node type keeps no minimum (rayfleet:minWorkers stays on the preferred
        type's spot and on-demand, as without reservations) and may grow to maxWorkers: how
        many instances a reservation holds is AWS's to say (`rayfleet preflight` shows it),
        and the cluster's max_workers bounds every type together anyway. A fallback AZ's
        spot or on-demand keeps no minimum either (the minimum stays in the workers' AZ, with
        its placement group) and has its market's maximum."""
        bounds = {"spot": (self.spot_min, self.spot_max),
                  "ondemand": (self.on_demand_min, self.on_demand_max)}
        out: list[WorkerSplit] = []
        for i, spec in enumerate(self.workers):
            out += [WorkerSplit(spec, r.market, 0, self.max_workers, r)
                    for r in self.reservations_of(spec.name)]
            out += [WorkerSplit(spec, market, bounds[market][0] if i == 0 else 0,
                                bounds[market][1]) for market in MARKETS]
            out += [WorkerSplit(spec, market, 0, bounds[market][1], fallback_az=az)
                    for az in self.worker_fallback_azs for market in MARKETS]
        return tuple(out)

    @property
    def reserved_azs(self) -> tuple[str, ...]:
        """The AZs the reservations are in, each once, in config order: each needs a private
        subnet of the stack for its template's interfaces."""
        return tuple(dict.fromkeys(r.availability_zone for r in self.capacity_reservations))


@dataclass(frozen=True)
class StorageConfig:
    bucket_prefix: str
    key_prefix: str
    encryption: str  # "kms" | "s3"
    noncurrent_version_days: int
    abort_multipart_days: int


@dataclass(frozen=True)
class BudgetConfig:
    monthly_usd: int
    emails: tuple[str, ...]

    @property
    def enabled(self) -> bool:
        return self.monthly_usd > 0


@dataclass(frozen=True)
class StackConfig:
    """The validated stack config. Build it with :meth:`from_mapping`, never directly."""

    cluster_name: str
    region: str
    network: NetworkConfig
    access: AccessConfig
    nodes: NodesConfig
    storage: StorageConfig
    budget: BudgetConfig
    autostop_minutes: int   # 0: never
    # rayfleet:headHa: GCS fault tolerance (the GCS store and the head's fixed address).
    head_ha: bool = False
    # The raw values (defaults filled in), keyed by bare key name: what to_mapping returns.
    values: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], namespace: str = NAMESPACE) -> StackConfig:
        """Validate a mapping of config keys (``"rayfleet:azCount"`` or ``"azCount"``)."""
        raw = _collect(mapping, namespace)
        v = {k.name: _coerce(k, raw[k.name]) if k.name in raw else k.default for k in SCHEMA}
        region = _region(v["region"])
        worker_az = _worker_az(v["workerAz"], region)
        nodes = _nodes(v, _worker_types(v["workerInstanceTypes"], region), region,
                       _worker_fallback_azs(v["workerFallbackAzs"], region, worker_az))
        budget = _budget(v)
        return cls(
            cluster_name=_cluster_name(v["clusterName"]),
            region=region,
            network=NetworkConfig(
                vpc_cidr=_vpc_cidr(v["vpcCidr"]),
                az_count=_int_range("azCount", v["azCount"], 3, 6),
                nat_gateways=_choice("natGateways", v["natGateways"], ("single", "per-az")),
                flow_log_retention_days=_choice(
                    "flowLogRetentionDays", v["flowLogRetentionDays"], LOG_RETENTION_DAYS),
                worker_az=worker_az,
            ),
            access=AccessConfig(operator_cidrs=_operator_cidrs(v["operatorCidrs"])),
            nodes=nodes,
            storage=StorageConfig(
                bucket_prefix=_bucket_prefix(v["bucketPrefix"]),
                key_prefix=_key_prefix(v["bucketKeyPrefix"]),
                encryption=_choice("bucketEncryption", v["bucketEncryption"], ("kms", "s3")),
                noncurrent_version_days=_int_range(
                    "noncurrentVersionDays", v["noncurrentVersionDays"], 1, 3650),
                abort_multipart_days=_int_range(
                    "abortMultipartDays", v["abortMultipartDays"], 1, 365),
            ),
            budget=budget,
            autostop_minutes=_int_range("autostopMinutes", v["autostopMinutes"], 0, 10080),
            head_ha=v["headHa"],
            values=v,
        )

    @property
    def partition(self) -> str:
        """The AWS partition of the region, for ARNs (GovCloud differs)."""
        return "aws-us-gov" if self.region.startswith("us-gov-") else "aws"

    def to_mapping(self) -> dict[str, Any]:
        """The config as ``{"rayfleet:<key>": value}``; ``from_mapping`` of it is equal."""
        return {f"{NAMESPACE}:{k}": val for k, val in self.values.items()}


# ----------------------------------------------------------------------------- entry points

def load_stack_file(path: str | Path) -> StackConfig:
    """Validate a ``Pulumi.<stack>.yaml`` file (what render/preflight/cost read)."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise ConfigError(str(p), f"cannot read the stack file ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), f"is not UTF-8 text (byte {e.start}); Pulumi stack files "
                                  "are UTF-8 YAML") from None
    except yaml.YAMLError as e:
        raise ConfigError(str(p), "is not valid YAML") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise ConfigError(str(p), "expected a mapping with a config: section")
    return StackConfig.from_mapping(doc.get("config") or {})


def load_stack_config(config: Any = None) -> StackConfig:
    """Validate the running Pulumi program's config (``pulumi.Config`` of the project)."""
    import pulumi

    config = config if config is not None else pulumi.Config()
    namespace = config.name
    raw: dict[str, Any] = {}
    for key in SCHEMA:
        value = config.get(key.name)
        if value is not None:
            raw[key.name] = value
    # pulumi.Config can only answer for keys one names; to catch typos ("azcount") look at
    # every key the engine handed the program.
    for full_key, value in _runtime_config().items():
        ns, _, name = full_key.partition(":")
        if (ns == namespace and name not in SCHEMA_BY_NAME) or ns == "aws":
            raw[full_key] = value
    return StackConfig.from_mapping(raw, namespace=namespace)


def _runtime_config() -> dict[str, Any]:
    try:
        from pulumi.runtime import config as runtime_config
    except ImportError:  # pragma: no cover - pulumi is a hard dependency
        return {}
    merged = dict(runtime_config.get_config_env())
    merged.update(runtime_config.CONFIG.get())
    return merged


# ----------------------------------------------------------------------------- validation

def _q(name: str) -> str:
    return f"{NAMESPACE}:{name}"


def _collect(mapping: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """Bare-keyed values of our namespace; unknown keys are errors with a close match."""
    known = [k.qualified for k in SCHEMA]
    raw: dict[str, Any] = {}
    for full_key, value in mapping.items():
        full_key = str(full_key)
        ns, sep, name = full_key.partition(":")
        if not sep:
            ns, name = namespace, full_key
        if ns == "aws":
            _aws_key(full_key, value, mapping, namespace)
            continue
        if ns != namespace:
            continue  # another package's config; not ours to judge
        if name in RETIRED:
            raise ConfigError(_q(name), RETIRED[name](value))
        if name not in SCHEMA_BY_NAME:
            raise ConfigError(_q(name), f"is not a rayfleet setting{did_you_mean(_q(name), known)}"
                                        "; Pulumi.yaml lists them all")
        if isinstance(value, dict) and "secure" in value:
            raise ConfigError(_q(name), "is not a secret setting; set it with plain "
                                        "`pulumi config set`")
        raw[name] = value
    return raw


def _aws_key(full_key: str, value: Any, mapping: Mapping[str, Any], namespace: str) -> None:
    # The program builds an explicit aws.Provider from rayfleet:region (so every resource
    # carries the validated region and the cluster's default tags); the ambient aws:* config
    # would be silently ignored, which is worse than refusing it.
    if full_key == "aws:region":
        ours = mapping.get(f"{namespace}:region", mapping.get("region", DEFAULTS["region"]))
        if str(value) == str(ours):
            return
        raise ConfigError("aws:region", f"is {value} but rayfleet deploys to "
                                        f"rayfleet:region ({ours}); set rayfleet:region instead")
    raise ConfigError(full_key, "is not read: the stack uses an explicit AWS provider; set "
                                "credentials with AWS_PROFILE or the AWS_* environment "
                                "variables, the region with rayfleet:region")


def _coerce(key: ConfigKey, value: Any) -> Any:
    """Accept typed values and Pulumi's string forms ("3", "true", '["a"]')."""
    name = key.qualified
    if key.type == "integer":
        if isinstance(value, bool):
            raise ConfigError(name, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            return int(value)
        raise ConfigError(name, f"expected an integer, got {value!r}")
    if key.type == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ConfigError(name, f"expected true or false, got {value!r}")
    if key.type == "objects":
        if isinstance(value, str):
            # How pulumi.Config hands a structured value over: JSON text.
            try:
                value = json.loads(value) if value.strip() else []
            except json.JSONDecodeError:
                raise ConfigError(name, f"expected a list of objects, got {value!r}") from None
        if isinstance(value, (list, tuple)) and all(isinstance(x, dict) for x in value):
            return [dict(x) for x in value]
        raise ConfigError(name, f"expected a list of objects (one per reservation), got "
                                f"{value!r}")
    if key.type == "array":
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return []
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                # A single bare value ("10.0.0.0/8") is read as a one-item list.
                value = [text]
        if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
            return [x.strip() for x in value]
        raise ConfigError(name, f"expected a list of strings, got {value!r}")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(name, f"expected a string, got {value!r}")
    return value.strip()


def _choice(name: str, value: Any, allowed: Any) -> Any:
    if value in allowed:
        return value
    shown = [str(a) for a in allowed]
    if isinstance(value, int) and all(isinstance(a, int) for a in allowed):
        # Spelling distance means nothing for numbers: suggest the nearest allowed one.
        nearest = min(allowed, key=lambda a: abs(a - value))
        raise ConfigError(_q(name), f"{value} is not allowed; allowed: {', '.join(shown)}"
                                    f"{_suggest(str(nearest))}")
    raise ConfigError(_q(name), f"{value!r} is not allowed", allowed=shown, value=value)


def _int_range(name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise ConfigError(_q(name), f"must be between {lo} and {hi}, got {value}")
    return value


def _suggest(value: str) -> str:
    return f' (did you mean "{value}"?)'


def _slug(value: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", value.lower())).strip("-")


def _cluster_name(value: str) -> str:
    if CLUSTER_NAME.fullmatch(value) and "--" not in value:
        return value
    slug = _slug(value)
    hint = _suggest(slug) if slug and slug != value and 3 <= len(slug) <= 32 else ""
    raise ConfigError(_q("clusterName"), f"{value!r} must be 3-32 lowercase letters, digits "
                                         f"or single hyphens, starting with a letter{hint}")


def _region(value: str) -> str:
    if value in AWS_REGIONS:
        return value
    raise ConfigError(_q("region"), f"{value!r} is not an AWS region"
                                    f"{did_you_mean(value, AWS_REGIONS)}")


def _worker_types(values: list[str], region: str) -> tuple[str, ...]:
    """rayfleet:workerInstanceTypes: known GPU types, each once, all offered in the region."""
    name = _q("workerInstanceTypes")
    known = list(WORKER_INSTANCE_TYPES)
    if not values:
        raise ConfigError(name, f"is empty; name at least one GPU worker type, most preferred "
                                f"first (one of {', '.join(known)})")
    seen: list[str] = []
    for value in values:
        if value in seen:
            raise ConfigError(name, f"lists {value} twice; name each type once, most preferred "
                                    "first")
        if value not in WORKER_INSTANCE_TYPES:
            raise ConfigError(name, f"{value!r} is not a GPU worker type of the catalog",
                              allowed=known, value=value)
        if region not in WORKER_REGIONS[value]:
            raise ConfigError(name, f"{value} is not offered in rayfleet:region {region}; drop "
                                    "it from the list, or pick a region that offers it",
                              allowed=WORKER_REGIONS[value], value=region)
        seen.append(value)
    return tuple(seen)


# Keys an older kit read, and the one line that says what replaced them.
RETIRED = {
    "workerInstanceType": lambda value: (
        "was replaced by rayfleet:workerInstanceTypes, a list, most preferred first; set "
        f"rayfleet:workerInstanceTypes: [{value}] instead"),
}


def _worker_az(value: str, region: str) -> str | None:
    if not value:
        return None
    if re.fullmatch(re.escape(region) + r"[a-z]", value):
        return value
    hint = _suggest(region + value[-1]) if re.fullmatch(r"[a-z]", value[-1:]) else ""
    raise ConfigError(_q("workerAz"), f"{value!r} is not an availability zone of {region} "
                                      f"(expected {region}a, {region}b, ...){hint}")


def _worker_fallback_azs(values: list[str], region: str,
                         worker_az: str | None) -> tuple[str, ...]:
    """rayfleet:workerFallbackAzs: AZs of the region, each once, none the workers' own. An
    empty rayfleet:workerAz resolves to the region's first available AZ only under `pulumi
    up`, so the program (infra/components/network.py) refuses a fallback AZ equal to that."""
    name = _q("workerFallbackAzs")
    out: list[str] = []
    for value in values:
        if not re.fullmatch(re.escape(region) + r"[a-z]", value):
            hint = _suggest(region + value[-1]) if re.fullmatch(r"[a-z]", value[-1:]) else ""
            raise ConfigError(name, f"{value!r} is not an availability zone of rayfleet:region "
                                    f"{region} (expected a list such as [{region}c]){hint}")
        if value == worker_az:
            raise ConfigError(name, f"lists {value}, which is rayfleet:workerAz; name other AZs "
                                    "of the region, in the order to try them")
        if value in out:
            raise ConfigError(name, f"lists {value} twice; name each AZ once, in the order to "
                                    "try them")
        out.append(value)
    return tuple(out)


def _network(name: str, value: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError:
        pass
    try:
        fixed = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ConfigError(_q(name), f"{value!r} is not a CIDR (expected e.g. 10.0.0.0/16)") \
            from None
    raise ConfigError(_q(name), f"{value!r} has host bits set{_suggest(str(fixed))}")


def _vpc_cidr(value: str) -> str:
    net = _network("vpcCidr", value)
    if net.version != 4:
        raise ConfigError(_q("vpcCidr"), f"{value!r} must be an IPv4 CIDR")
    # RFC 1918 and CGNAT, plus 198.18.0.0/15 (RFC 2544's benchmarking range): AWS accepts VPC
    # ranges outside RFC 1918, and the fake cloud of the `ray up` rehearsal lives in this one
    # because nothing real can be there.
    private = [ipaddress.ip_network(n) for n in
               ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                "198.18.0.0/15")]
    if not any(net.subnet_of(p) for p in private):
        raise ConfigError(_q("vpcCidr"), f"{value!r} must lie in a private range",
                          allowed=[str(p) for p in private])
    # /22 is the smallest VPC whose eighth-of-an-eighth public subnets are still /28, the
    # smallest subnet AWS allows.
    if not 16 <= net.prefixlen <= 22:
        raise ConfigError(_q("vpcCidr"), f"{value!r} must be /16 to /22")
    return str(net)


def _operator_cidrs(values: list[str]) -> tuple[str, ...]:
    """Rule 24: refuse world-open and malformed CIDRs; an empty list means SSM only."""
    out: list[str] = []
    for value in values:
        net = _network("operatorCidrs", value)
        why = f"rule 24, {rule(24).anchor}"
        if net.prefixlen == 0:
            raise ConfigError(_q("operatorCidrs"), f"{value} opens SSH and the dashboard to "
                                                   "the whole internet; name your VPN or office "
                                                   "range, or leave the list empty for SSM only "
                                                   f"({why})")
        # Broader than a /8 (or an IPv6 /32) is "most of the internet" split in pieces.
        floor = 8 if net.version == 4 else 32
        if net.prefixlen < floor:
            raise ConfigError(_q("operatorCidrs"), f"{value} is broader than /{floor}; name "
                                                   f"a narrower range ({why})")
        if str(net) not in out:
            out.append(str(net))
    return tuple(out)


def _nodes(v: Mapping[str, Any], worker_types: tuple[str, ...], region: str,
           fallback_azs: tuple[str, ...] = ()) -> NodesConfig:
    head = v["headInstanceType"]
    # The catalog's head types, in a few words: its families and its smallest to largest size.
    families, sizes = catalog.data()["head_families"], list(catalog.data()["head_sizes"])
    head_types = f"{' '.join(families)}, {sizes[0]} to {sizes[-1]}"
    if head in WORKER_INSTANCE_TYPES:
        raise ConfigError(_q("headInstanceType"), f"{head} is a GPU type; the head is a CPU "
                                                  f"node (it runs no training): pick one of "
                                                  f"{head_types}")
    if head not in HEAD_INSTANCE_TYPES:
        raise ConfigError(_q("headInstanceType"), f"{head!r} is not a supported head type "
                                                  f"({head_types})"
                                                  f"{did_you_mean(head, HEAD_INSTANCE_TYPES)}")
    min_w = _int_range("minWorkers", v["minWorkers"], 0, 64)
    max_w = _int_range("maxWorkers", v["maxWorkers"], 1, 64)
    if min_w > max_w:
        raise ConfigError(_q("minWorkers"), f"is {min_w} but rayfleet:maxWorkers is {max_w}; "
                                            "minWorkers must be <= maxWorkers")
    on_demand = v["onDemandWorkers"]
    if not 0 <= on_demand <= max_w:
        raise ConfigError(_q("onDemandWorkers"), f"must be between 0 and rayfleet:maxWorkers "
                                                 f"({max_w}), got {on_demand}")
    ami = v["amiId"] or None
    if ami is not None and not re.fullmatch(r"ami-([0-9a-f]{8}|[0-9a-f]{17})", ami):
        raise ConfigError(_q("amiId"), f"{ami!r} is not an AMI id (ami- and 8 or 17 hex "
                                       "digits); leave it empty for the newest Deep Learning "
                                       "AMI")
    return NodesConfig(
        head_instance_type=head,
        worker_instance_types=worker_types,
        min_workers=min_w,
        max_workers=max_w,
        on_demand_workers=on_demand,
        head_root_volume_gb=_int_range("headRootVolumeGb", v["headRootVolumeGb"], 100, 16384),
        # The Deep Learning AMI's own root snapshot is ~100 GiB; models and images need more.
        worker_root_volume_gb=_int_range("workerRootVolumeGb", v["workerRootVolumeGb"],
                                         200, 16384),
        ami_id=ami,
        ray_in_docker=v["rayInDocker"],
        capacity_reservations=_capacity_reservations(v["capacityReservations"], worker_types,
                                                     region),
        worker_fallback_azs=fallback_azs,
    )


# The keys of one rayfleet:capacityReservations entry.
RESERVATION_KEYS = ("instanceType", "availabilityZone", "id", "resourceGroupArn",
                    "capacityBlock")
RESERVATION_ID = re.compile(r"cr-[0-9a-f]{17}")


def _capacity_reservations(entries: list[dict], worker_types: tuple[str, ...],
                           region: str) -> tuple[CapacityReservation, ...]:
    """rayfleet:capacityReservations: each entry names an allowed worker type, an AZ of the
    region and exactly one target; one Capacity Block and one reservation per type."""
    name = _q("capacityReservations")
    out: list[CapacityReservation] = []
    for i, entry in enumerate(entries):
        at = f"{name}[{i}]"
        for key in entry:
            if key not in RESERVATION_KEYS:
                raise ConfigError(f"{at}.{key}", "is not a reservation setting",
                                  allowed=RESERVATION_KEYS, value=key)
        itype = entry.get("instanceType")
        if itype not in worker_types:
            raise ConfigError(f"{at}.instanceType", f"{itype!r} is not one of "
                                                    "rayfleet:workerInstanceTypes; add it there "
                                                    "first", allowed=worker_types, value=itype)
        az = entry.get("availabilityZone")
        if not (isinstance(az, str) and re.fullmatch(re.escape(region) + r"[a-z]", az)):
            hint = (_suggest(region + az[-1]) if isinstance(az, str)
                    and re.fullmatch(r"[a-z]", az[-1:]) else "")
            raise ConfigError(f"{at}.availabilityZone",
                              f"{az!r} is not an availability zone of rayfleet:region {region} "
                              f"(expected {region}a, {region}b, ...){hint}")
        block = entry.get("capacityBlock", False)
        if isinstance(block, str) and block.strip().lower() in ("true", "false"):
            block = block.strip().lower() == "true"
        if not isinstance(block, bool):
            raise ConfigError(f"{at}.capacityBlock", f"expected true or false, got {block!r}")
        rid, arn = entry.get("id"), entry.get("resourceGroupArn")
        if (rid is None) == (arn is None):
            raise ConfigError(at, "needs exactly one of id (cr-...) or resourceGroupArn, got "
                                  + ("both" if rid is not None else "neither"))
        if block and rid is None:
            raise ConfigError(f"{at}.resourceGroupArn", "cannot target a Capacity Block "
                                                        "(capacityBlock: true): EC2 launches "
                                                        "into a block by its reservation id; "
                                                        "set id: cr-... instead")
        if rid is not None:
            if not (isinstance(rid, str) and RESERVATION_ID.fullmatch(rid)):
                fixed = str(rid).strip().lower()
                hint = _suggest(fixed) if RESERVATION_ID.fullmatch(fixed) else ""
                raise ConfigError(f"{at}.id", f"{rid!r} is not a capacity reservation id (cr- "
                                              f"and 17 lowercase hex digits){hint}")
        else:
            partition = "aws-us-gov" if region.startswith("us-gov-") else "aws"
            pattern = (rf"arn:{partition}:resource-groups:{re.escape(region)}:\d{{12}}:"
                       r"group/[A-Za-z0-9_.-]{1,300}")
            if not (isinstance(arn, str) and re.fullmatch(pattern, arn)):
                raise ConfigError(f"{at}.resourceGroupArn",
                                  f"{arn!r} is not a resource group ARN of rayfleet:region "
                                  f"{region} (arn:{partition}:resource-groups:{region}:"
                                  "<account>:group/<name>)")
        r = CapacityReservation(itype, az, rid, arn, block)
        for other in out:
            if r.target == other.target:
                raise ConfigError(f"{at}", f"lists {r.target} twice; name each reservation "
                                           "once")
            if (r.instance_type, r.market) == (other.instance_type, other.market):
                what = "Capacity Block" if block else "On-Demand Capacity Reservation"
                raise ConfigError(f"{at}", f"is a second {what} for {itype}; one per type "
                                           "(put several On-Demand Capacity Reservations in "
                                           "one resource group and target that)")
        out.append(r)
    return tuple(out)


def _bucket_prefix(value: str) -> str:
    # S3 bucket naming rules
    # (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html), for a
    # prefix: at most BUCKET_PREFIX_MAX, as a unique suffix is appended to it.
    # Dots are refused too: they break TLS for virtual-hosted-style requests.
    name = _q("bucketPrefix")
    fixed = re.sub(r"[^a-z0-9-]", "-", value.lower())[:BUCKET_PREFIX_MAX]
    hint = _suggest(fixed) if fixed != value and len(fixed) >= 3 else ""
    if not 3 <= len(value) <= BUCKET_PREFIX_MAX:
        raise ConfigError(name, f"{value!r} must be 3-{BUCKET_PREFIX_MAX} characters{hint}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", value):
        raise ConfigError(name, f"{value!r} may hold only lowercase letters, digits and "
                                f"hyphens, starting with a letter or digit{hint}")
    for reserved in ("xn--", "sthree-", "amzn-s3-demo-"):
        if value.startswith(reserved):
            raise ConfigError(name, f"{value!r} starts with {reserved}, which S3 reserves")
    return value


def _key_prefix(value: str) -> str:
    name = _q("bucketKeyPrefix")
    if re.fullmatch(r"([A-Za-z0-9_.=-]+/)+", value) and ".." not in value.split("/"):
        return value
    fixed = "/".join(s for s in value.split("/") if s and s != "..")
    hint = _suggest(fixed + "/") if fixed else ""
    raise ConfigError(name, f"{value!r} must be one or more path segments ending with / "
                            f"(letters, digits, _ . = -), without a leading /{hint}")


def _budget(v: Mapping[str, Any]) -> BudgetConfig:
    amount = v["budgetMonthlyUsd"]
    emails = tuple(v["budgetEmails"])
    if amount < 0:
        raise ConfigError(_q("budgetMonthlyUsd"), f"must be 0 (no budget) or more, got {amount}")
    for email in emails:
        if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[A-Za-z]{2,}", email):
            raise ConfigError(_q("budgetEmails"), f"{email!r} is not an email address")
    if amount and not emails:
        raise ConfigError(_q("budgetEmails"), f"is empty but rayfleet:budgetMonthlyUsd is "
                                              f"{amount}; name at least one address to alert")
    if emails and not amount:
        raise ConfigError(_q("budgetMonthlyUsd"), "is 0 (no budget) but rayfleet:budgetEmails "
                                                  "is set; set a monthly limit in USD")
    # AWS Budgets allows at most 10 email subscribers per notification.
    if len(emails) > 10:
        raise ConfigError(_q("budgetEmails"), f"has {len(emails)} addresses; AWS Budgets "
                                              "allows at most 10")
    return BudgetConfig(monthly_usd=amount, emails=emails)


__all__ = [
    "AWS_REGIONS",
    "DEFAULTS",
    "HEAD_INSTANCE_TYPES",
    "LOG_RETENTION_DAYS",
    "NAMESPACE",
    "RAY_CLUSTER_TAG",
    "RAY_PORTS",
    "SCHEMA",
    "WORKER_INSTANCE_TYPES",
    "WORKER_REGIONS",
    "AccessConfig",
    "BudgetConfig",
    "CapacityReservation",
    "ConfigKey",
    "InstanceSpec",
    "NetworkConfig",
    "NodesConfig",
    "RayPort",
    "StackConfig",
    "StorageConfig",
    "WorkerSplit",
    "load_stack_config",
    "load_stack_file",
]
