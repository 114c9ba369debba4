"""What the driver knows about a run in storage: its latest checkpoint (checked before
`fit()`), and the end-of-run summary (metrics.csv and a loss-curve PNG beside the run)."""

from __future__ import annotations

import io
import json
import time

import pyarrow.fs as pafs

from workloads.common.storage import Storage
from workloads.train import checkpoint as ckpt

# Ray Train V2 keeps the run's checkpoint bookkeeping here; re-running the same name and
# storage path restores from its `latest_checkpoint_result`.
SNAPSHOT = "checkpoint_manager_snapshot.json"


def _read(fs: pafs.FileSystem, path: str) -> bytes | None:
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError):
        return None


def _listing(fs: pafs.FileSystem, path: str) -> dict[str, int]:
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return {i.path[len(path):].lstrip("/"): i.size for i in infos
            if i.type == pafs.FileType.File}


def uri(storage: Storage, path: str) -> str:
    """A storage path as the user wrote it (s3:// for S3)."""
    return path if storage.filesystem is None else f"s3://{path}"


def latest_checkpoint_path(storage: Storage, name: str) -> str | None:
    raw = _read(storage.fs, storage.join(name, SNAPSHOT))
    if raw is None:
        return None
    try:
        latest = json.loads(raw).get("latest_checkpoint_result") or {}
    except json.JSONDecodeError:
        return None
    dirname = latest.get("checkpoint_dir_name")
    return storage.join(name, dirname) if dirname else None


def check_latest_checkpoint(storage: Storage, name: str, strategy: str) -> dict | None:
    """Validate the checkpoint a re-run would resume from. CheckpointError if it is
    damaged: better to stop now than to crash every worker (or train on garbage)."""
    path = latest_checkpoint_path(storage, name)
    if path is None:
        return None
    where = path if storage.filesystem is None else f"s3://{path}"
    listing = _listing(storage.fs, path)
    if not listing:
        raise ckpt.CheckpointError(f"checkpoint {where} recorded by run {name!r} is missing "
                                   "from storage; use a new --name or restore the folder")
    marker = ckpt.parse_marker(where, _read(storage.fs, f"{path}/{ckpt.MARKER}"))
    ckpt.check_listing(where, marker, listing, expect_strategy=strategy)
    print(f"[rayfleet] run {name!r} exists: resuming from step {marker['step']} ({where})",
          flush=True)
    return marker


def _history(storage: Storage, checkpoint_path: str | None) -> list[dict]:
    raw = _read(storage.fs, f"{checkpoint_path}/metrics.csv") if checkpoint_path else None
    if not raw:
        return []
    return ckpt.read_history(raw.decode())


def loss_png(history: list[dict], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters or CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def summarize(result, storage: Storage, name: str, started: float, global_batch: int,
              cfg) -> dict:
    # Train V2: result.metrics is None when the last report carried no checkpoint, so fall
    # back to the metrics of the latest checkpoint, then to rank 0's return value.
    metrics = result.metrics or {}
    if not metrics and result.best_checkpoints:
        metrics = result.best_checkpoints[-1][1] or {}
    if not metrics and isinstance(result.return_value, dict):
        metrics = result.return_value
    ckpt_path = result.checkpoint.path if result.checkpoint else None
    history = _history(storage, ckpt_path)

    def uri(p: str) -> str:
        return p if storage.filesystem is None else f"s3://{p}"

    out = {"name": name, "strategy": cfg.strategy, "run_path": uri(storage.join(name)),
           "checkpoint": uri(ckpt_path) if ckpt_path else None,
           "steps": int(metrics.get("step", 0)), "final_loss": metrics.get("loss"),
           "first_loss": history[0]["loss"] if history else None,
           "tokens_per_s": metrics.get("tokens_per_s"), "mfu": metrics.get("mfu"),
           "global_batch": global_batch, "wall_s": round(time.time() - started, 1),
           "metrics_csv": None, "loss_png": None}
    if history:
        out["metrics_csv"] = storage.write_bytes(f"{name}/metrics.csv",
                                                 ckpt.history_csv(history).encode())
        out["loss_png"] = storage.write_bytes(f"{name}/loss.png",
                                              loss_png(history, f"{name} ({cfg.strategy})"))
    return out


def format_summary(s: dict) -> str:
    loss = (f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}"
            if s.get("first_loss") is not None and s.get("final_loss") is not None
            else str(s.get("final_loss")))
    lines = [
        "",
        f"== run {s['name']} finished in {s['wall_s']}s ==",
        f"  steps         {s['steps']}  (global batch {s['global_batch']} sequences)",
        f"  loss          {loss}",
        f"  throughput    {s['tokens_per_s']} tokens/s" + (f", MFU {s['mfu']:.1%}"
                                                           if s.get("mfu") else ""),
        f"  checkpoint    {s['checkpoint']}",
        f"  metrics       {s['metrics_csv']}",
        f"  loss curve    {s['loss_png']}",
    ]
    return "\n".join(lines)
