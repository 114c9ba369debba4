"""Serve: the `lm` app under Ray Serve (deployed with `serve deploy`, one replica, through
Serve's HTTP proxy) vs the same `LMServer` object behind a bare FastAPI/uvicorn app in a
subprocess, side by side in one run. An asyncio + aiohttp load generator sends
`/v1/completions` at concurrency 1, 8, 16 and 32 with dynamic batching on
(`max_batch_size` 8, the shipped config) and off (`max_batch_size` 1): p50/p99 latency and
requests/s; then time to first token with `stream: true` at concurrency 1. Each side runs
two processes (batching on, batching off), each with one instance of the model.

    python -m bench.serve_latency [--requests-per-worker 6] [--rounds 2]

Both sides run the same code: the bare app instantiates the class under `@serve.ingress`
and awaits its route methods, so `@serve.batch` batches there too; the difference is Serve
(proxy, router, replica actor, handle calls) and nothing else.

Serve's floor: the no-op app of `bench.serve_noop` (the same route shape, answering at once)
runs on both sides too; its p50 gap is Serve's own per-request cost, and `lm`'s gap minus it
is what `lm` adds. Settings can be tried without editing anything:
`--app-env KEY=VALUE` goes into the `lm` apps' runtime_env (replica-side RAY_SERVE_*
settings), `--cluster-env KEY=VALUE` into the environment of a throwaway cluster's
`ray start` (proxy-side settings).
"""

# No `from __future__ import annotations`: the bare app's routes declare the request model
# as a class, or FastAPI (which resolves string annotations in this module) reads it as a
# query parameter.
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import ArgumentParser, at_least, command
from bench.cluster import cluster_env
from rayfleet.commands.host import free_port
from workloads.common.runs import local_checkpoints

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONCURRENCY = (1, 8, 16, 32)
BATCHING = {"on": 8, "off": 1}       # max_batch_size per side
APPS = (*BATCHING, "noop")            # routes under /on, /off, /noop on each side
MODEL = "rayfleet-lm"
BODY = {"model": MODEL, "prompt": "def main(argv):\n", "max_tokens": 8, "temperature": 0}


# --------------------------------------------------------------------------- statistics

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def cell_stats(latencies_s: list[float], wall_s: float) -> dict:
    return {"n": len(latencies_s), "p50_ms": round(1000 * percentile(latencies_s, 50), 2),
            "p99_ms": round(1000 * percentile(latencies_s, 99), 2),
            "rps": round(len(latencies_s) / wall_s, 1)}


def compare(results: dict) -> dict:
    """Headline numbers: Serve's p50 overhead over bare per cell, and the batching gain
    (requests/s with batching on / off) at concurrency 16 on each side."""
    out = {"overhead_p50_ms": {}, "batching_gain_c16": {}}
    for batching in BATCHING:
        for c in CONCURRENCY:
            s, b = results["serve"][batching].get(c), results["bare"][batching].get(c)
            if s and b:
                out["overhead_p50_ms"][f"{batching}/c{c}"] = round(s["p50_ms"] - b["p50_ms"], 2)
    for c in CONCURRENCY:
        s, b = results["serve"].get("noop", {}).get(c), results["bare"].get("noop", {}).get(c)
        if s and b:
            out["overhead_p50_ms"][f"noop/c{c}"] = round(s["p50_ms"] - b["p50_ms"], 2)
    for side in ("serve", "bare"):
        on, off = results[side]["on"].get(16), results[side]["off"].get(16)
        if on and off:
            out["batching_gain_c16"][side] = round(on["rps"] / off["rps"], 2)
    over = out["overhead_p50_ms"]
    if "off/c1" in over and "noop/c1" in over:  # what lm adds over Serve's own floor
        out["lm_over_floor_p50_ms_c1"] = round(over["off/c1"] - over["noop/c1"], 2)
    s16, b16 = results["serve"]["on"].get(16), results["bare"]["on"].get(16)
    if s16 and b16:
        out["serve_vs_bare_rps_c16"] = round(s16["rps"] / b16["rps"], 2)
    return out


# --------------------------------------------------------------------------- load generator

async def _load(url: str, concurrency: int, total: int) -> tuple[list[float], float]:
    import aiohttp

    latencies: list[float] = []
    todo = iter(range(total))

    async def worker(session):
        for _ in todo:
            t = time.perf_counter()
            async with session.post(url, json=BODY) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
            latencies.append(time.perf_counter() - t)

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, wall


async def _ttft(url: str, n: int) -> list[float]:
    """Seconds from sending a streaming request to the first SSE event carrying text."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            t = time.perf_counter()
            async with session.post(url, json={**BODY, "stream": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        out.append(time.perf_counter() - t)
                        break
                await r.read()
    return out


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.startswith("RAY_"):
        raise argparse.ArgumentTypeError(f"expected RAY_...=VALUE, got {text!r}")
    return key, value


def load(url: str, concurrency: int, total: int) -> tuple[list[float], float]:
    return asyncio.run(_load(url, concurrency, total))


# --------------------------------------------------------------------------- the two sides

def start_bare(ports: dict[str, int], checkpoint: str) -> list[subprocess.Popen]:
    """The bare side: one uvicorn process per app (bench.serve_latency --bare-server)."""
    return [subprocess.Popen([str(BIN / "python"), "-m", "bench.serve_latency",
                              "--bare-server", str(port), checkpoint, b], cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for b, port in ports.items()]


def interleave(urls: dict, raw: dict, rounds: int, requests_per_worker: int,
               concurrency: tuple[int, ...]) -> None:
    """Warm every route up, then per round, app and concurrency, one load per side in turn
    (Serve, bare, Serve, bare, ...): latencies and wall times go into raw[side][app][c]."""
    for side in urls.values():  # warm-up: first requests pay lazy set-up
        for u in side.values():
            load(f"{u}/v1/completions", 8, 16)
    for _ in range(rounds):
        for b in APPS:
            for c in concurrency:
                total = max(20, c * requests_per_worker)
                for side in urls:
                    lat, wall = load(f"{urls[side][b]}/v1/completions", c, total)
                    raw[side][b][c][0].extend(lat)
                    raw[side][b][c][1].append(wall)


def make_checkpoint(folder: Path) -> str:
    """A finished `tiny` checkpoint (the demo's model), written by the loop in one process
    without Ray: a few seconds, and the Serve side and the bare side load the same files."""
    subprocess.run([str(BIN / "python"), "-m", "workloads.train.torchrun", "--model", "tiny",
                    "--max-steps", "2", "--checkpoint-every", "2", "--batch-size", "4",
                    "--corpus-bytes", str(1 << 16), "--output", str(folder)], cwd=REPO,
                   check=True, capture_output=True, text=True, env={**os.environ,
                                                                    "OMP_NUM_THREADS": "1"})
    return str(local_checkpoints(folder)[-1])


def bare_app(checkpoint: str, name: str):
    """FastAPI app holding one instance of lm's class, its routes under /<name> as on Serve.
    One per process, as one Serve replica per process: `@serve.batch` on a method keeps one
    queue per process, shared by every instance of the class."""
    from fastapi import FastAPI
    from ray.serve import batching

    # Lazy, for the bare server's process only: lm pulls torch and Ray Serve (3.6 s),
    # openai_api FastAPI and pydantic (0.35 s), which --help, ingress and llm_serve (they
    # import this module) would otherwise pay for.
    from workloads.serve import lm
    from workloads.serve.openai_api import CompletionRequest, add_error_handlers

    # The only Serve-only call in @serve.batch's queue: a warning that reads the replica's
    # max_ongoing_requests from the replica context, which exists only inside Serve.
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = (
        lambda self: None)
    user_class = lm.LMServer.func_or_class.__mro__[1]  # the class under @serve.ingress
    server = user_class(checkpoint, max_batch_size=BATCHING[name], batch_wait_timeout_s=0.05)
    app = add_error_handlers(FastAPI())

    @app.post(f"/{name}/v1/completions")
    async def completions(body: CompletionRequest):
        return await server.completions(body)

    @app.get(f"/{name}/health")
    async def health():
        return await server.health()

    @app.get(f"/{name}/v1/stats")
    async def stats():  # lm's own route asks Serve for the replica id
        return {"batch_sizes": list(server.batch_sizes)}

    return app


def serve_bare(port: int, checkpoint: str, name: str) -> None:
    import uvicorn

    from bench import serve_noop  # lazy: pulls Ray Serve (1.4 s), bare server only

    app = serve_noop.bare_app(f"/{name}") if name == "noop" else bare_app(checkpoint, name)
    # Serve's proxy logs requests to files, not the console; no access log here either.
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_config(checkpoint: str, port: int, app_env: dict | None = None) -> dict:
    """cluster-configs/serve/lm.yaml, twice (batching on at /on, off at /off), one replica
    each (autoscaling to a second replica would make it two processes against one), plus the
    no-op app at /noop with the same replica resources; app_env joins each lm app's
    runtime_env env_vars."""
    import yaml

    base = yaml.safe_load((REPO / "cluster-configs" / "serve" / "lm.yaml").read_text())
    apps = []
    for name, size in BATCHING.items():
        app = json.loads(json.dumps(base["applications"][0]))
        app.update(name=f"lm-{name}", route_prefix=f"/{name}")
        app["args"].update(checkpoint=checkpoint, max_batch_size=size)
        if app_env:
            env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
            env_vars.update(app_env)
        for d in app.get("deployments", []):
            d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1,
                                       "initial_replicas": 1}
        apps.append(app)
    apps.append({"name": "noop", "route_prefix": "/noop",
                 "import_path": "bench.serve_noop:app"})
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": apps}


def wait_healthy(urls: list[str], timeout: float = 240) -> None:
    deadline = time.time() + timeout
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")
            time.sleep(0.5)


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None, env: dict | None = None) -> dict:
    ap = ArgumentParser(prog="bench.serve_latency")
    ap.add_argument("--requests-per-worker", type=at_least(1), default=6,
                    help="requests per concurrent client per cell (at least 20 per cell)")
    ap.add_argument("--rounds", type=at_least(1), default=2, help="interleaved Serve/bare rounds")
    ap.add_argument("--ttft-requests", type=at_least(1), default=10)
    ap.add_argument("--app-env", action="append", default=[], type=key_value,
                    metavar="KEY=VALUE", help="env var for the lm apps' replicas (repeatable)")
    ap.add_argument("--cluster-env", action="append", default=[], type=key_value,
                    metavar="KEY=VALUE", help="env var for a throwaway cluster's ray start "
                    "(repeatable; not with make bench's shared cluster)")
    ap.add_argument("--bare-server", nargs=3, metavar=("PORT", "CHECKPOINT", "BATCHING"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_server:
        serve_bare(int(args.bare_server[0]), args.bare_server[1], args.bare_server[2])
        return {}
    import yaml

    if args.cluster_env and env is not None:
        ap.error("--cluster-env needs a throwaway cluster: run it alone, not under make bench")
    results = {side: {b: {} for b in APPS} for side in ("serve", "bare")}
    raw = {side: {b: {c: ([], []) for c in CONCURRENCY} for b in APPS}
           for side in ("serve", "bare")}
    ttft = {side: {} for side in ("serve", "bare")}
    mean_batch: dict = {}
    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-serve-") as tmp_s, \
            cluster_env(env, extra_env=dict(args.cluster_env)) as cenv:
        tmp = Path(tmp_s)
        checkpoint = make_checkpoint(tmp / "ckpt")
        serve_port = free_port()
        bare_ports = {b: free_port() for b in APPS}
        (tmp / "serve.yaml").write_text(yaml.safe_dump(
            serve_config(checkpoint, serve_port, dict(args.app_env))))
        bare = start_bare(bare_ports, checkpoint)
        try:
            subprocess.run([str(BIN / "serve"), "deploy", str(tmp / "serve.yaml")], cwd=REPO,
                           env=cenv, check=True, capture_output=True, text=True, timeout=180)
            urls = {"serve": {b: f"http://127.0.0.1:{serve_port}/{b}" for b in APPS},
                    "bare": {b: f"http://127.0.0.1:{p}/{b}" for b, p in bare_ports.items()}}
            wait_healthy([f"{u}/health" for side in urls.values() for u in side.values()])
            interleave(urls, raw, args.rounds, args.requests_per_worker, CONCURRENCY)
            for side in urls:
                for b in BATCHING:
                    t = asyncio.run(_ttft(f"{urls[side][b]}/v1/completions",
                                          args.ttft_requests))
                    ttft[side][b] = round(1000 * statistics.median(t), 2)
            # Mean decode-batch size each side formed with batching on (last 1000 batches).
            for side in urls:
                with urllib.request.urlopen(f"{urls[side]['on']}/v1/stats", timeout=30) as r:
                    sizes = json.loads(r.read())["batch_sizes"]
                mean_batch[side] = round(statistics.mean(sizes), 2) if sizes else None
        finally:
            for proc in bare:
                proc.terminate()
                proc.wait(timeout=30)
            subprocess.run([str(BIN / "serve"), "shutdown", "-y"], cwd=REPO, env=cenv,
                           capture_output=True, timeout=120)
    for side in raw:
        for b in APPS:
            for c in CONCURRENCY:
                lat, walls = raw[side][b][c]
                results[side][b][c] = cell_stats(lat, sum(walls))
    out = {"results": results, "ttft_ms": ttft, **compare(results), "rounds": args.rounds,
           "mean_batch_on": mean_batch, "app_env": dict(args.app_env),
           "cluster_env": dict(args.cluster_env),
           "max_tokens": BODY["max_tokens"], "load_avg": round(os.getloadavg()[0], 1)}
    print(json.dumps(out))
    return out



if __name__ == "__main__":
    sys.exit(command(main, "bench.serve_latency"))
