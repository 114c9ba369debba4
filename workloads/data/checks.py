"""workloads.data's checks of its input and tokenizer, made on the driver before Ray starts or
anything is written: a bad one is one line and exit 2 (docs/house.md, convention 6)."""

from __future__ import annotations

import json
from pathlib import Path

from rayfleet.errors import ConfigError
from workloads.common.hf import BYTE_TOKENIZER, fetch, load_tokenizer, tokenizer_identity
from workloads.common.shards import Inputs
from workloads.data.tokenize import BYTE, ship, tokenizer_files


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
