"""Rules 1, 2, 4, 5, 6 and 30: who a security group lets in, read from every way a permission
can be written (:func:`permissions`: rule resources, legacy rules, inline rules).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rayfleet.facts import (
    INGRESS_PORTS,
    OPERATOR_PORTS,
    RAY_PORTS,
    RAY_PORTS_BY_NAME,
    WORLD_FORBIDDEN,
    port,
)

from .graph import (
    DEFAULT_SG,
    SG,
    SG_EGRESS,
    SG_INGRESS,
    SG_RULE,
    UNKNOWN,
    VPC,
    Resource,
    Violation,
    _all,
    _known,
    _list,
    _points_to,
    _true,
    _v,
    _value,
)


# Rule 1's ports: Ray's unauthenticated-by-default surfaces and Serve.
WORLD_FORBIDDEN_PORTS = tuple((RAY_PORTS_BY_NAME[n].from_port, RAY_PORTS_BY_NAME[n].to_port)
                              for n in WORLD_FORBIDDEN)
# Rule 4's ports: every port Ray listens on between nodes (ssh is rule 2's).
RAY_ONLY_PORTS = tuple((p.from_port, p.to_port) for p in RAY_PORTS if p.name != "ssh")
# What rayfleet:operatorCidrs may open: SSH and the dashboard/Jobs API.
OPERATOR_PORT_NUMBERS = tuple(port(name) for name, _ in OPERATOR_PORTS)

# Characters EC2 accepts in security group and rule descriptions (CreateSecurityGroup API).
_SG_DESCRIPTION = re.compile(r"[a-zA-Z0-9. _\-:/()#,@\[\]+=&;{}!$*]+")
_TOOL_DEFAULT_DESCRIPTIONS = {"managed by pulumi", "managed by terraform"}


# Serve's HAProxy ingress: the ranges the nodes pin (rayfleet.ingress), and the ranges Ray picks
# from when nothing is pinned (ray/serve/_private/constants.py: direct ingress 30000-31000 and
# 40000-41000), which a rule opening them would have to name.
INGRESS_RANGES = {name: (RAY_PORTS_BY_NAME[name].from_port, RAY_PORTS_BY_NAME[name].to_port)
                  for name in INGRESS_PORTS}
RAY_DIRECT_INGRESS_DEFAULTS = ((30000, 31000), (40000, 41000))


def _overlaps(lo: int, hi: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in ranges if lo <= b and a <= hi]


def _ports(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def _is_world(cidr: str) -> bool:
    try:
        return ipaddress.ip_network(cidr, strict=False).prefixlen == 0
    except ValueError:
        return False


def _norm(cidr: str) -> str:
    try:
        return str(ipaddress.ip_network(cidr, strict=False))
    except ValueError:
        return cidr


@dataclass(frozen=True)
class Permission:
    """One ingress or egress permission, however it was written (rule resource or inline)."""

    resource: Resource
    direction: str  # "ingress" | "egress"
    group: str  # the security group id it belongs to
    protocol: str
    from_port: int
    to_port: int
    cidrs: tuple[str, ...]
    groups: tuple[str, ...]  # source/destination security groups
    self_ref: bool
    prefix_lists: tuple[str, ...]
    description: str | None

    @property
    def all_ports(self) -> bool:
        return self.protocol in ("-1", "all")

    @property
    def port_range(self) -> tuple[int, int]:
        return (0, 65535) if self.all_ports else (self.from_port, self.to_port)

    @property
    def tcp_or_all(self) -> bool:
        return self.protocol in ("-1", "all", "tcp", "6")

    @property
    def from_itself(self) -> bool:
        return self.self_ref or (bool(self.groups) and set(self.groups) <= {self.group})


def _group_ref(r: Resource, key: str) -> str:
    """A security group id, or, while it is unknown (a preview), the URN it comes from."""
    value = _value(r.inputs, key)
    if value is UNKNOWN:
        return "|".join(r.deps.get(key, ()))
    return str(value) if value else ""


def _is_group(ref: str, group: Resource) -> bool:
    """Whether a permission's group reference (:func:`_group_ref`) is ``group``."""
    return ref in group.refs or (bool(group.urn) and group.urn in ref.split("|"))


def permissions(resources: Sequence[Resource]) -> list[Permission]:
    out = []
    for r in resources:
        i = r.inputs
        if r.type in (SG_INGRESS, SG_EGRESS):
            out.append(Permission(
                r, "ingress" if r.type == SG_INGRESS else "egress",
                _group_ref(r, "securityGroupId"), str(i.get("ipProtocol", "")).lower(),
                int(i.get("fromPort") or 0), int(i.get("toPort") or 0),
                tuple(c for c in (i.get("cidrIpv4"), i.get("cidrIpv6")) if c),
                tuple(g for g in [_group_ref(r, "referencedSecurityGroupId")] if g),
                False, tuple(p for p in [i.get("prefixListId")] if p), i.get("description")))
        elif r.type == SG_RULE:
            out.append(Permission(
                r, str(i.get("type", "")), str(i.get("securityGroupId", "")),
                str(i.get("protocol", "")).lower(),
                int(i.get("fromPort") or 0), int(i.get("toPort") or 0),
                tuple(_list(i.get("cidrBlocks")) + _list(i.get("ipv6CidrBlocks"))),
                tuple(g for g in [i.get("sourceSecurityGroupId")] if g),
                _true(i.get("self")), tuple(_list(i.get("prefixListIds"))),
                i.get("description")))
        elif r.type in (SG, DEFAULT_SG):
            for direction in ("ingress", "egress"):
                for rule in _list(i.get(direction)):
                    out.append(Permission(
                        r, direction, str(r.outputs.get("id", "")),
                        str(rule.get("protocol", "")).lower(),
                        int(rule.get("fromPort") or 0), int(rule.get("toPort") or 0),
                        tuple(_list(rule.get("cidrBlocks")) + _list(rule.get("ipv6CidrBlocks"))),
                        tuple(_list(rule.get("securityGroups"))), _true(rule.get("self")),
                        tuple(_list(rule.get("prefixListIds"))), rule.get("description")))
    return out


def rule_1_no_world_ray_ports(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for p in permissions(resources):
        if p.direction != "ingress" or not p.tcp_or_all:
            continue
        world = [c for c in p.cidrs if _is_world(c)]
        hits = _overlaps(*p.port_range, WORLD_FORBIDDEN_PORTS)
        if world and hits:
            yield _v(1, p.resource, f"admits {world[0]} on Ray port(s) "
                                    f"{', '.join(_ports(a, b) for a, b in hits)}")


def rule_2_no_world_ssh(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for p in permissions(resources):
        if p.direction != "ingress" or not p.tcp_or_all:
            continue
        world = [c for c in p.cidrs if _is_world(c)]
        if world and _overlaps(*p.port_range, [(port("ssh"), port("ssh"))]):
            yield _v(2, p.resource, f"admits SSH (22) from {world[0]}; use SSM Session Manager "
                                    "or rayfleet:operatorCidrs")


def rule_4_ray_ports_from_cluster_only(resources: Sequence[Resource],
                                       operator_cidrs: Sequence[str] = (),
                                       **_: Any) -> Iterator[Violation]:
    allowed = {str(ipaddress.ip_network(c, strict=False)) for c in operator_cidrs}
    for p in permissions(resources):
        if p.direction != "ingress" or not p.tcp_or_all or p.from_itself:
            continue
        hits = _overlaps(*p.port_range, RAY_ONLY_PORTS)
        if not hits:
            continue
        lo, hi = p.port_range
        operator_rule = (lo == hi and lo in OPERATOR_PORT_NUMBERS and not p.groups
                         and not p.prefix_lists and p.cidrs
                         and all(_norm(c) in allowed for c in p.cidrs))
        if operator_rule:
            continue
        source = ", ".join(p.cidrs + p.groups + p.prefix_lists) or "an unnamed source"
        yield _v(4, p.resource, f"opens Ray port(s) {', '.join(_ports(a, b) for a, b in hits)} "
                                f"to {source}, not only to its own security group")


def rule_5_default_sg_denies_all(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    defaults = _all(resources, DEFAULT_SG)
    for vpc in _all(resources, VPC):
        mine = [d for d in defaults if _points_to(d, "vpcId", vpc)]
        if not mine:
            yield _v(5, vpc, "has no DefaultSecurityGroup resource stripping the default "
                             "group's allow-all-from-self rule")
        for d in mine:
            if _list(d.inputs.get("ingress")) or _list(d.inputs.get("egress")):
                yield _v(5, d, "keeps rules on the VPC's default security group")


def rule_6_descriptions(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    def bad(text: Any) -> str | None:
        if not text or not str(text).strip():
            return "has no description"
        if str(text).strip().lower() in _TOOL_DEFAULT_DESCRIPTIONS:
            return f"has only the tool's default description {text!r}"
        if not _SG_DESCRIPTION.fullmatch(str(text)) or len(str(text)) > 255:
            return (f"has a description EC2 rejects (over 255 characters, or characters "
                    f"outside a-zA-Z0-9 ._-:/()#,@[]+=&;{{}}!$*): {text!r}")
        return None

    for g in _all(resources, SG):
        problem = bad(g.inputs.get("description"))
        if problem:
            yield _v(6, g, problem)
    for p in permissions(resources):
        if p.resource.type == DEFAULT_SG:
            continue  # rule 5 wants it empty anyway
        problem = bad(p.description)
        if problem:
            where = "" if p.resource.type != SG else f"'s inline {p.direction} rule"
            yield _v(6, p.resource, f"{where} {problem}".strip())


def rule_30_ingress_ports_from_cluster(resources: Sequence[Resource],
                                       **_: Any) -> Iterator[Violation]:
    """The cluster group (the one admitting Ray's GCS port over TCP from itself) must admit each
    ingress range exactly, from itself: HAProxy on one node forwards to replicas on another. A
    rule over Ray's unpinned defaults means nodes and group disagree on the ports."""
    perms = [p for p in permissions(resources) if p.direction == "ingress" and p.tcp_or_all]
    clusters = {p.group for p in perms if p.from_itself and not p.all_ports
                and p.from_port <= port("gcs") <= p.to_port}
    def of(sg: Resource, ref: str) -> bool:
        return bool(ref) and (sg.urn in ref.split("|") or ref == _known(sg.outputs, "id"))

    for sg in _all(resources, SG):
        if not any(of(sg, c) for c in clusters):
            continue
        own = [p for p in perms if of(sg, p.group)]
        for name, (lo, hi) in INGRESS_RANGES.items():
            if not any(p.from_itself and not p.all_ports and p.port_range == (lo, hi)
                       for p in own):
                yield _v(30, sg, f"does not admit Serve's {name} ports {_ports(lo, hi)} from "
                                 "itself: HAProxy on one node cannot reach replicas on another")
        for p in own:
            if p.all_ports or p.port_range in INGRESS_RANGES.values():
                continue
            if _overlaps(*p.port_range, RAY_DIRECT_INGRESS_DEFAULTS):
                yield _v(30, p.resource, f"opens {_ports(*p.port_range)}, Ray's unpinned "
                                         "direct-ingress range, where the nodes pin "
                                         + ", ".join(_ports(a, b)
                                                     for a, b in INGRESS_RANGES.values()))
