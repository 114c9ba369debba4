"""Sharded Parquet outputs, what workloads.data and workloads.embed write and what
workloads.train (`--dataset`) and workloads.serve.rag read: the input listing that decides the
shards, and the output layout.

Input files are sorted and grouped into shards by size, so shard i always covers the same
files. Output, in one folder (local or s3://):

    shard-00003-000.parquet   shard 3's rows (one file per Ray Data write task that had rows)
    _done/shard-00003.json    its done marker, written once the files are in place: shard,
                              of (the shard count), rows, files, and what the job made it with
    _tmp-shard-00003/         where a shard is written before it is moved into place
    _manifest.json            written last: what the whole output is (the job's summary)

A re-run skips a shard whose marker matches and redoes any other or half-written one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pyarrow.fs as pafs

from rayfleet.errors import ConfigError
from workloads.common.corpus import stdlib_files
from workloads.common.storage import Storage, resolve

TEXT_EXT = (".txt", ".md", ".py", ".rst")
JSON_EXT = (".jsonl", ".json")
PARQUET_EXT = (".parquet",)
FORMATS = {"text": TEXT_EXT, "jsonl": JSON_EXT, "parquet": PARQUET_EXT}
DONE_DIR = "_done"
MANIFEST = "_manifest.json"
# workloads.data's `--input stdlib`: this interpreter's standard library source, offline.
STDLIB = "stdlib"


# --------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Inputs:
    fmt: str
    files: list[tuple[str, int]]   # (path inside the filesystem, size)
    filesystem: object | None      # pyarrow filesystem, None for local


def list_inputs(args) -> Inputs:
    """The input files of `args.input` (a folder, a file, an s3:// prefix or `stdlib`) in
    `args.format` (auto: by extension), up to `args.max_bytes`; ConfigError naming the flag
    when there is nothing to read."""
    if args.input == STDLIB:
        files = [(str(p), p.stat().st_size) for p in stdlib_files()]
        return Inputs("text", _cap(files, args.max_bytes), None)
    if args.input.startswith("s3://"):
        storage = resolve(args.input, endpoint=args.s3_endpoint, check_writable=False)
        fs, root, fs_out = storage.fs, storage.path, storage.filesystem
    else:
        root = os.path.abspath(os.path.expanduser(args.input))
        if not os.path.exists(root):
            raise ConfigError("--input", f"{args.input} does not exist")
        fs, fs_out = pafs.LocalFileSystem(), None
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        infos = [info]
    elif info.type == pafs.FileType.Directory:
        infos = [i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                 if i.type == pafs.FileType.File]
    else:
        raise ConfigError("--input", f"{args.input} does not exist")
    infos = [i for i in infos if not any(part.startswith((".", "_")) for part in
                                         i.path[len(root):].split("/") if part)
             or i.path == root]
    fmt = args.format
    if fmt == "auto":
        kinds = {k for i in infos for k, exts in FORMATS.items() if i.path.endswith(exts)}
        if len(kinds) > 1:
            raise ConfigError("--format", f"{args.input} mixes {', '.join(sorted(kinds))} "
                              "files; pick one", FORMATS)
        fmt = kinds.pop() if kinds else "text"
    elif fmt not in FORMATS:
        raise ConfigError("--format", f"unknown format {fmt!r}", ["auto", *FORMATS], fmt)
    files = sorted((i.path, i.size) for i in infos if i.path.endswith(FORMATS[fmt]))
    if not files:
        raise ConfigError("--input", f"{args.input} holds no {fmt} files "
                          f"({', '.join(FORMATS[fmt])}); the corpus is empty")
    if sum(s for _, s in files) == 0:
        raise ConfigError("--input", f"{args.input}: every input file is empty")
    return Inputs(fmt, _cap(files, args.max_bytes), fs_out)


def _cap(files: list[tuple[str, int]], max_bytes: int) -> list[tuple[str, int]]:
    if not max_bytes:
        return files
    out, total = [], 0
    for path, size in files:
        if total >= max_bytes:
            break
        out.append((path, size))
        total += size
    return out


def shards_of(files: list[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for path, s in files:
        cur.append(path)
        size += s
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = [], 0
    if cur:
        shards.append(cur)
    return shards


# --------------------------------------------------------------------------- output

def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def marker_path(index: int) -> str:
    """Shard `index`'s done marker, relative to the output folder."""
    return f"{DONE_DIR}/{shard_name(index)}.json"


def write_shard(ds, storage: Storage, index: int, n: int, extra: dict | None = None,
                after=None) -> dict:
    """Write one shard atomically enough: temp folder, then move, then the done marker
    (`extra` goes into the marker: what a re-run must match to skip the shard; so does what
    `after()` returns once the data is written, e.g. counts gathered while writing)."""
    import pyarrow.parquet as pq

    fs, name = storage.fs, shard_name(index)
    tmp = storage.join(f"_tmp-{name}")
    fs.delete_dir_contents(tmp, missing_dir_ok=True)
    # Ray writes no file (and no folder) for a shard that cleaning emptied; the listing
    # below must still find the folder.
    fs.create_dir(tmp)
    ds.write_parquet(tmp, filesystem=storage.filesystem)
    parts = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(tmp, recursive=True))
                   if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
    rows, files = 0, []
    for k, part in enumerate(parts):
        n_rows = pq.ParquetFile(fs.open_input_file(part)).metadata.num_rows
        if not n_rows:
            continue
        final = f"{name}-{k:03d}.parquet"
        fs.move(part, storage.join(final))
        rows += n_rows
        files.append(final)
    fs.delete_dir(tmp)
    marker = {"shard": index, "of": n, "rows": rows, "files": files, **(extra or {}),
              **(after() if after else {})}
    storage.write_bytes(marker_path(index), json.dumps(marker).encode())
    return marker


def clear_partial(storage: Storage, index: int) -> None:
    """Remove shard `index`'s files (of a write that never got its marker)."""
    prefix = f"{shard_name(index)}-"
    for i in storage.fs.get_file_info(pafs.FileSelector(storage.path, allow_not_found=True)):
        if i.base_name.startswith(prefix):
            storage.fs.delete_file(i.path)


def drop_partial(storage: Storage, index: int) -> None:
    """Remove shard `index`'s temporary folder and any of its files already moved in."""
    try:
        storage.fs.delete_dir(storage.join(f"_tmp-{shard_name(index)}"))
    except (FileNotFoundError, OSError):
        pass  # never created
    clear_partial(storage, index)


def drop_marker(storage: Storage, index: int) -> None:
    try:
        storage.fs.delete_file(storage.join(marker_path(index)))
    except (FileNotFoundError, OSError):
        pass


def read_marker(storage: Storage, index: int) -> dict | None:
    """Shard `index`'s done marker, or None when it is not done (or the marker is damaged)."""
    try:
        return json.loads(storage.read_bytes(storage.join(marker_path(index))))
    except (FileNotFoundError, OSError, ValueError):
        return None


def write_manifest(storage: Storage, manifest: dict) -> str:
    """The output's manifest, written last (a reader takes the output as finished by it)."""
    return storage.write_bytes(MANIFEST, json.dumps(manifest, indent=1).encode())
