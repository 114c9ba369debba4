"""Benchmarks (`make bench`): side-by-side ratios written to BENCHMARKS.md, never asserted."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable

from rayfleet.entrypoint import ArgumentParser, at_least, run_main

__all__ = ["ArgumentParser", "at_least", "command", "goal", "machine"]


def command(main: Callable[[list[str] | None], object], prog: str) -> int:
    """Run a benchmark's main(argv) as a command: what it measured is in what it wrote and
    printed, so it exits 0; a bad flag is one line and exit 2, as every kit entry point."""
    return run_main(lambda argv: main(argv) and 0, None, prog)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.platform()}"


def goal(ok: bool, load: float | None = None) -> str:
    """'met' / 'missed', flagged as unreadable when the benchmark ran on a busy machine."""
    verdict = "met" if ok else "**missed**"
    cores = os.cpu_count() or 1
    if load is not None and load > cores:
        verdict += (f" (as measured at load {load:g} on {cores} cores, which says little: "
                    "re-run on an idle machine)")
    return verdict
