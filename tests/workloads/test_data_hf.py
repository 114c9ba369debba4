"""workloads.data with a Hugging Face tokenizer (`--tokenizer FOLDER`): the text shape packed
with EOS between documents, shards redone when the tokenizer changes, the chat shape from an
s3:// tokenizer, and the one-line refusals; the SFT row builder without Ray. The instruction
shape's job output is checked row by row (`check_instruction_output`) on README's example,
which runs that job (tests/cluster/test_readme.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import BIN, run, summary_of
from workloads.common.shards import MANIFEST

DATA = [str(BIN / "python"), "-m", "workloads.data"]
# One tokenizer actor: each one loads transformers and the tokenizer (~3 s of a 2-core box).
ONE_ACTOR = ["--concurrency", "1"]
COLUMNS = {"instruction": "instruction", "response": "response"}


@pytest.fixture(scope="module")
def tok(hf_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_model_dir))


def read_rows(folder: Path) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("shard-*.parquet"))
    assert files, list(folder.iterdir())
    table = pq.read_table([str(f) for f in files]) if len(files) > 1 else pq.read_table(files[0])
    return {c: np.array(table.column(c).to_pylist(), dtype=np.int64)
            for c in table.column_names}


# --------------------------------------------------------------------------- no Ray

def test_sft_row_pads_masks_truncates_and_drops():
    from workloads.data.tokenize import IGNORE, sft_row

    tokens, labels, truncated = sft_row([([5, 6, 7], False), ([8, 9], True)], max_length=7,
                                        pad_id=0)
    assert tokens.dtype == np.int32 and labels.dtype == np.int32
    assert tokens.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert labels.tolist() == [IGNORE] * 3 + [8, 9] + [IGNORE] * 3
    assert truncated is False
    # Cut to max_length + 1: what is left of the response is still learned.
    tokens, labels, truncated = sft_row([([5, 6, 7], False), ([8, 9], True)], max_length=3,
                                        pad_id=0)
    assert tokens.tolist() == [5, 6, 7, 8] and labels.tolist() == [IGNORE] * 3 + [8]
    assert truncated is True
    # Nothing learnable within the window (or only at position 0, never a target): dropped.
    assert sft_row([([5, 6, 7], False), ([8, 9], True)], max_length=2, pad_id=0) is None
    assert sft_row([([8], True), ([5, 6], False)], max_length=4, pad_id=0) is None


def test_byte_instruction_rows_and_counts():
    from workloads.data.tokenize import IGNORE, Encoder, build_sft_rows

    records = [{"instruction": "ab", "response": "cd"},
               {"instruction": "a" * 20, "response": "x"},    # prompt fills the window
               {"instruction": "ab", "response": None},       # not text
               {"instruction": "ab", "response": "cdefghij"}]  # cut
    tokens, labels, counts = build_sft_rows(records, Encoder("byte"), "instruction", 7, COLUMNS)
    assert counts == {"records": 4, "rows": 2, "truncated": 1, "dropped": 1, "invalid": 1}
    assert bytes(tokens[0][:6].tolist()) == b"ab\ncd\n" and tokens[0][6:].tolist() == [0, 0]
    assert labels[0].tolist() == [IGNORE] * 3 + list(b"cd\n") + [IGNORE] * 2
    assert bytes(tokens[1].tolist()) == b"ab\ncdefg"
    assert labels[1].tolist() == [IGNORE] * 3 + list(b"cdefg")


def test_hf_instruction_and_chat_segments(tok):
    from workloads.data.tokenize import IGNORE, Encoder, build_sft_rows

    enc = Encoder(tok=tok)
    rec = {"instruction": "Repeat the word echo twice.", "response": "echo echo"}
    tokens, labels, counts = build_sft_rows([rec], enc, "instruction", 40, COLUMNS)
    assert counts["rows"] == 1
    learned = labels[0] != IGNORE
    # The prompt is the chat template's user turn and generation prompt, not learned.
    prompt = tok.apply_chat_template([{"role": "user", "content": rec["instruction"]}],
                                     tokenize=False, add_generation_prompt=True)
    n_prompt = int(np.argmax(learned))
    assert tok.decode(tokens[0][:n_prompt]) == prompt
    assert tok.decode(tokens[0][learned]) == "echo echo" + tok.eos_token
    assert (labels[0][learned] == tokens[0][learned]).all()
    assert (tokens[0][~learned][n_prompt:] == tok.pad_token_id).all()

    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "again"},
                         {"role": "assistant", "content": "hello hello"}]}
    tokens, labels, counts = build_sft_rows([chat], enc, "chat", 60, {"messages": "messages"})
    assert counts["rows"] == 1
    text = tok.decode(tokens[0][tokens[0] != tok.pad_token_id])
    assert text == tok.apply_chat_template(chat["messages"], tokenize=False)
    # Loss on both assistant turns (through their EOS), on nothing else.
    spans, cur = [], []
    for t, lab in zip(tokens[0], labels[0], strict=True):
        if lab != IGNORE:
            assert lab == t
            cur.append(int(t))
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    assert spans == ["hello" + tok.eos_token, "hello hello" + tok.eos_token]


# --------------------------------------------------------------------------- Ray

def check_instruction_output(out: Path, records: list[dict], tok, tokenizer_dir: str,
                             max_length: int) -> None:
    """What `workloads.data --shape instruction --tokenizer DIR` must have written to `out`
    for `records`: rows in input order, labels -100 on the prompt and padding and equal to the
    tokens on the response + EOS, the manifest and the done marker naming the tokenizer. Run
    on README's example output (tests/cluster/test_readme.py), which makes it with the real
    job."""
    rows = read_rows(out)
    tokens, labels = rows["tokens"], rows["labels"]
    assert tokens.shape == labels.shape == (len(records), max_length + 1)
    assert pq.read_schema(next(out.glob("shard-*.parquet"))).names == ["tokens", "labels"]
    manifest = json.loads((out / MANIFEST).read_text())
    from workloads.common.hf import tokenizer_identity

    assert manifest["tokenizer"] == tokenizer_identity(tok, tokenizer_dir)
    assert manifest["shape"] == "instruction" and manifest["pad_id"] == tok.pad_token_id
    assert manifest["max_length"] == manifest["seq_len"] == max_length
    assert (manifest["rows"], manifest["records"], manifest["truncated"],
            manifest["dropped"], manifest["invalid"]) == (len(records), len(records), 0, 0, 0)
    marker = json.loads((out / "_done" / "shard-00000.json").read_text())
    assert marker["tokenizer_sha256"] == manifest["tokenizer"]["sha256"]
    assert marker["shape"] == "instruction"
    for rec, t, lab in zip(records, tokens, labels, strict=True):   # rows in input order
        learned = lab != -100
        first = int(np.argmax(learned))
        prompt = tok.apply_chat_template([{"role": "user", "content": rec["instruction"]}],
                                         tokenize=False, add_generation_prompt=True)
        assert tok.decode(t[:first]) == prompt
        assert not learned[:first].any() and (lab[learned] == t[learned]).all()
        end = first + int(learned[first:].sum())
        assert learned[first:end].all()                # one contiguous response span
        assert tok.decode(t[first:end]) == rec["response"] + tok.eos_token
        assert (t[end:] == tok.pad_token_id).all() and (lab[end:] == -100).all()


@pytest.mark.ray
def test_text_shape_packs_with_eos_and_a_new_tokenizer_redoes_shards(
        ray_cluster, hf_model_dir, tok, tmp_path):
    from tests.hf_fixtures import make_tokenizer
    from workloads.data.pipeline import clean

    corpus = tmp_path / "corpus.jsonl"
    docs = [f"# doc {i}\n" + "def value(self, batch):\n    return step\n" * (i + 2)
            for i in range(24)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "text"
    args = ["--input", str(corpus), "--output", str(out), "--seq-len", "32", *ONE_ACTOR]
    proc = run(DATA + args + ["--tokenizer", str(hf_model_dir)], env=ray_cluster["env"],
               timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = summary_of(proc.stdout)
    assert (first["shards"], first["written"], first["shape"]) == (1, 1, "text")
    assert first["eos_id"] == tok.eos_token_id
    # The documents' ids with EOS after each, cut into windows of 33 every 32 tokens.
    stream = []
    for d in docs:
        stream += tok(clean({"text": d})["text"], add_special_tokens=False)["input_ids"]
        stream.append(tok.eos_token_id)
    expected = [stream[i * 32: i * 32 + 33] for i in range((len(stream) - 1) // 32)]
    rows = read_rows(out)["tokens"]
    assert list(rows.shape) == [len(expected), 33] and rows.tolist() == expected
    assert rows.max() < len(tok) and (rows == tok.eos_token_id).sum() >= 20

    other = make_tokenizer(tmp_path / "other-tok", vocab_size=300, corpus_bytes=60_000)
    proc = run(DATA + args + ["--tokenizer", str(tmp_path / "other-tok")],
               env=ray_cluster["env"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = summary_of(proc.stdout)
    assert (second["written"], second["skipped"]) == (1, 0)   # redone, not skipped
    assert second["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]
    assert second["tokenizer"]["vocab_size"] == len(other) == 300
    rows = read_rows(out)["tokens"]
    assert rows.max() < 300 and rows.max() >= 256   # the new vocabulary's merges
    assert json.loads((out / "_done" / "shard-00000.json").read_text())[
        "tokenizer_sha256"] == second["tokenizer"]["sha256"]


@pytest.mark.ray
def test_bad_hf_inputs_are_one_line_exit_2_nothing_written(ray_cluster, hf_model_dir,
                                                           sft_jsonl, tmp_path):
    from tests.hf_fixtures import make_tokenizer

    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text("{}")
    plain = make_tokenizer(tmp_path / "templated", vocab_size=280, corpus_bytes=30_000)
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "plain"))
    cfg = json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    assert not cfg.get("chat_template") and not (tmp_path / "plain" / "chat_template.jinja"
                                                 ).exists()
    hf = ["--tokenizer", str(hf_model_dir)]
    sft = ["--input", str(sft_jsonl)]
    ins = sft + ["--shape", "instruction"]
    cases = [
        (["--tokenizer", str(no_tok)] + ins, "--tokenizer: " + str(no_tok) +
         " holds no Hugging Face tokenizer"),
        (["--tokenizer", str(tmp_path / "missing")] + ins, "is not a folder"),
        (hf + ins + ["--response-column", "answer"],
         "--response-column: no column 'answer' in " + str(sft_jsonl) +
         " (columns: instruction, response)"),
        (hf + sft + ["--shape", "chat"], "--messages-column: no column 'messages'"),
        (["--tokenizer", str(tmp_path / "plain"), "--shape", "chat",
          "--messages-column", "instruction"] + sft, "has none"),
        (sft + ["--shape", "chat", "--messages-column", "instruction"], "not byte"),
        (hf + sft + ["--shape", "instructions"], "--shape: unknown shape 'instructions'"),
    ]
    for args, needle in cases:
        out = tmp_path / "out"
        proc = run(DATA + args + ["--output", str(out)], env=ray_cluster["env"], timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith("workloads.data: error:") and needle in lines[0], lines
        assert not out.exists()


@pytest.mark.ray
@pytest.mark.moto
def test_chat_shape_from_an_s3_tokenizer_learns_only_assistant_turns(
        ray_cluster, hf_model_dir, tok, s3_client, aws_env, tmp_path):
    # The tokenizer lives in S3 and only the driver has the keys (the cluster's processes do
    # not): the actors get its files from the driver.
    bucket = "rayfleet-test-data-tokenizer"
    s3_client.create_bucket(Bucket=bucket)
    for p in hf_model_dir.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors"):
            s3_client.upload_file(str(p), bucket, f"tiny-llama/{p.name}")
    words = ["alpha", "bravo", "charlie", "delta"]
    chats = [[{"role": "system", "content": "Answer in words."},
              {"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w},
              {"role": "user", "content": "Twice?"},
              {"role": "assistant", "content": f"{w} {w}"}] for w in words]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats)
                    + json.dumps({"messages": "not a conversation"}) + "\n")
    out, spec = tmp_path / "chat", f"s3://{bucket}/tiny-llama"
    proc = run(DATA + ["--tokenizer", spec, "--shape", "chat", "--input", str(data),
                       "--max-length", "128", "--output", str(out), *ONE_ACTOR],
               env={**ray_cluster["env"], **aws_env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / MANIFEST).read_text())
    from workloads.common.hf import tokenizer_identity

    assert manifest["tokenizer"] == tokenizer_identity(tok, spec)
    assert (manifest["shape"], manifest["rows"], manifest["records"], manifest["invalid"],
            manifest["truncated"], manifest["dropped"]) == ("chat", 4, 5, 1, 0, 0)
    rows = read_rows(out)
    for messages, t, lab in zip(chats, rows["tokens"], rows["labels"], strict=True):
        assert len(t) == 129
        real = t != tok.pad_token_id
        assert tok.decode(t[real]) == tok.apply_chat_template(messages, tokenize=False)
        assert not real[int(real.sum()):].any() and (lab[~real] == -100).all()
        spans, cur = [], []
        for i, lab_i in zip(t, lab, strict=True):
            if lab_i != -100:
                assert lab_i == i
                cur.append(int(i))
            elif cur:
                spans.append(tok.decode(cur))
                cur = []
        assert spans == [m["content"] + tok.eos_token for m in messages
                         if m["role"] == "assistant"]
