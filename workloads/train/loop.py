"""The per-worker training loop: plain PyTorch behind a small context, so the same loop runs
under Ray Train and under torchrun.

`train_loop(cfg, ctx)` knows nothing about Ray. The context supplies rank, world size,
device, data-loader preparation, the latest checkpoint and `report`; `context.RayContext`
implements it with ray.train, `context.TorchrunContext` with torch.distributed env vars, so
the same loop runs under Ray Train, under `torchrun` (GPU checks, overhead benchmarks) and
in one process.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from rayfleet import catalog
from rayfleet.errors import CheckpointError
from workloads.common import runs
from workloads.common.corpus import stdlib_corpus
from workloads.common.model import GPT, GPTConfig
from workloads.train import ds_config, hf_io, hf_model, preempt
from workloads.train.context import startup
from workloads.train.data import ByteBlocks, ParquetRows, split_batch
from workloads.train.rng import load_rng, save_rng

startup.mark("kit_imported")  # in a worker: torch and the kit's modules are loaded

STRATEGIES = ("ddp", "fsdp", "deepspeed")


@dataclass
class LoopConfig:
    model: dict = field(default_factory=lambda: GPTConfig().to_dict())
    strategy: str = "ddp"
    zero_stage: int = 2
    offload: bool = False
    batch_size: int = 8               # per worker, per micro-step
    grad_accum: int = 1
    lr: float = 3e-3                  # already scaled by world size by the driver
    warmup_steps: int = 10
    max_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    log_every: int = 10
    corpus_bytes: int = 1 << 20
    seed: int = 0
    use_ray_dataset: bool = False
    num_workers: int = 1              # DataLoader worker processes (0 = in the train process)
    compile: bool = False             # torch.compile in place (ddp, fsdp)
    # Hugging Face models (model = HFSpec.to_dict()): weights from hf_source, or fresh from
    # the config when it is None; the tokenizer is exported with the final checkpoint.
    hf_source: str | None = None
    tokenizer: str | None = None
    s3_endpoint: str | None = None
    activation_checkpointing: bool = False
    offload_params: bool = False      # DeepSpeed ZeRO-3: parameters on the host
    deepspeed_config: dict = field(default_factory=dict)   # the user's, merged over the kit's
    dataset_path: str | None = None   # a local Parquet dataset without Ray Data (torchrun)
    lora_merge: bool = False          # LoRA: the final checkpoint's hf/ has the adapter merged
    hf_max_shard_bytes: int | None = None   # the hf/ export's largest file (None: hf_io's)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Context(Protocol):
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    def prepare_ddp(self, model: torch.nn.Module) -> torch.nn.Module: ...
    def prepare_data_loader(self, loader: DataLoader) -> DataLoader: ...
    def dataset_shard(self) -> Any: ...
    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]: ...
    def report(self, metrics: dict, checkpoint_dir: Path | None) -> None: ...
    def spot_notices(self) -> preempt.Notices: ...
    def export_metrics(self, metrics: dict) -> None: ...


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


def _ndim(p: torch.Tensor) -> int:
    """A parameter's dimensions, also of one ZeRO-3 built partitioned (its data is empty)."""
    return len(getattr(p, "ds_shape", p.shape))


def _one_rank_group(ctx, cuda: bool) -> None:
    """DeepSpeed needs a process group even on one rank; the context starts one only for two
    or more (DDP and FSDP need none on one). Without it, a one-GPU run (`torchrun
    --nproc-per-node 1`, bench.gpu, a one-GPU node) failed in deepspeed.initialize: "Distributed
    backend is not initialized" (seen on an H100). A one-rank group over an in-process store,
    where the run has none yet: a tcp:// or env:// store under torchrun would wait for the
    agent's store as a client (TORCHELASTIC_USE_AGENT_STORE), and one rank needs no network."""
    import torch.distributed as dist

    if ctx.world_size != 1 or dist.is_initialized():
        return
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)


def _deepspeed(cfg: LoopConfig, cuda: bool):
    """(the deepspeed module, the run's DeepSpeed config), DeepSpeed imported the kit's way."""
    import warnings

    if not cuda:
        # Said, not guessed: otherwise DeepSpeed warns on every worker that it found no
        # GPU ("Setting accelerator to CPU. If you have GPU ...").
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed 0.19 still calls torch.distributed's deprecated all_gather_into_tensor
    # name: harmless, but a FutureWarning from every rank reads like a failure.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*all_gather_into_tensor.* is deprecated")
    import deepspeed

    if not cuda and os.environ.get("RAYFLEET_DS_SHM_COMM") != "1":
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel
        # on first use (~90 s of g++ per fresh machine, in every CI run); gloo does
        # the same job. RAYFLEET_DS_SHM_COMM=1 builds and uses it.
        import importlib

        # (`import deepspeed.comm.torch as m` would bind the torch package that
        # deepspeed.comm imports under the same name.)
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
        if hasattr(ds_torch_comm, "build_shm_op"):
            ds_torch_comm.build_shm_op = lambda: None

    config = ds_config.merge(ds_config.defaults(
        batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip,
        zero_stage=cfg.zero_stage, offload=cfg.offload,
        offload_params=cfg.offload_params, cuda=cuda), cfg.deepspeed_config)
    return deepspeed, config


class _Engine:
    """The strategy-specific parts: wrapping, stepping, saving and loading state."""

    def __init__(self, cfg: LoopConfig, ctx: Context, model: torch.nn.Module,
                 from_rank0: bool = False):
        self.cfg, self.ctx, self.strategy = cfg, ctx, cfg.strategy
        cuda = ctx.device.type == "cuda"
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                         else contextlib.nullcontext())
        # What the forward pass actually computed in (the logits' dtype), for the summary:
        # bf16 on GPU is measured, not assumed from the settings.
        self.compute_dtype = ""
        self.files_elsewhere: dict[str, int] = {}   # the final hf/ shards other ranks wrote

        # LoRA: the frozen base has no gradients and no optimizer state; checkpoints hold
        # only what trains (the base is loaded from its source again on resume).
        self.lora = hf_model.is_hf(cfg.model) and bool(cfg.model.get("lora"))
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.raw = model
        if self.strategy == "deepspeed":
            deepspeed, config = _deepspeed(cfg, cuda)
            decay = [p for p in model.parameters() if p.requires_grad and _ndim(p) >= 2]
            no_decay = [p for p in model.parameters() if p.requires_grad and _ndim(p) < 2]
            groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}]
            opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
            _one_rank_group(ctx, cuda)
            self.model, self.optimizer, _, _ = deepspeed.initialize(
                model=model.to(ctx.device), optimizer=opt, config=config,
                dist_init_required=False)
            return
        if cfg.compile:
            # In place (nn.Module.compile): parameter names and state_dict keys stay as they
            # are, so compiled and eager runs read each other's checkpoints. FSDP2 compiles
            # per block, before sharding (each block's all-gather stays outside its graph).
            for module in (model.blocks if self.strategy == "fsdp" else [model]):
                module.compile()
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mp = None
            if cuda:
                from torch.distributed.fsdp import MixedPrecisionPolicy

                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

            def shard(model):
                # FSDP2: shard each block, then the root (embeddings, final norm).
                for block in model.blocks:
                    fully_shard(block, mp_policy=mp) if mp else fully_shard(block)
                fully_shard(model, mp_policy=mp) if mp else fully_shard(model)

            if next(model.parameters()).is_meta:
                # Built on the meta device (prepare): this rank allocates only its shards and
                # gets their values from rank 0, which shards its own copy afterwards.
                shard(model)
                model.to_empty(device=ctx.device)
                hf_io.scatter_into_shards(model, ctx.rank, ctx.device)
            else:
                model = model.to(ctx.device)
                if from_rank0:
                    hf_io.scatter_into_shards(model, ctx.rank, ctx.device)
                shard(model)
            self.model = model
        else:
            self.model = ctx.prepare_ddp(model)
        groups = [{"params": [p for n, p in self.model.named_parameters()
                              if p.requires_grad and p.dim() >= 2],
                   "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in self.model.named_parameters()
                              if p.requires_grad and p.dim() < 2],
                   "weight_decay": 0.0}]
        # Fused AdamW where the device has the kernel (CUDA); foreach elsewhere.
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95),
                                           fused=True if cuda else None)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        if self.strategy == "deepspeed":
            with self.autocast:
                logits, loss = self.model(x, y)
            self.compute_dtype = str(logits.dtype).removeprefix("torch.")
            self.model.backward(loss)
            self.model.step()  # DeepSpeed only steps at accumulation boundaries
            return loss.detach()
        sync = contextlib.nullcontext()
        if not last and self.strategy == "ddp" and hasattr(self.model, "no_sync"):
            sync = self.model.no_sync()  # skip the all-reduce on accumulation micro-steps
        with sync:
            with self.autocast:
                logits, loss = self.model(x, y)
            self.compute_dtype = str(logits.dtype).removeprefix("torch.")
            (loss / self.cfg.grad_accum).backward()
        if last:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, d: Path, final: bool) -> None:
        rank = self.ctx.rank
        full = None
        # A Hugging Face run's final checkpoint (not LoRA's): hf/ is its full-weight export,
        # written shard by shard by every rank (export_hf), never gathered into one process.
        hf_full = final and hf_model.is_hf(self.cfg.model) and not self.lora
        self.files_elsewhere = {}
        if self.strategy == "ddp":
            if rank == 0:
                full = self.raw.state_dict()
                if self.lora:
                    full = {k: v for k, v in full.items() if k in self.trainable}
                torch.save(full, d / runs.FULL_WEIGHTS)
                torch.save(self.optimizer.state_dict(), d / runs.OPTIMIZER)
        elif self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer, options=self._sd_options())
            # Each rank writes only its own shard (rank 0 adds .metadata); Ray merges the
            # per-rank folders into one checkpoint in storage.
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / runs.DCP_DIR))
            if final and not hf_full:
                full = self._save_full(d)
        else:
            client = {"rayfleet": True}
            self.model.save_checkpoint(str(d / runs.DS_DIR), tag="ckpt", client_state=client,
                                       exclude_frozen_parameters=self.lora)
            if final and not hf_full:
                full = self._save_full(d)
        if hf_full:
            # The run's result in Hugging Face format: what `lm`, vLLM and from_pretrained
            # load.
            self.export_hf(d / runs.HF_DIR,
                           self.cfg.hf_max_shard_bytes or hf_io.MAX_SHARD_BYTES)
        elif final and rank == 0 and self.lora:
            # The adapter (PEFT's folder), and with --lora-merge the base with it merged in.
            lora = self.cfg.model["lora"]
            hf_model.export_adapter(full, lora, self.cfg.tokenizer, d / runs.ADAPTER_DIR,
                                    self.cfg.s3_endpoint)
            if self.cfg.lora_merge:
                hf_model.export_merged(d / runs.ADAPTER_DIR, self.cfg.model[runs.HF_MODEL_KEY],
                                       self.cfg.tokenizer, d / runs.HF_DIR, self.cfg.s3_endpoint)

    def export_hf(self, out: Path, max_shard_bytes: int = hf_io.MAX_SHARD_BYTES) -> None:
        """Write the model as a Hugging Face folder at `out` (hf_io.export_sharded): every rank
        calls it and writes its shards; rank 0 learns the others' files and sizes
        (files_elsewhere, for the checkpoint's marker). The files land in each rank's own
        checkpoint folder, which Ray (or TorchrunContext) merges into one."""
        written = hf_io.export_sharded(
            self._full_tensors(), self.cfg.model[runs.HF_MODEL_KEY], self.cfg.tokenizer, out,
            rank=self.ctx.rank, world_size=self.ctx.world_size,
            endpoint=self.cfg.s3_endpoint, max_shard_bytes=max_shard_bytes)
        self.files_elsewhere = {}
        if self.ctx.world_size > 1:
            every: list = [None] * self.ctx.world_size
            dist.all_gather_object(every, written)
            rel = out.name
            self.files_elsewhere = {f"{rel}/{f}": size for r, w in enumerate(every)
                                    if r != self.ctx.rank for f, size in w.items()}

    def _full_tensors(self):
        """full(name): the full value of the model's tensor `name` (save_pretrained's key) on
        this rank; a collective for sharded weights (FSDP2's DTensors, ZeRO-3's partitions),
        so every rank asks for every tensor in the same order."""
        from torch.distributed.tensor import DTensor

        module = {"deepspeed": lambda: self.model.module, "fsdp": lambda: self.model}.get(
            self.strategy, lambda: self.raw)()
        # Tied tensors under each of their names.
        named = {**dict(module.named_parameters(remove_duplicate=False)),
                 **dict(module.named_buffers(remove_duplicate=False))}

        def full(name: str) -> torch.Tensor:
            t = named[f"lm.{name}"]
            if isinstance(t, DTensor):
                return t.full_tensor()
            if hasattr(t, "ds_id"):   # a ZeRO-3 partitioned parameter
                import deepspeed

                with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                    return t.data.detach().clone()
            return t.detach()

        return full

    def _sd_options(self, **kw):
        """torch.distributed.checkpoint's state-dict options: LoRA leaves the frozen base out."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.lora, **kw)

    def _save_full(self, d: Path) -> dict | None:
        """Gather full fp32 weights onto rank 0 (a collective: every rank calls it); rank 0
        writes model.pt and gets the state dict back. LoRA: the adapter's weights only, for
        its export (no model.pt: the adapter/ folder is what is served)."""
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            sd = get_model_state_dict(self.model, options=self._sd_options(
                full_state_dict=True, cpu_offload=True))
        elif self.cfg.zero_stage == 3:
            sd = self.model._zero3_consolidated_16bit_state_dict(
                exclude_frozen_parameters=self.lora)
        else:
            sd = self.model.module_state_dict(exclude_frozen_parameters=self.lora)
        if self.ctx.rank != 0:
            return None
        full = {k: v.detach().float().cpu() for k, v in sd.items()}
        if not self.lora:
            torch.save(full, d / runs.FULL_WEIGHTS)
        return full

    def load(self, d: Path) -> None:
        if self.strategy == "ddp":
            sd = torch.load(d / runs.FULL_WEIGHTS, map_location=self.ctx.device,
                            weights_only=True)
            if self.lora:
                # The adapter only: the frozen base came from its source.
                if set(sd) != self.trainable:
                    raise CheckpointError(f"checkpoint {d} does not hold this run's LoRA "
                                          f"adapter ({len(set(sd) & self.trainable)} of "
                                          f"{len(self.trainable)} adapter tensors)")
                self.raw.load_state_dict(sd, strict=False)
            else:
                self.raw.load_state_dict(sd)
            self.optimizer.load_state_dict(torch.load(d / runs.OPTIMIZER,
                                                      map_location=self.ctx.device,
                                                      weights_only=False))
        elif self.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer, options=self._sd_options())
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(d / runs.DCP_DIR))
            # LoRA: dcp.load has already refused a checkpoint missing any adapter tensor; the
            # frozen base is absent from it by design (not strict about those).
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"],
                           options=self._sd_options(strict=not self.lora))
        else:
            # A LoRA checkpoint has no frozen weights to load (they came from the source).
            path, _ = self.model.load_checkpoint(str(d / runs.DS_DIR), tag="ckpt",
                                                 load_module_strict=not self.lora)
            if path is None:
                raise CheckpointError(f"checkpoint {d} has no DeepSpeed state under "
                                      f"{runs.DS_DIR}/")


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
    kw: dict = {}
    from_rank0 = sharded and cfg.strategy == "fsdp"
    if from_rank0:
        kw["meta"] = ctx.rank != 0
    elif sharded and cfg.strategy == "deepspeed":
        _, config = _deepspeed(cfg, ctx.device.type == "cuda")
        if config["zero_optimization"].get("stage") == 3:
            kw["zero3_config"] = config
    # Building draws random numbers on some ranks and not on others (meta, or weights that
    # come from elsewhere): every rank goes on from the same RNG state, as the seed left it.
    with torch.random.fork_rng(devices=[]):
        model = hf_model.build(cfg.hf_source, model_cfg.config, cfg.activation_checkpointing,
                               cfg.s3_endpoint, lora=model_cfg.lora, **kw)
    return model_cfg, _Engine(cfg, ctx, model, from_rank0=from_rank0)


def train_loop(cfg: LoopConfig, ctx: Context) -> dict:
    """Train to cfg.max_steps, resuming from ctx's latest checkpoint. Returns final metrics."""
    startup.mark("loop_entered")
    torch.manual_seed(cfg.seed)  # same init on every rank; DDP broadcasts rank 0's anyway
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model_cfg, engine = prepare(cfg, ctx)
    startup.mark("model_ready")

    step, epoch, batch_in_epoch, history = 0, 0, 0, []
    with ctx.latest_checkpoint() as d:
        if d is not None:
            marker = runs.validate(d, expect_strategy=cfg.strategy)
            state = json.loads((d / runs.TRAINER_STATE).read_text())
            engine.load(d)
            load_rng(d, ctx.rank)
            step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
            history = runs.read_history((d / runs.METRICS).read_text()) \
                if (d / runs.METRICS).exists() else []
            for h in history:
                # Checkpoints from before the data-wait metric: unknown, not zero (and the
                # CSV writer needs every row to carry the same columns).
                h.setdefault("data_wait_frac", float("nan"))
            if ctx.rank == 0:
                print(f"[rayfleet] resumed from step {marker['step']} ({d.name})", flush=True)
    startup.mark("checkpoint_checked")

    if cfg.use_ray_dataset:
        shard = ctx.dataset_shard()

        def epoch_batches(epoch: int, skip: int):
            # Streaming: Ray Data preprocesses while this loop trains; position inside an
            # epoch is not replayed on resume (the shard is a stream).
            return shard.iter_torch_batches(batch_size=cfg.batch_size, drop_last=True)
    else:
        dataset = (ParquetRows(cfg.dataset_path) if cfg.dataset_path else
                   ByteBlocks(stdlib_corpus(cfg.corpus_bytes), model_cfg.seq_len))
        loader = ctx.prepare_data_loader(DataLoader(
            dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
            generator=torch.Generator(), num_workers=cfg.num_workers,
            persistent_workers=cfg.num_workers > 0))

        def epoch_batches(epoch: int, skip: int):
            return _batches(loader, epoch, skip, cfg.seed)
    startup.mark("data_ready")

    tokens_per_step = cfg.batch_size * cfg.grad_accum * model_cfg.seq_len * ctx.world_size
    flops_per_token = model_cfg.flops_per_token()
    peak = peak_flops(ctx.device)
    engine.model.train()
    t_last, steps_since, losses = time.perf_counter(), 0, []
    wait = _WaitTimer()
    notices = ctx.spot_notices()
    metrics: dict = dict(history[-1]) if history else {}
    done = step >= cfg.max_steps
    if done and ctx.rank == 0:
        print(f"[rayfleet] run already complete at step {step}; raise --max-steps to go on",
              flush=True)
    while not done:
        micro, seen = 0, 0
        for batch in wait.wrap(epoch_batches(epoch, batch_in_epoch)):
            startup.mark("first_batch")
            batch_in_epoch += 1
            seen += 1
            x, y = (t.to(ctx.device, non_blocking=True) for t in split_batch(batch))
            micro += 1
            last = micro == cfg.grad_accum
            if micro == 1:
                engine.set_lr(lr_at(step, cfg))
            losses.append(engine.micro_step(x, y, last))
            if not last:
                continue
            micro = 0
            step += 1
            steps_since += 1
            is_final = step >= cfg.max_steps
            # A spot notice for a node of this run: the same checkpoint, at this step.
            save = notices.due(step) or is_final or step % cfg.checkpoint_every == 0
            if step % cfg.log_every == 0 or save:
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t_last
                dt = elapsed / steps_since
                loss = torch.stack(losses).mean()
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                    loss = loss / ctx.world_size
                tps = tokens_per_step / dt
                metrics = {"step": step, "epoch": epoch, "loss": round(loss.item(), 5),
                           "lr": lr_at(step - 1, cfg), "step_time_s": round(dt, 5),
                           "tokens_per_s": round(tps, 1),
                           "data_wait_frac": round(min(1.0, wait.seconds / elapsed), 5),
                           "mfu": round(flops_per_token * tps / (peak * ctx.world_size), 4)
                           if peak else 0.0}
                history.append(metrics)
                ctx.export_metrics(metrics)
                losses = []
                if ctx.rank == 0:
                    print(f"[rayfleet] step {step}/{cfg.max_steps} loss {metrics['loss']:.4f} "
                          f"{tps:,.0f} tok/s {dt * 1000:.0f} ms/step", flush=True)
                    startup.mark("first_logged_step")
                    startup.emit("rank0")
            # Metrics go to Ray only with checkpoints: ray.train.report is a barrier across
            # ranks, and Train V2 drains each worker's one-slot result queue only when the
            # controller polls, so frequent reports stall training.
            if save:
                with tempfile.TemporaryDirectory(prefix="rayfleet-ckpt-") as tmp:
                    d = Path(tmp)
                    engine.save(d, final=is_final)
                    save_rng(d, ctx.rank)
                    if ctx.rank == 0:
                        (d / runs.MODEL_CONFIG).write_text(json.dumps(model_cfg.to_dict()))
                        (d / runs.TRAINER_STATE).write_text(json.dumps({
                            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                            "schedule": {"name": "warmup_cosine", "lr": cfg.lr,
                                         "warmup_steps": cfg.warmup_steps,
                                         "max_steps": cfg.max_steps},
                            "loop_config": cfg.to_dict()}))
                        (d / runs.METRICS).write_text(runs.history_csv(history))
                        runs.write_marker(d, step=step, strategy=cfg.strategy,
                                          world_size=ctx.world_size, final=is_final,
                                          elsewhere=engine.files_elsewhere)
                    ctx.report(metrics, d)
            if step % cfg.log_every == 0 or save:
                # Step time and tokens/s measure training only; checkpoint time is not in them.
                t_last, steps_since = time.perf_counter(), 0
                wait.seconds = 0.0
            if is_final:
                done = True
                break
        else:
            if seen == 0 and batch_in_epoch == 0:
                raise ValueError(f"rank {ctx.rank} got no full batch of {cfg.batch_size} in "
                                 f"epoch {epoch}: the data is smaller than one global batch")
            epoch += 1
            batch_in_epoch = 0
    return {**metrics, "compute_dtype": engine.compute_dtype}
