"""The run store: what a workloads.train run leaves in storage, and how it is read.

Training writes it (workloads.train); serving (`checkpoint: latest`, `--model-source <run>`),
the benchmarks and the tests read it, all through here. A run is one folder,
`<storage>/<name>/`, local or s3://:

    checkpoint_manager_snapshot.json  Ray Train V2's bookkeeping: `latest_checkpoint_result`
                                      names the checkpoint a re-run of the same name and
                                      storage resumes from (and the metrics reported with it)
    rayfleet_run.json                 what the run is (model, strategy, dataset): a re-run of
                                      its --name must be the same run (workloads.train)
    checkpoint_<...>/                 one folder per checkpoint, the latest --num-to-keep
    metrics.csv                       every logged step of the whole run, at its end
    loss.png                          the loss curve drawn from it

A checkpoint folder: under Ray Train each rank writes its part into its own temporary folder
and Ray merges them into one folder in storage (torchrun's runs copy theirs into
`checkpoint_<step>/` folders of a local one):

    rayfleet_checkpoint.json  marker, written last by rank 0: step, strategy, world size,
                              final (the run's last), and the size of every file rank 0 wrote
                              (and of the hf/ shards the other ranks wrote)
    model_config.json         GPTConfig (what workloads.serve needs to rebuild the model), or
                              for a Hugging Face model {"hf": its config, "seq_len", "n_params"}
    trainer_state.json        step, epoch, batch-in-epoch, LR schedule, the loop's config
    metrics.csv               the metrics history so far (a resumed run's curve is whole)
    rng_rank{r}.pt            each rank's RNG state (torch, numpy, python)
    ddp:        model.pt, optim.pt                     (rank 0)
    fsdp:       dcp/  torch.distributed.checkpoint     (each rank its shard, rank 0 .metadata)
    deepspeed:  ds/   DeepSpeed's own layout           (each rank its partition)
    model.pt    full weights, also for fsdp/deepspeed on the byte GPT's final checkpoint (for
                serving; a Hugging Face run's final weights are its hf/ export)
    hf/         Hugging Face models, final checkpoint: a save_pretrained folder (config.json,
                safetensors weights, the tokenizer; from_pretrained, `lm`, vLLM), written shard
                by shard by every rank (model-0000i-of-0000n.safetensors + the index, or one
                model.safetensors when it fits one shard)
    LoRA runs (--lora-r): every checkpoint holds the adapter's weights and optimizer state
                only (ddp: model.pt is the adapter's; fsdp/deepspeed: their own layouts
                without the frozen base); model_config.json's "lora" names the base (its
                source and weights fingerprint), which resume loads from there again
    adapter/    LoRA runs, final checkpoint: a PEFT adapter folder (adapter_config.json,
                adapter_model.safetensors, rayfleet_base.json, the tokenizer):
                PeftModel.from_pretrained, `lm`, vLLM's LoRA; `hf/` only with --lora-merge
                (the base with the adapter merged in)

A checkpoint without a valid marker, or whose files are missing or short, is never resumed
from (fault 4 of docs/faults.md): the marker is the last thing written and records the sizes.
The names, the formats and the readers are here; what needs torch to write (weights,
optimizer and RNG state) is the training loop's.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import pyarrow.fs as pafs

from rayfleet.errors import CheckpointError
from workloads.common.storage import Storage, resolve

# -- the run folder
SNAPSHOT = "checkpoint_manager_snapshot.json"
RUN_FILE = "rayfleet_run.json"
METRICS = "metrics.csv"
LOSS_PNG = "loss.png"
CHECKPOINT_PREFIX = "checkpoint_"
# -- a checkpoint folder
MARKER = "rayfleet_checkpoint.json"
FORMAT_VERSION = 1
MODEL_CONFIG = "model_config.json"
# The key of a Hugging Face run's model_config.json (and of its model in rayfleet_run.json).
HF_MODEL_KEY = "hf"
TRAINER_STATE = "trainer_state.json"
FULL_WEIGHTS = "model.pt"
OPTIMIZER = "optim.pt"
DCP_DIR = "dcp"
DS_DIR = "ds"
HF_DIR = "hf"
ADAPTER_DIR = "adapter"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def uri(storage: Storage, path: str) -> str:
    """A storage path as the user wrote it (s3:// for S3)."""
    return path if storage.filesystem is None else f"s3://{path}"


def read_file(fs: pafs.FileSystem, path: str) -> bytes | None:
    """A file's bytes on any pyarrow filesystem, or None when it cannot be read."""
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError):
        return None


def list_files(fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """{relative path: size} of every file under `path` ({} when there is no such folder)."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except NotADirectoryError:
        return {}
    return {i.path[len(path):].lstrip("/"): i.size for i in infos
            if i.type == pafs.FileType.File}


# ----------------------------------------------------------------------------- metrics

def history_csv(history: list[dict]) -> str:
    """metrics.csv: one row per logged step (it travels inside every checkpoint, so the
    loss curve of a resumed run is whole)."""
    if not history:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(history[0].keys()))
    w.writeheader()
    w.writerows(history)
    return buf.getvalue()


def read_history(text: str) -> list[dict]:
    ints = {"step", "epoch"}
    return [{k: int(float(v)) if k in ints else float(v) for k, v in row.items()}
            for row in csv.DictReader(io.StringIO(text))]


def checkpoint_history(storage: Storage, checkpoint_path: str | None) -> list[dict]:
    """The metrics history a checkpoint carries ([] when it carries none)."""
    raw = read_file(storage.fs, f"{checkpoint_path}/{METRICS}") if checkpoint_path else None
    return read_history(raw.decode()) if raw else []


def read_metrics(storage: Storage, name: str) -> list[dict]:
    """The run's metrics.csv: every logged step ([] until the run has finished)."""
    raw = read_file(storage.fs, storage.join(name, METRICS))
    return read_history(raw.decode()) if raw else []


def loss_png(history: list[dict], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters or CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_metrics(storage: Storage, name: str, history: list[dict],
                  title: str) -> tuple[str, str]:
    """The run's metrics.csv and loss.png, beside its checkpoints: (where each went)."""
    return (storage.write_bytes(f"{name}/{METRICS}", history_csv(history).encode()),
            storage.write_bytes(f"{name}/{LOSS_PNG}", loss_png(history, title)))


# ----------------------------------------------------------------------------- checkpoints

def write_marker(dirpath: Path, *, step: int, strategy: str, world_size: int,
                 final: bool, elsewhere: dict[str, int] | None = None) -> None:
    """`elsewhere`: files other ranks wrote into their own parts of this checkpoint (relative
    path -> size), listed with rank 0's so a missing or short one is caught too."""
    files = {str(p.relative_to(dirpath)): p.stat().st_size
             for p in sorted(dirpath.rglob("*")) if p.is_file() and p.name != MARKER}
    files = dict(sorted({**files, **(elsewhere or {})}.items()))
    tmp = dirpath / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "strategy": strategy,
                               "world_size": world_size, "final": final, "files": files},
                              indent=1))
    os.replace(tmp, dirpath / MARKER)


def parse_marker(where: str, raw: bytes | None) -> dict:
    if raw is None:
        raise CheckpointError(f"checkpoint {where} is incomplete (no {MARKER}); "
                              "it was never finished and will not be used")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {where} is corrupt ({MARKER} is not JSON); "
                              "delete it or point at an earlier one") from None


def read_marker(fs: pafs.FileSystem, path: str) -> dict | None:
    """The marker of the checkpoint at `path` on `fs`, None when it has none or it is not
    JSON (never finished, or damaged). Not a validation: see validate_on."""
    try:
        return parse_marker(path, read_file(fs, f"{path.rstrip('/')}/{MARKER}"))
    except CheckpointError:
        return None


def check_listing(where: str, marker: dict, listing: dict[str, int],
                  expect_strategy: str | None = None) -> dict:
    """Raise CheckpointError unless every file the marker lists is present and whole.
    `listing` maps relative path -> size, from a local folder or any pyarrow filesystem."""
    for rel, size in marker.get("files", {}).items():
        if rel not in listing:
            raise CheckpointError(f"checkpoint {where} is incomplete: {rel} is missing")
        if listing[rel] != size:
            raise CheckpointError(f"checkpoint {where} is corrupt: {rel} is {listing[rel]} "
                                  f"bytes, expected {size}")
    ws = marker.get("world_size", 1)
    if marker.get("strategy") == "fsdp":
        missing = [r for r in range(ws)
                   if not any(k.startswith(f"{DCP_DIR}/__{r}_") for k in listing)]
        if missing or f"{DCP_DIR}/.metadata" not in listing:
            raise CheckpointError(f"checkpoint {where} is incomplete: FSDP shards of ranks "
                                  f"{missing or '?'} are missing")
    if (expect_strategy and marker.get("strategy") != expect_strategy
            and FULL_WEIGHTS not in listing):
        raise CheckpointError(
            f"checkpoint {where} was written by --strategy {marker.get('strategy')} and holds "
            f"no full weights; resume with --strategy {marker.get('strategy')}")
    return marker


def validate_on(fs: pafs.FileSystem, path: str, where: str, *,
                expect_strategy: str | None = None,
                listing: dict[str, int] | None = None) -> dict:
    """The checkpoint at `path` on `fs` (a local folder or an s3:// prefix alike): its marker
    parses and every file it lists is there, whole. Returns the marker; CheckpointError naming
    `where` (the path as the user wrote it) otherwise. `listing`: one already taken."""
    if listing is None:
        listing = list_files(fs, path)
    marker = parse_marker(where, read_file(fs, f"{path.rstrip('/')}/{MARKER}"))
    return check_listing(where, marker, listing, expect_strategy)


def validate(dirpath: Path | str, *, expect_strategy: str | None = None) -> dict:
    """validate_on for a local folder."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        raise CheckpointError(f"checkpoint {dirpath} does not exist")
    return validate_on(pafs.LocalFileSystem(), str(dirpath.resolve()), str(dirpath),
                       expect_strategy=expect_strategy)


def load_full_weights(dirpath: Path | str) -> tuple[dict, dict]:
    """(model_config, state_dict) of a finished checkpoint, for serving and evaluation."""
    import torch

    dirpath = Path(dirpath)
    validate(dirpath)
    if not (dirpath / FULL_WEIGHTS).exists():
        raise CheckpointError(f"checkpoint {dirpath} holds sharded weights only; serve the "
                              f"run's final checkpoint, which carries {FULL_WEIGHTS}")
    try:
        cfg = json.loads((dirpath / MODEL_CONFIG).read_text())
        state = torch.load(dirpath / FULL_WEIGHTS, map_location="cpu", weights_only=True)
    except Exception as e:  # a torch/pickle error means the bytes are damaged
        raise CheckpointError(f"checkpoint {dirpath} is corrupt: cannot load {FULL_WEIGHTS} "
                              f"({type(e).__name__})") from e
    return cfg, state


def local_checkpoints(root: Path | str) -> list[Path]:
    """The checkpoint folders of a local run folder, oldest first (their names sort so)."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


# ----------------------------------------------------------------------------- runs

def latest_result(raw: bytes | None) -> dict | None:
    """`latest_checkpoint_result` of a run's snapshot (its bytes, as read from anywhere):
    the checkpoint Ray Train resumes from, {"checkpoint_dir_name", "metrics"}, registered only
    after every rank's upload succeeded. None when there is none yet, or the snapshot was
    caught while Ray rewrites it."""
    if not raw:
        return None
    try:
        return json.loads(raw).get("latest_checkpoint_result") or None
    except (ValueError, AttributeError):
        return None


def latest_registered(storage: Storage, name: str) -> dict | None:
    """latest_result of run `name` under `storage`."""
    return latest_result(read_file(storage.fs, storage.join(name, SNAPSHOT)))


def latest_checkpoint_path(storage: Storage, name: str) -> str | None:
    dirname = (latest_registered(storage, name) or {}).get("checkpoint_dir_name")
    return storage.join(name, dirname) if dirname else None


def locate(run: str) -> tuple[Storage, str] | None:
    """A run folder (`<storage>/<name>`, local or s3://) as (storage, name), for reading;
    None when it cannot be one (no parent). StorageError when the parent is unreachable."""
    parent, _, name = run.rstrip("/").rpartition("/")
    if not name or not parent or parent == "s3:/":
        return None
    return resolve(parent, check_writable=False, create=False), name


def run_latest_checkpoint(run: str) -> str | None:
    """A run folder (`<storage>/<name>`, local or s3://) -> its latest checkpoint, as a path or
    s3:// URI; None when `run` is not a run folder (no Ray Train bookkeeping in it)."""
    found = locate(run)
    if found is None:
        return None
    storage, name = found
    path = latest_checkpoint_path(storage, name)
    return uri(storage, path) if path else None


def latest_finished_checkpoint(storage: Storage) -> str | None:
    """The final checkpoint of the run under `storage` whose bookkeeping changed last (what
    the Serve configs' `checkpoint: latest` means), as a path or s3:// URI; None if no run
    there has finished."""
    runs = [i for i in storage.fs.get_file_info(pafs.FileSelector(storage.path,
                                                                   allow_not_found=True))
            if i.type == pafs.FileType.Directory]
    snapshots = storage.fs.get_file_info([f"{r.path}/{SNAPSHOT}" for r in runs])
    for info in sorted((s for s in snapshots if s.type == pafs.FileType.File),
                       key=lambda s: s.mtime_ns or 0, reverse=True):
        name = info.path[len(storage.path):].strip("/").split("/")[0]
        path = latest_checkpoint_path(storage, name)
        marker = read_marker(storage.fs, path) if path else None
        if marker is not None and marker.get("final"):
            return uri(storage, path)
    return None


def check_latest_checkpoint(storage: Storage, name: str, strategy: str | None = None
                            ) -> dict | None:
    """The checkpoint a re-run of run `name` would resume from, validated (its marker plus
    "path" and "where", its URI); None for a run with none. CheckpointError if it is missing
    or damaged: better to stop now than to crash every worker (or train on garbage)."""
    path = latest_checkpoint_path(storage, name)
    if path is None:
        return None
    where = uri(storage, path)
    listing = list_files(storage.fs, path)
    if not listing:
        raise CheckpointError(f"checkpoint {where} recorded by run {name!r} is missing "
                              "from storage; use a new --name or restore the folder")
    marker = validate_on(storage.fs, path, where, expect_strategy=strategy, listing=listing)
    return {**marker, "path": path, "where": where}


def read_run_file(storage: Storage, name: str) -> dict | None:
    """What run `name` recorded it is (rayfleet_run.json); None when it has no readable one
    (a run from before the file existed)."""
    raw = read_file(storage.fs, storage.join(name, RUN_FILE))
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None


def record_run(storage: Storage, name: str, identity: dict) -> None:
    """What this run is, beside its checkpoints, for the next re-run of its --name to check."""
    storage.write_bytes(f"{name}/{RUN_FILE}", json.dumps(identity, indent=1).encode())
