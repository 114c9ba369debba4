"""Rules 9, 10 and 20: what a node boots with, read from its launch template or instance
(IMDSv2 and its hop limit, encrypted EBS volumes, no secret in the user data).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from typing import Any

from rayfleet.facts import (
    IMDS_HOP_LIMIT,
    IMDS_HOP_LIMIT_CONTAINERS,
    SECRET_PATTERNS,
    TAG_HOP_LIMIT_REASON,
)

from .graph import (
    INSTANCE,
    LAUNCH_TEMPLATE,
    VOLUME,
    Resource,
    Violation,
    _all,
    _list,
    _true,
    _v,
)


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


def rule_20_no_secrets_in_user_data(resources: Sequence[Resource],
                                    **_: Any) -> Iterator[Violation]:
    for r in _all(resources, LAUNCH_TEMPLATE, INSTANCE):
        text = _decoded_user_data(r)
        for pattern, what in SECRET_PATTERNS:
            if pattern.search(text):
                yield _v(20, r, f"carries {what} in its user data")
