"""Rules 7 and 8: the VPC's own concerns, nodes kept off public subnets (:func:`public_subnets`)
and every VPC's traffic logged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .graph import (
    FLOW_LOG,
    IGW,
    INSTANCE,
    LAUNCH_TEMPLATE,
    LOG_GROUP,
    ROUTE,
    ROUTE_ASSOC,
    ROUTE_TABLE,
    SUBNET,
    VPC,
    Resource,
    Violation,
    _all,
    _known,
    _list,
    _points_to,
    _true,
    _v,
)


def public_subnets(resources: Sequence[Resource]) -> list[Resource]:
    """Subnets whose route table sends 0.0.0.0/0 to an internet gateway."""
    igws = _all(resources, IGW)

    def to_igw(holder: Resource, gateway: Any) -> bool:
        return (str(gateway or "").startswith("igw-")
                or any(_points_to(holder, "gatewayId", g) for g in igws))

    tables = _all(resources, ROUTE_TABLE)
    public = [t for t in tables
              if any(route.get("cidrBlock") == "0.0.0.0/0" and to_igw(t, route.get("gatewayId"))
                     for route in _list(_known(t.inputs, "routes")))]
    for r in _all(resources, ROUTE):
        if _known(r.inputs, "destinationCidrBlock") == "0.0.0.0/0" and \
                to_igw(r, _known(r.inputs, "gatewayId")):
            public += [t for t in tables if _points_to(r, "routeTableId", t)]
    return [s for s in _all(resources, SUBNET)
            if any(_points_to(a, "subnetId", s) and any(_points_to(a, "routeTableId", t)
                                                        for t in public)
                   for a in _all(resources, ROUTE_ASSOC))]


def rule_7_private_nodes(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    public = public_subnets(resources)
    public_ids = {ref for subnet in public for ref in subnet.refs}
    for s in _all(resources, SUBNET):
        if _true(s.inputs.get("mapPublicIpOnLaunch")):
            yield _v(7, s, "gives instances a public IP on launch (mapPublicIpOnLaunch)")
    for lt in _all(resources, LAUNCH_TEMPLATE):
        for nic in _list(lt.inputs.get("networkInterfaces")):
            if _true(nic.get("associatePublicIpAddress")):
                yield _v(7, lt, "associates a public IP with a network interface")
            if nic.get("subnetId") and str(nic.get("subnetId")) in public_ids:
                yield _v(7, lt, f"puts nodes in public subnet {nic.get('subnetId')}")
        if not public_ids and any(s.urn in lt.deps.get("networkInterfaces", ())
                                  for s in public):
            yield _v(7, lt, "puts nodes in a public subnet")
    for inst in _all(resources, INSTANCE):
        if _true(inst.inputs.get("associatePublicIpAddress")):
            yield _v(7, inst, "has a public IP")
        if str(inst.inputs.get("subnetId")) in public_ids or \
                any(_points_to(inst, "subnetId", s) for s in public):
            yield _v(7, inst, f"runs in public subnet {inst.inputs.get('subnetId')}")


def rule_8_flow_logs(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    groups = _all(resources, LOG_GROUP)
    for vpc in _all(resources, VPC):
        logs = [f for f in _all(resources, FLOW_LOG) if _points_to(f, "vpcId", vpc)]
        if not logs:
            yield _v(8, vpc, "has no flow log")
            continue
        for f in logs:
            if f.inputs.get("trafficType", "ALL") != "ALL":
                yield _v(8, f, f"logs only {f.inputs.get('trafficType')} traffic, not ALL")
            if f.inputs.get("logDestinationType", "cloud-watch-logs") != "cloud-watch-logs":
                continue  # S3 destinations expire through the bucket's lifecycle
            group = next((g for g in groups if _points_to(f, "logDestination", g)), None)
            if group is None:
                dest = str(f.inputs.get("logDestination", "")).removesuffix(":*")
                yield _v(8, f, f"sends to {dest or 'no destination'}, not a log group of this "
                               "stack")
            elif not int(group.inputs.get("retentionInDays") or 0):
                yield _v(8, group, "keeps flow logs forever (no retentionInDays)")
