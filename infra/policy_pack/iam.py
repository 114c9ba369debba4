"""Rules 16 to 19 and 26: the stack's IAM, no broad managed policy, node roles scoped to the
cluster's bucket and tag, iam:PassRole on the worker role alone, EC2-only trust, EC2 reads
listed one by one. The helpers that find node roles and read policy documents are rule 33's
too.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from rayfleet.facts import RAY_CLUSTER_TAG, TAG_NODE_ROLE

from .graph import (
    BUCKETS,
    INSTANCE_PROFILE,
    POLICY,
    POLICY_ATTACHMENTS,
    ROLE,
    ROLE_ATTACHMENT,
    ROLE_POLICY,
    Resource,
    Violation,
    _actions,
    _all,
    _allows,
    _list,
    _points_to,
    _statements,
    _v,
)


FORBIDDEN_MANAGED_POLICIES = ("AdministratorAccess", "AmazonEC2FullAccess",
                              "AmazonS3FullAccess", "PowerUserAccess", "IAMFullAccess")


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


def _policy_documents(resources: Sequence[Resource]) -> list[tuple[Resource, list[dict]]]:
    """(resource, statements) of every IAM policy document: policies, role policies and
    roles' inline policies."""
    docs = [(r, _statements(r.inputs.get("policy"))) for r in _all(resources, ROLE_POLICY,
                                                                   POLICY)]
    docs += [(role, _statements(p.get("policy"))) for role in _all(resources, ROLE)
             for p in _list(role.inputs.get("inlinePolicies"))]
    return docs


def _grants(statement: dict, action: str) -> bool:
    """Whether an Allow statement grants ``action`` as IAM matches it: case-insensitively,
    with * and ? wildcards, NotAction granting everything it does not name."""
    def hit(patterns: Any) -> bool:
        return any(fnmatch.fnmatchcase(action.lower(), str(p).lower()) for p in _list(patterns))
    if statement.get("NotAction") is not None:
        return not hit(statement["NotAction"])
    return hit(statement.get("Action"))


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
    condition = s.get("Condition") or {}
    if "s3:ListBucket" in s3 and not any(condition.get(op, {}).get("s3:prefix")
                                         for op in ("StringLike", "StringLikeIfExists")):
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
