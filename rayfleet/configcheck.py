"""Reading the stack config's values: the raw mapping (unknown, retired, secret and ``aws:*``
keys refused) and Pulumi's string forms coerced to each key's type. What each value may then be
is rayfleet/configvalues.py's (re-exported here), declared with its key in configkeys.SCHEMA;
the node settings' joint checks are rayfleet/nodes.py's and rayfleet/reservations.py's.

Each failure is one :class:`~rayfleet.errors.ConfigError` line naming the key, what is allowed
and, where one is close, the value that was probably meant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rayfleet.configkeys import (
    DEFAULTS,
    RETIRED,
    SCHEMA,
    SCHEMA_BY_NAME,
    ConfigKey,
)

# The value checks moved to rayfleet/configvalues.py; rayfleet/nodes.py, reservations.py and
# older callers still import them from here.
from rayfleet.configvalues import (  # noqa: F401
    budget,
    bucket_prefix,
    choice,
    cluster_name,
    int_range,
    key_prefix,
    operator_cidrs,
    qualified,
    region,
    suggest,
    vpc_cidr,
)
from rayfleet.errors import ConfigError, did_you_mean


# ----------------------------------------------------------------------------- reading

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
