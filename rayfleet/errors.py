"""User-facing errors: one actionable line, exit code 2, no traceback.

Expected failures (bad input, a port in use, a missing checkpoint) raise a RayfleetError;
the CLI and every workload entry point print ``str(err)`` on one line and exit with
``err.exit_code``. Unexpected failures propagate with ``raise ... from e``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    return f' (did you mean "{match[0]}"?)' if match else ""


class RayfleetError(Exception):
    """An expected failure the user can fix. The message is one line that says what to do."""

    exit_code = 2

    def __init__(self, message: str):
        # One line, always: a multi-line message is a traceback in disguise.
        super().__init__(" ".join(str(message).split()))


class ConfigError(RayfleetError):
    """A configuration value is missing, malformed or not allowed."""

    def __init__(self, key: str, problem: str, allowed: Iterable[str] | None = None,
                 value: object = None):
        allowed = list(allowed) if allowed is not None else None
        msg = f"{key}: {problem}"
        if allowed:
            msg += f"; allowed: {', '.join(allowed)}"
            if value is not None:
                msg += did_you_mean(value, allowed)
        self.key = key
        super().__init__(msg)


class ClusterError(RayfleetError):
    """The Ray cluster is missing, unreachable, or cannot satisfy the request."""


class StorageError(RayfleetError):
    """A storage path (local folder or s3://) is unreadable, unwritable or malformed."""


class CheckpointError(RayfleetError):
    """A checkpoint is missing or incomplete; nothing was resumed from it."""
