"""Ray Train overhead: the same per-worker loop, model, data and seed under TorchTrainer and
under torchrun (2 workers, gloo on CPU), side by side in one run, interleaved A B A B so
machine noise hits both. Prints the steady-state step-time ratio (median over logged
intervals after warm-up) and the wall-clock ratio including start-up.

    python -m bench.train_overhead [--steps 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _summary(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RAYFLEET_SUMMARY ")][-1]
    return json.loads(line.split(" ", 1)[1])


def loop_args(steps: int) -> list[str]:
    return ["--model", "small", "--batch-size", "16", "--max-steps", str(steps),
            "--checkpoint-every", str(steps), "--log-every", "10", "--corpus-bytes",
            str(1 << 20), "--seed", "0"]


def run_torchrun(steps: int, out: Path) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node=2", "-m",
                           "workloads.train.torchrun", *loop_args(steps), "--output", str(out)],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    wall = time.perf_counter() - t0
    return [h["step_time_s"] for h in _summary(proc.stdout)["history"]], wall


def run_ray(steps: int, storage: Path, env: dict, name: str) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    subprocess.run([str(BIN / "python"), "-m", "workloads.train", *loop_args(steps),
                    "--num-workers", "2", "--storage-path", str(storage), "--name", name],
                   capture_output=True, text=True, cwd=REPO, env=env, check=True)
    wall = time.perf_counter() - t0
    from workloads.train.checkpoint import read_history

    history = read_history((storage / name / "metrics.csv").read_text())
    return [h["step_time_s"] for h in history], wall


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="bench.train_overhead")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from bench.cluster import local_cluster

    results = {"ray": {"step": [], "wall": []}, "torchrun": {"step": [], "wall": []}}
    with local_cluster() as env, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            steps, wall = run_ray(args.steps, Path(tmp), env, f"bench-{r}")
            results["ray"]["step"] += steps[1:]  # first interval holds warm-up
            results["ray"]["wall"].append(wall)
            steps, wall = run_torchrun(args.steps, Path(tmp) / f"torchrun-{r}")
            results["torchrun"]["step"] += steps[1:]
            results["torchrun"]["wall"].append(wall)
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
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
