"""What the Hugging Face tests feed the real loading code, since nothing can be downloaded: the
tiny model, tokenizer and instruction records of workloads.common.tiny_hf, and instruction rows
in workloads.data's layout written without Ray."""

from __future__ import annotations

import json
from pathlib import Path

from workloads.common.shards import MANIFEST, shard_name
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
    """Instruction rows as workloads.data writes them (its own row builder, the function its
    actors run), with a manifest naming the tokenizer, but without Ray: for the loop's tests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workloads.common.hf import load_tokenizer, tokenizer_identity
    from workloads.data.tokenize import Encoder, build_sft_rows

    tok = load_tokenizer(tokenizer_dir)
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    tokens, labels, counts = build_sft_rows(
        records, Encoder(tok=tok), "instruction", max_length,
        {"instruction": "instruction", "response": "response"})
    assert counts["rows"] == len(records), counts
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"tokens": pa.array(tokens.tolist(), pa.list_(pa.int32())),
                             "labels": pa.array(labels.tolist(), pa.list_(pa.int32()))}),
                   out / f"{shard_name(0)}-000.parquet")
    (out / MANIFEST).write_text(json.dumps({
        "seq_len": max_length, "shape": "instruction",
        "tokenizer": tokenizer_identity(tok, tokenizer_dir)}))
    return out
