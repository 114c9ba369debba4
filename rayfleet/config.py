"""The stack configuration: the one entry point that parses and validates it.

Every consumer — the Pulumi program in ``infra/``, and ``rayfleet render / preflight / cost`` —
gets the same typed, frozen :class:`StackConfig`, built by one of three entry points:

- :meth:`StackConfig.from_mapping` — a plain dict, keys ``"rayfleet:azCount"`` or ``"azCount"``,
  values typed (``3``) or as Pulumi stores them (``"3"``, ``'["10.0.0.0/8"]'``);
- :func:`load_stack_file` — a ``Pulumi.<stack>.yaml`` file, without the Pulumi CLI;
- :func:`load_stack_config` — inside the Pulumi program, from ``pulumi.Config``.

Everything is checked before any resource or API call exists; each failure is a
:class:`~rayfleet.errors.ConfigError` whose one line names the key, what is allowed and, where
one is close, the value that was probably meant. The parts live beside it: the keys
(``SCHEMA``, with type, default and description, from which `make regen` writes
``Pulumi.yaml``'s ``config:`` block, and each key's own check) in rayfleet/configkeys.py,
reading and coercing the values in rayfleet/configcheck.py, the value checks in
rayfleet/configvalues.py, the nodes in rayfleet/nodes.py and the capacity reservations in
rayfleet/reservations.py.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Some names below are only re-exported (see __all__): rayfleet.config is the entry point the
# README and Pulumi.yaml name, so `from rayfleet.config import ...` of them keeps working.
from rayfleet import configcheck as check
from rayfleet.catalog import InstanceSpec
from rayfleet.configkeys import (
    DEFAULTS,
    HEAD_INSTANCE_TYPES,
    NAMESPACE,
    SCHEMA,
    SCHEMA_BY_NAME,
    WORKER_INSTANCE_TYPES,
    WORKER_REGIONS,
    ConfigKey,
)
from rayfleet.configvalues import AWS_REGIONS, LOG_RETENTION_DAYS
from rayfleet.errors import ConfigError
from rayfleet.facts import RAY_CLUSTER_TAG, RAY_PORTS, RayPort
from rayfleet.nodes import NodesConfig, WorkerSplit, nodes_config, worker_az
from rayfleet.reservations import CapacityReservation


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
    # rayfleet:vllm: render's default --vllm (cuda, cpu or none).
    vllm: str = "cuda"
    # rayfleet:headHa: GCS fault tolerance (the GCS store and the head's fixed address).
    head_ha: bool = False
    # The raw values (defaults filled in), keyed by bare key name: what to_mapping returns.
    values: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], namespace: str = NAMESPACE) -> StackConfig:
        """Validate a mapping of config keys (``"rayfleet:azCount"`` or ``"azCount"``)."""
        raw = check.collect(mapping, namespace)
        v = {k.name: check.coerce(k, raw[k.name]) if k.name in raw else k.default
             for k in SCHEMA}
        # The checks run in this order, so the first bad key of several is the one reported:
        # the region (the node checks read it), the keys checked jointly (the nodes, then the
        # budget), then every other key's own check, in SCHEMA's order.
        c = {"region": SCHEMA_BY_NAME["region"].checked(v["region"])}
        az = worker_az(v["workerAz"], c["region"])
        nodes = nodes_config(v, c["region"], az)
        monthly_usd, emails = check.budget(v)
        c.update((k.name, k.checked(v[k.name])) for k in SCHEMA
                 if k.check is not None and k.name not in c)
        return cls(
            cluster_name=c["clusterName"],
            region=c["region"],
            network=NetworkConfig(
                vpc_cidr=c["vpcCidr"],
                az_count=c["azCount"],
                nat_gateways=c["natGateways"],
                flow_log_retention_days=c["flowLogRetentionDays"],
                worker_az=az,
            ),
            access=AccessConfig(operator_cidrs=c["operatorCidrs"]),
            nodes=nodes,
            storage=StorageConfig(
                bucket_prefix=c["bucketPrefix"],
                key_prefix=c["bucketKeyPrefix"],
                encryption=c["bucketEncryption"],
                noncurrent_version_days=c["noncurrentVersionDays"],
                abort_multipart_days=c["abortMultipartDays"],
            ),
            budget=BudgetConfig(monthly_usd=monthly_usd, emails=emails),
            autostop_minutes=c["autostopMinutes"],
            vllm=c["vllm"],
            head_ha=c["headHa"],
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


# What `from rayfleet.config import *` gives: the typed config, its entry points and the
# names that live in rayfleet/configkeys.py, nodes.py, reservations.py, facts.py, catalog.py.
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
