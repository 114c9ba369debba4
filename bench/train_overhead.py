"""Ray Train overhead: the same per-worker loop, model, data and seed under TorchTrainer and
under torchrun (2 workers, gloo on CPU), side by side in one run, interleaved A B A B so
machine noise hits both. Prints the steady-state step-time ratio (median over logged
intervals after warm-up), the time from launch until the first logged step (cold start +
10 steps) and the wall-clock ratio including start-up and the final checkpoint.

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

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LOG_EVERY = 10
FIRST_STEP = f"[rayfleet] step {LOG_EVERY}/"  # rank 0's line for the first logged interval


def _summary(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RAYFLEET_SUMMARY ")][-1]
    return json.loads(line.split(" ", 1)[1])


def loop_args(steps: int) -> list[str]:
    return ["--model", "small", "--batch-size", "16", "--max-steps", str(steps),
            "--checkpoint-every", str(steps), "--log-every", str(LOG_EVERY), "--corpus-bytes",
            str(1 << 20), "--seed", "0"]


def _timed_run(cmd: list[str], env: dict) -> tuple[str, float, float | None]:
    """Run cmd; return (output, wall seconds, seconds from launch until the first logged
    step's line appears: cold start plus the first --log-every steps, as a user sees it)."""
    t0 = time.perf_counter()
    first = None
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        if first is None and FIRST_STEP in line:
            first = time.perf_counter() - t0
        lines.append(line)
    proc.wait()
    wall = time.perf_counter() - t0
    out = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}:\n{out[-3000:]}")
    return out, wall, first


def run_torchrun(steps: int, out: Path) -> tuple[list[float], float, float | None]:
    stdout, wall, first = _timed_run(
        [str(BIN / "torchrun"), "--nproc-per-node=2", "-m", "workloads.train.torchrun",
         *loop_args(steps), "--output", str(out)], {**os.environ, "OMP_NUM_THREADS": "1"})
    return [h["step_time_s"] for h in _summary(stdout)["history"]], wall, first


def run_ray(steps: int, storage: Path, env: dict, name: str
            ) -> tuple[list[float], float, float | None]:
    _, wall, first = _timed_run(
        [str(BIN / "python"), "-m", "workloads.train", *loop_args(steps), "--num-workers", "2",
         "--storage-path", str(storage), "--name", name], env)
    from workloads.train.checkpoint import read_history

    history = read_history((storage / name / "metrics.csv").read_text())
    return [h["step_time_s"] for h in history], wall, first


def main(argv: list[str] | None = None, env: dict | None = None) -> dict:
    ap = ArgumentParser(prog="bench.train_overhead")
    ap.add_argument("--steps", type=at_least(2 * LOG_EVERY), default=150,
                    help="steps per run (the first logged interval is warm-up)")
    ap.add_argument("--rounds", type=at_least(1), default=2)
    args = ap.parse_args(argv)
    from bench.cluster import cluster_env

    results = {side: {"step": [], "wall": [], "first": []} for side in ("ray", "torchrun")}
    with cluster_env(env) as env, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("ray", "torchrun"):
                steps, wall, first = (run_ray(args.steps, Path(tmp), env, f"bench-{r}")
                                      if side == "ray" else
                                      run_torchrun(args.steps, Path(tmp) / f"torchrun-{r}"))
                results[side]["step"] += steps[1:]  # the first interval holds warm-up
                results[side]["wall"].append(wall)
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
    out["load_avg"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(command(main, "bench.train_overhead"))
