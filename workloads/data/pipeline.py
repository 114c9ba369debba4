"""`python -m workloads.data`: a Ray Data streaming pipeline from raw text to the packed
training sequences `workloads.train --dataset` reads.

    ray job submit --working-dir . -- python -m workloads.data --smoke-test --output runs/data
    ray job submit --working-dir . -- python -m workloads.data \
        --input s3://my-bucket/raw/ --column text --output s3://my-bucket/data/seq1024 \
        --seq-len 1024 --concurrency 8
    python -m workloads.data --tokenizer s3://my-bucket/models/llama/ --shape instruction \
        --input s3://my-bucket/sft/ --max-length 1024 --output s3://my-bucket/data/sft1024

Stages (streamed block by block, never the whole corpus in memory):
  read     text files (one row per file), JSONL or Parquet (`--column`), local or s3://
  clean    `map_batches` (one task per block): the kit's text cleaning (workloads/common/
           text.py: newlines normalised, non-UTF-8 documents discarded), then documents too
           short or with minified lines dropped
  tokenize `map_batches` over an actor pool of stateful tokenizers (workloads/data/tokenize.py):
           bytes (`--tokenizer byte`) or a Hugging Face tokenizer folder / s3:// prefix (loaded
           on the driver, which hands it to the actors: they need no S3 access or shared disk)
  pack     `map_batches`: concatenate and cut into windows of seq_len + 1 (column `tokens`)
  write    Parquet, one shard per group of input files: `shard-00003-000.parquet`, ...

`--shape instruction|chat` (supervised fine-tuning, JSONL / Parquet records) skips clean and
pack: the actor pool (`SFTBuilder`, which loads the driver's tokenizer files) turns each record
into one row of `tokens` (right-padded with the pad id) and `labels` (-100 on prompt and
padding), max_length + 1 each; `_manifest.json` counts the truncated and dropped records.

Input files are sorted and grouped into shards by size, so shard i always covers the same
files. A shard is written to a temporary folder, moved into place, and only then marked done
(`_done/shard-00003.json`, which records the tokenizer's sha256, the shape and seq_len); a
re-run skips done shards made the same way and redoes any other or half-written one.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path

import numpy as np

from rayfleet.errors import ConfigError, RayfleetError
from rayfleet.entrypoint import ArgumentParser, at_least, run_main
from workloads.common.deps import require
from workloads.common.hf import BYTE_TOKENIZER, fetch, load_tokenizer, tokenizer_identity
from workloads.common.shards import (
    STDLIB,
    Inputs,
    clear_partial,
    drop_marker,
    drop_partial,
    list_inputs,
    read_marker,
    shards_of,
    write_manifest,
    write_shard,
)
from workloads.common.storage import default_root, resolve, user_path
from workloads.common.text import clean_text
from workloads.data.tokenize import (  # noqa: F401  (ByteTokenizer: bench imports it here)
    BYTE, IGNORE, SHAPES, ByteTokenizer, HFTokenizer, SFTBuilder, Tally, ship, tokenizer_files)

PROG = "workloads.data"

COUNTS = ("records", "truncated", "dropped", "invalid")   # SFT shapes, per shard and in all
DEFAULTS = {"seq_len": 128, "max_bytes": 0, "shard_bytes": 8 << 20}
SMOKE = {"seq_len": 64, "max_bytes": 768 << 10, "shard_bytes": 256 << 10}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Ray Data: raw text -> packed token sequences.")
    p.add_argument("--smoke-test", action="store_true",
                   help="768 KiB of the stdlib corpus, seq_len 64 (the train smoke model)")
    p.add_argument("--input", default=STDLIB,
                   help="'stdlib' (this Python's standard library source, offline) or a "
                        "folder / file / s3:// prefix of .txt/.py/.md, .jsonl or .parquet")
    p.add_argument("--format", default="auto", help="auto (by extension), text, jsonl, parquet")
    p.add_argument("--column", default="text", help="text column of JSONL / Parquet input")
    p.add_argument("--tokenizer", default=BYTE,
                   help="'byte' (256 ids, the kit's byte GPT) or a Hugging Face tokenizer "
                        "folder / s3:// prefix (as save_pretrained writes it)")
    p.add_argument("--shape", default="text",
                   help="text: documents packed into seq_len + 1 windows (EOS between them); "
                        "instruction: --instruction-column / --response-column records; chat: "
                        "--messages-column conversations (both: one padded row of tokens + "
                        "labels per record, loss on the response / assistant turns only)")
    p.add_argument("--instruction-column", default="instruction",
                   help="prompt column of --shape instruction")
    p.add_argument("--response-column", default="response",
                   help="answer column of --shape instruction")
    p.add_argument("--messages-column", default="messages",
                   help="column of --shape chat: a list of {role, content}")
    p.add_argument("--output", default=os.path.join(default_root(), "data"),
                   help="folder or s3:// prefix for the Parquet shards (default under "
                        "$RAYFLEET_STORAGE, else ~/rayfleet-runs)")
    p.add_argument("--seq-len", "--max-length", dest="seq_len", type=int, default=None,
                   help="model context (--max-length is the same setting); each row holds "
                        "seq_len + 1 tokens (match the model); longer SFT records are cut")
    p.add_argument("--max-bytes", type=at_least(0), default=None,
                   help="stop listing input after this")
    p.add_argument("--shard-bytes", type=at_least(1), default=None,
                   help="input bytes per output shard")
    p.add_argument("--min-chars", type=at_least(0), default=32,
                   help="drop documents shorter than this")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="rows per tokenizer batch")
    p.add_argument("--concurrency", type=at_least(1), default=2, help="tokenizer actors (max)")
    p.add_argument("--tokenizer-cpus", type=float, default=0.25, help="CPUs per tokenizer actor")
    p.add_argument("--pack-rows", type=at_least(1), default=256,
                   help="documents packed together (the tail of each group is dropped)")
    p.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL")
    return p


# --------------------------------------------------------------------------- stages

def clean(row: dict) -> dict:
    """The kit's text cleaning (workloads.common.text) and one newline to end the document
    (documents are concatenated); a discarded one is a bare newline, which `keep` drops."""
    return {"text": clean_text(row["text"]) + "\n"}


def keep(row: dict, min_chars: int) -> bool:
    text = row["text"]
    # Never an empty one, even at --min-chars 0: that is what `clean` left of a discarded one.
    if len(text.strip()) < max(1, min_chars):
        return False
    # Minified or generated files (very long lines) teach a byte model nothing useful.
    return max((len(line) for line in text.split("\n")), default=0) <= 1000


def clean_batch(batch: dict, min_chars: int) -> dict:
    """`clean` + `keep` over a whole batch: one Ray Data task per block instead of a row-at-a-
    time `map` and `filter` (Ray Data's per-row overhead was most of the pipeline's CPU for a
    byte tokenizer; see BENCHMARKS.md)."""
    texts = [clean({"text": t})["text"] for t in batch["text"]]
    kept = [t for t in texts if keep({"text": t}, min_chars)]
    return {"text": np.array(kept, dtype=object)}


def make_packer(seq_len: int):
    def pack(batch: dict) -> dict:
        # uint8 ids (bytes) stay uint8 until the windows are cut: a quarter of the copying.
        flat = (np.concatenate([np.asarray(i) for i in batch["ids"]])
                if len(batch["ids"]) else np.zeros(0, np.int32))
        n = (len(flat) - 1) // seq_len if len(flat) > seq_len else 0
        # Windows of seq_len + 1 starting every seq_len tokens: inputs [:-1], targets [1:],
        # the layout the training loop's byte blocks have too.
        tokens = np.stack([flat[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
                          ).astype(np.int32) if n else np.zeros((0, seq_len + 1), np.int32)
        return {"tokens": tokens}
    return pack


# --------------------------------------------------------------------------- inputs

def read(inputs: Inputs, paths: list[str], column: str, columns: list[str] | None = None):
    """The input as a dataset of one `text` column, or of `columns` as they are (SFT)."""
    import ray.data

    fs = inputs.filesystem
    if inputs.fmt == "text":
        ds = ray.data.read_binary_files(paths, filesystem=fs)
        return ds.rename_columns({"bytes": "text"})
    if inputs.fmt == "jsonl":
        ds = ray.data.read_json(paths, filesystem=fs, lines=True)
    else:
        ds = ray.data.read_parquet(paths, filesystem=fs)
    # The column was checked on the first file before Ray started (check_first_file); asking
    # Ray for ds.schema() here would execute the read once more per shard.
    if columns is not None:
        return ds.select_columns(list(dict.fromkeys(columns)))
    return ds.select_columns([column]).rename_columns({column: "text"})


def sft_columns(args) -> dict[str, str]:
    """The record fields an SFT shape reads, by role."""
    if args.shape == "instruction":
        return {"instruction": args.instruction_column, "response": args.response_column}
    return {"messages": args.messages_column}


def needed_columns(args) -> dict[str, str]:
    """Input column -> the flag that names it, for check_first_file."""
    if args.shape == "text":
        return {args.column: "--column"}
    flags = {"instruction": "--instruction-column", "response": "--response-column",
             "messages": "--messages-column"}
    return {col: flags[role] for role, col in sft_columns(args).items()}


def build_pipeline(inputs: Inputs, paths: list[str], args, tally=None,
                   shipped: dict | None = None):
    """The dataset of one shard. `args.tokenizer` / `args.shape` default to byte / text;
    `tally` (a Tally actor) receives the SFT shapes' counts; `shipped` is what the driver
    hands the actors of its loaded tokenizer: tokenize.ship (text shape: no transformers in
    the actors) or {"files": tokenize.tokenizer_files} (SFT: no S3 or shared folder needed)."""
    from ray.data import ActorPoolStrategy

    spec = getattr(args, "tokenizer", BYTE)
    shape = getattr(args, "shape", "text")
    endpoint = getattr(args, "s3_endpoint", None)
    # A Hugging Face tokenizer's actor takes seconds to start (transformers' imports): all of
    # them start at once, not one by one as the queue grows. Byte actors start in a blink.
    pool = {"compute": ActorPoolStrategy(min_size=1 if spec == BYTE else args.concurrency,
                                         max_size=args.concurrency),
            "num_cpus": args.tokenizer_cpus, "batch_size": args.batch_size}
    if shape != "text":
        columns = sft_columns(args)
        ds = read(inputs, paths, args.column, list(columns.values()))
        return ds.map_batches(SFTBuilder, batch_format="pyarrow", **pool,
                              fn_constructor_kwargs={"spec": spec, "shape": shape,
                                                     "max_length": args.seq_len,
                                                     "columns": columns, "endpoint": endpoint,
                                                     "tally": tally, "files": (shipped or {}
                                                                               ).get("files")})
    ds = read(inputs, paths, args.column)
    ds = ds.map_batches(clean_batch, batch_size=args.batch_size, batch_format="numpy",
                        fn_kwargs={"min_chars": args.min_chars})
    if spec == BYTE:
        ds = ds.map_batches(ByteTokenizer, batch_format="numpy", **pool)
    else:
        ds = ds.map_batches(HFTokenizer, batch_format="numpy", **pool,
                            fn_constructor_kwargs=shipped or {"spec": spec,
                                                              "endpoint": endpoint})
    return ds.map_batches(make_packer(args.seq_len), batch_size=args.pack_rows,
                          batch_format="numpy")


def check_first_file(inputs: Inputs, columns: str | dict[str, str]) -> None:
    """JSONL / Parquet: the first file's encoding, syntax and columns (`columns`: a column, or
    column -> the flag that names it), read here without Ray.
    A Ray Data read would start the cluster and stream its worker's traceback to the user
    before the error; this reads a Parquet footer or the first MiB of JSON Lines."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = inputs.filesystem or pafs.LocalFileSystem()
    path = inputs.files[0][0]
    where = path if inputs.filesystem is None else f"s3://{path}"
    if inputs.fmt == "parquet":
        try:
            with fs.open_input_file(path) as f:
                names = pq.read_schema(f).names
        except (OSError, pa.ArrowException) as e:
            raise ConfigError("--input", f"{where} is not a readable Parquet file "
                                         f"({str(e).splitlines()[0][:120]})") from None
    else:
        limit = 1 << 20
        with fs.open_input_stream(path) as f:
            head = f.read(limit)
        lines = head.split(b"\n")
        if len(head) == limit:
            lines = lines[:-1]  # cut mid-line by the limit
        keys: set[str] = set()
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ConfigError("--input", f"{where} line {n} is not UTF-8 (byte {e.start} "
                                             "of the line); convert the file, e.g. iconv -f "
                                             "latin1 -t utf-8") from None
            except json.JSONDecodeError as e:
                raise ConfigError("--input", f"{where} line {n} is not JSON ({e.msg}); "
                                             "expected one JSON object per line") from None
            if not isinstance(obj, dict):
                raise ConfigError("--input", f"{where} line {n} is a JSON "
                                             f"{type(obj).__name__}, not an object")
            keys.update(obj)
        if not keys:
            return  # no whole line in the first MiB: Ray Data's reader will judge it
        names = sorted(keys)
    if isinstance(columns, str):
        columns = {columns: "--column"}
    for column, flag in columns.items():
        if column not in names:
            raise ConfigError(flag, f"no column {column!r} in {where} "
                              f"(columns: {', '.join(names)})", names, column)


def check_tokenizer(args) -> dict:
    """--tokenizer loaded on the driver (one line if it is not a tokenizer, or lacks what the
    shape needs), before Ray starts or anything is written. A local folder becomes absolute:
    the actors may not share the driver's working directory."""
    if args.tokenizer == BYTE:
        if args.shape == "chat":
            raise ConfigError("--shape", "chat needs a Hugging Face tokenizer with a chat "
                                         "template (--tokenizer FOLDER or s3://...), not byte")
        return {"identity": dict(BYTE_TOKENIZER), "eos_id": None, "shipped": None,
                "pad_id": 0 if args.shape != "text" else None}
    spec = args.tokenizer
    tok = load_tokenizer(spec, "--tokenizer", args.s3_endpoint)
    folder = fetch(spec, "--tokenizer", args.s3_endpoint)   # where it was loaded from
    if not spec.startswith("s3://"):
        args.tokenizer = str(Path(spec.removeprefix("file://")).expanduser().resolve())
    if tok.eos_token_id is None:
        raise ConfigError("--tokenizer", f"{spec} has no EOS token (the separator between "
                                         "documents and the end of every response)")
    if args.shape == "chat" and not getattr(tok, "chat_template", None):
        raise ConfigError("--shape", f"chat renders conversations with the tokenizer's chat "
                                     f"template, and {spec} has none (use --shape "
                                     "instruction, or a tokenizer with a chat_template)")
    return {"identity": tokenizer_identity(tok, spec), "eos_id": tok.eos_token_id,
            "pad_id": tok.pad_token_id if args.shape != "text" else None,
            # The actors get the tokenizer from here, not from the folder or S3 (another node
            # may see neither): the text shape its Rust backend (no transformers import in
            # the actors); the SFT shapes its files, loaded in each (chat templates).
            "shipped": ship(tok) if args.shape == "text" else {
                "files": tokenizer_files(folder)}}


# --------------------------------------------------------------------------- output

def run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    defaults = SMOKE if args.smoke_test else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # Not an argparse type (at_least) like the other counts: argparse would name the flag
    # "--seq-len/--max-length", and the error names --seq-len (tests/faults/test_bad_input.py).
    if args.seq_len < 1:
        raise ConfigError("--seq-len", "must be at least 1")
    if not 0 < args.tokenizer_cpus < float("inf"):  # NaN fails every comparison
        raise ConfigError("--tokenizer-cpus", "must be more than 0")
    if args.shape not in SHAPES:
        raise ConfigError("--shape", f"unknown shape {args.shape!r}", SHAPES, args.shape)
    sft = args.shape != "text"
    if args.input != STDLIB:
        args.input = user_path(args.input, "--input", output=False)
    args.output = user_path(args.output, "--output", output=True)

    inputs = list_inputs(args)                   # bad input fails here, before any write
    if sft and inputs.fmt == "text":
        raise ConfigError("--shape", f"{args.shape} reads records: give JSON Lines or Parquet "
                                     f"input (--input {args.input} is {inputs.fmt} files)")
    if not sft and sum(s for _, s in inputs.files) <= args.seq_len:
        raise ConfigError("--input", f"the corpus ({sum(s for _, s in inputs.files)} bytes) "
                          f"is shorter than one sequence of {args.seq_len + 1} tokens")
    shards = shards_of(inputs.files, args.shard_bytes)
    if inputs.fmt != "text":  # encoding and schema errors before Ray or any write
        check_first_file(inputs, needed_columns(args))
    tok_info = check_tokenizer(args)             # one line and exit 2 if not a tokenizer

    created = args.output if not args.output.startswith("s3://") and \
        not os.path.exists(os.path.expanduser(args.output)) else None
    storage = resolve(args.output, endpoint=args.s3_endpoint)
    # What the pipeline imports, checked on this node before anything is written or started
    # (the output is checked first: a bad one is the user's first problem).
    try:
        require({"ray.data": "ray[data]", "pyarrow": "pyarrow", "pandas": "pandas"},
                "workloads.data")
    except RayfleetError:
        if created:
            _remove_empty_dirs(os.path.expanduser(created))
        raise

    import ray
    from ray.data import DataContext

    ray.init(ignore_reinit_error=True, log_to_driver=True)
    # Same input, same rows in the same order: shards are reproducible byte for byte.
    DataContext.get_current().execution_options.preserve_order = True

    t0 = time.time()
    written, skipped, rows = 0, 0, 0
    counts = dict.fromkeys(COUNTS, 0)
    # What a done shard must have been made with to be skipped (markers written before these
    # keys existed were byte / text).
    made_with = {"tokenizer_sha256": tok_info["identity"]["sha256"], "shape": args.shape,
                 "seq_len": args.seq_len}
    old_default = {"tokenizer_sha256": "byte", "shape": "text", "seq_len": args.seq_len}
    unit = "rows" if sft else "sequences"
    tally = None
    for i, paths in enumerate(shards):
        done = read_marker(storage, i)
        if done is not None and done.get("of") == len(shards) and all(
                done.get(k, old_default[k]) == v for k, v in made_with.items()):
            print(f"[rayfleet] shard {i + 1}/{len(shards)}: already written "
                  f"({done['rows']} {unit}), skipped", flush=True)
            skipped += 1
            rows += done["rows"]
            for k in counts:
                counts[k] += done.get(k, 0)
            continue
        clear_partial(storage, i)
        if sft and tally is None:   # one per run (an actor is a process): taken per shard
            tally = ray.remote(num_cpus=0)(Tally).remote()
        try:
            ds = build_pipeline(inputs, paths, args, tally, tok_info["shipped"])
            marker = write_shard(ds, storage, i, len(shards), made_with,
                                 after=None if tally is None else partial(_tally_counts, tally))
        except BaseException as e:
            # No half-written shard stays behind, whatever stopped the write.
            drop_partial(storage, i)
            # Ray re-raises a worker's error as RayTaskError(UnicodeDecodeError), an instance
            # of both (JSON Lines past the first MiB that check_first_file read).
            if isinstance(e, UnicodeDecodeError):
                raise ConfigError("--input", f"shard {i + 1} ({paths[0]}, ...) is not UTF-8 "
                                             "text; convert it, e.g. iconv -f latin1 -t "
                                             "utf-8") from None
            raise
        made = (f"{marker['rows']} rows of {args.seq_len + 1} tokens ({marker.get('truncated')}"
                f" truncated, {marker.get('dropped')} dropped, {marker.get('invalid')} invalid)"
                if sft else f"{marker['rows']} sequences of {args.seq_len + 1} tokens")
        print(f"[rayfleet] shard {i + 1}/{len(shards)}: {len(paths)} files -> {made}",
              flush=True)
        written += 1
        rows += marker["rows"]
        for k in counts:
            counts[k] += marker.get(k, 0)
    if rows == 0:
        # Nothing usable: leave the output as it was, so no empty "done" shard is skipped by
        # the next run once the input is fixed.
        for i in range(len(shards)):
            drop_partial(storage, i)
            drop_marker(storage, i)
        if created:
            _remove_empty_dirs(storage.path)
        if sft:
            raise RayfleetError(
                f"{args.input}: no row left: of {counts['records']} records, {counts['invalid']} "
                f"lack text in {', '.join(needed_columns(args))} and {counts['dropped']} have no "
                f"response token within --max-length {args.seq_len}")
        raise RayfleetError(f"{args.input}: nothing left after cleaning: every document is "
                            f"shorter than --min-chars {args.min_chars}, has lines over 1000 "
                            "characters, or is not UTF-8 text (convert it, e.g. iconv -f "
                            "latin1 -t utf-8)")
    manifest = {"output": storage.uri, "input": args.input, "format": inputs.fmt,
                "seq_len": args.seq_len, "shards": len(shards), "written": written,
                "skipped": skipped, "rows": rows,
                "input_bytes": sum(s for _, s in inputs.files),
                "seconds": round(time.time() - t0, 1),
                "tokenizer": tok_info["identity"], "shape": args.shape,
                "columns": ["tokens", "labels"] if sft else ["tokens"]}
    if tok_info["eos_id"] is not None:
        manifest["eos_id"] = tok_info["eos_id"]
    if sft:
        manifest.update({"max_length": args.seq_len, "pad_id": tok_info["pad_id"],
                         "ignore_index": IGNORE, **counts})
    write_manifest(storage, manifest)
    print(f"[rayfleet] {rows} {unit} of seq_len {args.seq_len} + 1 in {storage.uri} "
          f"({written} shards written, {skipped} skipped); train with: python -m "
          f"workloads.train --dataset {storage.uri}", flush=True)
    print("RAYFLEET_SUMMARY " + json.dumps(manifest), flush=True)
    return 0


def _tally_counts(tally) -> dict:
    import ray

    counts = ray.get(tally.take.remote())
    return {k: counts.get(k, 0) for k in COUNTS}   # "rows" is what the files hold


def _remove_empty_dirs(root: str) -> None:
    """Remove `root` and its sub-folders if they hold no file (a folder this run created)."""
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass  # not empty: something else lives there


def main(argv: list[str] | None = None) -> int:
    return run_main(run, argv, PROG)
