"""Rules 31 and 32: where the workers' launch templates put them, in the reserved capacity
rayfleet:capacityReservations names (handed in by the pack from the stack's config) and in the
AZ each template and placement group was built for (their ``rayfleet:availability-zone`` tag).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rayfleet.facts import (
    CAPACITY_BLOCK_MARKET_TYPE,
    TAG_AVAILABILITY_ZONE,
    TAG_CAPACITY_RESERVATION,
)

from .graph import (
    LAUNCH_TEMPLATE,
    PLACEMENT_GROUP,
    SUBNET,
    UNKNOWN,
    Resource,
    Violation,
    _all,
    _known,
    _list,
    _referenced,
    _true,
    _v,
    _value,
)


def _target(lt: Resource) -> list[str]:
    """The reservation ids and resource group ARNs a launch template targets."""
    spec = _known(lt.inputs, "capacityReservationSpecification") or {}
    target = spec.get("capacityReservationTarget") or {}
    return [str(v) for v in (target.get("capacityReservationId"),
                             target.get("capacityReservationResourceGroupArn")) if v]


def rule_31_reserved_capacity(resources: Sequence[Resource],
                              capacity_reservations: Sequence[Mapping[str, Any]] = (),
                              **_: Any) -> Iterator[Violation]:
    """Each reservation of rayfleet:capacityReservations (``capacity_reservations``, as the
    stack config holds them) has a template that targets it and nothing else, of its instance
    type and market; no template targets a reservation the config does not name; a template
    with the capacity-block market type targets a reservation id; none of them is spot."""
    configured = {str(c.get("id") or c.get("resourceGroupArn")): c
                  for c in capacity_reservations}
    served: set[str] = set()
    for lt in _all(resources, LAUNCH_TEMPLATE):
        targets = _target(lt)
        market = (_known(lt.inputs, "instanceMarketOptions") or {}).get("marketType")
        built_for = (_known(lt.inputs, "tags") or {}).get(TAG_CAPACITY_RESERVATION)
        block = market == CAPACITY_BLOCK_MARKET_TYPE
        if not (targets or built_for or block):
            continue  # an ordinary spot or on-demand template
        if built_for:
            served.add(str(built_for))
        if market == "spot":
            yield _v(31, lt, "targets reserved capacity but is spot: a reservation is "
                             "launched on-demand, a Capacity Block with market type "
                             f"{CAPACITY_BLOCK_MARKET_TYPE}")
        if not targets:
            yield _v(31, lt, ("has market type capacity-block but targets no reservation "
                              "(EC2 needs the block's reservation id)") if block else
                             f"was built for {built_for} ({TAG_CAPACITY_RESERVATION}) but "
                             "targets no reservation: it would launch outside it, or not at all")
            continue
        if len(targets) > 1:
            yield _v(31, lt, f"targets both {' and '.join(targets)}; a template targets one")
            continue
        target = targets[0]
        if built_for and built_for != target:
            yield _v(31, lt, f"was built for {built_for} but targets {target}")
        entry = configured.get(target)
        if entry is None:
            yield _v(31, lt, f"targets {target}, which rayfleet:capacityReservations does not "
                             "name (another team's reserved capacity, or a stale one)")
            continue
        if str(_known(lt.inputs, "instanceType")) != str(entry.get("instanceType")):
            yield _v(31, lt, f"is {_known(lt.inputs, 'instanceType')} but {target} reserves "
                             f"{entry.get('instanceType')}")
        if _true(entry.get("capacityBlock")) != block:
            yield _v(31, lt, f"targets {target} with market type {market or 'on-demand'}, but "
                             "the config says it is "
                             + ("a Capacity Block (capacity-block)" if _true(
                                 entry.get("capacityBlock")) else
                                "an On-Demand Capacity Reservation (on-demand)"))
        if block and not target.startswith("cr-"):
            yield _v(31, lt, "has market type capacity-block but targets a resource group; a "
                             "Capacity Block is launched into by its reservation id")
    for target in configured:
        if target not in served:
            yield _v(31, f"capacityReservations '{target}'",
                     "has no launch template built for it (none tagged "
                     f"{TAG_CAPACITY_RESERVATION}={target}): the cluster would never use it")


def rule_32_worker_template_in_its_az(resources: Sequence[Resource],
                                      **_: Any) -> Iterator[Violation]:
    """Each launch template tagged with the AZ it was built for (the workers' or a fallback
    AZ's) has every EFA interface in a subnet of this stack in that AZ, and its placement
    group is the one tagged for that AZ; a template placed in a group without saying its AZ
    is named as well (a reservation's template has neither)."""
    subnets = _all(resources, SUBNET)
    groups = _all(resources, PLACEMENT_GROUP)
    for lt in _all(resources, LAUNCH_TEMPLATE):
        az = (_known(lt.inputs, "tags") or {}).get(TAG_AVAILABILITY_ZONE)
        placement = _value(lt.inputs, "placement")
        group_name = (UNKNOWN if placement is UNKNOWN else
                      _value(placement, "groupName") if isinstance(placement, Mapping)
                      else None)
        if not az:
            if group_name is not None:
                yield _v(32, lt, f"is placed in a cluster placement group but has no "
                                 f"{TAG_AVAILABILITY_ZONE} tag saying which AZ it was built for")
            continue
        nics = _value(lt.inputs, "networkInterfaces")
        # In a first preview the interfaces are unknown as a whole: their subnets are then
        # those the property depends on.
        for i, nic in enumerate([UNKNOWN] if nics is UNKNOWN else _list(nics)):
            subnet = _value(nic, "subnetId") if isinstance(nic, Mapping) else UNKNOWN
            found = _referenced(lt, "networkInterfaces", subnet, subnets)
            zones = {str(s.inputs.get("availabilityZone")) for s in found}
            which = "its EFA interfaces" if nic is UNKNOWN else f"EFA interface {i}"
            if not found:
                yield _v(32, lt, f"puts {which} in subnet {subnet if nic is not UNKNOWN else ''}"
                                 f", not a subnet of this stack (built for {az})")
            elif zones != {az}:
                yield _v(32, lt, f"puts {which} in a subnet of {', '.join(sorted(zones))} but "
                                 f"was built for {az}: EFA stays in its subnet's AZ")
        if group_name is None:
            yield _v(32, lt, f"was built for {az} but names no placement group: its workers "
                             "would not be placed close together for EFA")
            continue
        found = _referenced(lt, "placement", group_name, groups)
        zones = {str((_known(g.inputs, "tags") or {}).get(TAG_AVAILABILITY_ZONE)) for g in found}
        if not found:
            yield _v(32, lt, f"is placed in {'' if group_name is UNKNOWN else group_name}, "
                             "not a placement group of this stack")
        elif zones != {az}:
            yield _v(32, lt, f"was built for {az} but its placement group is the one of "
                             f"{', '.join(sorted(zones))}: a cluster placement group lives in "
                             "one AZ")
