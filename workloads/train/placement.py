"""What the cluster can hold for a run: the worker's bundle, the nodes running and those the
autoscaler may launch, the fail-fast resource check, the per-worker memory estimate, and the
watch that ends a run no node type can launch for."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from rayfleet import capacity, catalog
from rayfleet.agents import fallover
from rayfleet.clusteryaml import ClusterYaml
# Moved to the core (workloads.common reads it too); the driver's name for it.
from rayfleet.clusteryaml import autoscaler_config as autoscaler_config
from rayfleet.errors import ClusterError
from rayfleet.facts import BOOTSTRAP_CONFIG
from workloads.common.model import GPTConfig
from workloads.train.options import PROG, TrainOptions


def worker_bundle(opts: TrainOptions) -> dict[str, float]:
    bundle = {"CPU": opts.cpus_per_worker}
    if opts.use_gpu:
        bundle["GPU"] = 1.0
    if opts.resources_per_worker:
        bundle.update(json.loads(opts.resources_per_worker))
    return bundle


# The head's autoscaling config (clusteryaml.autoscaler_config reads it).
AUTOSCALER_CONFIG = BOOTSTRAP_CONFIG
# How long a run waits for its workers to be placed when the autoscaler may add the nodes.
AUTOSCALE_START_TIMEOUT_S = 900


def worker_types(cfg: dict) -> dict[str, dict]:
    """The autoscaler's worker node types that may launch at all, in the YAML's order, by name
    -> their declared resources."""
    return {t.name: t.resources for t in ClusterYaml(cfg).workers() if (t.max_workers or 0) > 0}


def launchable_nodes(cfg: dict) -> list[dict]:
    """The workers the cluster's autoscaler may still start, as ``ray.nodes()`` entries: one
    per node the head's autoscaling config lets each worker type have at once, in the YAML's
    order (ClusterYaml.capacity; none on a cluster that does not autoscale). A job asking for
    what only such a node has must wait for the autoscaler, not fail."""
    cluster = ClusterYaml(cfg)
    # Ray writes max_workers into every config it prepares; a config without it launches
    # nothing here.
    return [{"Alive": True, "Resources": t.resources, "Launchable": t.name}
            for t, n in cluster.capacity(cap=cluster.max_workers or 0) for _ in range(n)]


def fitting_types(opts: TrainOptions, types: dict[str, dict]) -> list[str]:
    """The autoscaler's node types (:func:`worker_types`) that could hold one of this run's
    workers, in the cluster YAML's order: every one of them, not only those the cluster's
    max_workers leaves room for in :func:`launchable_nodes` (p4de is a fallback for p4d even
    when max_workers is spent on p4d's spot and on-demand types)."""
    bundle = worker_bundle(opts)
    return [name for name, res in types.items()
            if all(res.get(k, 0) >= v for k, v in bundle.items() if v > 0)]


def _stop_run(line: str) -> None:
    """End the driver with ``line``, as run_main ends it on a ClusterError (one line, exit 2).

    Not through the main thread: Ray Train V2 owns the driver's SIGINT (its handler aborts the
    run and the process exits 1, saying nothing of why). Nothing of the run exists yet to save:
    no worker was ever placed, so no checkpoint is being written; Ray ends the job's actors
    with its driver."""
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(ClusterError.exit_code)


class LaunchWatch:
    """While the run waits for nodes the autoscaler must launch, read the autoscaler's report
    (the GCS KV, rayfleet/capacity.py) every ``poll_s``; when every node type that could hold
    a worker has failed its last launch (EC2: no capacity, quota, ...), and none is running or
    launching, end the run with that in one line (``on_fail``), instead of Ray Train waiting
    out its placement timeout (15 min) while the autoscaler retries."""

    def __init__(self, candidates: list[str], read, poll_s: float = 5.0, on_fail=_stop_run):
        import threading

        self.candidates, self.read, self.poll_s = candidates, read, poll_s
        self.on_fail = on_fail
        self.line: str | None = None
        # Only launches tried for this run count (capacity.all_failing's `since`).
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayfleet-launch-watch",
                                        daemon=True)

    def __enter__(self) -> LaunchWatch:
        if self.candidates:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def check(self) -> str | None:
        rows = capacity.all_failing(capacity.report(self.read()), self.candidates,
                                    since=self.started)
        return capacity.failing_line(rows) if rows else None

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.poll_s):
            try:
                line = self.check()
            except Exception as e:   # noqa: BLE001  (a report it cannot read is no verdict)
                if not warned:   # but said, once: the run then waits out Ray Train's timeout
                    warned = True
                    print(f"[rayfleet] cannot read the autoscaler's report ("
                          f"{type(e).__name__}: {e}); a type that cannot launch is not "
                          "noticed, the run waits on Ray Train's placement timeout",
                          flush=True)
                continue
            if line and not self._stop.is_set():
                self.line = line
                self.on_fail(line)
                return


def autoscaler_report() -> bytes | None:
    """The autoscaler's last report, from the GCS this driver is connected to."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(DEBUG_AUTOSCALING_STATUS)


def check_placement(opts: TrainOptions, nodes: list[dict], total: dict,
                    autoscaling: dict) -> list[dict]:
    """check_resources against the nodes running (``ray.nodes()``, ``total``) and those the
    autoscaler may still launch for this run; returns the latter."""
    launchable = launchable_nodes(autoscaling)
    if not fallover.wants_accelerator(worker_bundle(opts)):
        # The head's scorer starts no GPU worker for CPU-only work (rayfleet/agents/
        # fallover.py): such a run fits what is running, or nothing.
        launchable = [n for n in launchable if not n["Resources"].get("GPU")]
    room = dict(total)
    for n in launchable:
        for k, v in n["Resources"].items():
            room[k] = room.get(k, 0) + v
    check_resources(opts, nodes + launchable, room)
    return launchable


def check_resources(opts: TrainOptions, nodes: list[dict], total: dict) -> None:
    """Fail in seconds, naming what is missing, when no placement can exist (instead of
    Ray Train waiting forever for resources)."""
    bundle = worker_bundle(opts)
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    for key, need in bundle.items():
        if need > 0 and total.get(key, 0) == 0:
            what = {"GPU": "GPUs (use_gpu)", "CPU": "CPUs"}.get(key, f"resource {key!r}")
            raise ClusterError(
                f"the job asks for {opts.num_workers} workers with {need:g} {what} each, "
                f"but the cluster has no {key} at all; drop --use-gpu or add GPU nodes"
                if key == "GPU" else
                f"the job asks for {key}={need:g} per worker, but no node has {key}")
    fits = sum(min(math.floor(res.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0)
               for res in alive)
    if fits < opts.num_workers:
        largest = max(alive, key=lambda r: r.get("GPU", 0) * 1000 + r.get("CPU", 0), default={})
        have = ", ".join(f"{k} {largest.get(k, 0):g}" for k in bundle)
        totals = ", ".join(f"{k} {total.get(k, 0):g}" for k in bundle)
        raise ClusterError(
            f"the job needs {opts.num_workers} workers x {format_bundle(bundle)} but the "
            f"cluster fits only {fits} (cluster total: {totals}; largest node: {have}); lower "
            "--num-workers or the per-worker resources, or add nodes")


def format_bundle(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def memory_estimate_bytes(model: GPTConfig, opts: TrainOptions) -> dict[str, float]:
    """Per-worker bytes: parameters, gradients, optimizer state (AdamW: 2 fp32 moments)
    for the strategy, plus activations (Korthikanti et al. 2022: ~34·s·b·h per layer)."""
    n, w = model.num_params(), opts.num_workers
    # Gradients and optimizer state only for what trains (LoRA: the adapters).
    t = model.trainable_params() if hasattr(model, "trainable_params") else n
    p, g, o = 4.0 * n, 4.0 * t, 8.0 * t  # fp32 master weights, grads, Adam moments
    if opts.strategy == "fsdp":
        p, g, o = p / w, g / w, o / w
    elif opts.strategy == "deepspeed":
        g, o = g / w, o / w
        if opts.zero_stage == 3:
            p = p / w
        if opts.offload:
            o = 0.0  # on the host instead
        if opts.offload_params:
            p = 0.0
    act = 34.0 * model.seq_len * opts.batch_size * model.d_model * model.n_layer
    if opts.activation_checkpointing:
        act /= 17  # only each layer's input (2·s·b·h) is kept; the rest is recomputed
    if opts.use_gpu:
        act /= 2  # bf16 activations
    return {"params": p, "grads": g, "optimizer": o, "activations": act,
            "total": p + g + o + act}


def check_memory(model: GPTConfig, opts: TrainOptions, nodes: list[dict]) -> str | None:
    est = memory_estimate_bytes(model, opts)
    if opts.use_gpu:
        have = opts.gpu_memory_gib
        if have is None:
            kinds = [k.split(":", 1)[1] for n in nodes for k in n.get("Resources", {})
                     if k.startswith("accelerator_type:")]
            have = max((catalog.gpu_memory_gib(k) for k in kinds), default=0) or None
        where = "GPU"
        have_b = have * 2**30 if have else None
    else:
        alive = [n["Resources"] for n in nodes if n.get("Alive")]
        per_node = [r.get("memory", 0) / max(1, math.floor(r.get("CPU", 1) / opts.cpus_per_worker))
                    for r in alive]
        have_b, where = (max(per_node) if per_node else None), "host"
    if not have_b:
        return None
    if est["total"] > 0.9 * have_b:
        return (f"warning: estimated {est['total'] / 2**30:.1f} GiB per worker "
                f"(params {est['params'] / 2**30:.1f}, grads {est['grads'] / 2**30:.1f}, "
                f"optimizer {est['optimizer'] / 2**30:.1f}, activations "
                f"{est['activations'] / 2**30:.1f}) vs {have_b / 2**30:.1f} GiB of {where} "
                f"memory: expect OOM; try --strategy fsdp, deepspeed --zero-stage 3 "
                f"--offload, or a smaller --batch-size")
    return None
