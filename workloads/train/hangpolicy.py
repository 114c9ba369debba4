"""Hung worker groups counted apart from --max-failures, with their own limit (--max-hangs), as
Ray Train counts preemptions apart (FailureConfig.max_preemption_failures).

A rank's hang watch (hangwatch.py) writes its verdict to the GCS KV before it ends its worker
group, so when Ray Train's controller decides on the group's failure the verdict is there:
HangAwarePolicy charges a failure that brought a new verdict to the hang budget and leaves
every other failure to Ray's DefaultFailurePolicy. Ray Train 2.60 builds its policy with
`create_failure_policy` in ray.train.v2.api.data_parallel_trainer and no public way to give
another: install() replaces that name for this driver's fit() (tests/unit/test_hangwatch.py
fails if a Ray upgrade moves it).

The module imports no Ray (the driver imports it with the kit's other modules, before Ray:
`--help` and bad flags answer without Ray): the policy's class is made on first use, and Ray
pickles it by value for the controller."""

from __future__ import annotations

import functools
import logging

from rayfleet.errors import ClusterError
from workloads.train import hangwatch

logger = logging.getLogger(__name__)


@functools.cache
def policy_class():
    """HangAwarePolicy: Ray Train's DefaultFailurePolicy, hangs charged to their own budget."""
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import (
        FailureDecision,
    )
    from ray.train.v2.api.exceptions import WorkerGroupError

    class HangAwarePolicy(DefaultFailurePolicy):
        def __init__(self, failure_config, job: str, run: str, max_hangs: int, kv=None):
            super().__init__(failure_config)
            self.job, self.run, self.max_hangs = job, run, max_hangs
            self.kv = kv
            self.hangs = 0

        def make_decision(self, training_failed_error) -> FailureDecision:
            if isinstance(training_failed_error, WorkerGroupError):
                kv = self.kv or hangwatch.GcsKV()
                found = len(kv.verdicts(self.job, self.run))
                if found > self.hangs:
                    self.hangs = found
                    limit = float("inf") if self.max_hangs == -1 else self.max_hangs
                    decision = (FailureDecision.RETRY if self.hangs <= limit
                                else FailureDecision.RAISE)
                    logger.warning(f"[rayfleet] hung worker group {self.hangs} (--max-hangs "
                                   f"{self.max_hangs}): {decision.value}")
                    return decision
            return super().make_decision(training_failed_error)

    return HangAwarePolicy


def install(job: str, run: str, max_hangs: int) -> None:
    """This driver's trainers decide on failures with HangAwarePolicy."""
    from ray.train.v2.api import data_parallel_trainer

    policy = policy_class()

    def create_failure_policy(failure_config):
        return policy(failure_config, job, run, max_hangs)

    data_parallel_trainer.create_failure_policy = create_failure_policy


def verdicts(job: str, run: str, kv=None) -> list[dict]:
    """The run's hang verdicts in this job, oldest group first ([] when the KV cannot be
    read: the summary then says nothing of hangs rather than fail a finished run)."""
    try:
        return (kv or hangwatch.GcsKV()).verdicts(job, run)
    except Exception:
        return []


def forget(job: str, run: str, kv=None) -> None:
    """The run's records and verdicts gone from the GCS once the driver has read them (the
    store is the cluster's, and outlives the job); a failure to remove them is not the run's."""
    try:
        (kv or hangwatch.GcsKV()).forget(job, run)
    except Exception:
        pass


def too_many(found: list[dict], max_hangs: int) -> ClusterError | None:
    """The run's failure in one line when its hangs passed --max-hangs."""
    if max_hangs == -1 or len(found) <= max_hangs:
        return None
    return ClusterError(
        f"training stopped: its worker group hung {len(found)} times, more than --max-hangs "
        f"{max_hangs}; the last: {hangwatch.describe(found[-1])}. Look at that rank's node "
        f"(rayfleet status), then re-run the same command to resume from the latest "
        f"checkpoint")
