"""Slow ranks, named (docs/faults.md, fault 11): each rank's time in the model's forward pass.

In synchronous data parallel training every rank's step takes as long as the slowest rank's
(the gradient collective waits for it), so step times cannot tell ranks apart. The forward
pass of the model's own module (below DDP's wrapper, so without its buffer broadcast) is this
rank's compute alone under DDP: a rank on a slow or throttled GPU, or a busy host, takes
longer there. Under FSDP2 and ZeRO-3 forward holds the all-gathers of the weights, which wait
for the slowest rank too: ranks read more alike there, and a straggler is named less readily.

At each log point the ranks' forward seconds travel in the loss's all_reduce (one collective,
as before); rank 0 writes the slowest rank and its ratio to the others' median into the
metrics (metrics.csv, Prometheus). The summary names a rank that was the slowest by
STRAGGLER_FACTOR or more in at least MIN_WINDOWS log windows and in half of them or more.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

STRAGGLER_FACTOR = 1.5
MIN_WINDOWS = 3
COLUMNS = ("slowest_rank", "slowest_ratio")   # metrics.csv's columns; NaN where unknown


class ForwardClock:
    """Seconds this rank spends in `module`'s forward, summed until `take()`. On CUDA the
    forward is timed with events (the host only queues it), read once the caller has
    synchronized."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._start = None
        self._events: list = []
        # Under --compile the hooks run inside the compiled call: kept out of the graph (a
        # traced clock would be a constant), they split it only at forward's two ends.
        module.register_forward_pre_hook(torch.compiler.disable(self._pre))
        module.register_forward_hook(torch.compiler.disable(self._post))

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, module, args) -> None:
        self._start = self._now()

    def _post(self, module, args, output) -> None:
        end = self._now()
        if self._start is None:
            return
        if self.cuda:
            self._events.append((self._start, end))
        else:
            self.seconds += end - self._start
        self._start = None

    def take(self) -> float:
        seconds = self.seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000
        self.seconds, self._events = 0.0, []
        return seconds


def slowest(per_rank: list[float]) -> dict:
    """The log window's slowest rank and its forward time over the others' median; with one
    rank, or no time measured, NaN (unknown, not zero)."""
    if len(per_rank) < 2 or not all(t > 0 for t in per_rank):
        return {"slowest_rank": float("nan"), "slowest_ratio": float("nan")}
    rank = max(range(len(per_rank)), key=lambda r: per_rank[r])
    others = statistics.median(t for r, t in enumerate(per_rank) if r != rank)
    return {"slowest_rank": rank, "slowest_ratio": round(per_rank[rank] / others, 3)}


def named(history: list[dict]) -> list[dict]:
    """The ranks the run's metrics history shows consistently slower than the others:
    [{rank, windows, of, median_ratio}]."""
    rows = [h for h in history if not math.isnan(float(h.get("slowest_ratio", math.nan)))]
    flagged: dict[int, list[float]] = {}
    for h in rows:
        if h["slowest_ratio"] >= STRAGGLER_FACTOR:
            flagged.setdefault(int(h["slowest_rank"]), []).append(h["slowest_ratio"])
    return [{"rank": r, "windows": len(ratios), "of": len(rows),
             "median_ratio": round(statistics.median(ratios), 2)}
            for r, ratios in sorted(flagged.items())
            if len(ratios) >= MIN_WINDOWS and 2 * len(ratios) >= len(rows)]


def describe(found: list[dict]) -> str:
    return "; ".join(f"rank {s['rank']}: forward {s['median_ratio']:g}x the others' median "
                     f"in {s['windows']} of {s['of']} log windows" for s in found)
