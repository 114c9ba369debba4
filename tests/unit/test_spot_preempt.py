"""The loop's side of a spot notice (workloads/train/preempt.py), on a real 2-rank gloo group:
a notice seen by one rank's node makes every rank checkpoint at the same step, once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from workloads.train import preempt
from workloads.train.context import TorchrunContext

NOTICE = json.dumps({"kind": "interruption", "action": "terminate"}).encode()
REBALANCE = json.dumps({"kind": "rebalance"}).encode()


def _rank(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    kv = {"value": None}   # this rank's node key; only rank 1's node gets notices
    notices = preempt.KVNotices(rank, world, lambda: kv["value"], f"node-{rank}", poll_s=0.01)
    due = []
    for step in range(1, 121):
        if rank == 1 and step == 30:
            kv["value"] = NOTICE
        if rank == 1 and step == 80:
            kv["value"] = REBALANCE  # a new notice: one more checkpoint
        if notices.due(step):
            due.append(step)
        time.sleep(0.003)
    Path(tmp, f"due-{rank}.json").write_text(json.dumps(due))
    dist.destroy_process_group()


def test_ranks_agree_on_one_checkpoint_step_per_notice(tmp_path, capfd):
    # fork: the ranks inherit the imported torch (a spawn re-imports it: seconds per rank).
    mp.start_processes(_rank, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    due = [json.loads((tmp_path / f"due-{r}.json").read_text()) for r in (0, 1)]
    assert due[0] == due[1], due  # the same steps on both ranks
    assert len(due[0]) == 2 and 30 <= due[0][0] < 80 <= due[0][1], due
    out = capfd.readouterr().out
    # One line per notice, from the rank that saw it.
    assert out.count("[rayfleet] spot notice on node-1 (interruption): checkpoint at step "
                     f"{due[0][0]}\n") == 1, out
    assert out.count("[rayfleet] spot notice on node-1 (rebalance): checkpoint at step "
                     f"{due[0][1]}\n") == 1, out
    assert out.count("[rayfleet] spot notice") == 2, out


def test_a_notice_there_before_the_run_is_not_a_new_one():
    notices = preempt.KVNotices(0, 1, lambda: NOTICE, "node-0", poll_s=0.01)
    time.sleep(0.1)
    assert not any(notices.due(step) for step in range(5))


def test_torchrun_has_no_notices(tmp_path):
    assert TorchrunContext(tmp_path).spot_notices() is preempt.NONE
    assert preempt.NONE.due(1) is False
