"""The stack-output contract: the one output, ``rayfleet``, that the Pulumi program exports
and `rayfleet render` turns into a Ray cluster-launcher YAML.

``infra/components`` builds a :class:`StackOutputs` (its values still Pulumi outputs) and
exports :meth:`StackOutputs.to_dict`; :func:`parse` reads ``pulumi stack output --json`` (or
the ``rayfleet`` object alone) back into one, checked, so that a stale or hand-edited output
is refused with one line before anything is written. Keys are the field names below, as
JSON::

    schema_version: 2                    # 2: several worker types (1: one A100 type, refused)
    stack, cluster_name, region: str
    availability_zones: [str]            # the workers' AZ first
    private_subnet_ids: [str]            # one per AZ, same order; nodes go only here
    worker_subnet_id: str                # private subnet of the workers' AZ (placement group)
    cluster_security_group_id: str       # every node; Ray ports from itself only
    instance_profiles: {head: {arn}, worker: {arn}}
    launch_templates: {head: {id}}       # each worker's template is in its node type
    node_types:                          # from the catalog when the stack was deployed
      head:    {instance_type, vcpus, gpus: 0}
      workers:                           # the order of preference: rayfleet:workerInstanceTypes'
        - {instance_type, market,        #   order; per type its Capacity Block ("block"), its
           vcpus, gpus, accelerator_type, #  reservation ("reserved"), its "spot", its "ondemand"
           efa_interfaces, min_workers,  #  in the workers' AZ, then "spot" and "ondemand" in
           max_workers,                  #  each of rayfleet:workerFallbackAzs in turn
           launch_template: {id},
           availability_zone,            # where it launches (optional: absent before fallback
                                         #   AZs, read as the workers' AZ or the reservation's)
           capacity_reservation:         # only on "block" and "reserved" node types
             {availability_zone, subnet_id, id | resource_group_arn}}
    max_workers: int                     # rayfleet:maxWorkers: every worker type together
    storage_uri: str                     # s3://<bucket>/<key prefix>: where jobs write
    autostop_minutes: int                # optional; 0 or absent: never (rayfleet:autostopMinutes)
    head_ha:                             # only with rayfleet:headHa (absent: no GCS store)
      gcs_store: {endpoint, port, auth_secret_arn}   # TLS-only Redis; the token's secret
      head_address: {private_ip, subnet_id}          # where every head launches
    # Not read by render; what an operator (and the kit's tests) look up in the stack:
    worker_availability_zone: str
    vpc_id: str
    efa_security_group_id: str           # GPU EFA interfaces (set by the worker templates)
    operator_access: "ssm" | "ssm+cidr"
    operator_cidrs: [str]
    roles: {head: {arn}, worker: {arn}}
    placement_group, ami_id: str
    imds_hop_limit: int
    bucket, bucket_arn: str
    kms_key_arn: str | null              # null with bucketEncryption: s3
    ray_ports: {name: [from_port, to_port]}   # rayfleet.facts.RAY_PORTS
    budget_name: str | null

Render trusts ``node_types``: a node type's Ray resources are what the stack says its instances
have, so a newer kit never silently disagrees with a deployed stack. A key this version does
not know is ignored (an older stack may export more); a change that would make an older
render misread an output raises :data:`SCHEMA_VERSION`.

Reserved capacity (``block`` and ``reserved`` node types, with their ``capacity_reservation``)
did not raise it: a render of the same schema without them refuses those markets in one line
("is not a market"), so it cannot misread them, and a stack without reservations exports
exactly what it did before.

Fallback AZs (spot and on-demand entries whose ``availability_zone`` is not the workers' AZ,
``availability_zones[0]``) did not raise it either: they repeat a (type, market) of the
workers' AZ, and a schema-2 render without them refuses a repeated (type, market) in one line
("p4d.24xlarge spot appears twice"), so it never writes two node types under one name. A
stack without fallback AZs adds only ``availability_zone``, a key such a render ignores. This
version names a fallback entry's Ray node type after its AZ (:func:`ray_worker_name`) and
refuses a repeated (type, market, AZ).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rayfleet import catalog
from rayfleet.errors import ConfigError, RayfleetError, did_you_mean
from rayfleet.facts import CLUSTER_NAME, MARKET_BLOCK, RESERVATION_MARKETS, WORKER_MARKETS

SCHEMA_VERSION = 2

# What `pulumi stack output --json` must be re-run for, named in every error.
_RERUN = "re-run `pulumi up` and pass the fresh `pulumi stack output --json`"


@dataclass(frozen=True)
class HeadNodeType:
    instance_type: str
    vcpus: int
    gpus: int = 0


@dataclass(frozen=True)
class TemplateId:
    id: str


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

    instance_type: str
    market: str               # "spot" | "ondemand" | "block" | "reserved"
    vcpus: int
    gpus: int
    accelerator_type: str     # the Ray resource accelerator_type:<this> (A100, H100, H200)
    efa_interfaces: int
    min_workers: int
    max_workers: int
    launch_template: TemplateId
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

    head: HeadNodeType
    workers: list[WorkerNodeType]


@dataclass(frozen=True)
class LaunchTemplates:
    head: TemplateId


@dataclass(frozen=True)
class ByRole(Generic[H]):
    """One value per node role (IAM): the head's and every worker's."""

    head: H
    worker: H


@dataclass(frozen=True)
class Arn:
    arn: str


@dataclass(frozen=True)
class GcsStore:
    """rayfleet:headHa's Redis: the GCS's tables outlive the head. TLS only; the auth token is
    in Secrets Manager (only the head role may read it), never in the outputs."""

    endpoint: str          # the replication group's primary endpoint (a DNS name)
    port: int
    auth_secret_arn: str

    @property
    def url(self) -> str:
        """What RAY_REDIS_ADDRESS names: ``rediss://`` is Ray's switch for TLS."""
        return f"rediss://{self.endpoint}:{self.port}"


@dataclass(frozen=True)
class HeadAddress:
    """The private address every head of an HA stack launches at (one subnet: the workers')."""

    private_ip: str
    subnet_id: str


@dataclass(frozen=True)
class HeadHa:
    gcs_store: GcsStore
    head_address: HeadAddress


@dataclass(frozen=True)
class StackOutputs:
    # What render reads: each must be present and non-empty.
    stack: str
    cluster_name: str
    region: str
    availability_zones: list[str]
    private_subnet_ids: list[str]
    worker_subnet_id: str
    cluster_security_group_id: str
    instance_profiles: ByRole[Arn]
    launch_templates: LaunchTemplates
    node_types: NodeTypes
    max_workers: int
    storage_uri: str
    # For operators and the kit's tests; optional when parsed.
    worker_availability_zone: str | None = None
    vpc_id: str | None = None
    efa_security_group_id: str | None = None
    operator_access: str | None = None
    operator_cidrs: list[str] = field(default_factory=list)
    roles: ByRole[Arn] | None = None
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
    # rayfleet:headHa; None (and absent from the output, as before it existed): no HA.
    head_ha: HeadHa | None = field(default=None, metadata={"omit_if_none": True})
    schema_version: int = SCHEMA_VERSION

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


# Every key render reads, dotted; a missing one is refused with its name.
REQUIRED_KEYS = (
    "schema_version", "stack", "cluster_name", "region", "availability_zones",
    "private_subnet_ids", "worker_subnet_id", "cluster_security_group_id",
    "instance_profiles.head.arn", "instance_profiles.worker.arn",
    "launch_templates.head.id", "node_types.head.instance_type", "node_types.head.vcpus",
    "node_types.workers", "max_workers", "storage_uri",
)
# Every key render reads of each worker node type.
WORKER_KEYS = ("instance_type", "market", "vcpus", "gpus", "accelerator_type", "min_workers",
               "max_workers", "launch_template.id")


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
    _check_head_ha(source, o)
    if not CLUSTER_NAME.fullmatch(str(o["cluster_name"])):
        raise ConfigError(f"{source}: cluster_name", f"{o['cluster_name']!r} is not a rayfleet "
                                                     "cluster name")


# What render reads of head_ha, when the output has it.
HEAD_HA_KEYS = ("gcs_store.endpoint", "gcs_store.port", "gcs_store.auth_secret_arn",
                "head_address.private_ip", "head_address.subnet_id")


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
    nt = o["node_types"]

    def worker(w: dict[str, Any]) -> WorkerNodeType:
        cr = w.get("capacity_reservation")
        return WorkerNodeType(w["instance_type"], w["market"], w["vcpus"], w["gpus"],
                              w["accelerator_type"], w.get("efa_interfaces", 0),
                              w["min_workers"], w["max_workers"],
                              TemplateId(w["launch_template"]["id"]),
                              CapacityReservationTarget(
                                  cr["availability_zone"], cr["subnet_id"], cr.get("id"),
                                  cr.get("resource_group_arn")) if cr else None,
                              availability_zone=w.get("availability_zone"),
                              workers_az=o["availability_zones"][0])

    def arns(d: dict[str, Any]) -> ByRole[Arn]:
        return ByRole(Arn(d["head"]["arn"]), Arn(d["worker"]["arn"]))

    lts = o["launch_templates"]
    ha = o.get("head_ha")
    head_ha = None if ha is None else HeadHa(
        GcsStore(ha["gcs_store"]["endpoint"], ha["gcs_store"]["port"],
                 ha["gcs_store"]["auth_secret_arn"]),
        HeadAddress(ha["head_address"]["private_ip"], ha["head_address"]["subnet_id"]))
    try:
        roles = arns(o["roles"])
    except (KeyError, TypeError):
        roles = None  # not render's; an older or hand-made output may lack it
    return StackOutputs(
        schema_version=o["schema_version"],
        stack=o["stack"],
        cluster_name=o["cluster_name"],
        region=o["region"],
        availability_zones=list(o["availability_zones"]),
        private_subnet_ids=list(o["private_subnet_ids"]),
        worker_subnet_id=o["worker_subnet_id"],
        cluster_security_group_id=o["cluster_security_group_id"],
        instance_profiles=arns(o["instance_profiles"]),
        launch_templates=LaunchTemplates(TemplateId(lts["head"]["id"])),
        node_types=NodeTypes(HeadNodeType(nt["head"]["instance_type"], nt["head"]["vcpus"],
                                          nt["head"].get("gpus", 0)),
                             [worker(w) for w in nt["workers"]]),
        max_workers=o["max_workers"],
        storage_uri=o["storage_uri"],
        worker_availability_zone=o.get("worker_availability_zone"),
        vpc_id=o.get("vpc_id"),
        efa_security_group_id=o.get("efa_security_group_id"),
        operator_access=o.get("operator_access"),
        operator_cidrs=list(o.get("operator_cidrs") or []),
        roles=roles,
        placement_group=o.get("placement_group"),
        ami_id=o.get("ami_id"),
        imds_hop_limit=o.get("imds_hop_limit"),
        bucket=o.get("bucket"),
        bucket_arn=o.get("bucket_arn"),
        kms_key_arn=o.get("kms_key_arn"),
        ray_ports=dict(o.get("ray_ports") or {}),
        budget_name=o.get("budget_name"),
        autostop_minutes=o.get("autostop_minutes", 0),
        head_ha=head_ha,
    )
