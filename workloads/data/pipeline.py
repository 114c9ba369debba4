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
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from rayfleet.errors import ConfigError, RayfleetError
from rayfleet.entrypoint import ArgumentParser, at_least, run_main
from workloads.common.deps import require
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
from workloads.common.storage import Storage, check_shared, default_root, resolve, user_path
from workloads.common.text import clean_text
from workloads.data.checks import check_first_file, check_tokenizer
from workloads.data.tokenize import (  # noqa: F401  (ByteTokenizer: bench imports it here)
    BYTE, IGNORE, SHAPES, ByteTokenizer, HFTokenizer, SFTBuilder, Tally)

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


# --------------------------------------------------------------------------- run

def run(argv: list[str] | None) -> int:
    args = settle_args(build_parser().parse_args(argv))
    inputs, shards = list_shards(args)
    tok_info = check_tokenizer(args)             # one line and exit 2 if not a tokenizer
    created, storage = open_output(args)
    start_ray()
    t0 = time.time()
    totals = write_shards(storage, inputs, shards, args, tok_info)
    if totals.rows == 0:
        refuse_empty(storage, len(shards), created, totals, args)
    manifest = build_manifest(storage, inputs, len(shards), totals, tok_info, args, t0)
    write_manifest(storage, manifest)
    print(f"[rayfleet] {totals.rows} {_unit(args)} of seq_len {args.seq_len} + 1 in "
          f"{storage.uri} ({totals.written} shards written, {totals.skipped} skipped); train "
          f"with: python -m workloads.train --dataset {storage.uri}", flush=True)
    print("RAYFLEET_SUMMARY " + json.dumps(manifest), flush=True)
    return 0


def settle_args(args):
    """The parsed flags with their defaults (smoke test or full) filled in, their values
    checked and the input and output paths resolved."""
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
    if args.input != STDLIB:
        args.input = user_path(args.input, "--input", output=False)
    args.output = user_path(args.output, "--output", output=True)
    check_shared(args.output, "--output")   # before Ray: one line, nothing written
    return args


def list_shards(args) -> tuple[Inputs, list[list[str]]]:
    """The input files, checked for the shape and grouped into shards."""
    sft = args.shape != "text"
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
    return inputs, shards


def open_output(args) -> tuple[str | None, Storage]:
    """The output's storage, and the folder this run created for it (None if it was there)."""
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
    return created, storage


def start_ray() -> None:
    import ray
    from ray.data import DataContext

    ray.init(ignore_reinit_error=True, log_to_driver=True)
    # Same input, same rows in the same order: shards are reproducible byte for byte.
    DataContext.get_current().execution_options.preserve_order = True


@dataclass
class Totals:
    """What the shards hold, written by this run or skipped as done before."""
    written: int = 0
    skipped: int = 0
    rows: int = 0
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add(self, marker: dict) -> None:
        self.rows += marker["rows"]
        for k in self.counts:
            self.counts[k] += marker.get(k, 0)


def write_shards(storage: Storage, inputs: Inputs, shards: list[list[str]], args,
                 tok_info: dict) -> Totals:
    """Each shard built and written, unless it is already done the same way (then skipped)."""
    import ray

    sft = args.shape != "text"
    totals = Totals()
    made_with = {"tokenizer_sha256": tok_info["identity"]["sha256"], "shape": args.shape,
                 "seq_len": args.seq_len}
    tally = None
    for i, paths in enumerate(shards):
        done = read_marker(storage, i)
        if made_alike(done, len(shards), made_with):
            print(f"[rayfleet] shard {i + 1}/{len(shards)}: already written "
                  f"({done['rows']} {_unit(args)}), skipped", flush=True)
            totals.skipped += 1
            totals.add(done)
            continue
        clear_partial(storage, i)
        if sft and tally is None:   # one per run (an actor is a process): taken per shard
            tally = ray.remote(num_cpus=0)(Tally).remote()
        marker = write_one(storage, inputs, shards, i, args, tally, tok_info["shipped"],
                           made_with)
        made = (f"{marker['rows']} rows of {args.seq_len + 1} tokens ({marker.get('truncated')}"
                f" truncated, {marker.get('dropped')} dropped, {marker.get('invalid')} invalid)"
                if sft else f"{marker['rows']} sequences of {args.seq_len + 1} tokens")
        print(f"[rayfleet] shard {i + 1}/{len(shards)}: {len(paths)} files -> {made}",
              flush=True)
        totals.written += 1
        totals.add(marker)
    return totals


def made_alike(done: dict | None, of: int, made_with: dict) -> bool:
    """Whether a shard's done marker was made for `of` shards the way `made_with` says, so the
    shard is skipped (markers written before these keys existed were byte / text)."""
    old_default = {"tokenizer_sha256": "byte", "shape": "text", "seq_len": made_with["seq_len"]}
    return done is not None and done.get("of") == of and all(
        done.get(k, old_default[k]) == v for k, v in made_with.items())


def write_one(storage: Storage, inputs: Inputs, shards: list[list[str]], i: int, args, tally,
              shipped: dict | None, made_with: dict) -> dict:
    """Shard i built and written; its done marker."""
    paths = shards[i]
    try:
        ds = build_pipeline(inputs, paths, args, tally, shipped)
        return write_shard(ds, storage, i, len(shards), made_with,
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


def refuse_empty(storage: Storage, n_shards: int, created: str | None, totals: Totals,
                 args) -> None:
    """No row in any shard: the output left as it was, and one line saying why."""
    # Nothing usable: leave the output as it was, so no empty "done" shard is skipped by
    # the next run once the input is fixed.
    for i in range(n_shards):
        drop_partial(storage, i)
        drop_marker(storage, i)
    if created:
        _remove_empty_dirs(storage.path)
    counts = totals.counts
    if args.shape != "text":
        raise RayfleetError(
            f"{args.input}: no row left: of {counts['records']} records, {counts['invalid']} "
            f"lack text in {', '.join(needed_columns(args))} and {counts['dropped']} have no "
            f"response token within --max-length {args.seq_len}")
    raise RayfleetError(f"{args.input}: nothing left after cleaning: every document is "
                        f"shorter than --min-chars {args.min_chars}, has lines over 1000 "
                        "characters, or is not UTF-8 text (convert it, e.g. iconv -f "
                        "latin1 -t utf-8)")


def build_manifest(storage: Storage, inputs: Inputs, n_shards: int, totals: Totals,
                   tok_info: dict, args, t0: float) -> dict:
    """`_manifest.json`: what the shards hold and how they were made."""
    sft = args.shape != "text"
    manifest = {"output": storage.uri, "input": args.input, "format": inputs.fmt,
                "seq_len": args.seq_len, "shards": n_shards, "written": totals.written,
                "skipped": totals.skipped, "rows": totals.rows,
                "input_bytes": sum(s for _, s in inputs.files),
                "seconds": round(time.time() - t0, 1),
                "tokenizer": tok_info["identity"], "shape": args.shape,
                "columns": ["tokens", "labels"] if sft else ["tokens"]}
    if tok_info["eos_id"] is not None:
        manifest["eos_id"] = tok_info["eos_id"]
    if sft:
        manifest.update({"max_length": args.seq_len, "pad_id": tok_info["pad_id"],
                         "ignore_index": IGNORE, **totals.counts})
    return manifest


def _unit(args) -> str:
    """What a row of the output is called in the log."""
    return "rows" if args.shape != "text" else "sequences"


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
