"""Spot notices in the training loop: checkpoint at the next step boundary once the node's
spot agent (rayfleet/agents/spot.py) has published an interruption notice, a rebalance
recommendation, its Capacity Block's coming end or a GPU fault for a node this run trains on, so
at most one step of work is lost.

A daemon thread reads this worker's node key from the GCS internal KV every `poll_s` and
raises a flag; `due(step)` is the step-boundary check: with several ranks, one all_reduce(MAX)
of two integers (on a gloo group: CPU only, no GPU sync), so every rank checkpoints at the
same step.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref

import torch
import torch.distributed as dist

from rayfleet.agents.spot import KV_NAMESPACE, notice_key


class Notices:
    """No notices: torchrun or one process (no spot agent publishes to them)."""

    def due(self, step: int) -> bool:
        return False


NONE = Notices()


class KVNotices(Notices):
    """The notices for one node: `get()` reads its key (None when there is no notice)."""

    def __init__(self, rank: int, world_size: int, get, node: str, poll_s: float = 1.0):
        self.rank, self.world_size, self._get, self.node = rank, world_size, get, node
        # A notice already there predates this worker's work: the run just resumed (or
        # started) here, so it has nothing to save for it; a later notice is new.
        try:
            self._handled = self._get()
        except Exception:  # a GCS blip: no notice known yet
            self._handled = None
        self._pending: bytes | None = None
        self._lock = threading.Lock()  # the poll thread's check-and-set vs due()'s clear
        self._group = None
        if world_size > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # collective: every rank makes it
        threading.Thread(target=_poll, args=(weakref.ref(self), poll_s), daemon=True,
                         name="rayfleet-spot-notices").start()

    def due(self, step: int) -> bool:
        pending = self._pending
        mine = pending is not None
        if self.world_size == 1:
            agreed, first = mine, self.rank
        else:
            # [any rank saw a notice, the lowest such rank (as world - rank)]
            t = torch.tensor([int(mine), self.world_size - self.rank if mine else 0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            agreed, first = bool(t[0]), self.world_size - int(t[1])
        if not agreed:
            return False
        if mine:
            with self._lock:
                self._handled, self._pending = pending, None
        else:
            # A rank on the same node whose thread has not read the key yet: take what is
            # there now as handled, or it would checkpoint again at its next read.
            with contextlib.suppress(Exception), self._lock:
                self._handled = self._get() or self._handled
        if self.rank == first:
            kind = json.loads(pending).get("kind", "interruption")
            what = {"capacity-block-end": "Capacity Block end",
                    "gpu-fault": "GPU fault"}.get(kind, "spot notice")
            print(f"[rayfleet] {what} on {self.node} ({kind}): checkpoint at step {step}",
                  flush=True)
        return True


def for_ray_worker(rank: int, world_size: int) -> KVNotices:
    """This Ray worker's node's notices, read through the worker's own GCS connection."""
    import ray
    from ray.experimental import internal_kv

    node_id = ray.get_runtime_context().get_node_id()
    key = notice_key(node_id)
    return KVNotices(rank, world_size,
                     lambda: internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE),
                     f"{ray.util.get_node_ip_address()} (node {node_id[:8]})")


def _poll(ref: weakref.ref, poll_s: float) -> None:
    """Until the loop drops its KVNotices: a GCS read every poll_s, flagging a new value."""
    while (n := ref()) is not None:
        try:
            value = n._get()
        except Exception:  # a GCS blip: the next read tries again, training goes on
            value = None
        with n._lock:
            if value is not None and value != n._handled:
                n._pending = value
        del n
        time.sleep(poll_s)
