"""Hugging Face causal LMs in the training loop: any architecture `AutoModelForCausalLM` knows,
from a model folder / s3:// prefix (`--model`) or from a config with fresh weights
(`--model-config`), wrapped so the loop drives it exactly like the kit's own GPT:
`model(x, y) -> (logits, loss)` and `model.blocks` (the decoder layers FSDP2 shards one by
one and `--compile` compiles).

The loss ignores label -100 (prompt and padding tokens of instruction data). The final
checkpoint also carries `hf/`: the weights as `save_pretrained` writes them (safetensors, one
file or shards plus an index, written shard by shard by every rank: workloads.train.hf_io) and
the tokenizer, loadable with `AutoModelForCausalLM.from_pretrained` and served by `lm` and by
vLLM (`ray.serve.llm`).

LoRA (`--lora-r`, PEFT): the base weights are frozen and only low-rank adapters train.
Checkpoints hold the adapter's weights and optimizer state only (the base is loaded from
`--model` again on resume); the final checkpoint carries `adapter/`, a PEFT adapter folder
(`PeftModel.from_pretrained`, `lm`'s adapter, vLLM's LoRA), and with `--lora-merge` also `hf/`,
the base with the adapter merged in. `adapter/rayfleet_base.json` says which base it was trained
on: its source and a fingerprint of its weights (workloads.common.hf.weights_fingerprint),
which serving compares with the model it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workloads.common.hf import ADAPTER_BASE_FILE, fetch, load_tokenizer, merge_adapter
from workloads.common.runs import HF_MODEL_KEY

# PEFT's name for every linear layer but the output head.
ALL_LINEAR = "all-linear"

IGNORE_INDEX = -100


@dataclass(frozen=True)
class HFSpec:
    """What the driver and the loop need to know of a Hugging Face model without building it
    (the same questions GPTConfig answers for the kit's model)."""
    config: dict            # the transformers config, as config.to_dict()
    seq_len: int            # the training context (from the dataset)
    n_params: int           # all of them (with LoRA: the base's and the adapter's)
    # LoRA: {"r", "alpha", "dropout", "targets", "base": {"source", "fingerprint"}}, and the
    # adapter's parameter count (the only ones with gradients and optimizer state).
    lora: dict | None = None
    n_trainable: int | None = None

    @property
    def d_model(self) -> int:
        return int(self.config.get("hidden_size") or self.config.get("n_embd") or 0)

    @property
    def n_layer(self) -> int:
        return int(self.config.get("num_hidden_layers") or self.config.get("n_layer") or 0)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int | None:
        v = self.config.get("max_position_embeddings") or self.config.get("n_positions")
        return int(v) if v else None

    def num_params(self) -> int:
        return self.n_params

    def trainable_params(self) -> int:
        return self.n_params if self.n_trainable is None else self.n_trainable

    def flops_per_token(self) -> float:
        """Training FLOPs per token, as GPTConfig's (PaLM appendix B), counting the matmul
        weights only: an untied input embedding is a lookup, not a matmul."""
        lookup = 0 if self.config.get("tie_word_embeddings") else self.vocab_size * self.d_model
        return 6 * (self.n_params - lookup) + 12 * self.n_layer * self.d_model * self.seq_len

    def to_dict(self) -> dict:
        d = {HF_MODEL_KEY: self.config, "seq_len": self.seq_len, "n_params": self.n_params}
        if self.lora is not None:
            d |= {"lora": self.lora, "n_trainable": self.n_trainable}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HFSpec:
        return cls(config=d[HF_MODEL_KEY], seq_len=int(d["seq_len"]),
                   n_params=int(d["n_params"]), lora=d.get("lora"),
                   n_trainable=d.get("n_trainable"))


def is_hf(model: dict) -> bool:
    return HF_MODEL_KEY in model


def make_config(config: dict):
    from transformers import AutoConfig

    rest = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **rest)


def meta_model(config: dict, **kw) -> nn.Module:
    """The transformers model `config` describes, on the meta device (no memory). Also in a
    process that built its training model under ZeRO-3: transformers would otherwise build
    this one inside deepspeed.zero.Init too (its HfDeepSpeedConfig is process-wide, read
    through a module global), which fails on the meta device."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(make_config(config), **kw)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def count_params(config: dict, lora: dict | None = None) -> tuple[int, int]:
    """(all parameters, trainable ones) of the model a config describes, with LoRA's adapters
    when `lora` is given, counted on the meta device (no memory). ValueError (one line) when
    LoRA's targets match no module of the model."""
    model = meta_model(config)
    if lora:
        with torch.device("meta"):
            model = add_lora(model, lora)
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad))


def lora_config(lora: dict):
    """PEFT's LoraConfig for the kit's `lora` settings."""
    from peft import LoraConfig

    targets = lora["targets"]
    return LoraConfig(r=int(lora["r"]), lora_alpha=float(lora["alpha"]),
                      lora_dropout=float(lora["dropout"]), task_type="CAUSAL_LM",
                      target_modules=targets if targets == ALL_LINEAR else list(targets))


def add_lora(lm: nn.Module, lora: dict) -> nn.Module:
    """`lm` with LoRA adapters on its target modules (everything else frozen): PEFT's
    PeftModelForCausalLM. ValueError when the targets match no module."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        # transformers 5 deprecates a name PEFT still reads (is_gradient_checkpointing).
        warnings.simplefilter("ignore", FutureWarning)
        try:
            model = get_peft_model(lm, lora_config(lora))
        except ValueError as e:   # PEFT's NoMatchingPeftModuleError is one
            raise ValueError(str(e).splitlines()[0]) from None
    # PEFT refuses targets only when none matches: a misspelt one beside a good one would
    # leave that layer silently untrained.
    if lora["targets"] != ALL_LINEAR:
        names = model.targeted_module_names
        missing = [t for t in lora["targets"]
                   if not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            raise ValueError(f"Target modules {missing} not found in the base model")
    return model


class HFCausalLM(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        n = lm.config.num_hidden_layers
        # The decoder layers: the ModuleList with one entry per layer (model.layers for
        # Llama/Qwen/Mistral, transformer.h for GPT-2, ...).
        blocks = next((m for m in lm.modules() if isinstance(m, nn.ModuleList) and len(m) == n),
                      None)
        if blocks is None:
            raise ValueError(f"{type(lm).__name__}: found no list of {n} decoder layers")
        # Kept out of the module tree (plain __dict__): registered twice, every layer's
        # weights would appear under two names in state_dict and in the optimizer.
        self.__dict__["_blocks"] = blocks

    @property
    def blocks(self) -> nn.ModuleList:
        return self.__dict__["_blocks"]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.lm(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return logits, loss


def safetensors_entries(folder: Path) -> dict[str, tuple[str, str, tuple[int, ...], int]] | None:
    """{tensor name: (file, safetensors dtype, shape, byte offset in the file)} of the model
    folder's safetensors weights (model.safetensors, or the shards its index names), read
    from the files' headers; None when the folder has none or one cannot be read."""
    import json
    import struct

    index = folder / "model.safetensors.index.json"
    try:
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
                 if index.exists() else ["model.safetensors"])
        entries = {}
        for name in files:
            path = folder / name
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            for key, v in header.items():
                if key != "__metadata__":
                    entries[key] = (str(path), v["dtype"], tuple(v["shape"]),
                                    8 + n + int(v["data_offsets"][0]))
        return entries
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64}


def _zero3_plan(folder: Path, cfg) -> dict | None:
    """{parameter name: its file entry} when every parameter of the model `cfg` describes
    (on the meta device) is exactly one tensor of the folder's safetensors files under one of
    its names, with its shape and a float dtype, every tensor of the files is a parameter,
    the model has no persistent buffers and no weight conversion of transformers' applies
    to the files' names: then the files hold exactly what from_pretrained would load, each
    tensor as it is (cast to fp32). None otherwise."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping

    entries = safetensors_entries(folder)
    if not entries:
        return None
    lm = meta_model(cfg.to_dict(), dtype=torch.float32)
    aliases: dict[int, list[str]] = {}
    params = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params.setdefault(id(p), p)
    if set(lm.state_dict()) - {n for names in aliases.values() for n in names}:
        return None                                        # persistent buffers
    try:
        patterns = [pat for conv in get_model_conversion_mapping(lm)
                    for pat in getattr(conv, "source_patterns", [])]
    except Exception:   # transformers' internals moved: take the path that surely works
        return None
    if any(re.search(pat, key) for pat in patterns for key in entries):
        return None
    plan, used = {}, set()
    for pid, names in aliases.items():
        found = [n for n in names if n in entries]
        if not found or entries[found[0]][1] not in _ST_DTYPES \
                or entries[found[0]][2] != tuple(params[pid].shape):
            return None
        plan[names[0]] = entries[found[0]]
        used.update(found)
    return plan if used == set(entries) else None


def _pread_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the file's bytes from `offset` (plain reads:
    the pages go to the page cache, not to this process)."""
    import os

    buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + (1 << 30)]], offset + done)
        if n <= 0:
            raise RuntimeError(f"reading weights: file ended at {offset + done}")
        done += n


def zero3_from_files(folder: Path) -> nn.Module | None:
    """The model of the folder built inside deepspeed.zero.Init as from_pretrained builds it
    under ZeRO-3, with every rank reading only its own partition of each weight straight
    from the safetensors files (one plain read per weight), instead of from_pretrained's way
    (rank 0 reads every tensor through the mapped file, and every rank gathers each layer's
    full weights to have rank 0 fill them). None, on every rank alike, when any rank's files
    do not give exactly from_pretrained's weights (_zero3_plan): the caller loads with
    from_pretrained then."""
    import os

    import torch.distributed as dist
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cfg = AutoConfig.from_pretrained(str(folder))
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError:
        cls = None
    plan = _zero3_plan(folder, cfg) if cls is not None else None
    oks = [None] * dist.get_world_size()
    dist.all_gather_object(oks, plan is not None)
    if not all(oks):
        return None
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils.generic import ContextManagers

    # zero.Init builds each parameter whole and broadcasts it from rank 0 before keeping
    # this rank's partition (_zero_init_param): random values every partition is about to be
    # overwritten with from the files (the plan covers every parameter). Received whole on the
    # other ranks, the largest (the embedding) is a transient of its full size there, and the
    # heap keeps some: partitioned here without the broadcast.
    from deepspeed.runtime.zero.partition_parameters import Init

    zero_init_param = Init.__dict__.get("_zero_init_param")
    if zero_init_param is not None and hasattr(Init, "_convert_to_deepspeed_param"):
        def partition_only(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()

        Init._zero_init_param = partition_only
    try:
        with ContextManagers(cls.get_init_context(torch.float32, False, False, None)):
            lm = cls(cfg)
            patch_output_recorders(lm)
    finally:
        if zero_init_param is not None:
            Init._zero_init_param = zero_init_param
    lm.tie_weights()
    fds: dict[str, int] = {}
    try:
        with torch.no_grad():
            for name, p in lm.named_parameters():
                path, st_dtype, shape, offset = plan[name]
                part = p.ds_tensor
                size = part.numel()
                numel = int(torch.Size(shape).numel())
                start = size * dist.get_rank(group=getattr(p, "ds_process_group", None))
                n = max(0, min(size, numel - start))
                dtype = _ST_DTYPES[st_dtype]
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                if n:
                    at = offset + start * torch.empty((), dtype=dtype).element_size()
                    if dtype == part.dtype and part.device.type == "cpu":
                        _pread_into(fds[path], at, part[:n])
                    else:
                        tmp = torch.empty(n, dtype=dtype)
                        _pread_into(fds[path], at, tmp)
                        part[:n].copy_(tmp)
                part[n:].zero_()
    finally:
        for fd in fds.values():
            os.close(fd)
    if lm.can_generate() and (folder / "generation_config.json").exists():
        lm.generation_config = GenerationConfig.from_pretrained(str(folder))
    lm.eval()                                      # as from_pretrained leaves it
    return lm


def build(source: str | None, config: dict, activation_checkpointing: bool = False,
          endpoint: str | None = None, lora: dict | None = None, *, meta: bool = False,
          zero3_config: dict | None = None) -> HFCausalLM:
    """The model in fp32 (master weights; autocast gives bf16 compute on GPU): pretrained
    weights from `source`, or fresh ones from `config` (seeded by the caller); with `lora`,
    frozen, with LoRA adapters on its targets.

    `meta`: the same model on the meta device, from `config` alone (no weights read, no
    memory): FSDP2's ranks other than 0 shard it and read or receive their rows
    (hf_io.scatter_into_shards). `zero3_config`: a ZeRO-3 DeepSpeed config; the model is
    built inside deepspeed.zero.Init (transformers' HfDeepSpeedConfig, kept alive with the
    model), each rank holding only its partition, which it reads straight from the
    safetensors files (zero3_from_files), or, where the files are not exactly the model's
    weights, from_pretrained copies them in one parameter group at a time from rank 0."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    keep = None
    if zero3_config is not None:
        from transformers.integrations import HfDeepSpeedConfig

        # transformers reads it through a weak reference (is_deepspeed_zero3_enabled): it
        # must outlive from_pretrained, and whatever transformers code runs on the model later.
        keep = HfDeepSpeedConfig(zero3_config)
    if meta:
        lm = meta_model(config, dtype=torch.float32)
    elif source:
        folder = fetch(source, "--model", endpoint)
        # (Not with partitions offloaded to NVMe: they live in DeepSpeed's swap buffers.)
        nvme = ((zero3_config or {}).get("zero_optimization", {}).get("offload_param")
                or {}).get("device") == "nvme"
        lm = zero3_from_files(Path(folder)) if zero3_config is not None and not nvme else None
        if lm is None:
            lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    else:
        lm = AutoModelForCausalLM.from_config(make_config(config), dtype=torch.float32)
    if activation_checkpointing:
        # Recompute each layer's activations in backward: memory for compute.
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    if lora:
        lm = add_lora(lm, lora)
    model = HFCausalLM(lm)
    if keep is not None:
        model.__dict__["_hf_deepspeed_config"] = keep
    return model


def export(state_dict: dict, config: dict, tokenizer: str | None, out: Path,
           endpoint: str | None = None) -> None:
    """Write `out` as a Hugging Face model folder: the full weights (keys of the wrapper, whose
    `lm.` prefix is dropped) with save_pretrained (safetensors) in the config's own dtype, and
    the tokenizer beside them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    lm = meta_model(config)
    cfg = lm.config
    sd = {k.removeprefix("lm."): v.detach().cpu().float() for k, v in state_dict.items()}
    missing, unexpected = lm.load_state_dict(sd, strict=False, assign=True)
    # Tied output embeddings are one tensor under two names: one of them may be absent.
    lm.tie_weights()
    still_meta = [n for n, p in lm.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(f"export: weights do not match the config (missing {still_meta[:3]},"
                           f" unexpected {unexpected[:3]})")
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype != torch.float32:
        lm = lm.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(str(out), safe_serialization=True)
    if tokenizer:
        load_tokenizer(tokenizer, "--tokenizer", endpoint).save_pretrained(str(out))


def adapter_state(state_dict: dict) -> dict:
    """The adapter's weights of a LoRA model's state dict (the wrapper's keys), under the names
    PEFT writes to adapter_model.safetensors (`lm.` and the adapter name `default` dropped, as
    peft.get_peft_model_state_dict does)."""
    return {k.removeprefix("lm.").replace(".default.", "."): v.detach().cpu().float().contiguous()
            for k, v in state_dict.items() if ".lora_" in k}


def export_adapter(state_dict: dict, lora: dict, tokenizer: str | None, out: Path,
                   endpoint: str | None = None) -> None:
    """Write `out` as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors),
    with the tokenizer and rayfleet_base.json (which base, by source and weights fingerprint)
    beside them. The targets are written as the module names the adapter has weights for
    (not "all-linear"), which every loader (PEFT, vLLM) reads the same way."""
    import json

    from safetensors.torch import save_file

    weights = adapter_state(state_dict)
    if not weights:
        raise RuntimeError("export: the LoRA model has no adapter weights")
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights})
    cfg = lora_config({**lora, "targets": targets})
    cfg.base_model_name_or_path = lora["base"]["source"]
    cfg.inference_mode = True
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / ADAPTER_BASE_FILE).write_text(json.dumps(lora["base"], indent=1))
    if tokenizer:
        load_tokenizer(tokenizer, "--tokenizer", endpoint).save_pretrained(str(out))


def export_merged(adapter: Path, config: dict, tokenizer: str | None, out: Path,
                  endpoint: str | None = None) -> None:
    """Write `out` as a Hugging Face model folder: the base the adapter names (its
    rayfleet_base.json) with the adapter merged in (PEFT's merge_and_unload), as `export`."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    base = json.loads((adapter / ADAPTER_BASE_FILE).read_text())["source"]
    lm = AutoModelForCausalLM.from_pretrained(str(fetch(base, "--model", endpoint)),
                                              dtype=torch.float32)
    merged = merge_adapter(lm, adapter)
    export(merged.state_dict(), config, tokenizer, out, endpoint)
