"""The `lm` app's engines: what turns text into token ids, decodes one token per step for a
batch of requests, and turns generated ids back into text as they stream.

- `Engine`: the kit's byte-level GPT (workloads.common.model, from a workloads.train
  checkpoint); tokens are UTF-8 bytes.
- `HFEngine`: a Hugging Face causal LM (`save_pretrained` folder, local or s3://, or the
  `hf/` export of a run's final checkpoint) with its tokenizer, on CPU in float32.

Both have the interface `LMCore` (workloads/serve/lm.py) drives from its `@serve.batch` loop:
`encode`, `chat_text`, `context` / `max_prompt`, `room`, `step`, `is_eos`, `decoder`,
`completion_tokens`, `generator_for`, `health_check`.
"""

from __future__ import annotations

import codecs
import collections
import os
from dataclasses import dataclass, field

from workloads.common import hf


@dataclass
class GenRequest:
    prompt: bytes | list[int]     # bytes for the byte GPT, token ids for a HF model
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    generated: int = 0            # tokens decoded so far (EOS included), for usage


class _Sampling:
    """Greedy / temperature / top-k sampling with a per-request seeded generator."""

    torch = None

    def _sample(self, logits, req: GenRequest, gen) -> int:
        torch = self.torch
        if req.temperature <= 0:
            return int(logits.argmax())
        logits = logits / req.temperature
        if req.top_k:
            kth = torch.topk(logits, min(req.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))

    def generator_for(self, req: GenRequest):
        g = self.torch.Generator()
        g.manual_seed(req.seed if req.seed is not None else int.from_bytes(os.urandom(4), "little"))
        return g


# --------------------------------------------------------------------------- byte GPT

class ByteDecoder:
    """UTF-8 bytes in, text out: a character split over several bytes waits for its last."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tok: int) -> str:
        return self._dec.decode(bytes([tok]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class Engine(_Sampling):
    """The kit's byte GPT (workloads.common.model) decoding several requests at once.
    Sequences of the same length share one forward pass (the model has no padding mask, and
    learned positions make left padding change the answer); the common case, equal prompts,
    is one matmul."""

    kind = "byte"
    unit = "tokens (bytes)"

    def __init__(self, model_config: dict, state_dict: dict):
        import torch

        # Here, not at the top: it imports torch (a second), and the app builders and
        # `rayfleet serve-config` import this module to check a config; only a replica runs it.
        from workloads.common.model import GPT, GPTConfig

        self.torch = torch
        self.cfg = GPTConfig.from_dict(model_config)
        self.model = GPT(self.cfg)
        self.model.load_state_dict(state_dict)
        self.model.eval()

    @property
    def context(self) -> int:
        return self.cfg.seq_len

    @property
    def max_prompt(self) -> int:
        return self.context      # the window slides: a full-context prompt still decodes

    def encode(self, text: str, special: bool = True) -> bytes:
        return text.encode("utf-8")

    def chat_text(self, messages: list[dict]) -> tuple[str, bool] | None:
        return None              # lm's own `chat_prompt` layout

    def room(self, seq: list[int]) -> int:
        return 1 << 30           # never full: the window slides

    def is_eos(self, tok: int) -> bool:
        return False

    def decoder(self, prompt) -> ByteDecoder:
        return ByteDecoder()

    def completion_tokens(self, req: GenRequest, text: str) -> int:
        return len(text.encode("utf-8"))

    def health_check(self) -> None:
        self.step([[10]], [GenRequest(b"\n", 1, temperature=0)], [None])

    def step(self, seqs: list[list[int]], reqs: list[GenRequest], gens: list) -> list[int]:
        """One new token for every sequence."""
        torch = self.torch
        out: list[int] = [0] * len(seqs)
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for i, s in enumerate(seqs):
            groups[min(len(s), self.context)].append(i)
        with torch.no_grad():
            for length, idxs in groups.items():
                x = torch.tensor([seqs[i][-length:] for i in idxs], dtype=torch.long)
                logits = self.model(x)[:, -1, :]
                for row, i in enumerate(idxs):
                    out[i] = self._sample(logits[row], reqs[i], gens[i])
        return out


# --------------------------------------------------------------------------- Hugging Face

class HFDecoder:
    """Incremental detokenization: decode all generated ids (after a few prompt ids, so a
    tokenizer that drops a leading space on the first token still gets it right) and emit
    what is new. A character split over several byte tokens, or a piece whose text a later
    merge changes, is held back until it is whole (the decoded text ends in U+FFFD)."""

    CONTEXT_IDS = 4

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ctx = list(prompt_ids[-self.CONTEXT_IDS:])
        self.ctx_text = self._decode(self.ctx)
        self.ids: list[int] = []
        self.emitted = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True,
                               clean_up_tokenization_spaces=False)

    def text(self) -> str:
        full = self._decode(self.ctx + self.ids)
        if self.ctx and full.startswith(self.ctx_text):
            return full[len(self.ctx_text):]
        return self._decode(self.ids)

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.text()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""            # an unfinished character: wait for its next byte
        new, self.emitted = text[len(self.emitted):], text
        return new

    def flush(self) -> str:
        text = self.text()
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new


class HFEngine(_Sampling):
    """A Hugging Face causal LM on CPU. Requests of different lengths decode in one forward
    pass: left-padded, with an attention mask and position ids counted from each sequence's
    first real token, so a padded row computes what it would alone. No KV cache: each step
    recomputes the (short, CPU-sized) context, which keeps joining and leaving the batch
    between steps free."""

    kind = "hf"
    unit = "tokens"

    def __init__(self, model, tokenizer):
        import torch

        self.torch = torch
        self.model = model.eval()
        self.tok = tokenizer
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        self._context = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        eos: set[int] = set()
        for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id",
                                                       None), getattr(cfg, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(int(t) for t in source)
        self.eos = eos
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @classmethod
    def load(cls, spec: str, adapter: str | None = None) -> HFEngine:
        """The model and tokenizer of a folder or s3:// prefix (copied once per process), with
        the LoRA adapter of folder `adapter` merged into its weights when given (one model
        per replica: merged, it decodes as fast as the base)."""
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        folder = hf.fetch(spec, "args.checkpoint")
        tok = hf.load_tokenizer(str(folder), "args.checkpoint")
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        if adapter:
            model = hf.merge_adapter(model, hf.fetch(adapter, "args.adapter"))
        return cls(model, tok)

    @property
    def context(self) -> int:
        return self._context

    @property
    def max_prompt(self) -> int:
        return self._context - 1   # room for at least one new token

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=special).input_ids)

    def chat_text(self, messages: list[dict]) -> tuple[str, bool] | None:
        """The conversation rendered with the tokenizer's chat template (which places its own
        special tokens, so the text is encoded without adding more), or None without one."""
        if not getattr(self.tok, "chat_template", None):
            return None
        text = self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True)
        return text, False

    def room(self, seq: list[int]) -> int:
        return self._context - len(seq)

    def is_eos(self, tok: int) -> bool:
        return tok in self.eos

    def decoder(self, prompt) -> HFDecoder:
        return HFDecoder(self.tok, list(prompt))

    def completion_tokens(self, req: GenRequest, text: str) -> int:
        return req.generated

    def health_check(self) -> None:
        first = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.pad
        self.step([[first]], [GenRequest([first], 1, temperature=0)], [None])

    def step(self, seqs: list[list[int]], reqs: list[GenRequest], gens: list) -> list[int]:
        """One new token for every sequence, all in one left-padded forward pass."""
        torch = self.torch
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[row, width - len(s):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                use_cache=False).logits[:, -1, :].float()
        return [self._sample(logits[row], reqs[row], gens[row]) for row in range(len(seqs))]
