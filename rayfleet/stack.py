"""The stack-output contract: the one output, ``rayfleet``, that the Pulumi program exports
(``infra/components`` builds a :class:`StackOutputs`) and `rayfleet render` reads back with
:func:`parse`, checked, so that a stale or hand-edited output is refused in one line. The
dataclasses below declare it once: each field is an output key, its metadata whether render
requires it. Every key, and why the schema is still 2: docs/node-types.md#the-stack-output.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rayfleet import catalog
from rayfleet.errors import ConfigError, RayfleetError, did_you_mean
from rayfleet.facts import (CLUSTER_NAME, MARKET_BLOCK, RESERVATION_MARKETS, VLLM_BUILDS,
                            WORKER_MARKETS)

SCHEMA_VERSION = 2

# What `pulumi stack output --json` must be re-run for, named in every error.
_RERUN = "re-run `pulumi up` and pass the fresh `pulumi stack output --json`"


# A field's name is its output key; its metadata: "required" (render refuses an output without
# it), "absent" (what a missing key reads as), "lenient" (a value render cannot read reads as
# None), "exported" (False: parse gives it, to_dict leaves it out), "omit_if_none".
def _required(**kw: Any) -> Any:
    """A field render reads: the output must hold it, not empty (a dataclass's field: each of
    that dataclass's own required fields)."""
    return field(metadata={"required": True}, **kw)


@dataclass(frozen=True)
class HeadNodeType:
    instance_type: str = _required()
    vcpus: int = _required()
    gpus: int = 0


@dataclass(frozen=True)
class TemplateId:
    id: str = _required()


@dataclass(frozen=True)
class CapacityReservationTarget:
    """What a reserved node type launches into: one reservation (``id``) or any reservation of
    a resource group (``resource_group_arn``), in one AZ, through that AZ's private subnet."""

    availability_zone: str
    subnet_id: str
    id: str | None = field(default=None, metadata={"omit_if_none": True})
    resource_group_arn: str | None = field(default=None, metadata={"omit_if_none": True})

    @property
    def target(self) -> str:
        return self.id or self.resource_group_arn or ""


@dataclass(frozen=True)
class WorkerNodeType:
    """One (GPU worker type, market) of the stack: a launch template and a Ray node type."""

    instance_type: str = _required()
    market: str = _required()             # "spot" | "ondemand" | "block" | "reserved"
    vcpus: int = _required()
    gpus: int = _required()
    # The Ray resource accelerator_type:<this> (A100, H100, H200).
    accelerator_type: str = _required()
    # Not render's to require: an output without it reads as 0.
    efa_interfaces: int = field(metadata={"absent": 0})
    min_workers: int = _required()
    max_workers: int = _required()
    launch_template: TemplateId = _required()
    # "block" and "reserved" only; absent from the others' output, as before reservations.
    capacity_reservation: CapacityReservationTarget | None = field(
        default=None, metadata={"omit_if_none": True})
    # The AZ its workers launch in (its template's subnet); None only in an output made before
    # fallback AZs, where it is the workers' AZ (or the reservation's).
    availability_zone: str | None = field(default=None, metadata={"omit_if_none": True})
    # The workers' AZ (availability_zones[0]), which tells a fallback entry from the others;
    # the output holds it once, at the top, so it is not exported here.
    workers_az: str | None = field(default=None, compare=False,
                                   metadata={"exported": False})

    @property
    def fallback_az(self) -> str | None:
        """The AZ of rayfleet:workerFallbackAzs this spot or on-demand entry launches in;
        None in the workers' AZ and for a reservation (in its own AZ)."""
        if self.capacity_reservation is not None or not self.availability_zone:
            return None
        return None if self.availability_zone == self.workers_az else self.availability_zone

    @property
    def ray_name(self) -> str:
        """The Ray node type's name in the cluster YAML, e.g. ``ray.worker.p5.48xlarge.spot``
        (``...spot.us-east-1c`` in a fallback AZ): one per (type, market, AZ), so the scorer
        and a `ray status` line name all three."""
        return ray_worker_name(self.instance_type, self.market, self.fallback_az)


def ray_worker_name(instance_type: str, market: str, fallback_az: str | None = None) -> str:
    """``ray.worker.<type>.<market>``, and ``.<az>`` after it in a fallback AZ: the workers'
    AZ keeps the name it had before fallback AZs."""
    return f"ray.worker.{instance_type}.{market}" + (f".{fallback_az}" if fallback_az else "")


H = TypeVar("H")


@dataclass(frozen=True)
class NodeTypes:
    """The head and the worker node types, in the stack's order."""

    head: HeadNodeType = _required()
    workers: list[WorkerNodeType] = _required()


@dataclass(frozen=True)
class LaunchTemplates:
    head: TemplateId = _required()


@dataclass(frozen=True)
class ByRole(Generic[H]):
    """One value per node role (IAM): the head's and every worker's."""

    head: H = _required()
    worker: H = _required()


@dataclass(frozen=True)
class Arn:
    arn: str = _required()


@dataclass(frozen=True)
class GcsStore:
    """rayfleet:headHa's Redis: the GCS's tables outlive the head. TLS only; the auth token is
    in Secrets Manager (only the head role may read it), never in the outputs."""

    endpoint: str = _required()     # the replication group's primary endpoint (a DNS name)
    port: int = _required()
    auth_secret_arn: str = _required()

    @property
    def url(self) -> str:
        """What RAY_REDIS_ADDRESS names: ``rediss://`` is Ray's switch for TLS."""
        return f"rediss://{self.endpoint}:{self.port}"


@dataclass(frozen=True)
class HeadAddress:
    """The private address every head of an HA stack launches at (one subnet: the workers')."""

    private_ip: str = _required()
    subnet_id: str = _required()


@dataclass(frozen=True)
class HeadHa:
    gcs_store: GcsStore = _required()
    head_address: HeadAddress = _required()


@dataclass(frozen=True)
class StackOutputs:
    # What render reads.
    stack: str = _required()
    cluster_name: str = _required()
    region: str = _required()
    availability_zones: list[str] = _required()
    private_subnet_ids: list[str] = _required()
    worker_subnet_id: str = _required()
    cluster_security_group_id: str = _required()
    instance_profiles: ByRole[Arn] = _required()
    launch_templates: LaunchTemplates = _required()
    node_types: NodeTypes = _required()
    max_workers: int = _required()
    storage_uri: str = _required()
    # For operators and the kit's tests; optional when parsed.
    worker_availability_zone: str | None = None
    vpc_id: str | None = None
    efa_security_group_id: str | None = None
    operator_access: str | None = None
    operator_cidrs: list[str] = field(default_factory=list)
    # Not render's: an output that lacks it, or half of it, reads as None.
    roles: ByRole[Arn] | None = field(default=None, metadata={"lenient": True})
    placement_group: str | None = None
    ami_id: str | None = None
    imds_hop_limit: int | None = None
    bucket: str | None = None
    bucket_arn: str | None = None
    kms_key_arn: str | None = None
    ray_ports: dict[str, list[int]] = field(default_factory=dict)
    budget_name: str | None = None
    # Read by render when present: 0 (and an older stack without it) means no auto-stop.
    autostop_minutes: int = 0
    # Read by render when present (rayfleet:vllm, render's default --vllm); absent: cuda.
    vllm: str = "cuda"
    # rayfleet:headHa; None (and absent from the output, as before it existed): no HA.
    head_ha: HeadHa | None = field(default=None, metadata={"omit_if_none": True})
    schema_version: int = _required(default=SCHEMA_VERSION)

    def to_dict(self) -> dict[str, Any]:
        """The exported object. Values are copied as they are (not deep-copied like
        ``dataclasses.asdict`` would), so Pulumi outputs inside stay outputs."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("exported", True)
                and not (f.metadata.get("omit_if_none") and getattr(value, f.name) is None)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _fields(tp: Any) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """A dataclass's fields with their declared types, a generic's parameter replaced by its
    argument (``ByRole[Arn]``'s ``head`` is an ``Arn``)."""
    cls = typing.get_origin(tp) or tp
    args = dict(zip(getattr(cls, "__parameters__", ()), typing.get_args(tp), strict=True))
    hints = typing.get_type_hints(cls)
    return tuple((f, args.get(hints[f.name], hints[f.name])) for f in dataclasses.fields(cls))


def _required_keys(tp: Any, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of ``tp``'s required fields, a dataclass's by its own required keys."""
    keys: list[str] = []
    for f, ftype in _fields(tp):
        if not f.metadata.get("required"):
            continue
        if dataclasses.is_dataclass(typing.get_origin(ftype) or ftype):
            keys += _required_keys(ftype, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return tuple(keys)


# Every key render reads, dotted; a missing one is refused with its name.
REQUIRED_KEYS = _required_keys(StackOutputs)
# Every key render reads of each worker node type.
WORKER_KEYS = _required_keys(WorkerNodeType)
# What render reads of head_ha, when the output has it.
HEAD_HA_KEYS = _required_keys(HeadHa)


def _read(tp: Any, value: Any, given: dict[str, Any]) -> Any:
    """An output's ``value`` as its declared type ``tp``: a dataclass from its keys, a list item
    by item, a dict copied, anything else as it is. ``given`` holds what the fields that are
    not exported take."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None:
            return None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    cls = typing.get_origin(tp) or tp
    if cls is list:
        (item,) = typing.get_args(tp)
        return [_read(item, v, given) for v in value]
    if cls is dict:
        return dict(value)
    if not dataclasses.is_dataclass(cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{cls.__name__} from {value!r}")
    kwargs = {}
    for f, ftype in _fields(tp):
        if not f.metadata.get("exported", True):
            if f.name in given:
                kwargs[f.name] = given[f.name]
        # An older or hand-made output may hold null for a list or map it did not fill.
        elif f.name in value and (value[f.name] or f.default_factory is dataclasses.MISSING):
            kwargs[f.name] = _read_field(f, ftype, value[f.name], given)
        elif "absent" in f.metadata:
            kwargs[f.name] = f.metadata["absent"]
    return cls(**kwargs)


def _read_field(f: dataclasses.Field, tp: Any, value: Any, given: dict[str, Any]) -> Any:
    if not f.metadata.get("lenient"):
        return _read(tp, value, given)
    try:
        return _read(tp, value, given)
    except (KeyError, TypeError):
        return None


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            raise KeyError(dotted)
        d = d[part]
    return d


def parse(text: str, source: str = "outputs") -> StackOutputs:
    """The ``rayfleet`` output from JSON text: either ``pulumi stack output --json`` (a dict
    with a ``rayfleet`` key) or the ``rayfleet`` object itself. Validated; one-line errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RayfleetError(f"{source}: not JSON ({e.msg} at line {e.lineno}); pass the output "
                            "of `pulumi stack output --json`") from None
    if isinstance(data, dict) and isinstance(data.get("rayfleet"), dict):
        data = data["rayfleet"]
    if not isinstance(data, dict) or "schema_version" not in data:
        raise RayfleetError(f"{source}: no `rayfleet` stack output found; pass the output of "
                            "`pulumi stack output --json` for a rayfleet stack")
    version = data["schema_version"]
    if _whole(version) and version < SCHEMA_VERSION:
        raise RayfleetError(f"{source}: schema_version {version} is older than {SCHEMA_VERSION} "
                            "(one worker type; now rayfleet:workerInstanceTypes, several); "
                            "re-run `pulumi up` with this rayfleet and pass the fresh "
                            "`pulumi stack output --json`")
    if version != SCHEMA_VERSION:
        raise RayfleetError(f"{source}: schema_version {version!r} is not "
                            f"{SCHEMA_VERSION}; upgrade rayfleet or re-run `pulumi up`")
    missing = []
    for key in REQUIRED_KEYS:
        try:
            value = _get(data, key)
        except KeyError:
            missing.append(key)
            continue
        if value is None or value == "" or value == []:
            missing.append(key)
    if not missing:
        workers = data["node_types"]["workers"]
        if not isinstance(workers, list):
            raise ConfigError(f"{source}: node_types.workers", f"must be a list of worker node "
                                                               f"types; {_RERUN}")
        for i, w in enumerate(workers):
            for key in WORKER_KEYS:
                try:
                    value = _get(w, key)
                except KeyError:
                    missing.append(f"node_types.workers[{i}].{key}")
                    continue
                if value is None or value == "":
                    missing.append(f"node_types.workers[{i}].{key}")
    if missing:
        raise RayfleetError(f"{source}: stack output `rayfleet` lacks {', '.join(missing)}; "
                            f"{_RERUN}")
    _check(data, source)
    return _build(data)


def _check(o: dict[str, Any], source: str) -> None:
    nt = o["node_types"]
    head = nt["head"]["instance_type"]
    heads = catalog.head_types()
    if head not in heads:
        raise ConfigError(f"{source}: node_types.head.instance_type",
                          f"{head!r} is not a known head type{did_you_mean(head, heads)}")
    _count(source, "node_types.head.vcpus", nt["head"]["vcpus"], 1)
    known = catalog.worker_types()
    seen: set[tuple[str, str, str | None]] = set()
    zones = o["availability_zones"]
    for i, w in enumerate(nt["workers"]):
        kind = f"workers[{i}]"
        t = w["instance_type"]
        if t not in known:
            raise ConfigError(f"{source}: node_types.{kind}.instance_type",
                              f"{t!r} is not a known GPU worker type{did_you_mean(t, known)}")
        if w["market"] not in WORKER_MARKETS:
            raise ConfigError(f"{source}: node_types.{kind}.market",
                              f"{w['market']!r} is not a market", WORKER_MARKETS, w["market"])
        _check_reservation(source, kind, w)
        az = _check_az(source, kind, w, zones)
        fallback = az if az != zones[0] and w["market"] not in RESERVATION_MARKETS else None
        if (t, w["market"], fallback) in seen:
            where = f" in {fallback}" if fallback else ""
            raise ConfigError(f"{source}: node_types.{kind}",
                              f"{t} {w['market']}{where} appears twice; {_RERUN}")
        seen.add((t, w["market"], fallback))
        lo, hi = w["min_workers"], w["max_workers"]
        if not (_whole(lo) and _whole(hi) and 0 <= lo <= hi):
            raise ConfigError(f"{source}: node_types.{kind}",
                              f"min_workers {lo!r} must be an integer between 0 and max_workers "
                              f"{hi!r}")
        _count(source, f"node_types.{kind}.vcpus", w["vcpus"], 1)
        _count(source, f"node_types.{kind}.gpus", w["gpus"], 1)
        _count(source, f"node_types.{kind}.efa_interfaces", w.get("efa_interfaces", 0), 0)
        if not isinstance(w["accelerator_type"], str):
            raise ConfigError(f"{source}: node_types.{kind}.accelerator_type",
                              f"must be a string, got {w['accelerator_type']!r}; {_RERUN}")
    _count(source, "max_workers", o["max_workers"], 1)
    _count(source, "autostop_minutes", o.get("autostop_minutes", 0), 0)
    if o.get("vllm", "cuda") not in VLLM_BUILDS:
        raise ConfigError(f"{source}: vllm", f"{o['vllm']!r} is not a vLLM build "
                                             "(rayfleet:vllm)", VLLM_BUILDS, o["vllm"])
    _check_head_ha(source, o)
    if not CLUSTER_NAME.fullmatch(str(o["cluster_name"])):
        raise ConfigError(f"{source}: cluster_name", f"{o['cluster_name']!r} is not a rayfleet "
                                                     "cluster name")


def _check_head_ha(source: str, o: dict[str, Any]) -> None:
    """head_ha, when present: every key render reads, a port, an IPv4 address, a secret ARN and
    a subnet of the stack's."""
    ha = o.get("head_ha")
    if ha is None:
        return
    for key in HEAD_HA_KEYS:
        try:
            value = _get(ha, key)
        except KeyError:
            value = None
        if value is None or value == "":
            raise RayfleetError(f"{source}: stack output `rayfleet` lacks head_ha.{key}; "
                                f"{_RERUN}")
    _count(source, "head_ha.gcs_store.port", ha["gcs_store"]["port"], 1)
    try:
        ipaddress.IPv4Address(str(ha["head_address"]["private_ip"]))
    except ValueError:
        raise ConfigError(f"{source}: head_ha.head_address.private_ip",
                          f"{ha['head_address']['private_ip']!r} is not an IPv4 address; "
                          f"{_RERUN}") from None
    if ha["head_address"]["subnet_id"] not in o["private_subnet_ids"]:
        raise ConfigError(f"{source}: head_ha.head_address.subnet_id",
                          f"{ha['head_address']['subnet_id']!r} is not one of the stack's "
                          f"private_subnet_ids; {_RERUN}")
    if not str(ha["gcs_store"]["auth_secret_arn"]).startswith("arn:"):
        raise ConfigError(f"{source}: head_ha.gcs_store.auth_secret_arn",
                          f"{ha['gcs_store']['auth_secret_arn']!r} is not an ARN; {_RERUN}")


def _check_reservation(source: str, kind: str, w: dict[str, Any]) -> None:
    """A block or reserved node type names its AZ, subnet and exactly one target (a block its
    reservation id); any other market names none."""
    key = f"{source}: node_types.{kind}.capacity_reservation"
    cr = w.get("capacity_reservation")
    if w["market"] not in RESERVATION_MARKETS:
        if cr is not None:
            raise ConfigError(key, f"is set on a {w['market']} node type; {_RERUN}")
        return
    if not isinstance(cr, dict) or not cr.get("availability_zone") or not cr.get("subnet_id"):
        raise ConfigError(key, f"must name the {w['market']} node type's availability_zone and "
                               f"subnet_id; {_RERUN}")
    if bool(cr.get("id")) == bool(cr.get("resource_group_arn")):
        raise ConfigError(key, f"must name exactly one of id and resource_group_arn; {_RERUN}")
    if w["market"] == MARKET_BLOCK and not cr.get("id"):
        raise ConfigError(key, f"a Capacity Block is launched into by its id; {_RERUN}")


def _check_az(source: str, kind: str, w: dict[str, Any], zones: list[Any]) -> Any:
    """A worker node type's AZ, one of the stack's (a reservation's its reservation's); an
    output made before fallback AZs names none: the workers' AZ, or the reservation's."""
    cr = w.get("capacity_reservation")
    own = cr.get("availability_zone") if isinstance(cr, dict) else zones[0]
    az = w.get("availability_zone", own)
    if az not in zones:
        raise ConfigError(f"{source}: node_types.{kind}.availability_zone",
                          f"{az!r} is not one of the stack's availability_zones "
                          f"({', '.join(map(str, zones))}); {_RERUN}")
    if isinstance(cr, dict) and az != own:
        raise ConfigError(f"{source}: node_types.{kind}.availability_zone",
                          f"is {az} but its capacity reservation is in {own}; {_RERUN}")
    return az


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(source: str, key: str, value: Any, least: int) -> None:
    if not (_whole(value) and value >= least):
        raise ConfigError(f"{source}: {key}", f"must be a whole number >= {least}, got "
                                              f"{value!r}; {_RERUN}")


def _build(o: dict[str, Any]) -> StackOutputs:
    # Each worker entry is told the workers' AZ, which the output holds once, at the top.
    return _read(StackOutputs, o, {"workers_az": o["availability_zones"][0]})
