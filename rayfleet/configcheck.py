"""Reading the stack config's values: the raw mapping (unknown, retired, secret and ``aws:*``
keys refused), Pulumi's string forms coerced to each key's type, and the checks of the
cluster, region, network, access, storage and budget settings. The node settings' checks are
rayfleet/nodes.py's and rayfleet/reservations.py's; rayfleet/config.py puts them together.

Each failure is one :class:`~rayfleet.errors.ConfigError` line naming the key, what is allowed
and, where one is close, the value that was probably meant.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Any

from rayfleet.configkeys import (
    AWS_REGIONS,
    DEFAULTS,
    NAMESPACE,
    RETIRED,
    SCHEMA,
    SCHEMA_BY_NAME,
    ConfigKey,
)
from rayfleet.errors import ConfigError, did_you_mean
from rayfleet.facts import BUCKET_PREFIX_MAX, CLUSTER_NAME
from rayfleet.rules import rule


# ----------------------------------------------------------------------------- reading

def qualified(name: str) -> str:
    """The key as errors name it: ``rayfleet:<name>``."""
    return f"{NAMESPACE}:{name}"


def collect(mapping: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """Bare-keyed values of our namespace; unknown keys are errors with a close match."""
    known = [k.qualified for k in SCHEMA]
    raw: dict[str, Any] = {}
    for full_key, value in mapping.items():
        full_key = str(full_key)
        ns, sep, name = full_key.partition(":")
        if not sep:
            ns, name = namespace, full_key
        if ns == "aws":
            _aws_key(full_key, value, mapping, namespace)
            continue
        if ns != namespace:
            continue  # another package's config; not ours to judge
        key = qualified(name)
        if name in RETIRED:
            raise ConfigError(key, RETIRED[name](value))
        if name not in SCHEMA_BY_NAME:
            raise ConfigError(key, f"is not a rayfleet setting{did_you_mean(key, known)}"
                                   "; Pulumi.yaml lists them all")
        if isinstance(value, dict) and "secure" in value:
            raise ConfigError(key, "is not a secret setting; set it with plain "
                                   "`pulumi config set`")
        raw[name] = value
    return raw


def _aws_key(full_key: str, value: Any, mapping: Mapping[str, Any], namespace: str) -> None:
    # The program builds an explicit aws.Provider from rayfleet:region (so every resource
    # carries the validated region and the cluster's default tags); the ambient aws:* config
    # would be silently ignored, which is worse than refusing it.
    if full_key == "aws:region":
        ours = mapping.get(f"{namespace}:region", mapping.get("region", DEFAULTS["region"]))
        if str(value) == str(ours):
            return
        raise ConfigError("aws:region", f"is {value} but rayfleet deploys to "
                                        f"rayfleet:region ({ours}); set rayfleet:region instead")
    raise ConfigError(full_key, "is not read: the stack uses an explicit AWS provider; set "
                                "credentials with AWS_PROFILE or the AWS_* environment "
                                "variables, the region with rayfleet:region")


def coerce(key: ConfigKey, value: Any) -> Any:
    """Accept typed values and Pulumi's string forms ("3", "true", '["a"]')."""
    name = key.qualified
    if key.type == "integer":
        if isinstance(value, bool):
            raise ConfigError(name, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            return int(value)
        raise ConfigError(name, f"expected an integer, got {value!r}")
    if key.type == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ConfigError(name, f"expected true or false, got {value!r}")
    if key.type == "objects":
        if isinstance(value, str):
            # How pulumi.Config hands a structured value over: JSON text.
            try:
                value = json.loads(value) if value.strip() else []
            except json.JSONDecodeError:
                raise ConfigError(name, f"expected a list of objects, got {value!r}") from None
        if isinstance(value, (list, tuple)) and all(isinstance(x, dict) for x in value):
            return [dict(x) for x in value]
        raise ConfigError(name, f"expected a list of objects (one per reservation), got "
                                f"{value!r}")
    if key.type == "array":
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return []
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                # A single bare value ("10.0.0.0/8") is read as a one-item list.
                value = [text]
        if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
            return [x.strip() for x in value]
        raise ConfigError(name, f"expected a list of strings, got {value!r}")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(name, f"expected a string, got {value!r}")
    return value.strip()


# ----------------------------------------------------------------------------- any key

def choice(name: str, value: Any, allowed: Any) -> Any:
    """``value`` if it is one of ``allowed``, else the error naming the closest."""
    if value in allowed:
        return value
    shown = [str(a) for a in allowed]
    if isinstance(value, int) and all(isinstance(a, int) for a in allowed):
        # Spelling distance means nothing for numbers: suggest the nearest allowed one.
        nearest = min(allowed, key=lambda a: abs(a - value))
        raise ConfigError(qualified(name), f"{value} is not allowed; allowed: {', '.join(shown)}"
                                           f"{suggest(str(nearest))}")
    raise ConfigError(qualified(name), f"{value!r} is not allowed", allowed=shown, value=value)


def int_range(name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise ConfigError(qualified(name), f"must be between {lo} and {hi}, got {value}")
    return value


def suggest(value: str) -> str:
    """The hint an error ends with when the meant value is plain to see."""
    return f' (did you mean "{value}"?)'


def _slug(value: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", value.lower())).strip("-")


# ----------------------------------------------------------------------------- the keys

def cluster_name(value: str) -> str:
    if CLUSTER_NAME.fullmatch(value) and "--" not in value:
        return value
    slug = _slug(value)
    hint = suggest(slug) if slug and slug != value and 3 <= len(slug) <= 32 else ""
    raise ConfigError(qualified("clusterName"), f"{value!r} must be 3-32 lowercase letters, "
                                                f"digits or single hyphens, starting with a "
                                                f"letter{hint}")


def region(value: str) -> str:
    if value in AWS_REGIONS:
        return value
    raise ConfigError(qualified("region"), f"{value!r} is not an AWS region"
                                           f"{did_you_mean(value, AWS_REGIONS)}")


def _network(name: str, value: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError:
        pass
    try:
        fixed = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ConfigError(qualified(name), f"{value!r} is not a CIDR (expected e.g. "
                                           "10.0.0.0/16)") from None
    raise ConfigError(qualified(name), f"{value!r} has host bits set{suggest(str(fixed))}")


def vpc_cidr(value: str) -> str:
    name = qualified("vpcCidr")
    net = _network("vpcCidr", value)
    if net.version != 4:
        raise ConfigError(name, f"{value!r} must be an IPv4 CIDR")
    # RFC 1918 and CGNAT, plus 198.18.0.0/15 (RFC 2544's benchmarking range): AWS accepts VPC
    # ranges outside RFC 1918, and the fake cloud of the `ray up` rehearsal lives in this one
    # because nothing real can be there.
    private = [ipaddress.ip_network(n) for n in
               ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                "198.18.0.0/15")]
    if not any(net.subnet_of(p) for p in private):
        raise ConfigError(name, f"{value!r} must lie in a private range",
                          allowed=[str(p) for p in private])
    # /22 is the smallest VPC whose eighth-of-an-eighth public subnets are still /28, the
    # smallest subnet AWS allows.
    if not 16 <= net.prefixlen <= 22:
        raise ConfigError(name, f"{value!r} must be /16 to /22")
    return str(net)


def operator_cidrs(values: list[str]) -> tuple[str, ...]:
    """Rule 24: refuse world-open and malformed CIDRs; an empty list means SSM only."""
    name = qualified("operatorCidrs")
    out: list[str] = []
    for value in values:
        net = _network("operatorCidrs", value)
        why = f"rule 24, {rule(24).anchor}"
        if net.prefixlen == 0:
            raise ConfigError(name, f"{value} opens SSH and the dashboard to the whole internet; "
                                    "name your VPN or office range, or leave the list empty for "
                                    f"SSM only ({why})")
        # Broader than a /8 (or an IPv6 /32) is "most of the internet" split in pieces.
        floor = 8 if net.version == 4 else 32
        if net.prefixlen < floor:
            raise ConfigError(name, f"{value} is broader than /{floor}; name a narrower range "
                                    f"({why})")
        if str(net) not in out:
            out.append(str(net))
    return tuple(out)


def bucket_prefix(value: str) -> str:
    # S3 bucket naming rules
    # (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html), for a
    # prefix: at most BUCKET_PREFIX_MAX, as a unique suffix is appended to it.
    # Dots are refused too: they break TLS for virtual-hosted-style requests.
    name = qualified("bucketPrefix")
    fixed = re.sub(r"[^a-z0-9-]", "-", value.lower())[:BUCKET_PREFIX_MAX]
    hint = suggest(fixed) if fixed != value and len(fixed) >= 3 else ""
    if not 3 <= len(value) <= BUCKET_PREFIX_MAX:
        raise ConfigError(name, f"{value!r} must be 3-{BUCKET_PREFIX_MAX} characters{hint}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", value):
        raise ConfigError(name, f"{value!r} may hold only lowercase letters, digits and "
                                f"hyphens, starting with a letter or digit{hint}")
    for reserved in ("xn--", "sthree-", "amzn-s3-demo-"):
        if value.startswith(reserved):
            raise ConfigError(name, f"{value!r} starts with {reserved}, which S3 reserves")
    return value


def key_prefix(value: str) -> str:
    name = qualified("bucketKeyPrefix")
    if re.fullmatch(r"([A-Za-z0-9_.=-]+/)+", value) and ".." not in value.split("/"):
        return value
    fixed = "/".join(s for s in value.split("/") if s and s != "..")
    hint = suggest(fixed + "/") if fixed else ""
    raise ConfigError(name, f"{value!r} must be one or more path segments ending with / "
                            f"(letters, digits, _ . = -), without a leading /{hint}")


def budget(v: Mapping[str, Any]) -> tuple[int, tuple[str, ...]]:
    """The monthly limit and the addresses to alert, checked together."""
    amount = v["budgetMonthlyUsd"]
    emails = tuple(v["budgetEmails"])
    amount_key, emails_key = qualified("budgetMonthlyUsd"), qualified("budgetEmails")
    if amount < 0:
        raise ConfigError(amount_key, f"must be 0 (no budget) or more, got {amount}")
    for email in emails:
        if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[A-Za-z]{2,}", email):
            raise ConfigError(emails_key, f"{email!r} is not an email address")
    if amount and not emails:
        raise ConfigError(emails_key, f"is empty but rayfleet:budgetMonthlyUsd is {amount}; name "
                                      "at least one address to alert")
    if emails and not amount:
        raise ConfigError(amount_key, "is 0 (no budget) but rayfleet:budgetEmails is set; set a "
                                      "monthly limit in USD")
    # AWS Budgets allows at most 10 email subscribers per notification.
    if len(emails) > 10:
        raise ConfigError(emails_key, f"has {len(emails)} addresses; AWS Budgets allows at most "
                                      "10")
    return amount, emails
