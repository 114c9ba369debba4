"""Benchmarks (`make bench`): side-by-side ratios written to BENCHMARKS.md, never asserted."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2, as every rayfleet entry point."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


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
