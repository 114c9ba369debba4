"""Hugging Face weights into and out of sharded training without a full copy in every process.

Loading (FSDP2): rank 0 builds the model as before (`from_pretrained`, or fresh weights from
the config); every other rank builds it on the meta device, shards it with `fully_shard` and
allocates only its own shards (`to_empty`). `scatter_into_shards` then fills every rank's rows
of each parameter: where rank 0's parameter is a view of a mapped safetensors file (what
from_pretrained leaves) and every rank sees that same file, each rank reads its own rows
straight from it with plain reads (none through the mapping, so the file's pages stay in the
page cache, not in the process); otherwise rank 0 scatters them, one parameter at a time.
Buffers are broadcast whole (also the non-persistent ones, such as RoPE's inv_freq, which no
state dict carries and `to_empty` leaves as garbage). Rank 0 shards its own model afterwards,
tensor by tensor, holding only its own rows of the file-backed parameters, so no process ever
holds more than one full copy, and rank 0 about its share. (ZeRO-3: the model is built inside
`deepspeed.zero.Init` and each rank reads its partitions from the files, see
hf_model.build.)

Export: `export_sharded` writes the final checkpoint's `hf/` as save_pretrained would
(safetensors shards of at most `max_shard_bytes` plus `model.safetensors.index.json`, or one
`model.safetensors` when the model fits one shard; config.json, generation_config.json), but
shard by shard: every rank walks the same plan, the full value of each tensor is gathered
tensor by tensor (a collective for FSDP2's DTensors and ZeRO-3's partitions), and the shard's
owner (shard i belongs to rank i % world) keeps it and writes the file. A process holds at
most one shard plus the tensor being gathered.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from workloads.common.hf import load_tokenizer
from workloads.train import hf_model

# A shard of the export is at most this many bytes (one tensor bigger than that is a shard of
# its own): the most any process holds of the export at once. Hub models commonly come in a
# few GB per file; transformers' own default (50 GB) would make every model one file, written
# by one process.
MAX_SHARD_BYTES = 2 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ------------------------------------------------------------------------------ loading

def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a tensor's dim 0 that FSDP2's Shard(0) gives `rank`: the
    chunks of torch.chunk, ceil(n / world) rows each, the last ones shorter or empty."""
    size = -(-n // world)
    return min(rank * size, n), min((rank + 1) * size, n)


# Rank 0's from_pretrained leaves a parameter whose dtype is the file's as a view of the
# safetensors file, memory-mapped (transformers 5). Reading it through that mapping makes its
# pages this process's resident memory (all of them, as rank 0 scatters every row), and they
# stay so while the mapping lives. Such a parameter's bytes are read with plain reads
# (os.preadv) instead: its rows land in the page cache, not in the process.

_PAGE = os.sysconf("SC_PAGE_SIZE")
_READ_MAX = 1 << 30                      # Linux reads at most ~2 GiB per call


def _file_maps() -> list[tuple[int, int, int, int, str]]:
    """This process's mappings of regular files: (start, end, file offset, inode, path)."""
    maps = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                maps.append((start, end, int(parts[2], 16), int(parts[4]),
                             parts[5].rstrip("\n")))
    except OSError:
        pass
    return maps


def _never_written(ptr: int, nbytes: int) -> bool:
    """Whether no page of [ptr, ptr + nbytes) is this process's own copy (a private mapping's
    page it wrote, or one swapped out): /proc/self/pagemap, bit 61 file page, 62 swapped,
    63 present. False when pagemap cannot be read."""
    first, last = ptr // _PAGE, (ptr + nbytes - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read((last - first + 1) * 8)
    except OSError:
        return False
    if len(raw) != (last - first + 1) * 8:
        return False
    flags = torch.frombuffer(bytearray(raw), dtype=torch.int64) >> 61
    present, swapped, file = flags & 4 != 0, flags & 2 != 0, flags & 1 != 0
    return not bool((swapped | (present & ~file)).any())


def file_location(t: torch.Tensor, maps: list) -> tuple[str, int] | None:
    """(path, byte offset) when `t`'s bytes are exactly a file's: a contiguous CPU tensor
    viewing a mapping of a regular file (the same file still at that path), none of whose
    pages this process wrote. None otherwise."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or t.dim() == 0:
        return None
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    for start, end, offset, inode, path in maps:
        if start <= ptr and ptr + nbytes <= end:
            try:
                st = os.stat(path)
            except OSError:
                return None
            if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
                return None
            if not _never_written(ptr, nbytes):
                return None
            return path, offset + ptr - start
    return None


def _fingerprint(path: str) -> tuple[int, str] | None:
    """(size, hash of 64 samples of 4 KiB spread over the file): that another process's file
    at the same path is the same one. None when it cannot be read."""
    import hashlib

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        h = hashlib.sha256()
        for i in range(64):
            h.update(os.pread(fd, 4096, size * i // 64))
        return size, h.hexdigest()
    except OSError:
        return None
    finally:
        os.close(fd)


def _pread_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the file's bytes from `offset`."""
    buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + _READ_MAX]], offset + done)
        if n <= 0:
            raise RuntimeError(f"reading weights: file ended at {offset + done}")
        done += n


def _anon(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in fresh anonymous memory of its own (mmap): pages
    nobody writes are never allocated, and all of it goes back to the system when the tensor
    goes (a malloc'd one of tens of MB may stay in the heap). Rank 0 keeps one per parameter
    with only its own rows written for fully_shard, which copies those and drops it."""
    numel = int(torch.Size(shape).numel())
    mm = mmap.mmap(-1, numel * torch.empty((), dtype=dtype).element_size(),
                   flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mm, dtype=dtype, count=numel).view(shape)


def _sources(entries: list, n_params: int, rank: int,
             device: torch.device) -> tuple[list, bool]:
    """(each parameter's (path, offset) in rank 0's files, or None; whether every rank reads
    its rows from those files): rank 0 finds them and tells the others, who check that they
    see the same files (a collective). RuntimeError when the ranks' models do not have the
    same tensors."""
    names = [(n, tuple(t.shape), str(t.dtype)) for n, t in entries]
    locs: list = [None] * len(entries)
    prints: dict = {}
    if rank == 0:
        maps = _file_maps()
        for i, (_, t) in enumerate(entries[:n_params]):
            locs[i] = file_location(t.detach(), maps) if maps else None
        prints = {path: _fingerprint(path) for path in {loc[0] for loc in locs if loc}}
        locs = [loc if loc and prints.get(loc[0]) else None for loc in locs]
    got = [(names, locs, prints) if rank == 0 else None]
    dist.broadcast_object_list(got, src=0)
    if got[0][0] != names:
        theirs = set(got[0][0]) ^ set(names)
        raise RuntimeError(f"rank {rank}'s model differs from rank 0's ({len(theirs)} tensors "
                           f"differ, e.g. {sorted(theirs)[:2]})")
    locs, prints = got[0][1], got[0][2]
    # Every rank reads from the files only if every rank sees the same files (another node
    # may have no copy at that path, or another version of it).
    ok = all(_fingerprint(path) == fp for path, fp in prints.items()) if rank else True
    flag = torch.tensor([1 if ok and prints else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return locs, bool(flag.item())


class _Transfer:
    """One scatter_into_shards call on one rank: where the weights come from, the files it
    holds open, and how many parameters it read from them or scattered."""

    def __init__(self, rank: int, world: int, device: torch.device, from_files: bool):
        self.rank, self.world, self.device = rank, world, device
        self.from_files = from_files
        self.fds: dict[str, int] = {}
        self.counts = {"read": 0, "scattered": 0}

    def fd(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for f in self.fds.values():
            os.close(f)

    def buffer(self, t: torch.Tensor) -> None:
        """A buffer: whole on every rank."""
        buf = t.detach()
        tmp = buf if buf.is_contiguous() else buf.contiguous()
        dist.broadcast(tmp, src=0)
        if tmp is not buf:
            buf.copy_(tmp)

    def send(self, t: torch.Tensor, loc: tuple[str, int] | None) -> None:
        """Rank 0: keep its own rows of the parameter `t` and give the others theirs."""
        n = t.shape[0]
        size = -(-n // self.world)
        own = slice(0, size)                               # rank 0's rows (n >= 1)
        if loc:
            # Only its own rows are ever written: the rest takes no memory.
            hold = _anon(t.shape, t.dtype)
            if self.from_files:                            # every rank reads its rows
                self.counts["read"] += 1
                _pread_into(self.fd(loc[0]), loc[1], hold[own])
                t.data = hold
                return
            full = _anon(t.shape, t.dtype)                 # read, not through the mapping
            _pread_into(self.fd(loc[0]), loc[1], full)
        else:
            full = t.detach().contiguous()
        chunks = []
        for r in range(self.world):
            a, b = _rows(n, self.world, r)
            chunk = full[a:b]
            if b - a < size:                               # gloo scatters equal sizes
                pad = full.new_zeros((size - (b - a), *full.shape[1:]))
                chunk = torch.cat([chunk, pad])
            chunks.append(chunk)
        mine = hold[own] if loc else torch.empty_like(chunks[0])
        self.counts["scattered"] += 1
        dist.scatter(mine, chunks, src=0)
        if loc:
            t.data = hold

    def receive(self, name: str, t: torch.Tensor, loc: tuple[str, int] | None) -> None:
        """Another rank: fill its shard of the parameter `t`, from the file or from rank 0."""
        from torch.distributed.tensor import DTensor, Shard

        n = t.shape[0]
        size = -(-n // self.world)
        row_bytes = (t.numel() // n if n else 0) * t.element_size()
        if not isinstance(t, DTensor) or tuple(t.placements) != (Shard(0),):
            raise RuntimeError(f"{name}: expected an FSDP2 shard (Shard(0)), got "
                               f"{type(t).__name__} {getattr(t, 'placements', '')}")
        local = t.to_local()
        start, stop = _rows(n, self.world, self.rank)
        if local.shape[0] != stop - start:
            raise RuntimeError(f"{name}: this rank holds {local.shape[0]} rows, "
                               f"expected {stop - start} of {n}")
        if loc and self.from_files:
            self.counts["read"] += 1
            if stop == start:
                return
            if local.device.type == "cpu" and local.is_contiguous():
                _pread_into(self.fd(loc[0]), loc[1] + start * row_bytes, local)
            else:
                tmp = torch.empty(local.shape, dtype=local.dtype)
                _pread_into(self.fd(loc[0]), loc[1] + start * row_bytes, tmp)
                local.copy_(tmp)
            return
        self.counts["scattered"] += 1
        if stop - start == size and local.is_contiguous():
            dist.scatter(local, None, src=0)               # straight into the shard
        else:
            recv = torch.empty((size, *t.shape[1:]), dtype=t.dtype, device=self.device)
            dist.scatter(recv, None, src=0)
            local.copy_(recv[:stop - start])


def scatter_into_shards(model: nn.Module, rank: int, device: torch.device) -> dict[str, int]:
    """Copy rank 0's parameters and buffers into every rank's `model` (a collective: every rank
    calls it). On rank 0 `model` is the whole model (not yet sharded); on the others it is the
    same model sharded with fully_shard (each parameter a DTensor, Shard(0) over all ranks)
    and allocated with to_empty. Each rank gets only its own rows of each parameter: read
    straight from the safetensors file when rank 0's parameter is a view of one (mapped by
    from_pretrained) and every rank sees that same file, else scattered from rank 0; buffers
    are broadcast whole. Rank 0 reads file-backed parameters with plain reads and keeps only
    its own rows of them (the rest of the tensor never allocated), so neither the mapped file
    nor a second copy of the model becomes its resident memory. Returns how many parameters
    each rank read from the files ("read") and how many rank 0 scattered ("scattered").
    RuntimeError when the ranks' models do not have the same tensors."""
    world = dist.get_world_size()
    entries = list(model.named_parameters()) + list(model.named_buffers())
    n_params = len(list(model.parameters()))
    locs, from_files = _sources(entries, n_params, rank, device)
    transfer = _Transfer(rank, world, device, from_files)
    try:
        with torch.no_grad():
            for i, (name, t) in enumerate(entries):
                if i >= n_params:
                    transfer.buffer(t)
                elif rank == 0:
                    transfer.send(t, locs[i])
                else:
                    transfer.receive(name, t, locs[i])
    finally:
        transfer.close()
    return transfer.counts


# ------------------------------------------------------------------------------- export

def _export_dtype(cfg) -> torch.dtype:
    """The dtype save_pretrained would write: the config's own, else float32 (training's)."""
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def export_keys(config: dict) -> tuple[object, list[tuple[str, tuple[int, ...]]]]:
    """(the model built on the meta device from `config`, [(name, shape)] of what
    save_pretrained writes for it, in its order): the state dict without tied duplicates
    (the name a loader expects is kept) and without non-persistent buffers."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    lm = hf_model.meta_model(config)
    lm.tie_weights()
    sd = remove_tied_weights_from_state_dict(lm.state_dict(), lm)
    return lm, [(k, tuple(v.shape)) for k, v in sd.items()]


def plan_shards(keys: list[tuple[str, tuple[int, ...]]], itemsize: int,
                max_shard_bytes: int) -> list[list[str]]:
    """Tensors in order, cut into consecutive shards of at most max_shard_bytes (a tensor
    bigger than that alone in its own)."""
    shards: list[list[str]] = []
    size = 0
    for name, shape in keys:
        n = itemsize * int(torch.Size(shape).numel())
        if not shards or (size + n > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                         for i in range(n)]


def export_sharded(full_tensor: Callable[[str], torch.Tensor], config: dict,
                   tokenizer: str | None, out: Path, *, rank: int = 0, world_size: int = 1,
                   endpoint: str | None = None,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, int]:
    """Write `out` as a Hugging Face model folder, shard by shard (see the module's doc).
    `full_tensor(name)` returns the full value of the model's tensor `name` (a key of
    save_pretrained's state dict: no `lm.` prefix); every rank calls it for every tensor in
    the same order, so it may be a collective. Rank 0 also writes config.json,
    generation_config.json, the index and the tokenizer. Returns {file name: size} of the
    files this rank wrote."""
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    lm, keys = export_keys(config)
    dtype = _export_dtype(lm.config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(keys, itemsize, max_shard_bytes)
    files = shard_names(len(shards))
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, int] = {}
    shapes = dict(keys)
    # transformers 5 keeps some architectures' weights in another layout than their files
    # (Mixtral's and Qwen-MoE's experts fused into one tensor): save_pretrained writes the
    # files' layout back (revert_weight_conversion), and so does each shard here. A tensor is
    # never split across shards, so each converts on its own.
    from transformers.core_model_loading import revert_weight_conversion

    meta = lm.state_dict()
    out_names = [list(revert_weight_conversion(lm, {n: meta[n] for n in names}))
                 for names in shards]
    for i, (file, names) in enumerate(zip(files, shards, strict=True)):
        mine = i % world_size == rank
        tensors = {}
        for name in names:
            t = full_tensor(name)
            if tuple(t.shape) != shapes[name]:
                raise RuntimeError(f"export: {name} is {tuple(t.shape)}, the config says "
                                   f"{shapes[name]}")
            if mine:
                tensors[name] = t.detach().to("cpu", dtype).contiguous()
            del t
        if mine:
            tensors = revert_weight_conversion(lm, tensors)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / file),
                      metadata={"format": "pt"})
            written[file] = (out / file).stat().st_size
        del tensors
    if rank == 0:
        # As save_pretrained writes them: the class that loads it, the weights' dtype.
        lm.config.architectures = [type(lm).__name__]
        lm.config.dtype = str(dtype).removeprefix("torch.")
        lm.config.save_pretrained(str(out))
        if lm.can_generate():
            lm.generation_config.save_pretrained(str(out))
        if len(files) > 1:
            total = sum(itemsize * int(torch.Size(s).numel()) for _, s in keys)
            index = {"metadata": {"total_size": total,
                                  "total_parameters": sum(int(torch.Size(s).numel())
                                                          for _, s in keys)},
                     "weight_map": {n: f for f, ns in zip(files, out_names, strict=True)
                                    for n in ns}}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if tokenizer:
            load_tokenizer(tokenizer, "--tokenizer", endpoint).save_pretrained(str(out))
    return written
