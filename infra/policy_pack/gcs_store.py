"""Rule 33: rayfleet:headHa's GCS store (ElastiCache Redis), encrypted, behind TLS and a token,
reached only from the cluster's security group, its token read by the head role alone. It
reads the graph through the security group and IAM rules' helpers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rayfleet.facts import port

from .graph import (
    CACHE_CLUSTER,
    REPLICATION_GROUP,
    ROLE_ATTACHMENT,
    SECRET,
    SG,
    Resource,
    Violation,
    _all,
    _allows,
    _known,
    _list,
    _lists,
    _points_to,
    _true,
    _v,
    _value,
)
from .iam import _grants, _node_roles, _policy_documents, _role_kind
from .security_groups import _is_group, permissions

# AWS-managed policies known to grant no secretsmanager action (the stack attaches SSM's).
SECRETLESS_MANAGED_POLICIES = frozenset({"AmazonSSMManagedInstanceCore"})


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
    for r in stores:
        yield from _store_settings(r)
        yield from _store_groups(resources, r)
    if stores:
        yield from _token_readers(resources)


def _store_settings(r: Resource) -> Iterator[Violation]:
    """The replication group's own settings: encryption, TLS required, a token, a group."""
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


def _store_groups(resources: Sequence[Resource], r: Resource) -> Iterator[Violation]:
    """The permissions of the store's security groups: no egress, and ingress from the
    cluster's security group alone."""
    perms = permissions(resources)
    # The cluster's group: the one admitting Ray's GCS port over TCP from itself.
    clusters = {p.group for p in perms if p.direction == "ingress" and p.tcp_or_all
                and p.from_itself and p.from_port <= port("gcs") <= p.to_port}
    for g in _all(resources, SG):
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


def _token_readers(resources: Sequence[Resource]) -> Iterator[Violation]:
    """Who may read the store's token: every secret of a stack with a GCS store is its (the
    stack keeps no other); a policy that reads one must be the head role's, and name it."""
    secret_arns = {str(x.outputs.get("arn")) for x in _all(resources, SECRET)}
    if not secret_arns:
        return
    roles = _node_roles(resources)
    yield from _managed_policies_off_the_head(resources, roles)
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


def _managed_policies_off_the_head(resources: Sequence[Resource],
                                   roles: Mapping[str, Resource]) -> Iterator[Violation]:
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
