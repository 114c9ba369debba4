"""What the driver knows about a run in storage: its latest checkpoint (checked before
`fit()`), and the end-of-run summary (metrics.csv and a loss-curve PNG beside the run)."""

from __future__ import annotations

import io
import json
import os
import time

import pyarrow.fs as pafs

from workloads.common.storage import Storage
from workloads.train import checkpoint as ckpt

# Ray Train V2 keeps the run's checkpoint bookkeeping here; re-running the same name and
# storage path restores from its `latest_checkpoint_result`.
SNAPSHOT = "checkpoint_manager_snapshot.json"


def chosen_submission_id() -> str | None:
    """The submission id of the Ray job this driver runs as, when the user chose it (`ray job
    submit --submission-id ID`); None outside a job or for Ray's own `raysubmit_...` ids."""
    # Ray's job supervisor hands its driver (only) the job's config, the submission id in its
    # metadata (ray/dashboard/modules/job/job_supervisor.py, JOB_ID_METADATA_KEY).
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    try:
        sid = (json.loads(raw).get("metadata") or {}).get("job_submission_id") if raw else None
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(sid, str) or sid.startswith("raysubmit_"):
        return None
    return sid


def uri(storage: Storage, path: str) -> str:
    """A storage path as the user wrote it (s3:// for S3)."""
    return path if storage.filesystem is None else f"s3://{path}"


def latest_checkpoint_path(storage: Storage, name: str) -> str | None:
    raw = ckpt.read_file(storage.fs, storage.join(name, SNAPSHOT))
    if raw is None:
        return None
    try:
        latest = json.loads(raw).get("latest_checkpoint_result") or {}
    except json.JSONDecodeError:
        return None
    dirname = latest.get("checkpoint_dir_name")
    return storage.join(name, dirname) if dirname else None


def run_latest_checkpoint(run: str) -> str | None:
    """A run folder (`<storage>/<name>`, local or s3://) -> its latest checkpoint, as a path or
    s3:// URI; None when `run` is not a run folder (no Ray Train bookkeeping in it)."""
    from workloads.common.storage import resolve

    parent, _, name = run.rstrip("/").rpartition("/")
    if not name or not parent or parent == "s3:/":
        return None
    storage = resolve(parent, check_writable=False, create=False)
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
        raw = ckpt.read_file(storage.fs, f"{path}/{ckpt.MARKER}") if path else None
        try:
            final = raw is not None and json.loads(raw).get("final")
        except json.JSONDecodeError:
            final = False
        if final:
            return uri(storage, path)
    return None


def check_latest_checkpoint(storage: Storage, name: str, strategy: str) -> dict | None:
    """Validate the checkpoint a re-run would resume from. CheckpointError if it is
    damaged: better to stop now than to crash every worker (or train on garbage)."""
    path = latest_checkpoint_path(storage, name)
    if path is None:
        return None
    where = uri(storage, path)
    listing = ckpt.list_files(storage.fs, path)
    if not listing:
        raise ckpt.CheckpointError(f"checkpoint {where} recorded by run {name!r} is missing "
                                   "from storage; use a new --name or restore the folder")
    marker = ckpt.validate_on(storage.fs, path, where, expect_strategy=strategy, listing=listing)
    return {**marker, "path": path, "where": where}


# What a run is: a re-run of the same --name must be the same model on the same data with the
# same strategy, or it would resume something else (a model of another shape fails to load in
# every worker; another dataset or strategy would silently continue the old run).
RUN_FILE = "rayfleet_run.json"


class RunFinished(Exception):
    """The run's final checkpoint already reached --max-steps: nothing to train."""


def run_identity(model: dict, strategy: str, zero_stage: int, dataset: str | None) -> dict:
    return {"model": model, "strategy": strategy,
            "zero_stage": zero_stage if strategy == "deepspeed" else None,
            "dataset": dataset or "built-in corpus"}


def _recorded_identity(storage: Storage, name: str, latest: dict) -> dict:
    raw = ckpt.read_file(storage.fs, storage.join(name, RUN_FILE))
    if raw is not None:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    # A run from before the run file existed: what its checkpoint says about itself.
    model = ckpt.read_file(storage.fs, f"{latest['path']}/model_config.json")
    return {"model": json.loads(model) if model else None, "strategy": latest.get("strategy")}


def _differences(old: dict, new: dict) -> list[str]:
    out = []
    for key, was in old.items():
        now = new.get(key)
        if was is None or key not in new or was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            out += [f"{key}.{k} {was.get(k)} (this run: {now.get(k)})"
                    for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
        else:
            out.append(f"{key} {was} (this run: {now})")
    return out


def check_run(storage: Storage, name: str, identity: dict, max_steps: int,
              allow_changes: bool = False) -> dict | None:
    """Before Ray starts: the checkpoint this run resumes from (None for a new run), checked
    whole and checked to belong to the same run. Raises CheckpointError or ConfigError with
    one line, RunFinished when there is nothing left to train."""
    from rayfleet.errors import ConfigError

    latest = check_latest_checkpoint(storage, name, identity["strategy"])
    if latest is not None:
        recorded = _recorded_identity(storage, name, latest)
        model_diff = _differences({"model": recorded.get("model")}, identity)
        if model_diff:
            raise ConfigError("--name", f"run {name!r} in {uri(storage, storage.path)} has a "
                                        f"model of another shape: {'; '.join(model_diff)}; its "
                                        "checkpoints cannot load into this one: give a new "
                                        "--name")
        other = _differences({k: v for k, v in recorded.items() if k != "model"}, identity)
        if other and not allow_changes:
            raise ConfigError("--name", f"run {name!r} in {uri(storage, storage.path)} exists "
                                        f"with other settings: {'; '.join(other)}; the same "
                                        "--name resumes it: give a new --name, or "
                                        "--allow-changes to continue it with these settings")
        if latest.get("final") and int(latest.get("step", 0)) >= max_steps:
            raise RunFinished(f"run {name!r} already finished at step {latest['step']} "
                              f"(--max-steps {max_steps}; checkpoint {latest['where']}); "
                              "nothing to train: a new --name starts a new run, a larger "
                              "--max-steps continues this one")
        print(f"[rayfleet] run {name!r} exists: resuming from step {latest['step']} "
              f"({latest['where']})" + (f"; continuing with {'; '.join(other)}"
                                         if other else ""), flush=True)
    return latest


def record_run(storage: Storage, name: str, identity: dict) -> None:
    """What this run is, beside its checkpoints, for the next re-run of its --name to check
    (written once the run is about to train: a refused run leaves nothing behind)."""
    storage.write_bytes(f"{name}/{RUN_FILE}", json.dumps(identity, indent=1).encode())


def _history(storage: Storage, checkpoint_path: str | None) -> list[dict]:
    raw = ckpt.read_file(storage.fs, f"{checkpoint_path}/metrics.csv") if checkpoint_path else None
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
    ax.set_ylabel("training loss (nats/token)")
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
           "metrics_csv": None, "loss_png": None, "hf_export": None}
    if ckpt_path and getattr(cfg, "tokenizer", None):
        # Hugging Face runs: the final checkpoint's hf/ folder (from_pretrained, lm, vLLM).
        out["hf_export"] = uri(f"{ckpt_path}/hf")
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
        *([f"  hf export     {s['hf_export']}  (from_pretrained, lm, vLLM)"]
          if s.get("hf_export") else []),
        f"  metrics       {s['metrics_csv']}",
        f"  loss curve    {s['loss_png']}",
    ]
    return "\n".join(lines)
