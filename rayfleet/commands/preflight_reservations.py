"""A capacity reservation as `rayfleet preflight` reports it: one line saying what it is, and
why a launch of a node type could not use it (docs/security.md, rule 31)."""

from __future__ import annotations

from datetime import datetime, timezone

from rayfleet.facts import CAPACITY_BLOCK_MARKET_TYPE

# States a launch can use (EC2 DescribeCapacityReservations' State): an ODCR only when active;
# a Capacity Block bought for later is scheduled until its start.
USABLE_STATES = {"default": ("active",), "capacity-block": ("active", "scheduled")}


def _when(value) -> str:
    """A reservation's date as a line shows it: UTC, to the minute."""
    if not isinstance(value, datetime):
        return str(value)
    value = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def describe_reservation(r: dict) -> str:
    """State, type, AZ, available/total and, for a Capacity Block, its dates: one line."""
    line = (f"{r.get('State')}, {r.get('InstanceType')} in {r.get('AvailabilityZone')}, "
            f"{r.get('AvailableInstanceCount')}/{r.get('TotalInstanceCount')} available")
    if r.get("ReservationType") == CAPACITY_BLOCK_MARKET_TYPE:
        line += f", Capacity Block {_when(r.get('StartDate'))} to {_when(r.get('EndDate'))}"
    elif r.get("EndDate"):
        line += f", ends {_when(r.get('EndDate'))}"
    return line


def reservation_problem(r: dict, itype: str | None, block: bool, stack_azs: list[str],
                        node_azs: list[str], until: datetime, hours: float) -> str | None:
    """Why a launch of the node type could not use reservation ``r``, or None."""
    kind = r.get("ReservationType") or "default"
    is_block = kind == CAPACITY_BLOCK_MARKET_TYPE
    if is_block != block:
        return ("is a Capacity Block but the node type is not launched as capacity-block"
                if is_block else "is not a Capacity Block but the node type is launched as "
                "capacity-block; set capacityBlock: false for it")
    usable = USABLE_STATES["capacity-block" if is_block else "default"]
    if r.get("State") not in usable:
        return (f"is {r.get('State')}, not {' or '.join(usable)}; a launch into it fails "
                "(buy or renew it, or drop it from rayfleet:capacityReservations)")
    if itype and r.get("InstanceType") != itype:
        return (f"reserves {r.get('InstanceType')} but the node type launches {itype}; fix "
                "instanceType in rayfleet:capacityReservations")
    az = r.get("AvailabilityZone")
    if az not in stack_azs:
        return (f"is in {az}, where the stack has no private subnet (it has "
                f"{', '.join(stack_azs) or 'none'}); set availabilityZone: {az} and re-run "
                "`pulumi up`, which adds one")
    if node_azs and az not in node_azs:
        return (f"is in {az} but the node type's interfaces are in {', '.join(node_azs)}; "
                f"set availabilityZone: {az} and re-run `pulumi up`")
    end = r.get("EndDate")
    if isinstance(end, datetime):
        end = end if end.tzinfo else end.replace(tzinfo=timezone.utc)
        if end < until:
            return (f"ends {_when(end)}, before the {hours:g} h asked for (--hours); buy a "
                    "block that lasts, or ask for fewer hours")
    return None
