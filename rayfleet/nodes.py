"""The cluster's nodes: the CPU head and the GPU worker types, their markets and AZs
(:class:`NodesConfig`, with one :class:`WorkerSplit` per launch template and Ray node type),
and the checks of the settings that build them (``rayfleet:headInstanceType``,
``workerInstanceTypes``, ``workerAz``, ``workerFallbackAzs``, the worker counts, ``amiId``...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rayfleet import catalog
from rayfleet.catalog import InstanceSpec
from rayfleet.configcheck import int_range, qualified, suggest
from rayfleet.configkeys import HEAD_INSTANCE_TYPES, WORKER_INSTANCE_TYPES, WORKER_REGIONS
from rayfleet.errors import ConfigError, did_you_mean
from rayfleet.facts import IMDS_HOP_LIMIT, IMDS_HOP_LIMIT_CONTAINERS, MARKETS
from rayfleet.reservations import CapacityReservation, capacity_reservations


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


# ----------------------------------------------------------------------------- checks

def worker_az(value: str, region: str) -> str | None:
    """rayfleet:workerAz: an AZ of the region, or None for the first available one."""
    if not value:
        return None
    if re.fullmatch(re.escape(region) + r"[a-z]", value):
        return value
    hint = suggest(region + value[-1]) if re.fullmatch(r"[a-z]", value[-1:]) else ""
    raise ConfigError(qualified("workerAz"), f"{value!r} is not an availability zone of {region} "
                                             f"(expected {region}a, {region}b, ...){hint}")


def nodes_config(v: Mapping[str, Any], region: str, workers_az: str | None) -> NodesConfig:
    """The node settings of ``v`` (coerced values by bare key name), checked in the order
    their errors are reported: worker types, fallback AZs, head, counts, AMI, volumes,
    reservations."""
    types = worker_types(v["workerInstanceTypes"], region)
    fallback_azs = worker_fallback_azs(v["workerFallbackAzs"], region, workers_az)
    head = _head_type(v["headInstanceType"])
    min_w = int_range("minWorkers", v["minWorkers"], 0, 64)
    max_w = int_range("maxWorkers", v["maxWorkers"], 1, 64)
    if min_w > max_w:
        raise ConfigError(qualified("minWorkers"), f"is {min_w} but rayfleet:maxWorkers is "
                                                   f"{max_w}; minWorkers must be <= maxWorkers")
    on_demand = v["onDemandWorkers"]
    if not 0 <= on_demand <= max_w:
        raise ConfigError(qualified("onDemandWorkers"), f"must be between 0 and "
                                                        f"rayfleet:maxWorkers ({max_w}), got "
                                                        f"{on_demand}")
    ami = v["amiId"] or None
    if ami is not None and not re.fullmatch(r"ami-([0-9a-f]{8}|[0-9a-f]{17})", ami):
        raise ConfigError(qualified("amiId"), f"{ami!r} is not an AMI id (ami- and 8 or 17 hex "
                                              "digits); leave it empty for the newest Deep "
                                              "Learning AMI")
    return NodesConfig(
        head_instance_type=head,
        worker_instance_types=types,
        min_workers=min_w,
        max_workers=max_w,
        on_demand_workers=on_demand,
        head_root_volume_gb=int_range("headRootVolumeGb", v["headRootVolumeGb"], 100, 16384),
        # The Deep Learning AMI's own root snapshot is ~100 GiB; models and images need more.
        worker_root_volume_gb=int_range("workerRootVolumeGb", v["workerRootVolumeGb"],
                                        200, 16384),
        ami_id=ami,
        ray_in_docker=v["rayInDocker"],
        capacity_reservations=capacity_reservations(v["capacityReservations"], types, region),
        worker_fallback_azs=fallback_azs,
    )


def worker_types(values: list[str], region: str) -> tuple[str, ...]:
    """rayfleet:workerInstanceTypes: known GPU types, each once, all offered in the region."""
    name = qualified("workerInstanceTypes")
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


def worker_fallback_azs(values: list[str], region: str,
                        workers_az: str | None) -> tuple[str, ...]:
    """rayfleet:workerFallbackAzs: AZs of the region, each once, none the workers' own. An
    empty rayfleet:workerAz resolves to the region's first available AZ only under `pulumi
    up`, so the program (infra/components/network.py) refuses a fallback AZ equal to that."""
    name = qualified("workerFallbackAzs")
    out: list[str] = []
    for value in values:
        if not re.fullmatch(re.escape(region) + r"[a-z]", value):
            hint = suggest(region + value[-1]) if re.fullmatch(r"[a-z]", value[-1:]) else ""
            raise ConfigError(name, f"{value!r} is not an availability zone of rayfleet:region "
                                    f"{region} (expected a list such as [{region}c]){hint}")
        if value == workers_az:
            raise ConfigError(name, f"lists {value}, which is rayfleet:workerAz; name other AZs "
                                    "of the region, in the order to try them")
        if value in out:
            raise ConfigError(name, f"lists {value} twice; name each AZ once, in the order to "
                                    "try them")
        out.append(value)
    return tuple(out)


def _head_type(head: str) -> str:
    """rayfleet:headInstanceType: a CPU type of the catalog's head families and sizes."""
    name = qualified("headInstanceType")
    # The catalog's head types, in a few words: its families and its smallest to largest size.
    families, sizes = catalog.data()["head_families"], list(catalog.data()["head_sizes"])
    head_types = f"{' '.join(families)}, {sizes[0]} to {sizes[-1]}"
    if head in WORKER_INSTANCE_TYPES:
        raise ConfigError(name, f"{head} is a GPU type; the head is a CPU node (it runs no "
                                f"training): pick one of {head_types}")
    if head not in HEAD_INSTANCE_TYPES:
        raise ConfigError(name, f"{head!r} is not a supported head type ({head_types})"
                                f"{did_you_mean(head, HEAD_INSTANCE_TYPES)}")
    return head
