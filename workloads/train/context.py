"""Contexts that run `loop.train_loop`: under Ray Train, or under `torchrun` / one process."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from rayfleet.errors import StorageError
from workloads.common import runs
from workloads.train import hangwatch, preempt
from workloads.train.telemetry import Telemetry

# RAYFLEET_TIMING=1: the driver and rank 0 each print one `RAYFLEET_TIMING {json}` line with
# the wall-clock time (time.time(), so processes on one machine compare) of each start-up
# stage they passed; bench.train_overhead reads them. Unset, nothing is printed.
TIMING_ENV = "RAYFLEET_TIMING"
TIMING_TAG = "RAYFLEET_TIMING"


def process_start_time() -> float | None:
    """When this process was created, as time.time(): /proc/self/stat's start tick against
    /proc/uptime (psutil's create_time rounds the boot time to whole seconds, so its value
    can be up to 1 s off from time.time())."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")


class Startup:
    """This process's start-up marks: the first time each named stage was reached. A mark is
    one dict write, so the loop always takes them; `emit` prints only with RAYFLEET_TIMING=1."""

    def __init__(self):
        self.marks: dict[str, float] = {}
        self.emitted = False

    def mark(self, stage: str) -> None:
        if stage not in self.marks:
            self.marks[stage] = time.time()

    def emit(self, side: str) -> None:
        if self.emitted or os.environ.get(TIMING_ENV) != "1":
            return
        self.emitted = True
        print(f"{TIMING_TAG} " + json.dumps({"side": side, "process_start": process_start_time(),
                                            **self.marks}), flush=True)


startup = Startup()

# Ray Train's own start-up stages, from Ray's task events: (mark, task, event reached, by the
# first or the last of the tasks of that name, e.g. of every worker).
RAY_TRAIN_STAGES = [
    ("ray_controller_start", "TrainController.__init__", "RUNNING", min),
    ("ray_controller_ready", "TrainController.__init__", "FINISHED", min),
    ("ray_workers_start", "RayTrainWorker.__init__", "RUNNING", min),
    ("ray_workers_ready", "RayTrainWorker.__init__", "FINISHED", max),
    ("ray_train_context_ready", "RayTrainWorker.init_train_context", "FINISHED", max),
    ("ray_process_group_ready", "execute._setup_torch_process_group", "FINISHED", max),
]


def ray_train_marks(job_id: str | None = None) -> dict[str, float]:
    """With RAYFLEET_TIMING=1, when this job's Train controller and workers passed each of
    RAY_TRAIN_STAGES (Ray's state API, so a cluster with its dashboard); {} otherwise."""
    if os.environ.get(TIMING_ENV) != "1":
        return {}
    try:
        import ray
        from ray.util.state import list_tasks

        job_id = job_id or ray.get_runtime_context().get_job_id()
        tasks = list_tasks(filters=[("job_id", "=", job_id)], detail=True, limit=10_000,
                           raise_on_missing_output=False)
    except Exception:  # no state API here: the kit's own marks still say most of it
        return {}
    return ray_marks_of_tasks(tasks)


def ray_marks_of_tasks(tasks: list) -> dict[str, float]:
    marks = {}
    for mark, name, state, pick in RAY_TRAIN_STAGES:
        times = [e["created_ms"] / 1000 for t in tasks if t.get("name") == name
                 for e in t.get("events") or [] if e.get("state") == state]
        if times:
            marks[mark] = pick(times)
    return marks


class RayContext:
    """ray.train's worker context: Ray has already set up the process group."""

    def __init__(self):
        import ray.train
        import ray.train.torch

        self._train = ray.train
        self._torch = ray.train.torch
        tctx = ray.train.get_context()
        self.rank = tctx.get_world_rank()
        self.local_rank = tctx.get_local_rank()
        self.world_size = tctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self._telemetry = None
        # Train V2 logs "Reporting training result N: TrainingReport(...)" at INFO from every
        # rank at every checkpoint, through a logger named after its own file: the kit prints
        # its own one-line progress, so keep that one to warnings.
        try:
            from ray.train.v2._internal.execution import context as v2_context

            logging.getLogger(v2_context.__file__).setLevel(logging.WARNING)
        except ImportError:   # another Ray layout: its messages stay, nothing breaks
            pass

    def prepare_ddp(self, model):
        return self._torch.prepare_model(model)  # device placement + DDP when world > 1

    def prepare_data_loader(self, loader: DataLoader) -> DataLoader:
        # Adds a DistributedSampler and moves batches to the device.
        return self._torch.prepare_data_loader(loader)

    def dataset_shard(self):
        return self._train.get_dataset_shard("train")

    @contextlib.contextmanager
    def latest_checkpoint(self):
        # Ray Train V2 hands back the run's latest registered checkpoint: after a worker
        # failure (FailureConfig) and when the same run name + storage path is run again.
        checkpoint = self._train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with contextlib.ExitStack() as stack:
            try:
                d = stack.enter_context(checkpoint.as_directory())
            except OSError as e:
                # pyarrow's OSError for an unreachable or failing S3: one line to show.
                raise StorageError(f"could not read checkpoint {checkpoint.path} from "
                                   f"storage: {_first_line(e)}") from e
            yield Path(d)

    def spot_notices(self) -> preempt.Notices:
        return preempt.for_ray_worker(self.rank, self.world_size)

    def hang_watch(self, settings: hangwatch.Settings | None) -> hangwatch.Watch:
        return hangwatch.for_ray_worker(self.rank, self.world_size,
                                        self._train.get_context().get_experiment_name(),
                                        settings)

    def report(self, metrics: dict, checkpoint_dir: Path | None) -> None:
        checkpoint = (self._train.Checkpoint.from_directory(str(checkpoint_dir))
                      if checkpoint_dir is not None else None)
        try:
            self._train.report(metrics, checkpoint=checkpoint)
        except OSError as e:
            # Raised after pyarrow's and Ray's own upload retries. The checkpoint is not
            # registered, so a re-run resumes from the previous one, never from this partial
            # upload.
            raise StorageError(f"could not write the step {metrics.get('step')} checkpoint "
                               f"to storage: {_first_line(e)}") from e

    def export_metrics(self, metrics: dict) -> None:
        # Rank 0 only: the loss is already averaged over ranks and tokens/s counts them all.
        if self.rank != 0:
            return
        if self._telemetry is None:
            self._telemetry = Telemetry(self._train.get_context().get_experiment_name())
        self._telemetry.export(metrics)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:240] if lines else type(e).__name__


class TorchrunContext:
    """torch.distributed from torchrun's env vars (RANK, WORLD_SIZE, LOCAL_RANK), or a
    single process when they are absent. Checkpoints go to a local folder; `report` keeps
    the metrics for the caller."""

    def __init__(self, checkpoint_root: str | Path, keep: int = 2):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            startup.mark("process_group_ready")  # under Ray Train, done before the loop
        self.root = Path(checkpoint_root)
        self.keep = keep
        self.reports: list[dict] = []

    def prepare_ddp(self, model):
        model = model.to(self.device)
        if self.world_size > 1:
            ids = [self.local_rank] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def prepare_data_loader(self, loader: DataLoader) -> DataLoader:
        if self.world_size == 1:
            return loader
        return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=True,
                          sampler=DistributedSampler(loader.dataset, shuffle=True),
                          num_workers=loader.num_workers,
                          persistent_workers=loader.num_workers > 0,
                          pin_memory=self.device.type == "cuda")

    def dataset_shard(self):
        raise RuntimeError("Ray Data shards exist only under Ray Train")

    def spot_notices(self) -> preempt.Notices:
        return preempt.NONE  # outside Ray: no spot agent publishes to this run

    def hang_watch(self, settings: hangwatch.Settings | None) -> hangwatch.Watch:
        return hangwatch.NONE  # torchrun's own elastic agent watches its ranks

    def _checkpoints(self) -> list[Path]:
        return runs.local_checkpoints(self.root)

    @contextlib.contextmanager
    def latest_checkpoint(self):
        found = self._checkpoints()
        yield found[-1] if found else None

    def export_metrics(self, metrics: dict) -> None:
        pass  # no Ray here: the log lines and metrics.csv carry them

    def report(self, metrics: dict, checkpoint_dir: Path | None) -> None:
        self.reports.append(metrics)
        if checkpoint_dir is None:
            return
        # Every rank copies its part into the shared folder, like Ray's merge.
        import shutil

        dest = self.root / f"{runs.CHECKPOINT_PREFIX}{metrics['step']:09d}"
        shutil.copytree(checkpoint_dir, dest, dirs_exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        if self.rank == 0:
            for old in self._checkpoints()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
