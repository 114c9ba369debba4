"""What the Hugging Face tests feed the real loading code, since nothing can be downloaded: a
BPE tokenizer trained in about a second on this interpreter's standard library, a tiny
Llama-architecture model built from a `LlamaConfig`, both saved with `save_pretrained` into
one folder, and a small instruction dataset whose answers a model can learn in a few steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
# A chat template in the usual role-header style (the tokenizer carries it; `lm` and
# workloads.data render `messages` with it).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
    "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_tokenizer(folder: Path, vocab_size: int = 512, corpus_bytes: int = 400_000):
    """Train a byte-level BPE tokenizer and save it as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workloads.train.data import stdlib_corpus

    text = stdlib_corpus(corpus_bytes).decode("utf-8", errors="ignore")
    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL.values()) + ["<|user|>",
                                                                      "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast


def make_model(folder: Path, vocab_size: int, *, hidden: int = 64, layers: int = 2,
               seed: int = 0, save: bool = True, tokenizer=None):
    """A tiny Llama (GQA, RoPE, SwiGLU: the real architecture, ~0.1M parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=getattr(tokenizer, "bos_token_id", None),
                      eos_token_id=getattr(tokenizer, "eos_token_id", None),
                      pad_token_id=getattr(tokenizer, "pad_token_id", None))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if save:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(folder))
    return model


def make_hf_model_dir(folder: Path, vocab_size: int = 512, **kw) -> Path:
    """Tokenizer and model in one folder, as a Hub download looks."""
    tok = make_tokenizer(folder, vocab_size=vocab_size)
    make_model(folder, len(tok), tokenizer=tok, **kw)
    return folder


def instruction_records(n: int = 200, seed: int = 0) -> list[dict]:
    """Instruction/response pairs with a learnable rule: the response repeats a word of the
    instruction. Prompts vary, answers are short, so SFT's loss falls within a few steps."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    out = []
    for _ in range(n):
        w = rng.choice(words)
        out.append({"instruction": f"Repeat the word {w} twice.", "response": f"{w} {w}"})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_sft_dataset(records_path: Path, out: Path, tokenizer_dir: str, max_length: int) -> Path:
    """Instruction rows in workloads.data's layout (tokens + labels, -100 on the prompt and
    padding, a manifest naming the tokenizer), written without Ray for the loop's tests."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workloads.common.hf import load_tokenizer, tokenizer_identity

    tok = load_tokenizer(tokenizer_dir)
    tokens, labels = [], []
    for line in records_path.read_text().splitlines():
        r = json.loads(line)
        prompt = tok.apply_chat_template([{"role": "user", "content": r["instruction"]}],
                                         tokenize=False, add_generation_prompt=True)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(r["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids, lab = (p + a)[:max_length + 1], ([-100] * len(p) + a)[:max_length + 1]
        pad = max_length + 1 - len(ids)
        tokens.append(ids + [tok.pad_token_id] * pad)
        labels.append(lab + [-100] * pad)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"tokens": pa.array(np.array(tokens, np.int32).tolist(),
                                                pa.list_(pa.int32())),
                             "labels": pa.array(labels, pa.list_(pa.int32()))}),
                   out / "shard-00000-000.parquet")
    (out / "_manifest.json").write_text(json.dumps({
        "seq_len": max_length, "shape": "instruction",
        "tokenizer": tokenizer_identity(tok, tokenizer_dir)}))
    return out
