"""`python -m workloads.train`: the Ray Train driver.

    ray job submit --working-dir . -- python -m workloads.train --smoke-test
    ray job submit --working-dir . -- python -m workloads.train \
        --model 125m --strategy fsdp --num-workers 8 --use-gpu --name gpt-125m

On a rendered cloud cluster the run lands in its run store ($RAYFLEET_STORAGE). Re-running
with the same --name and --storage-path resumes from the run's latest checkpoint (Ray Train
V2). Before `fit()` the request is checked against the cluster (fail fast rather than hang)
and a per-worker memory estimate is compared with what a worker has.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import replace

from rayfleet.entrypoint import run_main
from rayfleet.errors import CheckpointError, RayfleetError
from workloads.common import runs
from workloads.common.cli import parse_env_pairs
from workloads.common.deps import require
from workloads.common.model import GPTConfig
from workloads.common.storage import Storage, check_shared, resolve, user_path
from workloads.train import failures, hangpolicy, runinfo
from workloads.train.context import TIMING_ENV, RayContext, ray_train_marks, startup
from workloads.train.datasets import load_dataset
from workloads.train.inputs import absolute_hf_paths, loop_config, prepare_inputs
from workloads.train.loop import LoopConfig, train_loop
from workloads.train.options import PROG, RUN_NAME, TrainOptions, check_options
from workloads.train.placement import (
    AUTOSCALE_START_TIMEOUT_S,
    LaunchWatch,
    autoscaler_config,
    autoscaler_report,
    check_memory,
    check_placement,
    fitting_types,
    format_bundle,
    worker_bundle,
    worker_types,
)


def cluster_address_env(environ=os.environ) -> dict | None:
    """This cluster's GCS address for the run's actors (the job's runtime env), or None.

    Ray Train V2's PlacementGroupCleaner, a detached actor on the head, asks the state API
    about the controller every second with no address (ray/train/v2/_internal/execution/
    controller/placement_group_cleaner.py). Ray then guesses the cluster: RAY_ADDRESS, else
    /tmp/ray/ray_current_cluster, else every GCS that `ps` shows. Neither the local cluster
    (its own temp dir) nor the job's processes give it this cluster: with a second Ray
    instance on the machine the cleaner's thread dies with "Found multiple active Ray
    instances", with a stale ray_current_cluster it blocks on a dead GCS, and either way the
    controller prints a traceback after every successful run (`_stop_cleaner`: GetTimeoutError,
    "Monitor thread did not exit within 12.00 seconds"). The driver knows the address (the
    job supervisor or `rayfleet local env` set RAY_ADDRESS): the run's actors get it too."""
    address = environ.get("RAY_ADDRESS", "")
    if not re.fullmatch(r"[\w.:\[\]-]+:\d+", address):
        return None  # none, "auto", or a ray:// client address: nothing better to give
    job = json.loads(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    if "RAY_ADDRESS" in ((job.get("runtime_env") or {}).get("env_vars") or {}):
        return None  # the job set it itself (a second value would be refused as a conflict)
    return {"env_vars": {"RAY_ADDRESS": address}}


def run_name(opts: TrainOptions, hf_source: str | None) -> str:
    if opts.name:
        return opts.name
    # A job submitted with --submission-id ID is run ID: its checkpoints, metrics.csv and
    # loss.png land beside the job's logs (the head's log shipper writes <storage>/runs/ID/).
    submitted = runinfo.chosen_submission_id()
    if submitted and RUN_NAME.fullmatch(submitted):
        return submitted
    if opts.smoke_test and hf_source is None and opts.model_config is None:
        return f"smoke-{opts.strategy}"
    if opts.model_config is not None or hf_source is not None:
        base = (hf_source or opts.model_config).rstrip("/").rsplit("/", 1)[-1]
        base = re.sub(r"[^A-Za-z0-9_.-]", "-", base).strip("-.") or "model"
        return f"hf-{base}-{opts.strategy}"[:128]
    return f"gpt-{opts.model}-{opts.strategy}"


def _root_cause(err: BaseException) -> BaseException | None:
    """The first RayfleetError in a Ray exception chain (worker errors are wrapped)."""
    found = next((e for e in failures.causes(err) if isinstance(e, RayfleetError)), None)
    if found is not None:
        return found
    text = str(err)
    if "CheckpointError" in text:
        line = next((ln for ln in text.splitlines() if "CheckpointError" in ln), text)
        return CheckpointError(line.split("CheckpointError:", 1)[-1].strip())
    return None


def _train_func(config: dict) -> dict:
    # Runs on every Ray Train worker; rank 0's return value is Result.return_value.
    return train_loop(LoopConfig(**config), RayContext())


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


def _main(argv: list[str] | None) -> int:
    opts, model, env_vars = _options(argv)
    model, hf_source, tokenizer = prepare_inputs(opts, model)
    storage = resolve(opts.storage_path, endpoint=opts.s3_endpoint)
    name = run_name(opts, hf_source)
    # A corrupt latest checkpoint, or one of another run under the same name, stops the run
    # here, before Ray is started, before any worker starts and before anything in storage is
    # overwritten; a finished run says so and trains nothing.
    identity = runinfo.run_identity({**model.to_dict(), **({"source": hf_source or "fresh"}
                                                            if tokenizer else {})},
                                    opts.strategy, opts.zero_stage, opts.dataset)
    try:
        runinfo.check_run(storage, name, identity, opts.max_steps, opts.allow_changes)
    except runinfo.RunFinished as done:
        print(f"[rayfleet] {done}", flush=True)
        return 0
    startup.mark("inputs_checked")
    _require(opts, tokenizer)
    job = _connect(env_vars)
    nodes, candidates = _place(opts, model)

    # A DataLoader worker process only where the accelerator leaves host cores free (GPU).
    # On CPU it competes with the training processes for the same cores, and each batch
    # costs a socket round-trip to receive the worker's shared-memory fds (bench/: ~3% of
    # every step on 2 cores, and torchrun's loop does not pay it).
    cfg = loop_config(opts, model, hf_source, tokenizer, opts.num_workers,
                      data_workers=1 if opts.use_gpu and not opts.smoke_test else 0,
                      ray_dataset=opts.dataset is not None)
    global_batch = opts.batch_size * opts.grad_accum * opts.num_workers
    _announce(opts, model, name, cfg, global_batch)
    trainer = _trainer(opts, model, cfg, name, storage, env_vars)
    hangpolicy.install(job, name, opts.max_hangs)
    runs.record_run(storage, name, identity)
    started = time.time()
    startup.mark("fit_called")
    result = _fit(trainer, LaunchWatch(candidates, autoscaler_report), opts, storage, name, nodes,
                  job)
    summary = runinfo.summarize(result, storage, name, started, global_batch, cfg,
                                hangs=hangpolicy.verdicts(job, name))
    hangpolicy.forget(job, name)
    print(runinfo.format_summary(summary), flush=True)
    print("RAYFLEET_SUMMARY " + json.dumps(summary), flush=True)
    startup.marks.update(ray_train_marks())  # after the summary: bench/ times the run to it
    startup.emit("driver")
    return 0


def _options(argv: list[str] | None) -> tuple[TrainOptions, GPTConfig | None, dict[str, str]]:
    """The flags parsed and checked (check_options' model), the workers' --env, and the paths
    made absolute: storage and dataset here, where the user gave them (docs/house.md,
    convention 12), the model folders for the workers; storage this cluster cannot keep (a
    node's folder on a multi-node cloud cluster, a bucket path outside its prefix) refused."""
    opts = TrainOptions.parse(argv)
    model = check_options(opts)
    env_vars = parse_env_pairs(list(opts.env))
    opts = absolute_hf_paths(replace(
        opts, storage_path=user_path(opts.storage_path, "--storage-path", output=True),
        **({"dataset": user_path(opts.dataset, "--dataset", output=False)}
           if opts.dataset not in (None, "stdlib") else {})))
    check_shared(opts.storage_path, "--storage-path", autoscaler_config())
    return opts, model, env_vars


def _require(opts: TrainOptions, tokenizer: str | None) -> None:
    """Everything this run will import, on this node, once the inputs are known good and before
    anything is trained: the summary's PNG (matplotlib) would otherwise fail after the last
    step, DeepSpeed only inside a worker."""
    require({"ray.train": "ray[train]", "torch": "torch", "pyarrow": "pyarrow",
             "matplotlib": "matplotlib",
             **({"transformers": "transformers", "safetensors": "safetensors"}
                if tokenizer else {}),
             **({"peft": "peft"} if opts.lora_r else {}),
             **({"deepspeed": "deepspeed"} if opts.strategy == "deepspeed" else {})},
            f"workloads.train --strategy {opts.strategy}")


def _connect(env_vars: dict[str, str]) -> str:
    """Ray Train imported and this driver connected to its cluster; the job's id."""
    # Imported late: `--help` and bad flags answer without paying for Ray. All of Ray Train
    # that _trainer uses is imported here, so that the start-up marks time it (bench/).
    import ray
    import ray.train.torch  # noqa: F401

    startup.mark("imports_done")
    if os.environ.get(TIMING_ENV) == "1":
        env_vars.setdefault(TIMING_ENV, "1")  # rank 0 reports its start-up marks too (bench/)
    # Train V2 propagates these from the driver to its controller and workers: poll the
    # workers' result queues every second (default 2 s stalls short runs at each report),
    # and print worker output once (the print patch would echo it through the logger too).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1.0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(logging_level="ERROR", log_to_driver=True, runtime_env=cluster_address_env())
    startup.mark("ray_connected")
    return ray.get_runtime_context().get_job_id()


def _place(opts: TrainOptions, model) -> tuple[list[dict], list[str]]:
    """The run checked against the cluster (fail fast rather than hang) and its memory
    estimate against a worker's; returns the nodes running, and the autoscaler's node types
    LaunchWatch watches (none where the autoscaler can launch nothing for the run)."""
    import ray

    nodes, total = ray.nodes(), ray.cluster_resources()
    autoscaling = autoscaler_config()
    launchable = check_placement(opts, nodes, total, autoscaling)
    if launchable and failures.START_TIMEOUT_ENV not in os.environ:
        # Ray Train gives a worker group 60 s to be placed; a node the autoscaler launches
        # for it takes minutes (boot, setup commands, `ray start`).
        os.environ[failures.START_TIMEOUT_ENV] = str(AUTOSCALE_START_TIMEOUT_S)
    warning = check_memory(model, opts, nodes + launchable)
    if warning:
        print(f"[rayfleet] {warning}", flush=True)
    return nodes, fitting_types(opts, worker_types(autoscaling)) if launchable else []


def _announce(opts: TrainOptions, model, name: str, cfg: LoopConfig, global_batch: int) -> None:
    world = opts.num_workers
    print(f"[rayfleet] run {name}: {model.num_params() / 1e6:.2f}M params, strategy "
          f"{opts.strategy}, {world} workers x {format_bundle(worker_bundle(opts))}, global "
          f"batch {global_batch} seqs = {opts.batch_size} x {opts.grad_accum} accum x {world} "
          f"workers ({global_batch * model.seq_len:,} tokens), lr {opts.lr:g} x {world} = "
          f"{cfg.lr:g}", flush=True)


def _trainer(opts: TrainOptions, model, cfg: LoopConfig, name: str, storage: Storage,
             env_vars: dict[str, str]):
    """Ray Train's TorchTrainer for the run: its workers, storage, checkpoints and retries."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    datasets = None
    if opts.dataset:
        datasets = {"train": load_dataset(opts.dataset, model.seq_len, opts.corpus_bytes,
                                          opts.s3_endpoint)}
    return TorchTrainer(
        _train_func,
        train_loop_config=cfg.to_dict(),
        scaling_config=ScalingConfig(num_workers=opts.num_workers, use_gpu=opts.use_gpu,
                                     resources_per_worker=worker_bundle(opts)),
        run_config=RunConfig(
            name=name, storage_path=storage.path, storage_filesystem=storage.filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=opts.num_to_keep),
            # A finite controller_failure_limit: Ray's default (-1) retries a worker group
            # that cannot be placed (a node it needs is gone) forever, a silent hang.
            failure_config=FailureConfig(max_failures=opts.max_failures,
                                         controller_failure_limit=failures.PLACEMENT_RETRIES),
            worker_runtime_env={"env_vars": env_vars} if env_vars else None,
            logging_config=LoggingConfig(log_level="WARNING")),
        datasets=datasets,
    )


def _fit(trainer, watch: LaunchWatch, opts: TrainOptions, storage: Storage, name: str,
         nodes: list[dict], job: str):
    """trainer.fit() under the launch watch; a failure whose cause is known ends as that cause
    (one line), anything else propagates."""
    try:
        with watch:
            return trainer.fit()
    except Exception as e:
        hung = hangpolicy.verdicts(job, name)
        hangpolicy.forget(job, name)
        cause = hangpolicy.too_many(hung, opts.max_hangs) \
            or failures.explain(e, storage=storage, name=name, workers=opts.num_workers,
                                bundle=worker_bundle(opts), nodes_at_start=nodes) \
            or _root_cause(e)
        if cause is not None:
            raise cause from None
        raise


if __name__ == "__main__":
    sys.exit(main())
