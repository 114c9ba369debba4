"""What the Hugging Face tests feed the real loading code, since nothing can be downloaded: the
tiny model, tokenizer and instruction records of workloads.common.tiny_hf, and instruction rows
in workloads.data's layout written without Ray."""

from __future__ import annotations

import json
from pathlib import Path

from workloads.common.tiny_hf import (  # noqa: F401  (re-exported for the tests)
    CHAT_TEMPLATE,
    SPECIAL,
    instruction_records,
    make_hf_model_dir,
    make_model,
    make_tokenizer,
    write_jsonl,
)


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
