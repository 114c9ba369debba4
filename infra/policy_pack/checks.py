"""The security rules that concern infrastructure, as checks over the resource graph.

Each check is a pure function from a list of :class:`Resource` (type token, logical name, the
properties Pulumi holds for it, the URNs each property came from) to the :class:`Violation` s
it finds; every violation names the offending resource and the rule with its external ID
(Checkov / AWS Security Hub / tfsec). Numbers, titles and IDs come from ``rayfleet.rules``;
docs/security.md explains each rule. Property names are Pulumi's camelCase.

``pack.py`` turns each check into a mandatory CrossGuard stack policy (``pulumi preview/up
--policy-pack infra/policy_pack``); the kit's tests run the same policies over the graph the
program asks for under Pulumi's mocks. During a preview, a property another resource has not
produced yet (an ARN, an id) is unknown: references between resources are followed through
Pulumi's property dependencies, and a check that needs an unknown value is reported by
CrossGuard as not runnable in that preview instead of guessing.

Rule 32 reads the AZ each worker template and placement group was built for from their
``rayfleet:availability-zone`` tag. Rules 4 and 31 read the stack's config too (operatorCidrs,
capacityReservations), handed in by the pack as keyword arguments. Rules 3, 21, 22, 23 and 25
concern the cluster YAML and the nodes' runtime, not the resource graph: ``rayfleet lint``
checks those; rule 24 is the stack configuration's.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rayfleet.facts import (
    CAPACITY_BLOCK_MARKET_TYPE,
    IMDS_HOP_LIMIT,
    IMDS_HOP_LIMIT_CONTAINERS,
    OPERATOR_PORTS,
    RAY_CLUSTER_TAG,
    RAY_PORTS,
    RAY_PORTS_BY_NAME,
    INGRESS_PORTS,
    SECRET_PATTERNS,
    TAG_AVAILABILITY_ZONE,
    TAG_CAPACITY_RESERVATION,
    TAG_HOP_LIMIT_REASON,
    TAG_NODE_ROLE,
    WORLD_FORBIDDEN,
    port,
)
from rayfleet.rules import RULES as REGISTRY


@dataclass(frozen=True)
class Resource:
    type: str  # e.g. "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    name: str  # the logical (Pulumi) name
    inputs: Mapping[str, Any]
    outputs: Mapping[str, Any] = field(default_factory=dict)  # id, arn, name, bucket, ...
    urn: str = ""
    parent: str = ""
    provider: str = ""
    # property name -> URNs of the resources its value came from (Pulumi's
    # propertyDependencies): how a reference is followed while the referenced id is unknown.
    deps: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.type.rsplit(':', 1)[-1]} '{self.name}'"

    @property
    def refs(self) -> set[str]:
        """Every known value another resource may use to point at this one (id, name, ARN)."""
        out = {_known(self.outputs, k) for k in ("id", "arn", "name", "bucket")}
        out |= {_known(self.inputs, k) for k in ("name", "bucket")}
        return {str(v) for v in out if v}


@dataclass(frozen=True)
class Violation:
    rule: int
    external_id: str
    resource: str  # Resource.label
    message: str
    urn: str = ""  # the offending resource's, for CrossGuard's report

    def __str__(self) -> str:
        return f"rule {self.rule} ({self.external_id}): {self.resource} {self.message}"


# ----------------------------------------------------------------------------- type tokens

VPC = "aws:ec2/vpc:Vpc"
SUBNET = "aws:ec2/subnet:Subnet"
ROUTE = "aws:ec2/route:Route"
ROUTE_TABLE = "aws:ec2/routeTable:RouteTable"
ROUTE_ASSOC = "aws:ec2/routeTableAssociation:RouteTableAssociation"
IGW = "aws:ec2/internetGateway:InternetGateway"
SG = "aws:ec2/securityGroup:SecurityGroup"
DEFAULT_SG = "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SG_INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SG_EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"
FLOW_LOG = "aws:ec2/flowLog:FlowLog"
LOG_GROUP = "aws:cloudwatch/logGroup:LogGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
VOLUME = "aws:ebs/volume:Volume"
BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
SSE = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
       ("aws:s3/bucketServerSideEncryptionConfigurationV2:"
       "BucketServerSideEncryptionConfigurationV2"))
BUCKET_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
VERSIONING = ("aws:s3/bucketVersioning:BucketVersioning",
              "aws:s3/bucketVersioningV2:BucketVersioningV2")
LIFECYCLE = ("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
             "aws:s3/bucketLifecycleConfigurationV2:BucketLifecycleConfigurationV2")
OWNERSHIP = "aws:s3/bucketOwnershipControls:BucketOwnershipControls"
BUCKET_ACLS = ("aws:s3/bucketAcl:BucketAcl", "aws:s3/bucketAclV2:BucketAclV2")
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ROLE_ATTACHMENT = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
POLICY = "aws:iam/policy:Policy"
POLICY_ATTACHMENTS = ("aws:iam/policyAttachment:PolicyAttachment",
                      "aws:iam/userPolicyAttachment:UserPolicyAttachment",
                      "aws:iam/groupPolicyAttachment:GroupPolicyAttachment")
INSTANCE_PROFILE = "aws:iam/instanceProfile:InstanceProfile"
REPLICATION_GROUP = "aws:elasticache/replicationGroup:ReplicationGroup"
CACHE_CLUSTER = "aws:elasticache/cluster:Cluster"
SECRET = "aws:secretsmanager/secret:Secret"

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

FORBIDDEN_MANAGED_POLICIES = ("AdministratorAccess", "AmazonEC2FullAccess",
                              "AmazonS3FullAccess", "PowerUserAccess", "IAMFullAccess")


# ----------------------------------------------------------------------------- helpers

UNKNOWN = object()  # a value a preview cannot know yet


def _value(props: Mapping[str, Any], key: str) -> Any:
    """props[key]; None when absent; UNKNOWN where CrossGuard holds it as unknown (a preview,
    before the resource it comes from exists)."""
    try:
        return props.get(key)
    except Exception as err:  # pulumi_policy's UnknownValueError
        if type(err).__name__ == "UnknownValueError":
            return UNKNOWN
        raise


def _known(props: Mapping[str, Any], key: str) -> Any:
    value = _value(props, key)
    return None if value is UNKNOWN else value


def _points_to(r: Resource, key: str, target: Resource) -> bool:
    """Whether ``r``'s property ``key`` refers to ``target``: by value (id, name, ARN), or by
    the property's dependency on ``target`` when the value is not known yet."""
    value = _value(r.inputs, key)
    if value is None:
        return False
    if value is not UNKNOWN and str(value).removesuffix(":*") in target.refs:
        return True
    return bool(target.urn) and target.urn in r.deps.get(key, ())


def _all(resources: Iterable[Resource], *types: str) -> list[Resource]:
    return [r for r in resources if r.type in types]


def _v(rule: int, r: Resource | str, message: str) -> Violation:
    label = r.label if isinstance(r, Resource) else r
    return Violation(rule, REGISTRY[rule].controls or "rayfleet", label, message,
                     r.urn if isinstance(r, Resource) else "")


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def _list(value: Any) -> list:
    if value is None:
        return []
    # CrossGuard hands lists over as read-only sequences, not lists.
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return [value]


def _statements(doc: Any) -> list[dict]:
    doc = _json(doc)
    if not isinstance(doc, dict):
        return []
    return [s for s in _list(doc.get("Statement")) if isinstance(s, dict)]


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _overlaps(lo: int, hi: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in ranges if lo <= b and a <= hi]


def _ports(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def _is_world(cidr: str) -> bool:
    try:
        return ipaddress.ip_network(cidr, strict=False).prefixlen == 0
    except ValueError:
        return False


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


def _decoded_user_data(r: Resource) -> str:
    text = r.inputs.get("userData") or ""
    b64 = r.inputs.get("userDataBase64")
    if r.type == LAUNCH_TEMPLATE or b64:
        raw = b64 or text
        try:
            return base64.b64decode(raw, validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            return str(raw)
    return str(text)


def _node_roles(resources: Sequence[Resource]) -> dict[str, Resource]:
    """Roles nodes run as: attached to an instance profile or tagged rayfleet:node-role."""
    profiles = _all(resources, INSTANCE_PROFILE)
    out = {}
    for r in _all(resources, ROLE):
        if any(_points_to(p, "role", r) for p in profiles) \
                or (r.inputs.get("tags") or {}).get(TAG_NODE_ROLE):
            out[r.name] = r
    return out


def _role_kind(role: Resource) -> str:
    return str((role.inputs.get("tags") or {}).get(TAG_NODE_ROLE, ""))


def _inline_policies(resources: Sequence[Resource], role: Resource) -> list[tuple[Resource,
                                                                                  list[dict]]]:
    """(resource, statements) of every inline policy of ``role``."""
    out = [(p, _statements(p.inputs.get("policy"))) for p in _all(resources, ROLE_POLICY)
           if _points_to(p, "role", role)]
    for inline in _list(role.inputs.get("inlinePolicies")):
        out.append((role, _statements(inline.get("policy"))))
    return out


def _actions(statement: dict) -> list[str]:
    return [str(a) for a in _list(statement.get("Action"))]


def _allows(statement: dict) -> bool:
    return statement.get("Effect") == "Allow"


# ----------------------------------------------------------------------------- the rules

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


# Serve's HAProxy ingress: the ranges the nodes pin (rayfleet.ingress), and the ranges Ray picks
# from when nothing is pinned (ray/serve/_private/constants.py: direct ingress 30000-31000 and
# 40000-41000), which a rule opening them would have to name.
INGRESS_RANGES = {name: (RAY_PORTS_BY_NAME[name].from_port, RAY_PORTS_BY_NAME[name].to_port)
                  for name in INGRESS_PORTS}
RAY_DIRECT_INGRESS_DEFAULTS = ((30000, 31000), (40000, 41000))


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


def _norm(cidr: str) -> str:
    try:
        return str(ipaddress.ip_network(cidr, strict=False))
    except ValueError:
        return cidr


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


def rule_9_imdsv2(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for r in _all(resources, LAUNCH_TEMPLATE, INSTANCE):
        meta = r.inputs.get("metadataOptions") or {}
        if meta.get("httpEndpoint") == "disabled":
            continue  # no IMDS at all is stricter still
        if meta.get("httpTokens") != "required":
            yield _v(9, r, f"allows IMDSv1 (httpTokens={meta.get('httpTokens')!r}, "
                           "must be 'required')")
        hop = meta.get("httpPutResponseHopLimit")
        reason = (r.inputs.get("tags") or {}).get(TAG_HOP_LIMIT_REASON)
        if hop is None:
            yield _v(9, r, f"leaves the IMDS hop limit to the AMI (set {IMDS_HOP_LIMIT})")
        elif int(hop) == IMDS_HOP_LIMIT_CONTAINERS and not reason:
            yield _v(9, r, f"sets IMDS hop limit {hop} without a {TAG_HOP_LIMIT_REASON} tag "
                           "saying why")
        elif int(hop) > IMDS_HOP_LIMIT_CONTAINERS:
            yield _v(9, r, f"sets IMDS hop limit {hop}; {IMDS_HOP_LIMIT}, or "
                           f"{IMDS_HOP_LIMIT_CONTAINERS} for containers")


def rule_10_ebs_encrypted(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for lt in _all(resources, LAUNCH_TEMPLATE):
        mappings = [m for m in _list(lt.inputs.get("blockDeviceMappings")) if m.get("ebs")]
        if not mappings:
            yield _v(10, lt, "has no root volume mapping, so encryption is left to the AMI")
        for m in mappings:
            if not _true(m["ebs"].get("encrypted")):
                yield _v(10, lt, f"leaves EBS volume {m.get('deviceName')} unencrypted")
    for inst in _all(resources, INSTANCE):
        devices = [inst.inputs.get("rootBlockDevice") or {}] + \
            _list(inst.inputs.get("ebsBlockDevices"))
        for d in devices:
            if not _true(d.get("encrypted")):
                yield _v(10, inst, f"leaves EBS volume {d.get('deviceName', 'root')} unencrypted")
    for vol in _all(resources, VOLUME):
        if not _true(vol.inputs.get("encrypted")):
            yield _v(10, vol, "is not encrypted")


def _for_bucket(resources: Sequence[Resource], bucket: Resource,
                *types: str) -> list[Resource]:
    return [r for r in _all(resources, *types) if _points_to(r, "bucket", bucket)]


def rule_11_public_access_block(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
    for b in _all(resources, *BUCKETS):
        blocks = _for_bucket(resources, b, PUBLIC_ACCESS_BLOCK)
        if not blocks:
            yield _v(11, b, "has no BucketPublicAccessBlock")
        for block in blocks:
            off = [f for f in flags if not _true(block.inputs.get(f))]
            if off:
                yield _v(11, block, f"leaves {', '.join(off)} off")


def rule_12_encryption(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for b in _all(resources, *BUCKETS):
        configs = _for_bucket(resources, b, *SSE)
        algorithms = [((r.get("applyServerSideEncryptionByDefault") or {})
                       .get("sseAlgorithm")) for c in configs for r in _list(c.inputs.get("rules"))]
        if not any(a in ("aws:kms", "aws:kms:dsse", "AES256") for a in algorithms):
            yield _v(12, b, "has no server-side encryption configuration (KMS or AES256)")


def rule_13_tls_only(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for b in _all(resources, *BUCKETS):
        arn = str(b.outputs.get("arn", ""))
        found = False
        for policy in _for_bucket(resources, b, BUCKET_POLICY):
            for s in _statements(policy.inputs.get("policy")):
                principal = s.get("Principal")
                cond = (s.get("Condition") or {}).get("Bool") or {}
                resources_ = {str(x) for x in _list(s.get("Resource"))}
                if (s.get("Effect") == "Deny" and principal in ("*", {"AWS": "*"})
                        and {"s3:*"} & set(_actions(s))
                        and str(cond.get("aws:SecureTransport")).lower() == "false"
                        and {arn, f"{arn}/*"} <= resources_):
                    found = True
        if not found:
            yield _v(13, b, "has no bucket policy denying every s3:* request with "
                            "aws:SecureTransport=false on the bucket and its objects")


def rule_14_versioning_lifecycle(resources: Sequence[Resource],
                                 **_: Any) -> Iterator[Violation]:
    for b in _all(resources, *BUCKETS):
        enabled = [v for v in _for_bucket(resources, b, *VERSIONING)
                   if (v.inputs.get("versioningConfiguration") or {}).get("status") == "Enabled"]
        if not enabled:
            yield _v(14, b, "has versioning off")
        rules = [r for lc in _for_bucket(resources, b, *LIFECYCLE)
                 for r in _list(lc.inputs.get("rules"))
                 if r.get("status") == "Enabled" and _whole_bucket(r)]
        if not any(int((r.get("noncurrentVersionExpiration") or {}).get("noncurrentDays") or 0)
                   for r in rules):
            yield _v(14, b, "has no enabled lifecycle rule expiring noncurrent versions")
        if not any(int((r.get("abortIncompleteMultipartUpload") or {})
                       .get("daysAfterInitiation") or 0) for r in rules):
            yield _v(14, b, "has no enabled lifecycle rule aborting incomplete multipart uploads")


def _whole_bucket(rule: dict) -> bool:
    f = rule.get("filter") or {}
    return not (rule.get("prefix") or f.get("prefix") or f.get("tag") or f.get("and")
                or f.get("objectSizeGreaterThan") or f.get("objectSizeLessThan"))


def rule_15_acls_disabled(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    for b in _all(resources, *BUCKETS):
        owners = [(o.inputs.get("rule") or {}).get("objectOwnership")
                  for o in _for_bucket(resources, b, OWNERSHIP)]
        if "BucketOwnerEnforced" not in owners:
            yield _v(15, b, "does not enforce bucket-owner ownership (ACLs stay enabled)")
        if b.inputs.get("acl") or b.inputs.get("grants"):
            yield _v(15, b, "sets an ACL")
        for acl in _for_bucket(resources, b, *BUCKET_ACLS):
            yield _v(15, acl, "sets an ACL on the bucket")



def _policy_documents(resources: Sequence[Resource]) -> list[tuple[Resource, list[dict]]]:
    """(resource, statements) of every IAM policy document: policies, role policies and
    roles' inline policies."""
    docs = [(r, _statements(r.inputs.get("policy"))) for r in _all(resources, ROLE_POLICY,
                                                                   POLICY)]
    docs += [(role, _statements(p.get("policy"))) for role in _all(resources, ROLE)
             for p in _list(role.inputs.get("inlinePolicies"))]
    return docs

def rule_16_no_broad_managed_policies(resources: Sequence[Resource],
                                      **_: Any) -> Iterator[Violation]:
    def forbidden(arn: Any) -> str | None:
        name = str(arn).rsplit("/", 1)[-1]
        return name if ":aws:policy/" in str(arn) and name in FORBIDDEN_MANAGED_POLICIES \
            else None

    for r in _all(resources, ROLE_ATTACHMENT, *POLICY_ATTACHMENTS):
        name = forbidden(r.inputs.get("policyArn"))
        if name:
            yield _v(16, r, f"attaches {name}")
    for role in _all(resources, ROLE):
        for arn in _list(role.inputs.get("managedPolicyArns")):
            if forbidden(arn):
                yield _v(16, role, f"attaches {forbidden(arn)}")
    docs = _policy_documents(resources)
    for r, statements in docs:
        for s in statements:
            if not _allows(s):
                continue
            if s.get("NotAction"):
                yield _v(16, r, "allows NotAction (everything except a list)")
            broad = [a for a in _actions(s) if a == "*" or re.fullmatch(r"(iam|ec2|s3):\*", a)]
            if broad:
                yield _v(16, r, f"allows {', '.join(broad)}")


def rule_17_scoped_node_roles(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    bucket_arns = {str(b.outputs.get("arn")) for b in _all(resources, *BUCKETS)}
    for role in _node_roles(resources).values():
        kind = _role_kind(role)
        for policy, statements in _inline_policies(resources, role):
            for s in statements:
                if not _allows(s):
                    continue
                yield from _check_s3_scope(policy, s, bucket_arns)
                ec2 = [a for a in _actions(s) if a.lower().startswith("ec2:")
                       and not a.lower().startswith("ec2:describe")]
                if ec2 and kind != "head":
                    yield _v(17, policy, f"lets the {kind or 'node'} role call "
                                         f"{', '.join(ec2)}; only the head launches nodes")
                elif ec2 and not _ec2_scoped(s):
                    yield _v(17, policy, f"allows {', '.join(ec2)} without a "
                                         f"{RAY_CLUSTER_TAG} tag condition")


def _check_s3_scope(policy: Resource, s: dict, bucket_arns: set[str]) -> Iterator[Violation]:
    s3 = [a for a in _actions(s) if a.lower().startswith("s3:")]
    if not s3:
        return
    for res in (str(x) for x in _list(s.get("Resource"))):
        bucket = res.split("/", 1)[0]
        if bucket not in bucket_arns:
            yield _v(17, policy, f"allows {', '.join(s3)} on {res}, outside the stack's bucket")
        elif "/" in res and res.split("/", 1)[1] in ("", "*"):
            yield _v(17, policy, f"allows {', '.join(s3)} on every object of {bucket}, not "
                                 "only the cluster's key prefix")
    if "s3:ListBucket" in s3 and not (s.get("Condition") or {}).get("StringLike", {}).get(
            "s3:prefix"):
        yield _v(17, policy, "allows s3:ListBucket on the whole bucket (no s3:prefix condition)")


def _ec2_scoped(s: dict) -> bool:
    cond = json.dumps(s.get("Condition") or {})
    if RAY_CLUSTER_TAG in cond or "ec2:CreateAction" in cond:
        return True
    # RunInstances on the launch's supporting resources (subnet, image, volume...) cannot be
    # tag-conditioned; it is harmless as long as the instance itself is not covered.
    resources_ = [str(x) for x in _list(s.get("Resource"))]
    return (_actions(s) == ["ec2:RunInstances"]
            and not any(r == "*" or ":instance/" in r or r.endswith(":*") for r in resources_))


def rule_18_pass_role_worker_only(resources: Sequence[Resource],
                                  **_: Any) -> Iterator[Violation]:
    workers = {str(r.outputs.get("arn")) for r in _node_roles(resources).values()
               if _role_kind(r) == "worker"}
    docs = [(r, _statements(r.inputs.get("policy"))) for r in _all(resources, ROLE_POLICY,
                                                                   POLICY)]
    for r, statements in docs:
        for s in statements:
            if not _allows(s):
                continue
            if not any(a in ("iam:PassRole", "iam:*", "*") for a in _actions(s)):
                continue
            targets = [str(x) for x in _list(s.get("Resource"))]
            wrong = [t for t in targets if t not in workers]
            if wrong or not targets:
                yield _v(18, r, f"allows iam:PassRole on {', '.join(wrong) or 'nothing named'}"
                                ", not only the worker role")


def rule_19_ec2_trust_only(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    nodes = _node_roles(resources)
    for role in _all(resources, ROLE):
        for s in _statements(role.inputs.get("assumeRolePolicy")):
            if not _allows(s):
                continue
            principal = s.get("Principal")
            if not isinstance(principal, dict) or set(principal) != {"Service"}:
                yield _v(19, role, f"trusts {json.dumps(principal)}, not an AWS service")
                continue
            services = [str(x) for x in _list(principal["Service"])]
            if role.name in nodes and services != ["ec2.amazonaws.com"]:
                yield _v(19, role, f"is a node role trusting {', '.join(services)}; only "
                                   "ec2.amazonaws.com may assume it")


def rule_20_no_secrets_in_user_data(resources: Sequence[Resource],
                                    **_: Any) -> Iterator[Violation]:
    for r in _all(resources, LAUNCH_TEMPLATE, INSTANCE):
        text = _decoded_user_data(r)
        for pattern, what in SECRET_PATTERNS:
            if pattern.search(text):
                yield _v(20, r, f"carries {what} in its user data")


def rule_26_listed_describe_actions(resources: Sequence[Resource],
                                    **_: Any) -> Iterator[Violation]:
    docs = _policy_documents(resources)
    for r, statements in docs:
        for s in statements:
            if not _allows(s):
                continue
            reads = [a for a in _actions(s) if a.lower().startswith("ec2:")
                     and "*" in a.split(":", 1)[1] and a.lower() != "ec2:*"]
            if reads:
                yield _v(26, r, f"allows {', '.join(reads)}; list the EC2 read actions one by "
                                "one")
            if any(a.lower() == "ec2:describeinstanceattribute" for a in _actions(s)):
                yield _v(26, r, "allows ec2:DescribeInstanceAttribute, which reads any "
                                "instance's user data")


LOGGING = ("aws:s3/bucketLogging:BucketLogging", "aws:s3/bucketLoggingV2:BucketLoggingV2")
KMS_KEY = "aws:kms/key:Key"
S3_LOG_DELIVERY = "logging.s3.amazonaws.com"
_LOGS_SERVICE = re.compile(r"logs\.[a-z0-9-]+\.amazonaws\.com(\.cn)?")


def rule_27_bucket_access_logged(resources: Sequence[Resource],
                                 **_: Any) -> Iterator[Violation]:
    buckets = _all(resources, *BUCKETS)
    loggings = _all(resources, *LOGGING)
    targets = [b for b in buckets if any(_points_to(g, "targetBucket", b) for g in loggings)]
    for b in buckets:
        if b in targets:
            continue  # a log bucket logging itself would log its own log deliveries forever
        mine = _for_bucket(resources, b, *LOGGING)
        if not mine:
            yield _v(27, b, "has no server access logging (BucketLogging to a log bucket)")
        for g in mine:
            target = next((t for t in targets if _points_to(g, "targetBucket", t)), None)
            if target is None:
                yield _v(27, g, "sends access logs to a bucket outside this stack")
    for t in targets:
        algorithms = [((r.get("applyServerSideEncryptionByDefault") or {})
                       .get("sseAlgorithm")) for c in _for_bucket(resources, t, *SSE)
                      for r in _list(c.inputs.get("rules"))]
        if any(a and a != "AES256" for a in algorithms):
            yield _v(27, t, f"is a log target encrypted with {algorithms[0]}; S3 delivers "
                            "access logs only to SSE-S3 (AES256) buckets")
        granted = any(
            _allows(s) and S3_LOG_DELIVERY in _list((s.get("Principal") or {}).get("Service"))
            and "s3:PutObject" in _actions(s)
            for p in _for_bucket(resources, t, BUCKET_POLICY)
            for s in _statements(p.inputs.get("policy")))
        if not granted:
            yield _v(27, t, f"is a log target whose bucket policy does not let "
                            f"{S3_LOG_DELIVERY} put objects (ACLs are disabled)")


def rule_28_log_groups_cmk(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    keys = _all(resources, KMS_KEY)
    for g in _all(resources, LOG_GROUP):
        key = next((k for k in keys if _points_to(g, "kmsKeyId", k)), None)
        if key is None:
            yield _v(28, g, "is not encrypted with a customer-managed KMS key of this stack "
                            "(kmsKeyId)")
            continue
        services = {str(x) for s in _statements(key.inputs.get("policy")) if _allows(s)
                    for x in _list((s.get("Principal") or {}).get("Service")
                                   if isinstance(s.get("Principal"), dict) else None)}
        if not any(_LOGS_SERVICE.fullmatch(x) for x in services):
            yield _v(28, key, f"encrypts log group '{g.name}' but its key policy does not let "
                              "the region's CloudWatch Logs (logs.<region>.amazonaws.com) "
                              "use it")


def rule_29_explicit_key_policy(resources: Sequence[Resource],
                                **_: Any) -> Iterator[Violation]:
    for k in _all(resources, KMS_KEY):
        statements = _statements(k.inputs.get("policy"))
        if not statements:
            yield _v(29, k, "has no key policy of its own (AWS's default gives the account "
                            "kms:*, delegating everything to IAM)")
        for s in statements:
            if _allows(s) and s.get("Principal") in ("*", {"AWS": "*"}) \
                    and not s.get("Condition"):
                yield _v(29, k, "lets any principal use the key without a condition")


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


def _referenced(lt: Resource, key: str, value: Any, candidates: Sequence[Resource]
                ) -> list[Resource]:
    """The candidates ``value`` (a property of ``lt`` under ``key``) refers to: by id, name or
    ARN when known, else through the property's dependencies (a preview)."""
    if value is not None and value is not UNKNOWN:
        return [c for c in candidates if str(value) in c.refs]
    return [c for c in candidates if c.urn and c.urn in lt.deps.get(key, ())]


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


def _lists(r: Resource, key: str, target: Resource) -> bool:
    """Whether ``r``'s list property ``key`` names ``target`` (by value, or by dependency while
    the value is unknown)."""
    value = _value(r.inputs, key)
    if value not in (None, UNKNOWN) and any(str(v) in target.refs for v in _list(value)):
        return True
    return bool(target.urn) and target.urn in r.deps.get(key, ())


def _is_group(ref: str, group: Resource) -> bool:
    """Whether a permission's group reference (:func:`_group_ref`) is ``group``."""
    return ref in group.refs or (bool(group.urn) and group.urn in ref.split("|"))


# AWS-managed policies known to grant no secretsmanager action (the stack attaches SSM's).
SECRETLESS_MANAGED_POLICIES = frozenset({"AmazonSSMManagedInstanceCore"})


def _grants(statement: dict, action: str) -> bool:
    """Whether an Allow statement grants ``action`` as IAM matches it: case-insensitively,
    with * and ? wildcards, NotAction granting everything it does not name."""
    def hit(patterns: Any) -> bool:
        return any(fnmatch.fnmatchcase(action.lower(), str(p).lower()) for p in _list(patterns))
    if statement.get("NotAction") is not None:
        return not hit(statement["NotAction"])
    return hit(statement.get("Action"))


def rule_33_gcs_store(resources: Sequence[Resource], **_: Any) -> Iterator[Violation]:
    """rayfleet:headHa's Redis: encrypted at rest and in transit (TLS required, not merely
    preferred), an auth token, security groups that admit only other security groups; and
    the secrets such a store's token lives in read by the head role alone."""
    stores = _all(resources, REPLICATION_GROUP)
    for r in _all(resources, CACHE_CLUSTER):
        # A lone cache cluster (no replication group) cannot require TLS with a token the way
        # the stack's store does; the stack never makes one.
        if not _known(r.inputs, "replicationGroupId"):
            yield _v(33, r, "is a cache cluster outside a replication group; the GCS store is "
                            "a replication group with TLS required and an auth token")
    groups = _all(resources, SG)
    for r in stores:
        i = r.inputs
        if not _true(_known(i, "atRestEncryptionEnabled")):
            yield _v(33, r, "does not encrypt its data at rest (atRestEncryptionEnabled)")
        if not _true(_known(i, "transitEncryptionEnabled")):
            yield _v(33, r, "does not encrypt in transit (transitEncryptionEnabled)")
        mode = _known(i, "transitEncryptionMode")
        if mode is not None and mode != "required":
            yield _v(33, r, f"accepts clients without TLS (transitEncryptionMode {mode}); "
                            "set required")
        if _value(i, "authToken") in (None, "") and not _list(_known(i, "userGroupIds")):
            yield _v(33, r, "has no auth token: anyone who reaches it may read and rewrite the "
                            "cluster's state")
        if not _list(_known(i, "securityGroupIds")) and not r.deps.get("securityGroupIds"):
            yield _v(33, r, "names no security group, so the VPC's default group guards it")
        perms = permissions(resources)
        # The cluster's group: the one admitting Ray's GCS port over TCP from itself.
        clusters = {p.group for p in perms if p.direction == "ingress" and p.tcp_or_all
                    and p.from_itself and p.from_port <= port("gcs") <= p.to_port}
        for g in groups:
            if not _lists(r, "securityGroupIds", g):
                continue
            for p in perms:
                if not _is_group(p.group, g):
                    continue
                if p.direction == "egress":
                    target = ", ".join(p.cidrs + p.groups + p.prefix_lists) or "anywhere"
                    yield _v(33, p.resource, f"lets the GCS store's group {g.name} send to "
                                             f"{target}; the store needs no outbound rule")
                    continue
                others = [x for x in p.groups if x not in clusters]
                if p.cidrs or p.prefix_lists or others or p.self_ref:
                    source = ", ".join(p.cidrs + p.prefix_lists + tuple(others)) or "itself"
                    yield _v(33, p.resource, f"admits {source} to the GCS store's group "
                                             f"{g.name}; only the cluster's security group may "
                                             "reach it")
    if not stores:
        return
    # The store's token: every secret of a stack with a GCS store is its (the stack keeps no
    # other); a policy that reads one must be the head role's, and name it.
    secret_arns = {str(x.outputs.get("arn")) for x in _all(resources, SECRET)}
    if not secret_arns:
        return
    roles = _node_roles(resources)
    # A managed policy's document is not in the graph: on a role other than the head's, only
    # one known not to read secrets may be attached.
    for role in roles.values():
        if _role_kind(role) == "head":
            continue
        attached = [(a, a.inputs.get("policyArn")) for a in _all(resources, ROLE_ATTACHMENT)
                    if _points_to(a, "role", role)]
        attached += [(role, arn) for arn in _list(role.inputs.get("managedPolicyArns"))]
        for holder, arn in attached:
            if str(arn).rsplit("/", 1)[-1] not in SECRETLESS_MANAGED_POLICIES:
                yield _v(33, holder, f"attaches {arn} to the {_role_kind(role)} role: a managed "
                                     "policy may read the GCS store's token; only the head "
                                     "role may")
    for r, statements in _policy_documents(resources):
        for s in statements:
            if not _allows(s) or not _grants(s, "secretsmanager:GetSecretValue"):
                continue
            targets = [str(x) for x in _list(s.get("Resource"))]
            hits = [t for t in targets if t in secret_arns or "*" in t]
            if not hits:
                continue
            role = next((x for x in roles.values()
                         if r is x or _points_to(r, "role", x)), None)
            if role is None or _role_kind(role) != "head":
                who = f"the {_role_kind(role)} role" if role is not None else "a policy"
                yield _v(33, r, f"lets {who} read the GCS store's token ({', '.join(hits)}); "
                                "only the head role may")
            elif any("*" in t for t in hits):
                yield _v(33, r, f"lets the head read secrets by wildcard ({', '.join(hits)}); "
                                "name the GCS store's token")


CHECKS: Mapping[int, Callable[..., Iterator[Violation]]] = {
    1: rule_1_no_world_ray_ports, 2: rule_2_no_world_ssh, 4: rule_4_ray_ports_from_cluster_only,
    5: rule_5_default_sg_denies_all, 6: rule_6_descriptions, 7: rule_7_private_nodes,
    8: rule_8_flow_logs, 9: rule_9_imdsv2, 10: rule_10_ebs_encrypted,
    11: rule_11_public_access_block, 12: rule_12_encryption, 13: rule_13_tls_only,
    14: rule_14_versioning_lifecycle, 15: rule_15_acls_disabled,
    16: rule_16_no_broad_managed_policies, 17: rule_17_scoped_node_roles,
    18: rule_18_pass_role_worker_only, 19: rule_19_ec2_trust_only,
    20: rule_20_no_secrets_in_user_data, 26: rule_26_listed_describe_actions,
    27: rule_27_bucket_access_logged, 28: rule_28_log_groups_cmk,
    29: rule_29_explicit_key_policy, 30: rule_30_ingress_ports_from_cluster,
    31: rule_31_reserved_capacity, 32: rule_32_worker_template_in_its_az,
    33: rule_33_gcs_store,
}
