"""Spot interruption notice (issue 15) on a real two-node local Ray cluster: the spot agent
(rayfleet/agents/spot.py) watching a stand-in IMDSv2 server on loopback, a real training run
on the second node, the notice arriving mid-interval, the node lost as EC2 takes it back."""

import pytest

from bench.spot_notice import run_scenario

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]


def test_spot_notice_checkpoints_at_the_next_step_drains_and_resumes_from_it(
        two_node_cluster, tmp_path):
    """1 worker on the second node, a checkpoint every 20 steps. The IMDS starts answering the
    interruption notice once step 3 is logged: the agent publishes it and drains its node
    through Ray (reason preemption, the notice's deadline); the worker checkpoints at its next
    step boundary, well before the interval's; Ray Train registers it. The node is then
    SIGKILLed; the run resumes from that checkpoint on the head and finishes."""
    # The run goes on well past the kill: the checks between the notice and the kill (the
    # registration, the drain, Ray's node state) take seconds on a loaded machine, and a run
    # that ends in them finishes on the doomed node before its loss is noticed.
    notice_at, every = 3, 20
    r = run_scenario(two_node_cluster, tmp_path, notice_at=notice_at, kill_at=notice_at + 1,
                     max_steps=every + 10, checkpoint_every=every)
    logs = f"{r['train_log'][-4000:]}\n--- agent ---\n{r['agent_log'][-2000:]}"
    # The agent found the second node (by its raylet socket), never the head.
    assert f"this node is {r['node']}" in r["agent_log"], logs
    # Mid-interval: the notice's checkpoint lands after the notice, not at the interval's
    # step 20 (a worker learns within the agent's 0.5 s poll + its own 1 s read; steps here
    # take 0.3-0.8 s).
    assert notice_at <= r["notice_step_logged"] < r["checkpoint_step"] < every, logs
    assert r["notice_to_checkpoint_s"] < 10, logs
    assert r["registered_step"] == r["checkpoint_step"], logs
    assert r["train_log"].count("[rayfleet] spot notice on") == 1, logs  # handled once
    # Drained: the agent says so, and Ray's own node state has the node draining with the
    # notice's deadline.
    assert r["agent_drained"] == r["node"], logs
    assert r["node"] in r["draining"], (r["draining"], logs)
    assert r["agent_log"].count("drained (reason preemption") == 1, logs
    # IMDSv2: every metadata read carried the session token.
    assert r["imds_unauthorized"] == 0
    # The resumed run continues from the notice's checkpoint (or a later one, never from an
    # older one or from scratch) and finishes.
    assert r["resumed_from"] >= r["checkpoint_step"], logs
    assert r["returncode"] == 0, logs
    assert "RAYFLEET_SUMMARY" in r["train_log"], logs
