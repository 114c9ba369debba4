"""Ray Train overhead: the same per-worker loop, model, data and seed under TorchTrainer and
under torchrun (2 workers, gloo on CPU), side by side in one run, interleaved A B A B so
machine noise hits both. Prints the steady-state step-time ratio (median over logged
intervals after warm-up), the time from launch until the first logged step (cold start +
10 steps) broken down into start-up stages, and the wall-clock ratio including start-up and
the final checkpoint.

The stages come from the runs themselves: with RAYFLEET_TIMING=1 the Ray driver and rank 0
(under either launcher) print one `RAYFLEET_TIMING {json}` line each, wall-clock times of
the stages they passed (workloads/train/context.py), read here against the launch time.

    python -m bench.train_overhead [--steps 200] [--rounds 2]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ArgumentParser, at_least, command
from bench.cluster import cluster_env
from workloads.common.runs import METRICS, read_history

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LOG_EVERY = 10
FIRST_STEP = f"[rayfleet] step {LOG_EVERY}/"  # rank 0's line for the first logged interval
# Start-up stages in the order a run passes them: ("side.mark", what it is), side being the
# RAYFLEET_TIMING line's (the Ray driver's, or rank 0's under either launcher).
STAGES = [
    ("driver.process_start", "driver process started"),
    ("driver.kit_imported", "driver: torch + kit modules imported"),
    ("driver.inputs_checked", "driver: flags, dataset, storage and run checked"),
    ("driver.imports_done", "driver: ray.train imported"),
    ("driver.ray_connected", "driver: `ray.init` connected"),
    ("driver.fit_called", "driver: `trainer.fit()` called"),
    ("driver.ray_controller_start", "Ray: Train controller actor running (its process up)"),
    ("driver.ray_controller_ready", "Ray: controller initialised"),
    ("rank0.process_start", "rank 0 process started (placement group placed)"),
    ("driver.ray_workers_start", "Ray: first worker actor running"),
    ("driver.ray_workers_ready", "Ray: every worker actor initialised"),
    ("driver.ray_train_context_ready", "Ray: train context set up on every worker"),
    ("driver.ray_process_group_ready", "Ray: gloo process group set up on every worker"),
    ("rank0.kit_imported", "rank 0: torch + kit modules imported"),
    ("rank0.process_group_ready", "rank 0: process group ready (gloo)"),
    ("rank0.loop_entered", "rank 0: loop entered"),
    ("rank0.model_ready", "rank 0: model built, DDP-wrapped, optimizer made"),
    ("rank0.checkpoint_checked", "rank 0: latest checkpoint looked up"),
    ("rank0.data_ready", "rank 0: data loader ready"),
    ("rank0.first_batch", "rank 0: first batch"),
    ("rank0.first_logged_step", "rank 0: step 10 logged"),
    ("first_seen", "step 10 line on the launcher's stdout"),
]
TIMING_TAG = "RAYFLEET_TIMING "


def _summary(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RAYFLEET_SUMMARY ")][-1]
    return json.loads(line.split(" ", 1)[1])


def loop_args(steps: int) -> list[str]:
    return ["--model", "small", "--batch-size", "16", "--max-steps", str(steps),
            "--checkpoint-every", str(steps), "--log-every", str(LOG_EVERY), "--corpus-bytes",
            str(1 << 20), "--seed", "0"]


def parse_startup(output: str, launch: float) -> dict[str, float]:
    """Seconds from launch to each stage, from the RAYFLEET_TIMING lines in a run's output
    (under Ray, rank 0's line arrives prefixed with its actor's name)."""
    out: dict[str, float] = {}
    for line in output.splitlines():
        at = line.find(TIMING_TAG)
        if at < 0:
            continue
        marks = json.loads(line[at + len(TIMING_TAG):])
        side = marks.pop("side")
        out.update({f"{side}.{k}": round(v - launch, 3) for k, v in marks.items()
                    if isinstance(v, (int, float))})
    return out


def _timed_run(cmd: list[str], env: dict) -> tuple[str, float, float | None, dict]:
    """Run cmd; return (output, wall seconds, seconds from launch until the first logged
    step's line appears: cold start plus the first --log-every steps, as a user sees it,
    and the start-up stages in seconds from launch)."""
    env = {**env, "RAYFLEET_TIMING": "1"}
    launch = time.time()
    t0 = time.perf_counter()
    first = None
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    wall = None
    for line in proc.stdout:
        if first is None and FIRST_STEP in line:
            first = time.perf_counter() - t0
        if wall is None and line.startswith("RAYFLEET_SUMMARY "):
            wall = time.perf_counter() - t0  # the run's end; the start-up marks come after
        lines.append(line)
    proc.wait()
    wall = wall or time.perf_counter() - t0
    out = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}:\n{out[-3000:]}")
    stages = parse_startup(out, launch)
    if first is not None:
        stages["first_seen"] = round(first, 3)
    return out, wall, first, stages


def run_torchrun(steps: int, out: Path) -> tuple[list[float], float, float | None, dict]:
    stdout, wall, first, stages = _timed_run(
        [str(BIN / "torchrun"), "--nproc-per-node=2", "-m", "workloads.train.torchrun",
         *loop_args(steps), "--output", str(out)], {**os.environ, "OMP_NUM_THREADS": "1"})
    return [h["step_time_s"] for h in _summary(stdout)["history"]], wall, first, stages


def run_ray(steps: int, storage: Path, env: dict, name: str
            ) -> tuple[list[float], float, float | None, dict]:
    _, wall, first, stages = _timed_run(
        [str(BIN / "python"), "-m", "workloads.train", *loop_args(steps), "--num-workers", "2",
         "--storage-path", str(storage), "--name", name], env)
    history = read_history((storage / name / METRICS).read_text())
    return [h["step_time_s"] for h in history], wall, first, stages


def median_stages(runs: list[dict]) -> dict[str, float]:
    """Per stage, the median over runs of its seconds from launch, in STAGES order."""
    return {key: round(statistics.median(r[key] for r in runs if key in r), 2)
            for key, _ in STAGES if any(key in r for r in runs)}


def main(argv: list[str] | None = None, env: dict | None = None) -> dict:
    ap = ArgumentParser(prog="bench.train_overhead")
    ap.add_argument("--steps", type=at_least(2 * LOG_EVERY), default=150,
                    help="steps per run (the first logged interval is warm-up)")
    ap.add_argument("--rounds", type=at_least(1), default=2)
    args = ap.parse_args(argv)

    results = {side: {"step": [], "wall": [], "first": [], "stages": []}
               for side in ("ray", "torchrun")}
    with cluster_env(env) as env, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("ray", "torchrun"):
                steps, wall, first, stages = (
                    run_ray(args.steps, Path(tmp), env, f"bench-{r}") if side == "ray" else
                    run_torchrun(args.steps, Path(tmp) / f"torchrun-{r}"))
                results[side]["step"] += steps[1:]  # the first interval holds warm-up
                results[side]["wall"].append(wall)
                results[side]["stages"].append(stages)
                if first is not None:
                    results[side]["first"].append(first)
    ray_step = statistics.median(results["ray"]["step"])
    tr_step = statistics.median(results["torchrun"]["step"])
    out = {
        "steps": args.steps, "rounds": args.rounds,
        "ray_step_ms": round(ray_step * 1000, 2), "torchrun_step_ms": round(tr_step * 1000, 2),
        "step_ratio": round(ray_step / tr_step, 3),
        "ray_wall_s": round(statistics.median(results["ray"]["wall"]), 1),
        "torchrun_wall_s": round(statistics.median(results["torchrun"]["wall"]), 1),
    }
    out["wall_ratio"] = round(out["ray_wall_s"] / out["torchrun_wall_s"], 2)
    for side in ("ray", "torchrun"):
        firsts = results[side]["first"]
        out[f"{side}_first_s"] = round(statistics.median(firsts), 1) if firsts else None
    if out["ray_first_s"] and out["torchrun_first_s"]:
        out["first_ratio"] = round(out["ray_first_s"] / out["torchrun_first_s"], 2)
    out["startup"] = {side: median_stages(results[side]["stages"]) for side in results}
    out["load_avg"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(command(main, "bench.train_overhead"))
