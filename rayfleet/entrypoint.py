"""How every command line of the kit fails: `rayfleet`, each `python -m workloads.X` and
`python -m bench.X`. An expected failure, a bad flag included, is one line on stderr,
`<prog>: error: <what to do>`, and exit code 2; no usage block, no traceback."""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable

from rayfleet.errors import ConfigError, RayfleetError


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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def _bytes(text: str | int) -> int | None:
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_size(text: str | int | None, key: str = "--object-store-memory") -> int | None:
    """'2GB', '512MiB', '1000000' -> bytes."""
    if text is None:
        return None
    value = _bytes(text)
    if value is None:
        raise ConfigError(key, f"cannot read {text!r} as a size; use e.g. 2GB or 512MiB")
    return value


def byte_size(text: str) -> int:
    """An argparse type: a size of at least one byte ('2GB', '512MiB', '100000')."""
    value = _bytes(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; use e.g. 2GB or "
                                         "512MiB")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return value


# A TCP port to listen on (socket.bind() answers one outside it with an OverflowError).
tcp_port = bounded(int, lambda value: 1 <= value <= 65535, "a TCP port between 1 and 65535")


def _stop_ray_forwarding() -> None:
    """Disconnect a driver from its Ray cluster before its one line: Ray forwards its actors'
    output to the driver's terminal as it comes, and a failed run's workers still print as they
    exit (pyarrow's "Error ignored when destroying file", once), which landed after the line.
    Ray is looked up, not imported: a command that never started it does nothing here."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        try:
            ray.shutdown()
        except Exception:   # noqa: BLE001  (the line matters more than a clean disconnect)
            pass


def run_main(fn: Callable[[list[str] | None], int | None], argv: list[str] | None,
             prog: str) -> int:
    """Call fn(argv) and return its exit code (None is 0); expected failures become one line
    on stderr and their exit code (2), Ctrl-C one line and 130."""
    try:
        return fn(argv) or 0
    except RayfleetError as err:
        _stop_ray_forwarding()
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as err:
        said = aws_setup_error(err)
        if said is None:
            raise   # a bug keeps its traceback
        _stop_ray_forwarding()
        print(f"{prog}: error: AWS: {said}", file=sys.stderr, flush=True)
        return 2


# botocore's errors about the caller's own AWS set-up (a profile, credentials, SSO, the region,
# an endpoint): bad input, said in one line, whichever command met it.
AWS_SETUP_ERRORS = ("ProfileNotFound", "NoCredentialsError", "PartialCredentialsError",
                    "NoRegionError", "EndpointConnectionError", "ConnectTimeoutError",
                    "TokenRetrievalError", "SSOTokenLoadError", "UnauthorizedSSOTokenError",
                    "InvalidConfigError")


def aws_setup_error(err: BaseException) -> str | None:
    """What ``err`` says when it is one of AWS_SETUP_ERRORS, else None. botocore is not
    imported for this: an error of its can only come where it was."""
    exc = sys.modules.get("botocore.exceptions")
    kinds = tuple(getattr(exc, n) for n in AWS_SETUP_ERRORS if hasattr(exc, n)) if exc else ()
    return str(err) if kinds and isinstance(err, kinds) else None
