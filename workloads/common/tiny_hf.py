"""`python -m workloads.common.tiny_hf`: a stand-in for a Hub download, made offline in
seconds: a byte-level BPE tokenizer trained on this interpreter's standard library (with a chat
template), a tiny Llama-architecture model built from a `LlamaConfig`, both saved with
`save_pretrained` into one folder, and instruction records with a rule a model learns in a few
steps. The demo, the README's example and the tests feed it to the same `from_pretrained`
paths a real model takes.

    python -m workloads.common.tiny_hf --output runs/tiny-llama --sft runs/sft.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rayfleet.entrypoint import ArgumentParser, run_main
from workloads.common.corpus import stdlib_corpus

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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # "Writing model shards" on stderr, for a tiny file

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
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


def main(argv: list[str] | None = None) -> int:
    def _run(argv):
        p = ArgumentParser(prog="workloads.common.tiny_hf",
                           description="A tiny Llama + BPE tokenizer folder, made offline.")
        p.add_argument("--output", required=True, help="model folder to write")
        p.add_argument("--sft", default=None, help="also write instruction records (JSONL) here")
        p.add_argument("--records", type=int, default=200)
        args = p.parse_args(argv)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        folder = make_hf_model_dir(Path(args.output).expanduser())
        print(f"[rayfleet] tiny Llama and its tokenizer in {folder}", flush=True)
        if args.sft:
            path = write_jsonl(Path(args.sft).expanduser(), instruction_records(args.records))
            print(f"[rayfleet] {args.records} instruction records in {path}", flush=True)
        return 0

    return run_main(_run, argv, "workloads.common.tiny_hf")


if __name__ == "__main__":
    import sys

    sys.exit(main())
