"""The test tiers a machine may be unable to run, and the one place that decides whether that
is a skip or a failure.

Locally a tier this machine cannot run (no root or network namespaces for the fake cloud, no
Debian mirror for Prometheus, no CUDA) is skipped with one line saying why. Where
``RAYFLEET_REQUIRE`` names the tier (`.ci/run` sets ``fakecloud,prometheus``, `make test-gpu`
sets ``gpu``) the same line fails the test instead: a green CI run means the tier ran.
"""

from __future__ import annotations

import difflib
import os
from typing import NoReturn

import pytest

REQUIRE_ENV = "RAYFLEET_REQUIRE"
TIERS = {
    "fakecloud": "the `ray up` rehearsal on network namespaces (root, netns, apt-get)",
    "prometheus": "the metrics tests' Debian prometheus (installed with apt-get when missing)",
    "gpu": "the CUDA tests (`make test-gpu`)",
}


def required() -> set[str]:
    """The tiers ``RAYFLEET_REQUIRE`` names (comma-separated); an unknown name is an error."""
    names = {n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()}
    for name in sorted(names - set(TIERS)):
        close = difflib.get_close_matches(name, TIERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise pytest.UsageError(f"{REQUIRE_ENV} names an unknown tier {name!r}{hint}; "
                                f"the tiers are {', '.join(TIERS)}")
    return names


def unavailable(tier: str, why: str) -> NoReturn:
    """This machine cannot run ``tier`` (``why``, one line): skip the test, or fail it where
    ``RAYFLEET_REQUIRE`` asks for the tier."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}")
    line = f"{tier} tier unavailable: {why}"
    if tier in required():
        pytest.fail(f"{line} (required by {REQUIRE_ENV}={os.environ[REQUIRE_ENV]}; unset it "
                    "to skip instead)", pytrace=False)
    pytest.skip(line)
