"""Reserved capacity for the GPU workers (``rayfleet:capacityReservations``): what one entry
means (:class:`CapacityReservation`) and the checks each entry passes. A reservation is of one
worker type in one AZ, targeted by reservation id or by resource group; its node type comes
first in its type's order (rayfleet/nodes.py, :meth:`~rayfleet.nodes.NodesConfig.worker_splits`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rayfleet.configcheck import qualified, suggest
from rayfleet.errors import ConfigError
from rayfleet.facts import MARKET_BLOCK, MARKET_RESERVED

# The keys of one rayfleet:capacityReservations entry.
RESERVATION_KEYS = ("instanceType", "availabilityZone", "id", "resourceGroupArn",
                    "capacityBlock")
RESERVATION_ID = re.compile(r"cr-[0-9a-f]{17}")


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


def capacity_reservations(entries: list[dict], worker_types: tuple[str, ...],
                          region: str) -> tuple[CapacityReservation, ...]:
    """rayfleet:capacityReservations: each entry names an allowed worker type, an AZ of the
    region and exactly one target; one Capacity Block and one reservation per type."""
    name = qualified("capacityReservations")
    out: list[CapacityReservation] = []
    for i, entry in enumerate(entries):
        at = f"{name}[{i}]"
        r = _entry(at, entry, worker_types, region)
        for other in out:
            if r.target == other.target:
                raise ConfigError(f"{at}", f"lists {r.target} twice; name each reservation "
                                           "once")
            if (r.instance_type, r.market) == (other.instance_type, other.market):
                what = "Capacity Block" if r.capacity_block else "On-Demand Capacity Reservation"
                raise ConfigError(f"{at}", f"is a second {what} for {r.instance_type}; one per "
                                           "type (put several On-Demand Capacity Reservations in "
                                           "one resource group and target that)")
        out.append(r)
    return tuple(out)


def _entry(at: str, entry: dict, worker_types: tuple[str, ...],
           region: str) -> CapacityReservation:
    """One entry on its own, ``at`` being how errors name it (``...capacityReservations[0]``)."""
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
        hint = (suggest(region + az[-1]) if isinstance(az, str)
                and re.fullmatch(r"[a-z]", az[-1:]) else "")
        raise ConfigError(f"{at}.availabilityZone",
                          f"{az!r} is not an availability zone of rayfleet:region {region} "
                          f"(expected {region}a, {region}b, ...){hint}")
    block = entry.get("capacityBlock", False)
    if isinstance(block, str) and block.strip().lower() in ("true", "false"):
        block = block.strip().lower() == "true"
    if not isinstance(block, bool):
        raise ConfigError(f"{at}.capacityBlock", f"expected true or false, got {block!r}")
    rid, arn = _target(at, entry, block, region)
    return CapacityReservation(itype, az, rid, arn, block)


def _target(at: str, entry: dict, block: bool, region: str) -> tuple[str | None, str | None]:
    """The entry's (id, resourceGroupArn): exactly one set, and well formed for the region."""
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
            hint = suggest(fixed) if RESERVATION_ID.fullmatch(fixed) else ""
            raise ConfigError(f"{at}.id", f"{rid!r} is not a capacity reservation id (cr- "
                                          f"and 17 lowercase hex digits){hint}")
        return rid, arn
    partition = "aws-us-gov" if region.startswith("us-gov-") else "aws"
    pattern = (rf"arn:{partition}:resource-groups:{re.escape(region)}:\d{{12}}:"
               r"group/[A-Za-z0-9_.-]{1,300}")
    if not (isinstance(arn, str) and re.fullmatch(pattern, arn)):
        raise ConfigError(f"{at}.resourceGroupArn",
                          f"{arn!r} is not a resource group ARN of rayfleet:region "
                          f"{region} (arn:{partition}:resource-groups:{region}:"
                          "<account>:group/<name>)")
    return rid, arn
