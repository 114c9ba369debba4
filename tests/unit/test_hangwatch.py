"""The hang watch's judgement, its threads on a shared KV, the hang budget's policy, and the
straggler measure (workloads/train/hangwatch.py, hangpolicy.py, straggler.py). The watch on a
real cluster with a SIGSTOPped rank: tests/faults/test_train_faults.py (fault 11)."""

from __future__ import annotations

import inspect
import json
import math
import threading
import time

import pytest
import torch

from workloads.train import hangpolicy, hangwatch, straggler
from workloads.train.hangwatch import RankWatch, Seen, Settings, describe, judge

SETTINGS = Settings(floor_s=10.0, factor=10.0)


def _rec(rank, step, phase="step", longest=0.2, ckpt=None, beat=1):
    return {"rank": rank, "node": f"10.0.0.{rank}", "pid": 100 + rank, "step": step,
            "phase": phase, "beat": beat, "longest_step_s": longest,
            "longest_checkpoint_s": ckpt}


def test_the_bound_is_the_floor_or_the_factor_over_the_longest_gap_of_the_phase():
    assert hangwatch.bound([_rec(0, 5, longest=0.2)], SETTINGS)[0] == 10.0
    limit, why = hangwatch.bound([_rec(0, 5, longest=3.0), _rec(1, 5, longest=1.0)], SETTINGS)
    assert limit == 30.0 and "longest step, 3.0 s" in why
    # Inside a checkpoint: the longest checkpoint seen, else the first checkpoint's allowance.
    assert hangwatch.bound([_rec(0, 5, "checkpoint", longest=3.0)], SETTINGS)[0] == \
        10.0 * hangwatch.CHECKPOINT_ALLOWANCE
    assert hangwatch.bound([_rec(0, 5, "checkpoint", ckpt=6.0), _rec(1, 5)], SETTINGS)[0] == 60.0


def test_the_first_step_of_a_group_is_not_a_step_gap():
    p = hangwatch.Progress(last=0.0)
    p.stepped(1, now=50.0)      # model loading, compile, the first collective
    p.stepped(2, now=50.5)
    p.checkpointing(now=50.6)
    p.checkpointed(now=53.6)
    p.stepped(3, now=54.0)
    assert p.longest_step_s == pytest.approx(0.5) and p.longest_checkpoint_s == pytest.approx(3.0)
    assert (p.step, p.steps_here, p.phase) == (3, 3, "step")


def _seen(now, **ranks):
    """rank -> (record, seconds since its beat moved, seconds since it advanced)."""
    return {int(r[1:]): Seen(rec, now - beat_age, now - adv_age)
            for r, (rec, beat_age, adv_age) in ranks.items()}


def test_no_verdict_while_a_rank_advances_within_the_bound():
    now = 1000.0
    seen = _seen(now, r0=(_rec(0, 7), 0.5, 9.0), r1=(_rec(1, 7), 0.5, 12.0))
    assert judge(seen, 2, now, SETTINGS, armed_at=900.0) is None


def test_a_rank_that_stopped_beating_is_named_with_its_node_and_pid():
    now = 1000.0
    seen = _seen(now, r0=(_rec(0, 8), 0.5, 11.0), r1=(_rec(1, 7), 11.0, 11.0),
                 r2=(_rec(2, 8), 0.4, 11.0))
    v = judge(seen, 3, now, SETTINGS, armed_at=900.0)
    assert v["how"] == "stopped answering" and [r["rank"] for r in v["ranks"]] == [1]
    assert describe(v) == ("hung: no rank advanced for 11 s past step 8 (bound 10 s: the "
                           "floor; 10 x the longest step is 2.0 s): rank 1 on 10.0.0.1 (pid "
                           "101) at step 7 stopped answering")


def test_ranks_that_all_beat_are_told_apart_by_their_step_or_not_at_all():
    now = 1000.0
    behind = _seen(now, r0=(_rec(0, 8), 0.2, 20.0), r1=(_rec(1, 7), 0.2, 20.0))
    v = judge(behind, 2, now, SETTINGS, armed_at=900.0)
    assert (v["how"], [r["rank"] for r in v["ranks"]]) == ("fell behind", [1])
    level = _seen(now, r0=(_rec(0, 8), 0.2, 20.0), r1=(_rec(1, 8), 0.2, 20.0))
    v = judge(level, 2, now, SETTINGS, armed_at=900.0)
    assert v["ranks"] == [] and "no rank stands out" in describe(v)


def test_a_rank_that_finished_the_run_is_never_a_hang():
    now = 1000.0
    seen = _seen(now, r0=(_rec(0, 9, phase="done"), 30.0, 30.0), r1=(_rec(1, 9), 0.2, 30.0))
    assert judge(seen, 2, now, SETTINGS, armed_at=900.0) is None


def test_a_rank_that_never_reported_is_named_once_the_bound_passes_since_arming():
    now = 1000.0
    seen = _seen(now, r0=(_rec(0, 3), 0.3, 2.0))
    assert judge(seen, 2, now, SETTINGS, armed_at=995.0) is None
    v = judge(_seen(now, r0=(_rec(0, 3), 0.3, 12.0)), 2, now, SETTINGS, armed_at=980.0)
    assert [r["rank"] for r in v["ranks"]] == [1] and "rank 1 never reported" in describe(v)


class _KV:
    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def get(self, key):
        with self.lock:
            return self.data.get(key)

    def put(self, key, value):
        with self.lock:
            self.data[key] = value

    def get_many(self, keys):
        with self.lock:
            return {k: self.data[k] for k in keys if k in self.data}

    def verdicts(self, job, run):
        prefix = hangwatch.verdict_prefix(job, run)
        return sorted((json.loads(v) for k, v in self.data.items() if k.startswith(prefix)),
                      key=lambda v: v["at"])


def test_the_live_rank_names_the_silent_one_writes_the_verdict_and_exits(capsys):
    """Two ranks' watch threads on one KV: both step; rank 0's thread goes silent (as a
    SIGSTOPped process's does); rank 1's thread judges, writes the verdict and exits with
    HUNG_EXIT, and the policy then charges the failure to the hang budget."""
    kv, exits = _KV(), []
    fast = Settings(floor_s=0.6, factor=2.0)
    common = dict(world_size=2, job="01000000", run="r", group="pg1", settings=fast, kv=kv,
                  beat_s=0.05)
    w0 = RankWatch(rank=0, node="10.0.0.1 (node aa)", exit=lambda c: exits.append((0, c)),
                   **common)
    w1 = RankWatch(rank=1, node="10.0.0.2 (node bb)", exit=lambda c: exits.append((1, c)),
                   **common)
    for step in (1, 2, 3):
        w0.stepped(step)
        w1.stepped(step)
        time.sleep(0.1)
    w0.kv = _Frozen()       # rank 0 stops publishing: its beat and step stay where they were
    deadline = time.time() + 10
    while not exits and time.time() < deadline:
        w1.stepped(3)       # no advance: the step does not change
        time.sleep(0.05)
    assert exits == [(1, hangwatch.HUNG_EXIT)], exits
    (verdict,) = kv.verdicts("01000000", "r")
    assert verdict["by"] == 1 and verdict["how"] == "stopped answering"
    assert [(r["rank"], r["node"]) for r in verdict["ranks"]] == [(0, "10.0.0.1 (node aa)")]
    out = capsys.readouterr().out
    assert "[rayfleet] hung: no rank advanced for" in out and "ending the worker group" in out
    # Another run's or job's verdicts are not this one's.
    assert kv.verdicts("02000000", "r") == [] and kv.verdicts("01000000", "r2") == []


class _Frozen:
    def get(self, key):
        raise OSError("stopped")

    put = get


def test_the_policy_charges_a_failure_with_a_new_verdict_to_the_hang_budget():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling.failure_policy import (
        FailureDecision,
    )
    from ray.train.v2.api.exceptions import WorkerGroupError

    kv = _KV()
    policy = hangpolicy.policy_class()(FailureConfig(max_failures=0), "01000000", "r",
                                        max_hangs=1, kv=kv)
    err = WorkerGroupError("worker 1 died", {1: RuntimeError("died")})

    def hang(group, at):
        kv.put(hangwatch.verdict_key("01000000", "r", group),
               json.dumps({"ranks": [], "how": "", "waited_s": 11, "bound_s": 10,
                           "bound_why": "the floor", "step": 4, "at": at}).encode())

    hang("pg1", 1.0)
    assert policy.make_decision(err) == FailureDecision.RETRY     # a hang: not max_failures'
    hang("pg2", 2.0)
    assert policy.make_decision(err) == FailureDecision.RAISE     # the second, over max_hangs
    fresh = hangpolicy.policy_class()(FailureConfig(max_failures=0), "01000000", "other",
                                       max_hangs=1, kv=kv)
    assert fresh.make_decision(err) == FailureDecision.RAISE      # no verdict: max_failures 0
    line = str(hangpolicy.too_many(kv.verdicts("01000000", "r"), 1))
    assert line.startswith("training stopped: its worker group hung 2 times, more than "
                           "--max-hangs 1; the last: hung: no rank advanced for 11 s")
    assert hangpolicy.too_many(kv.verdicts("01000000", "r"), -1) is None


def test_ray_trains_fit_still_builds_its_policy_where_install_replaces_it():
    """install() swaps a module global of Ray Train 2.60; a Ray that builds its policy
    elsewhere would silently count hangs as failures: this fails first."""
    from ray.train.v2.api import data_parallel_trainer

    before = data_parallel_trainer.create_failure_policy
    assert "create_failure_policy(self.run_config.failure_config)" in inspect.getsource(
        data_parallel_trainer.DataParallelTrainer.fit)
    try:
        hangpolicy.install("01000000", "r", 2)
        from ray.train import FailureConfig

        policy = data_parallel_trainer.create_failure_policy(FailureConfig())
        assert isinstance(policy, hangpolicy.policy_class()) and policy.max_hangs == 2
    finally:
        data_parallel_trainer.create_failure_policy = before


def test_the_slowest_rank_is_measured_against_the_others_median():
    assert straggler.slowest([0.1, 0.1, 0.31, 0.1]) == {"slowest_rank": 2, "slowest_ratio": 3.1}
    assert all(math.isnan(v) for v in straggler.slowest([0.2]).values())
    assert all(math.isnan(v) for v in straggler.slowest([0.2, 0.0]).values())


def test_a_straggler_is_named_only_when_consistently_slower():
    nan = float("nan")
    rows = [{"slowest_rank": 1, "slowest_ratio": 2.0}] * 3 + \
        [{"slowest_rank": 0, "slowest_ratio": 1.1}] * 2 + [{"slowest_rank": nan,
                                                           "slowest_ratio": nan}]
    assert straggler.named(rows) == [{"rank": 1, "windows": 3, "of": 5, "median_ratio": 2.0}]
    # Two slow windows are not consistent; nor is one rank slow in under half the windows.
    assert straggler.named(rows[:2] + rows[3:]) == []
    assert straggler.named(rows[:3] + [{"slowest_rank": 0, "slowest_ratio": 1.0}] * 4) == []


class _Slow(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.05)
        return x


def test_the_forward_clock_times_the_modules_forward_only():
    module = _Slow()
    clock = straggler.ForwardClock(module, torch.device("cpu"))
    module(torch.zeros(2, 4))
    time.sleep(0.1)                 # outside forward: not counted
    first = clock.take()
    assert 0.04 < first < 0.14 and clock.take() == 0.0   # 0.15 with the sleep outside
