"""Spot notice and a Capacity Block's end (docs/faults.md, faults 7 and 12) on a real two-node
local Ray cluster: the spot agent (rayfleet/agents/spot.py) watching a stand-in IMDSv2 server
on loopback (and, on a block's node, a stand-in EC2 for the block's end), a real training run
on the second node, the notice arriving mid-interval, the node lost as EC2 takes it back."""

import re
import subprocess
import time
import types

import pytest

from bench import spot_notice
from bench.spot_notice import run_scenario
from rayfleet.agents.spot import parse_time_ms

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]


def _with_max_failures(n: int, trains: list):
    """bench.spot_notice's `subprocess`, the training command given --max-failures n (the
    benchmark runs the kit's default, 3); each training command is appended to `trains`."""
    def popen(args, **kw):
        if "workloads.train" in args:
            args = [*args, "--max-failures", str(n)]
            trains.append(args)
        return subprocess.Popen(args, **kw)
    return types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})


def _node_taken_at_the_notices_time(monkeypatch, in_s: float) -> None:
    """As EC2 does: the stand-in's notice (or the block's termination start) names a time
    in_s ahead (not 2 minutes, not 30), and the node is killed once that time has passed
    (run_scenario kills it right after reading Ray's draining nodes). Ray counts a drained
    node's loss as a preemption only from its deadline on; before it, the loss is an ordinary
    failure."""
    interrupt, draining = spot_notice.StandInImds.interrupt, spot_notice.draining_nodes
    end_block = spot_notice.StandInEc2.end_block
    deadline = {}

    def soon(self, action="terminate", in_s_=None):
        deadline["at"] = interrupt(self, action, in_s=in_s)
        return deadline["at"]

    def block_soon(self, in_s_=None):
        deadline["at"] = end_block(self, in_s=in_s)
        return deadline["at"]

    def draining_then_the_deadline(env):
        nodes = draining(env)
        time.sleep(max(0.0, parse_time_ms(deadline["at"]) / 1000 - time.time()) + 1)
        return nodes

    monkeypatch.setattr(spot_notice.StandInImds, "interrupt", soon)
    monkeypatch.setattr(spot_notice.StandInEc2, "end_block", block_soon)
    monkeypatch.setattr(spot_notice, "draining_nodes", draining_then_the_deadline)


# What the training log says at the notice's checkpoint, by the notice's source.
SAYS = {"spot": "[rayfleet] spot notice on", "block": "[rayfleet] Capacity Block end on"}


@pytest.mark.parametrize("trigger", ["spot", "block"])
def test_spot_notice_checkpoints_at_the_next_step_drains_and_resumes_from_it(
        two_node_cluster, tmp_path, monkeypatch, trigger):
    """1 worker on the second node, no regular checkpoint before the end of the run. Once step
    3 is logged, the IMDS starts answering the interruption notice ("spot"), or the node's
    Capacity Block, read from EC2 by the agent, now ends 30 minutes and 8 s from now ("block":
    EC2 terminates a block's instances from 30 minutes before its end): the agent publishes
    the notice and drains its node through Ray (reason preemption, the notice's deadline: the
    instance-action's time, or the block's termination start); the worker checkpoints at its
    next step boundary; Ray Train registers it. At the deadline the node is SIGKILLed; the run
    resumes from exactly that checkpoint on the head and finishes, with --max-failures 0: the
    lost node is counted as a preemption, not as a failure."""
    # The run goes on well past the kill: the checks between the notice and the kill (the
    # registration, the drain, Ray's node state) take seconds on a loaded machine, and a run
    # that ends in them finishes on the doomed node before its loss is noticed.
    notice_at, max_steps = 3, 50
    every = 1000   # no regular checkpoint: the one resumed from can only be the notice's
    trains: list = []
    monkeypatch.setattr(spot_notice, "subprocess", _with_max_failures(0, trains))
    # The notice's time 7-8 s ahead (whole seconds): its checkpoint is registered well before
    # (1-3 s here), and the doomed worker, training on until then at 0.3-0.8 s a step, stays
    # short of max_steps.
    _node_taken_at_the_notices_time(monkeypatch, in_s=8)
    r = run_scenario(two_node_cluster, tmp_path, notice_at=notice_at, kill_at=notice_at + 1,
                     max_steps=max_steps, checkpoint_every=every, trigger=trigger)
    logs = f"{r['train_log'][-4000:]}\n--- agent ---\n{r['agent_log'][-2000:]}"
    # The agent found the second node (by its raylet socket), never the head.
    assert f"this node is {r['node']}" in r["agent_log"], logs
    # The notice's checkpoint lands after the notice, at a step boundary of its own.
    assert notice_at <= r["notice_step_logged"] < r["checkpoint_step"] < max_steps, logs
    assert r["registered_step"] == r["checkpoint_step"], logs
    assert r["train_log"].count(SAYS[trigger]) == 1, logs  # handled once
    # Drained: the agent says so, and Ray's own node state has the node draining with the
    # notice's deadline (the instance-action's time, to the millisecond).
    assert r["agent_drained"] == r["node"], logs
    assert r["draining"].get(r["node"]) == parse_time_ms(r["deadline"]), (r["draining"], logs)
    assert r["agent_log"].count(f"drained (reason preemption, deadline {r['deadline']})") == 1, \
        logs
    # IMDSv2: every metadata read carried the session token.
    assert r["imds_unauthorized"] == 0
    if trigger == "block":   # the block's end, as EC2 gave it, and the drain it set
        assert r["ec2_calls"] > 1, r
        assert re.search(rf"Capacity Block {spot_notice.StandInEc2.BLOCK} ends at \S+; this "
                         rf"node drains at ", r["agent_log"]), logs
    # The lost worker never reached a later checkpoint (the final step's), so the run resumes
    # from the notice's step, not from scratch, and finishes with no failure allowed.
    assert r["lost_at"] < max_steps, logs
    assert r["resumed_from"] == r["checkpoint_step"], logs
    assert len(trains) == 1 and trains[0][-2:] == ["--max-failures", "0"], trains
    assert r["returncode"] == 0, logs
    assert "RAYFLEET_SUMMARY" in r["train_log"], logs
