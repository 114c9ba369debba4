"""A GPT-style decoder-only LM: byte-level vocab, pre-norm blocks, PyTorch SDPA attention.

Sizes run from `tiny` (CPU smoke tests, ~0.1M parameters) to `1b` (A100/H100). The model is
plain PyTorch so the same module trains under Ray Train and under `torchrun`
(workloads.train) and is served by workloads.serve.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 256


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = BYTE_VOCAB
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def num_params(self) -> int:
        d, L, V, T = self.d_model, self.n_layer, self.vocab_size, self.seq_len
        per_block = 12 * d * d + 13 * d  # qkv+proj (4d^2), mlp (8d^2), biases and norms
        return V * d + T * d + L * per_block + 2 * d  # lm head is tied to the embedding

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L H Q T."""
        return 6 * self.num_params() + 12 * self.n_layer * self.d_model * self.seq_len


# Presets. `tiny` is for CPU smoke tests; 125m/350m/760m/1b follow GPT-3's table (with a
# 256-byte vocabulary, so parameter counts are a little lower than the names say).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),
    "125m": GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "350m": GPTConfig(seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "760m": GPTConfig(seq_len=1024, n_layer=24, n_head=16, d_model=1536),
    "1b": GPTConfig(seq_len=2048, n_layer=24, n_head=16, d_model=2048),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA picks flash / memory-efficient kernels on GPU and a fused CPU kernel here.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc_out.weight")):
                # GPT-2's scaled init of residual projections keeps activations stable in depth.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        # Weight tying: the output projection reuses the token embedding.
        logits = F.linear(self.ln_f(x), self.tok.weight)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None):
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.seq_len:])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
