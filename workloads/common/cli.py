"""Flag parsing shared by the workloads. Their parser and `main` wrapper (one-line errors,
exit 2) are the kit's own, `rayfleet.entrypoint`."""

from __future__ import annotations

from rayfleet.errors import RayfleetError


def parse_env_pairs(pairs: list[str] | None, flag: str = "--env") -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RayfleetError(f"{flag} expects KEY=VALUE, got {pair!r}")
        out[key] = value
    return out
