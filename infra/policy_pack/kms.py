"""Rules 28 and 29: the stack's customer-managed KMS keys, one on every log group that
CloudWatch Logs may use, each with a key policy of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from .graph import (
    KMS_KEY,
    LOG_GROUP,
    Resource,
    Violation,
    _all,
    _allows,
    _list,
    _points_to,
    _statements,
    _v,
)


_LOGS_SERVICE = re.compile(r"logs\.[a-z0-9-]+\.amazonaws\.com(\.cn)?")


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
