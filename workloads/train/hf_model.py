"""Hugging Face causal LMs in the training loop: any architecture `AutoModelForCausalLM` knows,
from a model folder / s3:// prefix (`--model`) or from a config with fresh weights
(`--model-config`), wrapped so the loop drives it exactly like the kit's own GPT:
`model(x, y) -> (logits, loss)` and `model.blocks` (the decoder layers FSDP2 shards one by
one and `--compile` compiles).

The loss ignores label -100 (prompt and padding tokens of instruction data). The final
checkpoint also carries `hf/`: the gathered weights written with `save_pretrained`
(safetensors) and the tokenizer, loadable with `AutoModelForCausalLM.from_pretrained` and
served by `lm` and by vLLM (`ray.serve.llm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workloads.common.hf import fetch, load_tokenizer
from workloads.common.runs import HF_MODEL_KEY

IGNORE_INDEX = -100


@dataclass(frozen=True)
class HFSpec:
    """What the driver and the loop need to know of a Hugging Face model without building it
    (the same questions GPTConfig answers for the kit's model)."""
    config: dict            # the transformers config, as config.to_dict()
    seq_len: int            # the training context (from the dataset)
    n_params: int

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

    def flops_per_token(self) -> float:
        """Training FLOPs per token, as GPTConfig's (PaLM appendix B), counting the matmul
        weights only: an untied input embedding is a lookup, not a matmul."""
        lookup = 0 if self.config.get("tie_word_embeddings") else self.vocab_size * self.d_model
        return 6 * (self.n_params - lookup) + 12 * self.n_layer * self.d_model * self.seq_len

    def to_dict(self) -> dict:
        return {HF_MODEL_KEY: self.config, "seq_len": self.seq_len, "n_params": self.n_params}

    @classmethod
    def from_dict(cls, d: dict) -> HFSpec:
        return cls(config=d[HF_MODEL_KEY], seq_len=int(d["seq_len"]),
                   n_params=int(d["n_params"]))


def is_hf(model: dict) -> bool:
    return HF_MODEL_KEY in model


def make_config(config: dict):
    from transformers import AutoConfig

    rest = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **rest)


def count_params(config: dict) -> int:
    """Parameters of the model a config describes, counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(config))
    return sum(p.numel() for p in model.parameters())


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


def build(source: str | None, config: dict, activation_checkpointing: bool = False,
          endpoint: str | None = None) -> HFCausalLM:
    """The model in fp32 (master weights; autocast gives bf16 compute on GPU): pretrained
    weights from `source`, or fresh ones from `config` (seeded by the caller)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if source:
        lm = AutoModelForCausalLM.from_pretrained(str(fetch(source, "--model", endpoint)),
                                                  dtype=torch.float32)
    else:
        lm = AutoModelForCausalLM.from_config(make_config(config), dtype=torch.float32)
    if activation_checkpointing:
        # Recompute each layer's activations in backward: memory for compute.
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    return HFCausalLM(lm)


def export(state_dict: dict, config: dict, tokenizer: str | None, out: Path,
           endpoint: str | None = None) -> None:
    """Write `out` as a Hugging Face model folder: the full weights (keys of the wrapper, whose
    `lm.` prefix is dropped) with save_pretrained (safetensors) in the config's own dtype, and
    the tokenizer beside them."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = make_config(config)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(cfg)
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
