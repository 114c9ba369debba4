"""How every command line of the kit fails: `rayfleet`, each `python -m workloads.X` and
`python -m bench.X`. An expected failure, a bad flag included, is one line on stderr,
`<prog>: error: <what to do>`, and exit code 2; no usage block, no traceback."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from rayfleet.errors import RayfleetError


class UsageError(RayfleetError):
    """A flag or argument the parser refused."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises UsageError (one line, exit 2 through `run_main`):
    argparse's own error() prints the whole usage block first, which buries the one line that
    says what is wrong. With `help_hint`, the line ends "(see <prog> --help)", each
    subcommand naming its own prog."""

    def __init__(self, *args, help_hint: bool = False, **kwargs):
        self.help_hint = help_hint
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs):
        # Subparsers are built from parser_class: they inherit the one-line errors and the hint.
        kwargs.setdefault("parser_class", functools.partial(type(self), help_hint=self.help_hint))
        return super().add_subparsers(**kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)" if self.help_hint else message)


def bounded(kind, ok: Callable[[float], bool], says: str):
    """An argparse type: a number of `kind` for which ``ok(value)`` holds; any other number is
    refused with "must be <says>, got <text>", where argparse names the flag."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not ok(value):  # NaN fails every comparison, so `ok` written as one refuses it
            raise argparse.ArgumentTypeError(f"must be {says}, got {text}")
        return value

    return parse


def at_least(low: float, kind=int, unit: str = ""):
    """An argparse type: a number of `kind` no smaller than `low` ("at least 1 minute" with
    ``unit="minute"``)."""
    return bounded(kind, lambda value: value >= low,
                   f"at least {low:g}" + (f" {unit}" if unit else ""))


# A TCP port to listen on (socket.bind() answers one outside it with an OverflowError).
tcp_port = bounded(int, lambda value: 1 <= value <= 65535, "a TCP port between 1 and 65535")


def run_main(fn: Callable[[list[str] | None], int | None], argv: list[str] | None,
             prog: str) -> int:
    """Call fn(argv) and return its exit code (None is 0); expected failures become one line
    on stderr and their exit code (2), Ctrl-C one line and 130."""
    try:
        return fn(argv) or 0
    except RayfleetError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
