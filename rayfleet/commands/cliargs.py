"""The `rayfleet` CLI's one convention (docs/cli.md): the cluster YAML is the first positional
argument, CLUSTER_YAML; a file written is -o/--output; an old spelling still works for one
release, with one line on stderr naming the new one."""

from __future__ import annotations

import argparse
import sys

from rayfleet.entrypoint import UsageError


def cluster_yaml(p: argparse.ArgumentParser, what: str, optional: bool = False) -> None:
    """The first positional argument: the cluster YAML, CLUSTER_YAML in --help."""
    p.add_argument("cluster_yaml", nargs="?" if optional else None, default=None,
                   metavar="CLUSTER_YAML", help=what)


def output(p: argparse.ArgumentParser, what: str) -> None:
    """-o/--output PATH, and --out, its old spelling (kept out of --help)."""
    p.add_argument("-o", "--output", default=None, metavar="PATH", help=what)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)


def deprecated(old: str, new: str) -> None:
    print(f"rayfleet: {old} is deprecated: {new}", file=sys.stderr, flush=True)


def output_of(args: argparse.Namespace, usage: str) -> str | None:
    """The path -o/--output (or the old --out) names; ``usage``: the command line to show."""
    if args.out is None:
        return args.output
    if args.output is not None:
        raise UsageError("-o/--output and --out name the same file: give -o/--output only")
    deprecated("--out", f"{usage} -o/--output PATH")
    return args.out


def config_of(args: argparse.Namespace, usage: str) -> str | None:
    """The cluster YAML given as CLUSTER_YAML (or with the old --config)."""
    if args.config is None:
        return args.cluster_yaml
    if args.cluster_yaml is not None:
        raise UsageError(f"the cluster YAML is given twice (CLUSTER_YAML and --config): {usage}")
    deprecated("--config", usage)
    return args.config


def old_config(p: argparse.ArgumentParser) -> None:
    """--config CLUSTER_YAML, the old spelling of the positional (kept out of --help)."""
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
