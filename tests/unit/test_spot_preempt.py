"""The loop's side of a spot notice (workloads/train/preempt.py), on a real 2-rank gloo group:
a notice seen by one rank's node makes every rank checkpoint at the same step, once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from workloads.train import preempt
from workloads.train.context import TorchrunContext

NOTICE = json.dumps({"kind": "interruption", "action": "terminate"}).encode()
REBALANCE = json.dumps({"kind": "rebalance"}).encode()


class NodeKey:
    """One node's key, as the poll thread reads it: `set` a value, then `read_twice` waits
    until the thread has read it twice, so the first read's flag is raised (the thread reads,
    flags, sleeps, reads again) before the loop's next step boundary."""

    def __init__(self):
        self.value, self.reads = None, 0
        self.cond = threading.Condition()

    def get(self):
        with self.cond:
            self.reads += 1
            self.cond.notify_all()
            return self.value

    def set(self, value) -> None:
        with self.cond:
            self.value, self.since = value, self.reads

    def read_twice(self) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.reads >= self.since + 2, timeout=60)


def _rank(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    key = NodeKey()   # this rank's node key; only rank 1's node gets notices
    notices = preempt.KVNotices(rank, world, key.get, f"node-{rank}", poll_s=0.01)
    due = []
    for step in range(1, 121):
        if rank == 1 and step in (30, 80):
            # 80: a rebalance recommendation, a new notice: one more checkpoint.
            key.set(NOTICE if step == 30 else REBALANCE)
            key.read_twice()
        if notices.due(step):
            due.append(step)
    Path(tmp, f"due-{rank}.json").write_text(json.dumps(due))
    dist.destroy_process_group()


def test_ranks_agree_on_one_checkpoint_step_per_notice(tmp_path, capfd):
    # fork: the ranks inherit the imported torch (a spawn re-imports it: seconds per rank).
    mp.start_processes(_rank, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    due = [json.loads((tmp_path / f"due-{r}.json").read_text()) for r in (0, 1)]
    assert due[0] == due[1], due  # the same steps on both ranks
    # At the step boundary right after the notice, on both ranks, once per notice.
    assert due[0] == [30, 80], due
    out = capfd.readouterr().out
    # One line per notice, from the rank that saw it.
    assert out.count("[rayfleet] spot notice on node-1 (interruption): checkpoint at step "
                     f"{due[0][0]}\n") == 1, out
    assert out.count("[rayfleet] spot notice on node-1 (rebalance): checkpoint at step "
                     f"{due[0][1]}\n") == 1, out
    assert out.count("[rayfleet] spot notice") == 2, out


def test_a_notice_there_before_the_run_is_not_a_new_one():
    key = NodeKey()
    key.set(NOTICE)
    notices = preempt.KVNotices(0, 1, key.get, "node-0", poll_s=0.01)
    key.set(NOTICE)    # unchanged; counted from here: two reads by the poll thread, the first
    key.read_twice()   # of them handled (it would have flagged a new value at once)
    assert not any(notices.due(step) for step in range(5))


def test_torchrun_has_no_notices(tmp_path):
    assert TorchrunContext(tmp_path).spot_notices() is preempt.NONE
    assert preempt.NONE.due(1) is False
