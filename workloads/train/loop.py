"""The per-worker training loop: plain PyTorch behind a small context, so the same loop runs
under Ray Train and under torchrun.

`train_loop(cfg, ctx)` knows nothing about Ray. The context supplies rank, world size,
device, data-loader preparation, the latest checkpoint and `report`; `context.RayContext`
implements it with ray.train, `context.TorchrunContext` with torch.distributed env vars, so
the same loop runs under Ray Train, under `torchrun` (GPU checks, overhead benchmarks) and
in one process. The strategy (DDP, FSDP2, DeepSpeed) is the engine's, from
workloads/train/strategies/.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from rayfleet import catalog
from workloads.common import runs
from workloads.common.corpus import stdlib_corpus
from workloads.common.model import GPT, GPTConfig
from workloads.train import hangwatch, hf_model, straggler, strategies
from workloads.train.context import startup
from workloads.train.data import ByteBlocks, ParquetRows, split_batch
from workloads.train.engine import Engine
from workloads.train.loopconfig import Context, LoopConfig
from workloads.train.rng import load_rng, save_rng
from workloads.train.strategies.deepspeed import deepspeed_and_config

startup.mark("kit_imported")  # in a worker: torch and the kit's modules are loaded

STRATEGIES = tuple(strategies.REGISTRY)
# The names this module had before the engine and the strategies moved out (bench.hf_memory
# wraps _Engine.__init__ and imports DeepSpeed through _deepspeed).
_Engine = Engine
_deepspeed = deepspeed_and_config


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Linear warmup then cosine decay to 10% (a pure function of step: the schedule's state
    is the step, which every checkpoint records)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return catalog.peak_bf16_flops(torch.cuda.get_device_name(device))


def _batches(loader, epoch: int, skip: int, seed: int = 0) -> Iterator:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        # Distributed samplers shuffle by epoch: without this every epoch repeats one order.
        sampler.set_epoch(epoch)
    elif getattr(sampler, "generator", None) is not None:
        # One process: the order is a function of (seed, epoch) as well, so a resumed run
        # skips the batches it already trained on, not some other permutation's.
        sampler.generator.manual_seed(seed * 1_000_003 + epoch)
    for i, batch in enumerate(loader):
        if i >= skip:
            yield batch


class _WaitTimer:
    """Seconds the loop spends blocked on `next()` of its batch iterator: the data-wait share
    of step time (how far preprocessing, e.g. a streaming Ray Data shard, falls behind)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, batches) -> Iterator:
        it = iter(batches)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                self.seconds += time.perf_counter() - t
                return
            self.seconds += time.perf_counter() - t
            yield batch


def prepare(cfg: LoopConfig, ctx: Context, full_copy_per_rank: bool = False):
    """(the model's config, the engine holding the model wrapped for cfg.strategy) on this rank.

    A Hugging Face model is loaded without a full copy in every rank where the strategy shards
    it: with FSDP2 rank 0 builds it (from_pretrained, or fresh weights) and the others on the
    meta device, getting their shards from rank 0 (hf_io.scatter_into_shards); with ZeRO-3 it
    is built inside deepspeed.zero.Init, each rank holding its partition (hf_model.build).
    DDP keeps a full copy per rank, as it trains one. `full_copy_per_rank`: every rank builds
    the whole model first, as before (bench.hf_memory's "before" row)."""
    if not hf_model.is_hf(cfg.model):
        model_cfg = GPTConfig.from_dict(cfg.model)
        return model_cfg, _Engine(cfg, ctx, GPT(model_cfg))
    model_cfg = hf_model.HFSpec.from_dict(cfg.model)
    sharded = (not full_copy_per_rank and ctx.world_size > 1 and dist.is_available()
               and dist.is_initialized())
    kw, from_rank0 = strategies.get(cfg.strategy).build_kwargs(cfg, ctx, sharded)
    # Building draws random numbers on some ranks and not on others (meta, or weights that
    # come from elsewhere): every rank goes on from the same RNG state, as the seed left it.
    with torch.random.fork_rng(devices=[]):
        model = hf_model.build(cfg.hf_source, model_cfg.config, cfg.activation_checkpointing,
                               cfg.s3_endpoint, lora=model_cfg.lora, **kw)
    return model_cfg, _Engine(cfg, ctx, model, from_rank0=from_rank0)


# ------------------------------------------------------------------ the loop, step by step

@dataclass
class _Progress:
    """Where the run is (what a checkpoint records) and what it has logged."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    history: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


class _Window:
    """The steps since the last logged one: their losses, wall time and data wait."""

    def __init__(self):
        self.t_last, self.steps, self.losses = time.perf_counter(), 0, []
        self.wait = _WaitTimer()

    def restart(self) -> None:
        self.t_last, self.steps = time.perf_counter(), 0
        self.wait.seconds = 0.0


def _resume(cfg: LoopConfig, ctx: Context, engine: Engine) -> _Progress:
    """Where ctx's latest checkpoint left off (its state loaded into `engine`), or the start."""
    pos = _Progress()
    with ctx.latest_checkpoint() as d:
        if d is not None:
            marker = runs.validate(d, expect_strategy=cfg.strategy)
            state = json.loads((d / runs.TRAINER_STATE).read_text())
            engine.load(d)
            load_rng(d, ctx.rank)
            pos.step, pos.epoch = state["step"], state["epoch"]
            pos.batch_in_epoch = state["batch_in_epoch"]
            pos.history = runs.read_history((d / runs.METRICS).read_text()) \
                if (d / runs.METRICS).exists() else []
            for h in pos.history:
                # Checkpoints from before the data-wait and straggler metrics: unknown, not
                # zero (and the CSV writer needs every row to carry the same columns).
                for column in ("data_wait_frac", *straggler.COLUMNS):
                    h.setdefault(column, float("nan"))
            if ctx.rank == 0:
                print(f"[rayfleet] resumed from step {marker['step']} ({d.name})", flush=True)
    return pos


def _epoch_source(cfg: LoopConfig, ctx: Context, seq_len: int) -> Callable[[int, int], Any]:
    """epoch_batches(epoch, skip): the batches of one epoch, past the first `skip`."""
    if cfg.use_ray_dataset:
        shard = ctx.dataset_shard()

        def epoch_batches(epoch: int, skip: int):
            # Streaming: Ray Data preprocesses while this loop trains; position inside an
            # epoch is not replayed on resume (the shard is a stream).
            return shard.iter_torch_batches(batch_size=cfg.batch_size, drop_last=True)
        return epoch_batches
    dataset = (ParquetRows(cfg.dataset_path) if cfg.dataset_path else
               ByteBlocks(stdlib_corpus(cfg.corpus_bytes), seq_len))
    loader = ctx.prepare_data_loader(DataLoader(
        dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator(), num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0))

    def epoch_batches(epoch: int, skip: int):
        return _batches(loader, epoch, skip, cfg.seed)
    return epoch_batches


@dataclass
class _Run:
    """What every step of one run needs."""
    cfg: LoopConfig
    ctx: Context
    engine: Engine
    model_cfg: Any
    pos: _Progress
    window: _Window
    notices: Any
    watch: hangwatch.Watch
    forward: straggler.ForwardClock
    tokens_per_step: int
    flops_per_token: float
    peak: float | None


def _log(run: _Run) -> None:
    """Measure the window's steps into run.pos.metrics and history; rank 0 prints them."""
    cfg, ctx, pos, window = run.cfg, run.ctx, run.pos, run.window
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - window.t_last
    dt = elapsed / window.steps
    loss = torch.stack(window.losses).mean()
    # Each rank's forward seconds ride in the loss's all_reduce: [loss, rank 0's, rank 1's..]
    summed = torch.zeros(1 + ctx.world_size, dtype=loss.dtype, device=loss.device)
    summed[0], summed[1 + ctx.rank] = loss, run.forward.take()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    loss = summed[0] / ctx.world_size
    tps = run.tokens_per_step / dt
    pos.metrics = metrics = {
        "step": pos.step, "epoch": pos.epoch, "loss": round(loss.item(), 5),
        "lr": lr_at(pos.step - 1, cfg), "step_time_s": round(dt, 5),
        "tokens_per_s": round(tps, 1),
        "data_wait_frac": round(min(1.0, window.wait.seconds / elapsed), 5),
        "mfu": round(run.flops_per_token * tps / (run.peak * ctx.world_size), 4)
        if run.peak else 0.0,
        **straggler.slowest(summed[1:].tolist())}
    pos.history.append(metrics)
    ctx.export_metrics(metrics)
    window.losses = []
    if ctx.rank == 0:
        print(f"[rayfleet] step {pos.step}/{cfg.max_steps} loss {metrics['loss']:.4f} "
              f"{tps:,.0f} tok/s {dt * 1000:.0f} ms/step", flush=True)
        startup.mark("first_logged_step")
        startup.emit("rank0")


def _checkpoint(run: _Run, final: bool) -> None:
    """Save the run at this step and report it (with the metrics) to the context."""
    cfg, ctx, pos = run.cfg, run.ctx, run.pos
    with tempfile.TemporaryDirectory(prefix="rayfleet-ckpt-") as tmp:
        d = Path(tmp)
        run.engine.save(d, final=final)
        save_rng(d, ctx.rank)
        if ctx.rank == 0:
            (d / runs.MODEL_CONFIG).write_text(json.dumps(run.model_cfg.to_dict()))
            (d / runs.TRAINER_STATE).write_text(json.dumps({
                "step": pos.step, "epoch": pos.epoch, "batch_in_epoch": pos.batch_in_epoch,
                "schedule": {"name": "warmup_cosine", "lr": cfg.lr,
                             "warmup_steps": cfg.warmup_steps,
                             "max_steps": cfg.max_steps},
                "loop_config": cfg.to_dict()}))
            (d / runs.METRICS).write_text(runs.history_csv(pos.history))
            runs.write_marker(d, step=pos.step, strategy=cfg.strategy,
                              world_size=ctx.world_size, final=final,
                              elsewhere=run.engine.files_elsewhere)
        ctx.report(pos.metrics, d)


def _after_step(run: _Run) -> bool:
    """Log and checkpoint as this step calls for; whether it was the last."""
    cfg, pos = run.cfg, run.pos
    run.watch.stepped(pos.step)
    run.window.steps += 1
    is_final = pos.step >= cfg.max_steps
    # A spot notice for a node of this run: the same checkpoint, at this step.
    save = run.notices.due(pos.step) or is_final or pos.step % cfg.checkpoint_every == 0
    logged = pos.step % cfg.log_every == 0 or save
    if logged:
        _log(run)
    # Metrics go to Ray only with checkpoints: ray.train.report is a barrier across
    # ranks, and Train V2 drains each worker's one-slot result queue only when the
    # controller polls, so frequent reports stall training.
    if save:
        run.watch.checkpointing()
        _checkpoint(run, is_final)
        run.watch.checkpointed()
    if logged:
        # Step time and tokens/s measure training only; checkpoint time is not in them.
        run.window.restart()
    return is_final


def _epoch(run: _Run, epoch_batches: Callable[[int, int], Any]) -> bool:
    """Train through the rest of the current epoch; whether the run reached its last step."""
    cfg, ctx, pos = run.cfg, run.ctx, run.pos
    micro, seen = 0, 0
    for batch in run.window.wait.wrap(epoch_batches(pos.epoch, pos.batch_in_epoch)):
        startup.mark("first_batch")
        pos.batch_in_epoch += 1
        seen += 1
        x, y = (t.to(ctx.device, non_blocking=True) for t in split_batch(batch))
        micro += 1
        last = micro == cfg.grad_accum
        if micro == 1:
            run.engine.set_lr(lr_at(pos.step, cfg))
        run.window.losses.append(run.engine.micro_step(x, y, last))
        if not last:
            continue
        micro = 0
        pos.step += 1
        if _after_step(run):
            return True
    if seen == 0 and pos.batch_in_epoch == 0:
        raise ValueError(f"rank {ctx.rank} got no full batch of {cfg.batch_size} in "
                         f"epoch {pos.epoch}: the data is smaller than one global batch")
    pos.epoch += 1
    pos.batch_in_epoch = 0
    return False


def train_loop(cfg: LoopConfig, ctx: Context) -> dict:
    """Train to cfg.max_steps, resuming from ctx's latest checkpoint. Returns final metrics."""
    startup.mark("loop_entered")
    torch.manual_seed(cfg.seed)  # same init on every rank; DDP broadcasts rank 0's anyway
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model_cfg, engine = prepare(cfg, ctx)
    startup.mark("model_ready")
    pos = _resume(cfg, ctx, engine)
    startup.mark("checkpoint_checked")
    epoch_batches = _epoch_source(cfg, ctx, model_cfg.seq_len)
    startup.mark("data_ready")

    tokens_per_step = cfg.batch_size * cfg.grad_accum * model_cfg.seq_len * ctx.world_size
    flops_per_token = model_cfg.flops_per_token()
    peak = peak_flops(ctx.device)
    engine.model.train()
    window = _Window()
    watch = ctx.hang_watch(hangwatch.Settings(cfg.hang_floor_s, cfg.hang_factor)
                           if cfg.hang_floor_s else None)
    run = _Run(cfg, ctx, engine, model_cfg, pos, window, ctx.spot_notices(), watch,
               straggler.ForwardClock(engine.strategy.unwrapped(), ctx.device),
               tokens_per_step, flops_per_token, peak)
    pos.metrics = dict(pos.history[-1]) if pos.history else {}
    done = pos.step >= cfg.max_steps
    if done and ctx.rank == 0:
        print(f"[rayfleet] run already complete at step {pos.step}; raise --max-steps to go on",
              flush=True)
    while not done:
        done = _epoch(run, epoch_batches)
    watch.finished()
    return {**pos.metrics, "compute_dtype": engine.compute_dtype}
