"""The tokenizer stages of `workloads.data`, each a stateful callable for Ray Data's actor pool
(built once per actor), and the pure functions behind them (tested without Ray).

  ByteTokenizer   text shape, `--tokenizer byte`: UTF-8 bytes are the ids (256), "\\n" after
                  each document
  HFTokenizer     text shape, a Hugging Face fast tokenizer: its Rust backend's batched
                  encode (what `tok(texts, add_special_tokens=False)` runs), EOS after each
                  document (the packer then cuts the stream into seq_len + 1 windows)
  SFTBuilder      instruction / chat shapes: one row per record, `tokens` and `labels` of
                  max_length + 1 each (`sft_row`); no packing

SFT rows: `tokens` is right-padded with the pad id; `labels` holds the token where the model
learns it (response / assistant turns, their EOS included) and IGNORE (-100) on prompt tokens
and padding. Training takes x = tokens[:, :-1], y = labels[:, 1:].
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from workloads.common.hf import load_tokenizer

IGNORE = -100
SHAPES = ("text", "instruction", "chat")
BYTE = "byte"

# A segment of a record: text to tokenize, or ids as they are; and whether it is learned.
Segment = tuple[str | list[int], bool]
Render = Callable[[list[dict], bool], str]   # (messages, add_generation_prompt) -> text


class ByteTokenizer:
    """Stateful tokenizer for the actor pool: bytes are the vocabulary (256 ids, what the
    kit's byte GPT, workloads.common.model, reads). Built once per actor; counts what it has
    seen."""

    def __init__(self, separator: bytes = b"\n"):
        self.separator = separator
        self.docs = 0
        self.tokens = 0

    def __call__(self, batch: dict) -> dict:
        ids = [np.frombuffer(t.encode("utf-8") + self.separator, dtype=np.uint8)
               for t in batch["text"]]
        self.docs += len(ids)
        self.tokens += sum(len(i) for i in ids)
        return {"ids": ids}


# Not part of a tokenizer: left out of what the driver hands the actors.
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack", ".ckpt")
MAX_FILE = 64 << 20


def tokenizer_files(folder: Path) -> dict[str, bytes]:
    """The files of a (fetched) tokenizer folder a tokenizer load reads, weights left out: what
    the driver hands each SFT actor, which may run on a node that sees neither the driver's
    folder nor its S3 credentials."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.endswith(WEIGHTS) and p.stat().st_size <= MAX_FILE}


def load_in_actor(spec: str, endpoint: str | None = None,
                  files: dict[str, bytes] | None = None):
    """`load_tokenizer` for one actor of the pool: of `files` (tokenizer_files) when given,
    through a temporary folder, else of `spec`. The pool's actors are the parallelism: the
    tokenizers library's own threads (one per core, in every actor) are turned off unless
    TOKENIZERS_PARALLELISM says otherwise."""
    import os
    import shutil
    import tempfile

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not files:
        return load_tokenizer(spec, "--tokenizer", endpoint)
    folder = Path(tempfile.mkdtemp(prefix="rayfleet-tokenizer-"))
    try:
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return load_tokenizer(str(folder), "--tokenizer")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ship(tok) -> dict:
    """What HFTokenizer needs of a loaded fast tokenizer for the text shape, as plain values
    the driver hands every actor: the Rust tokenizer that `tok(texts)` runs (serialized, the
    very definition `tokenizer_identity` hashes), its EOS id, and its special-token flag."""
    return {"backend": tok.backend_tokenizer.to_str(), "eos_id": tok.eos_token_id,
            "split_special_tokens": bool(getattr(tok, "split_special_tokens", False))}


class HFTokenizer:
    """A Hugging Face fast tokenizer in the actor pool, the EOS id after every document, one
    batched call per batch. Built from `ship(tok)` of the driver's tokenizer (the backend that
    `tok(texts, add_special_tokens=False)` calls, so the same ids, and no transformers import:
    an actor starts in a blink instead of ~3 s of CPU, once per shard), or else loaded here
    with load_tokenizer from `spec` (a folder or an s3:// prefix)."""

    def __init__(self, spec: str | None = None, endpoint: str | None = None,
                 backend: str | None = None, eos_id: int | None = None,
                 split_special_tokens: bool = False):
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # see load_in_actor
        if backend is None:
            tok = load_in_actor(spec, endpoint)
            backend, eos_id = tok.backend_tokenizer.to_str(), tok.eos_token_id
            split_special_tokens = bool(getattr(tok, "split_special_tokens", False))
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(backend)
        # What transformers sets on the backend before every call (its split_special_tokens).
        self.tok.encode_special_tokens = split_special_tokens
        self.eos = eos_id

    def __call__(self, batch: dict) -> dict:
        texts = [str(t) for t in batch["text"]]
        enc = self.tok.encode_batch(texts, add_special_tokens=False) if texts else []
        return {"ids": [np.array(e.ids + [self.eos], dtype=np.int32) for e in enc]}


# --------------------------------------------------------------------------- SFT rows

def sft_row(segments: list[tuple[list[int], bool]], max_length: int, pad_id: int):
    """One SFT row from tokenized segments: (tokens, labels, truncated), both int32 arrays of
    max_length + 1; or None when no learnable token is left after truncation (labels[0] is
    never a target, since y = labels[1:])."""
    width = max_length + 1
    ids: list[int] = []
    learn: list[bool] = []
    for seg, learned in segments:
        ids.extend(seg)
        learn.extend([learned] * len(seg))
    truncated = len(ids) > width
    ids, learn = ids[:width], learn[:width]
    if not any(learn[1:]):
        return None
    tokens = np.full(width, pad_id, dtype=np.int32)
    labels = np.full(width, IGNORE, dtype=np.int32)
    arr = np.asarray(ids, dtype=np.int32)
    tokens[:len(ids)] = arr
    labels[:len(ids)] = np.where(np.asarray(learn, dtype=bool), arr, IGNORE)
    return tokens, labels, truncated


def instruction_segments(instruction: str, response: str, render: Render | None,
                         bos: list[int], eos: list[int]) -> list[Segment]:
    """The prompt (the chat template's user turn plus its generation prompt, or else the
    instruction and a newline after the BOS) is not learned; the response and the EOS are."""
    if render is not None:
        prompt: list[Segment] = [(render([{"role": "user", "content": instruction}], True),
                                  False)]
    else:
        prompt = [(list(bos), False), (instruction + "\n", False)]
    return prompt + [(response, True), (list(eos), True)]


def chat_segments(messages: list[dict], render: Render, eos_text: str) -> list[Segment]:
    """The conversation rendered by the chat template, split into text segments: each
    assistant turn (from after its generation prompt through its EOS) learned, the rest not.
    Each turn's span is found by rendering the conversation up to it, so the template must
    render a conversation as a prefix of its continuation (ValueError otherwise)."""
    full = render(messages, False)
    segments: list[Segment] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render(messages[:i], True)
        upto = render(messages[:i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= cursor):
            raise ValueError("the chat template does not render turns incrementally")
        span = full[len(before):len(upto)]
        end = span.rfind(eos_text) + len(eos_text) if eos_text and eos_text in span \
            else len(span)
        segments += [(full[cursor:len(before)], False), (span[:end], True)]
        cursor = len(before) + end
    segments.append((full[cursor:], False))
    return [s for s in segments if len(s[0])]


class Encoder:
    """What SFT rows need of a tokenizer, for 'byte' or a Hugging Face one: batched encoding
    without special tokens, the pad / BOS / EOS ids, the chat template as a render function."""

    def __init__(self, spec: str = BYTE, endpoint: str | None = None, tok=None,
                 files: dict[str, bytes] | None = None):
        if spec == BYTE and tok is None:
            self.tok, self.render = None, None
            self.pad_id, self.bos, self.eos, self.eos_text = 0, [], list(b"\n"), "\n"
            return
        if tok is None:
            tok = load_in_actor(spec, endpoint, files)
        self.tok = tok
        self.pad_id = tok.pad_token_id
        self.bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        self.eos, self.eos_text = [tok.eos_token_id], tok.eos_token
        self.render = self._render if getattr(tok, "chat_template", None) else None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.tok is None:
            return [list(t.encode("utf-8")) for t in texts]
        return self.tok(texts, add_special_tokens=False, return_attention_mask=False)[
            "input_ids"]


def _messages(value) -> list[dict] | None:
    """A record's messages as [{role, content}], None keys dropped; None if malformed."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    out = []
    for m in value:
        if not isinstance(m, dict):
            return None
        m = {k: v for k, v in m.items() if v is not None}
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append(m)
    return out


def build_sft_rows(records: list[dict], enc: Encoder, shape: str, max_length: int,
                   columns: dict[str, str]) -> tuple[np.ndarray, np.ndarray, dict]:
    """SFT rows of a batch of records: (tokens, labels) as (n, max_length + 1) int32 arrays
    and counts {records, rows, truncated, dropped (no learnable token left), invalid (a field
    missing or not text / not a list of {role, content}, or the template failed)}.
    `columns` names the record fields: instruction + response, or messages."""
    counts = {"records": len(records), "rows": 0, "truncated": 0, "dropped": 0, "invalid": 0}
    per_record: list[list[Segment]] = []
    for r in records:
        try:
            if shape == "instruction":
                ins, resp = r.get(columns["instruction"]), r.get(columns["response"])
                if not isinstance(ins, str) or not isinstance(resp, str):
                    raise ValueError("not text")
                per_record.append(instruction_segments(ins, resp, enc.render, enc.bos, enc.eos))
            else:
                msgs = _messages(r.get(columns["messages"]))
                if msgs is None or enc.render is None:
                    raise ValueError("not a conversation")
                per_record.append(chat_segments(msgs, enc.render, enc.eos_text))
        except Exception:  # a malformed record or a template error: counted, not fatal
            counts["invalid"] += 1
    texts = [s for segs in per_record for s, _ in segs if isinstance(s, str)]
    encoded = iter(enc.encode(texts))
    tokens, labels = [], []
    for segs in per_record:
        row = sft_row([(next(encoded) if isinstance(s, str) else s, learn) for s, learn in segs],
                      max_length, enc.pad_id)
        if row is None:
            counts["dropped"] += 1
            continue
        tokens.append(row[0])
        labels.append(row[1])
        counts["truncated"] += row[2]
    counts["rows"] = len(tokens)
    width = max_length + 1
    return (np.stack(tokens) if tokens else np.zeros((0, width), np.int32),
            np.stack(labels) if labels else np.zeros((0, width), np.int32), counts)


class SFTBuilder:
    """The instruction / chat stage for the actor pool: Arrow batches of records in, SFT rows
    out; the counts go to a tally actor (`tally.add`), awaited so that the driver's read after
    the write sees every batch's."""

    def __init__(self, spec: str, shape: str, max_length: int, columns: dict[str, str],
                 endpoint: str | None = None, tally=None, files: dict[str, bytes] | None = None):
        self.enc = Encoder(spec, endpoint, files=files)
        self.shape, self.max_length, self.columns, self.tally = shape, max_length, columns, tally

    def __call__(self, batch) -> dict:
        records = batch.select(list(self.columns.values())).to_pylist()
        tokens, labels, counts = build_sft_rows(records, self.enc, self.shape,
                                                self.max_length, self.columns)
        if self.tally is not None:
            import ray

            ray.get(self.tally.add.remote(counts))
        return {"tokens": tokens, "labels": labels}


class Tally:
    """Sums the SFT counts of every batch of a shard (a Ray actor, num_cpus=0); `take`
    returns them and starts over for the next shard."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, counts: dict) -> None:
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + int(v)

    def take(self) -> dict:
        counts, self.counts = self.counts, {}
        return counts
