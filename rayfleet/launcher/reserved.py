"""A reserved worker type (``block`` or ``reserved``): the market and the reservation its
node_config names, the same as its launch template's, so `rayfleet lint`, `cost` and
`preflight` read them from the YAML alone."""

from __future__ import annotations

from rayfleet.facts import CAPACITY_BLOCK_MARKET_TYPE, MARKET_BLOCK
from rayfleet.launcher.why import Why
from rayfleet.stack import WorkerNodeType

WHY = {
    "CapacityReservationSpecification":
        "Launch into reserved capacity in {az} (the template's EFA interfaces are in that AZ's "
        "private subnet, with no placement group: AWS already placed the reservation); "
        "{full}.",
    # {full}: what happens when the reservation has no room, by target.
    "one": "when it is full or over, the launch fails and the autoscaler moves on to the "
           "next node type",
    "group": "EC2 picks any reservation of the group with this type and AZ and room, and "
             "launches plain on-demand capacity (at the same rate) when none has room",
    "InstanceMarketOptions":
        "A Capacity Block: EC2 launches into it only with this market type and the "
        "block's id, and only between its start and end (`rayfleet preflight --hours` "
        "checks it lasts); it was paid for when bought, so its workers add no hourly "
        "compute cost.",
}


def reservation_options(t: WorkerNodeType) -> dict[str, Why]:
    """What a reserved node type (``block`` or ``reserved``) adds to its node_config: the
    same market and target as its launch template, so `rayfleet lint`, `cost` and `preflight`
    read them from the YAML alone."""
    cr = t.capacity_reservation
    assert cr is not None
    target = ({"CapacityReservationId": cr.id} if cr.id else
              {"CapacityReservationResourceGroupArn": cr.resource_group_arn})
    full = WHY["one"] if cr.id else WHY["group"]
    out = {"CapacityReservationSpecification": Why(
        {"CapacityReservationTarget": target},
        WHY["CapacityReservationSpecification"].format(az=cr.availability_zone, full=full))}
    if t.market == MARKET_BLOCK:
        out["InstanceMarketOptions"] = Why({"MarketType": CAPACITY_BLOCK_MARKET_TYPE},
                                           WHY["InstanceMarketOptions"])
    return out
