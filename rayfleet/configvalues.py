"""What a stack setting's value may be: the checks of single keys (each declared with its key in
rayfleet/configkeys.py's ``SCHEMA``), the budget's joint check, and the tables they read.

A check takes the key's name and its coerced value and returns the checked value, or raises
one :class:`~rayfleet.errors.ConfigError` line naming the key, what is allowed and, where one is
close, the value that was probably meant. It imports neither configkeys nor configcheck, which
both stand on it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from typing import Any

from rayfleet.errors import ConfigError, did_you_mean
from rayfleet.facts import BUCKET_PREFIX_MAX, CLUSTER_NAME
from rayfleet.rules import rule

NAMESPACE = "rayfleet"

# A single key's check: (the key's bare name, its coerced value) -> the checked value.
Check = Callable[[str, Any], Any]


# ----------------------------------------------------------------------------- tables

# Commercial and GovCloud regions, for "did you mean" on typos (us-east1 -> us-east-1).
AWS_REGIONS = (
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "us-gov-east-1", "us-gov-west-1",
    "ca-central-1", "ca-west-1", "mx-central-1", "sa-east-1",
    "eu-central-1", "eu-central-2", "eu-west-1", "eu-west-2", "eu-west-3", "eu-south-1",
    "eu-south-2", "eu-north-1", "il-central-1", "me-south-1", "me-central-1", "af-south-1",
    "ap-east-1", "ap-east-2", "ap-south-1", "ap-south-2", "ap-northeast-1", "ap-northeast-2",
    "ap-northeast-3", "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4",
    "ap-southeast-5", "ap-southeast-7",
)

# The only values CloudWatch Logs accepts for retentionInDays (PutRetentionPolicy API);
# 0 ("never expire") is left out on purpose: rule 8 wants a retention.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096,
                      1827, 2192, 2557, 2922, 3288, 3653)


def qualified(name: str) -> str:
    """The key as errors name it: ``rayfleet:<name>``."""
    return f"{NAMESPACE}:{name}"


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


def between(lo: int, hi: int) -> Check:
    """The check of an integer key allowed ``lo`` to ``hi``, both included."""
    return lambda name, value: int_range(name, value, lo, hi)


def one_of(*allowed: Any) -> Check:
    """The check of a key allowed only the values ``allowed``."""
    return lambda name, value: choice(name, value, allowed)


def flag(name: str, value: bool) -> bool:
    """The check of a boolean key: its coercion to true or false was all there was to check."""
    return value


def suggest(value: str) -> str:
    """The hint an error ends with when the meant value is plain to see."""
    return f' (did you mean "{value}"?)'


def _slug(value: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", value.lower())).strip("-")


# ----------------------------------------------------------------------------- the keys

def cluster_name(name: str, value: str) -> str:
    if CLUSTER_NAME.fullmatch(value) and "--" not in value:
        return value
    slug = _slug(value)
    hint = suggest(slug) if slug and slug != value and 3 <= len(slug) <= 32 else ""
    raise ConfigError(qualified(name), f"{value!r} must be 3-32 lowercase letters, digits or "
                                       f"single hyphens, starting with a letter{hint}")


def region(name: str, value: str) -> str:
    if value in AWS_REGIONS:
        return value
    raise ConfigError(qualified(name), f"{value!r} is not an AWS region"
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


def vpc_cidr(name: str, value: str) -> str:
    key = qualified(name)
    net = _network(name, value)
    if net.version != 4:
        raise ConfigError(key, f"{value!r} must be an IPv4 CIDR")
    # RFC 1918 and CGNAT, plus 198.18.0.0/15 (RFC 2544's benchmarking range): AWS accepts VPC
    # ranges outside RFC 1918, and the fake cloud of the `ray up` rehearsal lives in this one
    # because nothing real can be there.
    private = [ipaddress.ip_network(n) for n in
               ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                "198.18.0.0/15")]
    if not any(net.subnet_of(p) for p in private):
        raise ConfigError(key, f"{value!r} must lie in a private range",
                          allowed=[str(p) for p in private])
    # /22 is the smallest VPC whose eighth-of-an-eighth public subnets are still /28, the
    # smallest subnet AWS allows.
    if not 16 <= net.prefixlen <= 22:
        raise ConfigError(key, f"{value!r} must be /16 to /22")
    return str(net)


def operator_cidrs(name: str, values: list[str]) -> tuple[str, ...]:
    """Rule 24: refuse world-open and malformed CIDRs; an empty list means SSM only."""
    key = qualified(name)
    out: list[str] = []
    for value in values:
        net = _network(name, value)
        why = f"rule 24, {rule(24).anchor}"
        if net.prefixlen == 0:
            raise ConfigError(key, f"{value} opens SSH and the dashboard to the whole internet; "
                                   "name your VPN or office range, or leave the list empty for "
                                   f"SSM only ({why})")
        # Broader than a /8 (or an IPv6 /32) is "most of the internet" split in pieces.
        floor = 8 if net.version == 4 else 32
        if net.prefixlen < floor:
            raise ConfigError(key, f"{value} is broader than /{floor}; name a narrower range "
                                   f"({why})")
        if str(net) not in out:
            out.append(str(net))
    return tuple(out)


def bucket_prefix(name: str, value: str) -> str:
    # S3 bucket naming rules
    # (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html), for a
    # prefix: at most BUCKET_PREFIX_MAX, as a unique suffix is appended to it.
    # Dots are refused too: they break TLS for virtual-hosted-style requests.
    key = qualified(name)
    fixed = re.sub(r"[^a-z0-9-]", "-", value.lower())[:BUCKET_PREFIX_MAX]
    hint = suggest(fixed) if fixed != value and len(fixed) >= 3 else ""
    if not 3 <= len(value) <= BUCKET_PREFIX_MAX:
        raise ConfigError(key, f"{value!r} must be 3-{BUCKET_PREFIX_MAX} characters{hint}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", value):
        raise ConfigError(key, f"{value!r} may hold only lowercase letters, digits and "
                               f"hyphens, starting with a letter or digit{hint}")
    for reserved in ("xn--", "sthree-", "amzn-s3-demo-"):
        if value.startswith(reserved):
            raise ConfigError(key, f"{value!r} starts with {reserved}, which S3 reserves")
    return value


def key_prefix(name: str, value: str) -> str:
    key = qualified(name)
    if re.fullmatch(r"([A-Za-z0-9_.=-]+/)+", value) and ".." not in value.split("/"):
        return value
    fixed = "/".join(s for s in value.split("/") if s and s != "..")
    hint = suggest(fixed + "/") if fixed else ""
    raise ConfigError(key, f"{value!r} must be one or more path segments ending with / "
                           f"(letters, digits, _ . = -), without a leading /{hint}")


# ----------------------------------------------------------------------------- checked jointly

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
