"""Where the `llm` app's CPU goes: py-spy over each of its processes (Serve's proxy, the
replicas, vLLM's engine core and worker) while a client keeps 32 streaming completions in
flight, on a throwaway local cluster with the tiny Llama. Prints each process's CPU per
request (from /proc, py-spy's own overhead included) and, from py-spy's samples, its threads
and the library nearest each sample's leaf. The raw stacks (py-spy's `--format raw`, for
flame graphs) stay in --out, outside git.

    python -m bench.llm_profile [--api vllm|ray] [--seconds 20] [--out /tmp/llm-profile]

docs/benchmarks.md ("Where Serve LLM's CPU went") summarises a run of each shape.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import ArgumentParser, at_least, command
from bench.cluster import deploy, local_cluster, serve_status
from bench.llm_serve import cache_env, llm_app, request_body, stream_load, wait_answering
from bench.procs import cpu_seconds, home_of, processes
from rayfleet.commands.host import free_port
from workloads.common.tiny_hf import make_hf_model_dir

BIN = Path(sys.executable).parent
ROLES = ("ray::ServeReplica", "ray::ProxyActor", "VLLM::")
# Nearest library to a sample's leaf (the first match walking up from it), by the start of the
# frame's path as py-spy prints it ("func (vllm/engine/x.py:12)", relative to site-packages).
LIBRARIES = (("vllm", ("(vllm/",)), ("ray.serve", ("(ray/serve/",)), ("ray.llm", ("(ray/llm/",)),
             ("ray core", ("(ray/",)), ("uvicorn/starlette/fastapi",
                                        ("(uvicorn/", "(starlette/", "(fastapi/")),
             ("pydantic", ("(pydantic",)), ("zmq/msgspec", ("(zmq/", "(msgspec")),
             ("torch", ("(torch/",)), ("transformers/tokenizers", ("(transformers/",)))


def library(frame: str) -> str | None:
    return next((name for name, parts in LIBRARIES if any(p in frame for p in parts)), None)


def summarize(raw: str) -> dict:
    """py-spy's raw output (`frame;frame;... count`, threads first) -> samples per thread and
    per nearest library, and the 10 busiest leaves."""
    threads, libs, leaves = collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        code = [f for f in frames if not f.startswith(("thread", "process"))]
        threads[next((f for f in frames if f.startswith("thread")), "?")] += int(n)
        libs[next((lib for f in reversed(code) if (lib := library(f))), "other")] += int(n)
        leaves[code[-1] if code else "?"] += int(n)
    total = sum(threads.values()) or 1
    share = lambda c: [(k, round(100 * v / total, 1)) for k, v in c.most_common(10)]  # noqa: E731
    return {"samples": total, "threads": share(threads), "libraries": share(libs),
            "leaves": share(leaves)}


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(prog="bench.llm_profile")
    ap.add_argument("--api", choices=("vllm", "ray"), default="vllm")
    ap.add_argument("--seconds", type=at_least(5), default=20)
    ap.add_argument("--out", default=None, help="folder for py-spy's raw stacks")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="rayfleet-llm-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="rayfleet-llm-profile-") as tmp_s, \
            local_cluster(8) as env:
        tmp = Path(tmp_s)
        model = make_hf_model_dir(tmp / "model", hidden=64, layers=2)
        port = free_port()
        app = llm_app(model, port, args.api, 0 if args.api == "ray" else None)
        app.update(name="llm", route_prefix="/llm", runtime_env={"env_vars": cache_env(tmp)})
        deploy(env, {"http_options": {"host": "127.0.0.1", "port": port},
                     "applications": [app]}, tmp, "llm")
        url = f"http://127.0.0.1:{port}/llm"
        wait_answering(url, 900, serve_status(env))
        body = request_body(32)
        for c in (8, 32):
            stream_load(url + "/v1/completions", body, c, 2 * c)
        procs = {pid: cmd.split(" ")[0] for pid, (_, cmd) in processes().items()
                 if cmd.startswith(ROLES) and home_of(pid) == env["RAYFLEET_HOME"]}
        stop, done = threading.Event(), []

        def load():
            while not stop.is_set():
                done.append(len(stream_load(url + "/v1/completions", body, 32, 128)[0]))

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(3)
        cpu0, n0, t0 = {p: cpu_seconds([p]) for p in procs}, sum(done), time.time()
        spies = [subprocess.Popen([str(BIN / "py-spy"), "record", "-p", str(p), "-d",
                                   str(args.seconds), "-r", "50", "--threads", "--nonblocking",
                                   "--format", "raw", "-o", str(out / f"{p}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for p in procs]
        for spy in spies:
            spy.wait()
        n, wall = max(1, sum(done) - n0), time.time() - t0
        cpu1 = {p: cpu_seconds([p]) for p in procs}
        stop.set()
        loader.join()
        report = {"api": args.api, "requests_per_s": round(n / wall, 1), "raw": str(out),
                  "processes": {f"{cmd} ({p})": {
                      "cpu_ms_per_request": round(1000 * (cpu1[p] - cpu0[p]) / n, 2),
                      **(summarize((out / f"{p}.txt").read_text())
                         if (out / f"{p}.txt").exists() else {})}
                      for p, cmd in procs.items()}}
    for name, r in report["processes"].items():
        print(f"{r['cpu_ms_per_request']:6.2f} ms/request  {name}")
        for key in ("threads", "libraries", "leaves"):
            print(f"    {key}: " + "; ".join(f"{k} {v}%" for k, v in r.get(key, [])))
    print(f"{report['requests_per_s']} requests/s under py-spy; raw stacks in {out}")
    return report


if __name__ == "__main__":
    sys.exit(command(main, "bench.llm_profile"))
