"""Benchmarks (`make bench`): side-by-side ratios written to BENCHMARKS.md, never asserted."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rayfleet.entrypoint import ArgumentParser, run_main

__all__ = ["ArgumentParser", "at_least", "command"]


def command(main: Callable[[list[str] | None], object], prog: str) -> int:
    """Run a benchmark's main(argv) as a command: what it measured is in what it wrote and
    printed, so it exits 0; a bad flag is one line and exit 2, as every kit entry point."""
    return run_main(lambda argv: main(argv) and 0, None, prog)


def at_least(low: float, kind=int):
    """An argparse type: a number of `kind` no smaller than `low`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {text}")
        return value

    return parse
