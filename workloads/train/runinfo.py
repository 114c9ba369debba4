"""What the driver decides about a run in storage (workloads.common.runs holds what a run
is made of and reads it): whether a re-run of a --name is the same run (checked before
`fit()`), its name when the job chose one, and the end-of-run summary."""

from __future__ import annotations

import json
import os
import time

from rayfleet.errors import ConfigError
from workloads.common import runs
from workloads.common.storage import Storage
from workloads.train import hangwatch, straggler


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


class RunFinished(Exception):
    """The run's final checkpoint already reached --max-steps: nothing to train."""


# What a run is: a re-run of the same --name must be the same model on the same data with the
# same strategy, or it would resume something else (a model of another shape fails to load in
# every worker; another dataset or strategy would silently continue the old run). It is
# recorded beside the run (runs.record_run) once the run is about to train: a refused run
# leaves nothing behind.
def run_identity(model: dict, strategy: str, zero_stage: int, dataset: str | None) -> dict:
    return {"model": model, "strategy": strategy,
            "zero_stage": zero_stage if strategy == "deepspeed" else None,
            "dataset": dataset or "built-in corpus"}


def _recorded_identity(storage: Storage, name: str, latest: dict) -> dict:
    recorded = runs.read_run_file(storage, name)
    if recorded is not None:
        return recorded
    # A run from before the run file existed: what its checkpoint says about itself.
    model = runs.read_file(storage.fs, f"{latest['path']}/{runs.MODEL_CONFIG}")
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
    latest = runs.check_latest_checkpoint(storage, name, identity["strategy"])
    if latest is not None:
        recorded = _recorded_identity(storage, name, latest)
        model_diff = _differences({"model": recorded.get("model")}, identity)
        if model_diff:
            where = runs.uri(storage, storage.path)
            raise ConfigError("--name", f"run {name!r} in {where} has a "
                                        f"model of another shape: {'; '.join(model_diff)}; its "
                                        "checkpoints cannot load into this one: give a new "
                                        "--name")
        other = _differences({k: v for k, v in recorded.items() if k != "model"}, identity)
        if other and not allow_changes:
            where = runs.uri(storage, storage.path)
            raise ConfigError("--name", f"run {name!r} in {where} exists "
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


def summarize(result, storage: Storage, name: str, started: float, global_batch: int,
              cfg, hangs: list[dict] = ()) -> dict:
    # Train V2: result.metrics is None when the last report carried no checkpoint, so fall
    # back to the metrics of the latest checkpoint, then to rank 0's return value.
    metrics = result.metrics or {}
    if not metrics and result.best_checkpoints:
        metrics = result.best_checkpoints[-1][1] or {}
    if not metrics and isinstance(result.return_value, dict):
        metrics = result.return_value
    ckpt_path = result.checkpoint.path if result.checkpoint else None
    history = runs.checkpoint_history(storage, ckpt_path)

    def uri(p: str) -> str:
        return runs.uri(storage, p)

    out = {"name": name, "strategy": cfg.strategy, "run_path": uri(storage.join(name)),
           "checkpoint": uri(ckpt_path) if ckpt_path else None,
           "steps": int(metrics.get("step", 0)), "final_loss": metrics.get("loss"),
           "first_loss": history[0]["loss"] if history else None,
           "tokens_per_s": metrics.get("tokens_per_s"), "mfu": metrics.get("mfu"),
           "global_batch": global_batch, "wall_s": round(time.time() - started, 1),
           "metrics_csv": None, "loss_png": None, "hf_export": None, "adapter_export": None,
           # The worker groups a hung rank ended (hangwatch.py), and the ranks the metrics
           # show consistently slower than the others (straggler.py).
           "hangs": [hangwatch.describe(v) for v in hangs],
           "stragglers": straggler.named(history)}
    lora = bool((getattr(cfg, "model", None) or {}).get("lora"))
    if ckpt_path and getattr(cfg, "tokenizer", None) and (not lora or cfg.lora_merge):
        # Hugging Face runs: the final checkpoint's hf/ folder (from_pretrained, lm, vLLM).
        out["hf_export"] = uri(f"{ckpt_path}/{runs.HF_DIR}")
    if ckpt_path and lora:
        # LoRA runs: the adapter's PEFT folder (PeftModel.from_pretrained, lm, vLLM's LoRA).
        out["adapter_export"] = uri(f"{ckpt_path}/{runs.ADAPTER_DIR}")
    if history:
        out["metrics_csv"], out["loss_png"] = runs.write_metrics(
            storage, name, history, f"{name} ({cfg.strategy})")
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
        *([f"  adapter       {s['adapter_export']}  (PeftModel.from_pretrained, lm, vLLM)"]
          if s.get("adapter_export") else []),
        *([f"  hung          {h}" for h in s["hangs"]] if s.get("hangs") else []),
        *([f"  stragglers    {straggler.describe(s['stragglers'])}"]
          if s.get("stragglers") else []),
        f"  metrics       {s['metrics_csv']}",
        f"  loss curve    {s['loss_png']}",
    ]
    return "\n".join(lines)
