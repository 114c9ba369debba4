"""Why a training run stopped, in one line (faults 4 and 5 of README's fault table).

Ray Train raises `TrainingFailedError`s whose text is a worker's or the controller's whole
traceback. The two failures a user can act on are turned into one line here:

- storage failed while a checkpoint was written or read (S3 unreachable or erroring after
  pyarrow's and Ray's own retries) -> StorageError naming the storage and how to resume;
- the workers could not be placed again after a node was lost -> ClusterError naming the
  capacity that is gone. Train V2 retries a worker-group start that times out forever by
  default (`FailureConfig.controller_failure_limit=-1`), so without a limit a run that lost a
  node it needs waits forever; the driver sets PLACEMENT_RETRIES instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

from rayfleet.errors import ClusterError, RayfleetError, StorageError
from workloads.common import runs

# Worker-group starts that may time out (or fail) in a row before the run fails. Each waits
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (Ray's default 60 s) for the placement group: long
# enough for a transient start failure to pass. On a cluster whose autoscaler may add nodes
# the driver raises it (driver.AUTOSCALE_START_TIMEOUT_S): a launch takes minutes.
PLACEMENT_RETRIES = 1
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def causes(err: BaseException) -> Iterator[BaseException]:
    """Every exception in a Ray Train error: causes, contexts, each worker's failure (Train
    wraps it in UserExceptionWithTraceback._base_exc) and the controller's."""
    seen, stack = set(), [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None),
                      getattr(e, "_base_exc", None), getattr(e, "controller_failure", None)])
        for attr in ("worker_failures", "errors"):
            val = getattr(e, attr, None)
            if isinstance(val, dict):
                stack.extend(val.values())
            elif isinstance(val, (list, tuple)):
                stack.extend(val)


def first_line(e: BaseException | str) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:240] if lines else type(e).__name__


def explain(err: BaseException, *, storage, name: str, workers: int,
            bundle: dict[str, float], nodes_at_start: list[dict]) -> RayfleetError | None:
    """One actionable error for a failed `fit()`, or None when it is none of ours."""
    chain = list(causes(err))
    storage_err = next((e for e in chain if isinstance(e, StorageError)), None)
    if storage_err is None:
        # pyarrow reports every S3 failure as an OSError "... AWS Error ..." naming the
        # bucket; the controller (writing its checkpoint snapshot) has no kit code around it
        # to translate it. The bucket check keeps a --dataset bucket's errors out of this.
        bucket = f"'{storage.path.split('/', 1)[0]}'"
        storage_err = next((e for e in chain if isinstance(e, OSError)
                            and "AWS Error" in str(e) and bucket in str(e)), None)
    if storage_err is not None:
        return StorageError(
            f"storage {storage.uri} failed during training ({first_line(storage_err)}); "
            f"{_resume_hint(storage, name)}")
    names = {type(e).__name__ for e in chain}
    if names & {"WorkerGroupStartupTimeoutError", "InsufficientClusterResourcesError"}:
        return lost_capacity(workers, bundle, name, nodes_at_start)
    return None


def _resume_hint(storage, name: str) -> str:
    try:
        path = runs.latest_checkpoint_path(storage, name)
    except OSError:  # storage still down: say what to do without naming the step
        path = None
    where = (f"the latest complete checkpoint is {runs.uri(storage, path)}"
             if path else "no complete checkpoint could be read")
    return (f"{where}; nothing newer is resumed from. Re-run the same command once storage "
            "answers to resume from it")


def lost_capacity(workers: int, bundle: dict[str, float], name: str,
                  nodes_at_start: list[dict]) -> ClusterError:
    """The run could not get its workers back: say what the cluster lost and what is left.
    A dead node's resources are no longer reported, so they come from the driver's view of
    the cluster when the run started."""
    import ray

    nodes = ray.nodes()
    had = {n.get("NodeID"): n.get("Resources") or {} for n in nodes_at_start if n.get("Alive")}
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    fits = sum(min(math.floor(res.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0)
               for res in alive)
    lost = []
    for n in nodes:
        if n.get("Alive") or n.get("NodeID") not in had:
            continue  # alive, or already dead before this run started
        what = _relevant(had[n.get("NodeID")], bundle)
        lost.append(f"node {n.get('NodeManagerAddress', '?')} ({n.get('NodeID', '?')[:8]}) "
                    f"is DEAD" + (f", it had {_fmt(what)}" if what else ""))
    lost_text = "; ".join(lost) or "no node of the run is marked dead"
    timeout = float(os.environ.get(START_TIMEOUT_ENV, 60))
    fewer = f", or with --num-workers {fits}" if 0 < fits < workers else ""
    return ClusterError(
        f"training stopped: its {workers} workers x {_fmt(bundle)} could not be placed again "
        f"({PLACEMENT_RETRIES + 1} tries of {timeout:g}s, {START_TIMEOUT_ENV}); the cluster "
        f"now fits {fits} ({lost_text}). Add the lost capacity and re-run the same command to "
        f"resume run {name!r} from its latest checkpoint{fewer}")


def _relevant(res: dict, bundle: dict) -> dict:
    return {k: res[k] for k in bundle if res.get(k)}


def _fmt(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"
