"""Entry-point helpers shared by every workload: each is `main(argv) -> int`, and expected
failures end in one line and exit 2, no traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rayfleet.errors import RayfleetError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit 2 (argparse would print usage too)."""

    def error(self, message: str):
        # run_main already prefixes "<prog>: error:"; repeating the prog here doubled it.
        raise RayfleetError(message)


def run_main(fn: Callable[[list[str] | None], int], argv: list[str] | None, prog: str) -> int:
    """Call fn(argv); expected failures become one line on stderr and exit code 2."""
    try:
        return fn(argv)
    except RayfleetError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def parse_env_pairs(pairs: list[str] | None, flag: str = "--env") -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RayfleetError(f"{flag} expects KEY=VALUE, got {pair!r}")
        out[key] = value
    return out
