"""Rules 11 to 15 and 27: the stack's S3 buckets, private, encrypted, TLS-only, versioned with
a lifecycle, without ACLs, and their access logged to a log bucket of the stack.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .graph import (
    BUCKET_ACLS,
    BUCKET_POLICY,
    BUCKETS,
    LIFECYCLE,
    LOGGING,
    OWNERSHIP,
    PUBLIC_ACCESS_BLOCK,
    SSE,
    VERSIONING,
    Resource,
    Violation,
    _actions,
    _all,
    _allows,
    _list,
    _points_to,
    _statements,
    _true,
    _v,
)


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


S3_LOG_DELIVERY = "logging.s3.amazonaws.com"


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
