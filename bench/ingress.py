"""Serve's ingress: Serve's Python proxy vs HAProxy (the kit's default, through its guard) vs
bare uvicorn, side by side in one run, for Serve's floor (the no-op app of bench.serve_noop)
and `lm` with batching on and off.

    python -m bench.ingress [--rounds 2] [--requests-per-worker 6] [--write]

The ingress is chosen when a cluster starts (`rayfleet local up --ingress`), so the run
starts one throwaway cluster per ingress, one after the other, and deploys the same Serve
config (bench.serve_latency's: lm with batching on at /on and off at /off, one replica each,
the no-op app at /noop) on each. The bare side (the same classes in plain uvicorn
processes, bench.serve_latency --bare-server) runs for the whole benchmark and is measured
interleaved with each cluster in turn, so machine noise hits every side alike. `--write`
replaces BENCHMARKS.md's section of this benchmark.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ArgumentParser, at_least, command, goal, machine
from bench.cluster import local_cluster
from bench.serve_latency import (
    APPS,
    BIN,
    REPO,
    _ttft,
    cell_stats,
    interleave,
    make_checkpoint,
    serve_config,
    start_bare,
    wait_healthy,
)
from rayfleet.commands.host import free_port

INGRESSES = ("python", "haproxy")
CONCURRENCY = (1, 16)
SECTION = "## 7. Serve's ingress: Python proxy vs HAProxy vs bare"


def measure(args, tmp: Path, checkpoint: str, bare_urls: dict[str, str]) -> dict:
    raw = {side: {b: {c: ([], []) for c in CONCURRENCY} for b in APPS}
           for side in (*INGRESSES, "bare")}
    ttft = {side: {} for side in (*INGRESSES, "bare")}
    for ingress in INGRESSES:
        with local_cluster(ingress=ingress) as env:
            port = free_port()
            cfg = tmp / f"serve-{ingress}.yaml"
            cfg.write_text(json.dumps(serve_config(checkpoint, port)))
            subprocess.run([str(BIN / "serve"), "deploy", str(cfg)], cwd=REPO, env=env,
                           check=True, capture_output=True, text=True, timeout=180)
            urls = {ingress: {b: f"http://127.0.0.1:{port}/{b}" for b in APPS},
                    "bare": bare_urls}
            wait_healthy([f"{u}/health" for u in urls[ingress].values()])
            interleave(urls, raw, args.rounds, args.requests_per_worker, CONCURRENCY)
            for side in urls:
                for b in ("on", "off"):
                    t = asyncio.run(_ttft(f"{urls[side][b]}/v1/completions",
                                          args.ttft_requests))
                    ttft[side].setdefault(b, []).extend(t)
            subprocess.run([str(BIN / "serve"), "shutdown", "-y"], cwd=REPO, env=env,
                           capture_output=True, timeout=120)
    results = {side: {b: {c: cell_stats(raw[side][b][c][0], sum(raw[side][b][c][1]))
                          for c in CONCURRENCY} for b in APPS} for side in raw}
    ttft_ms = {side: {b: round(1000 * statistics.median(v), 2) for b, v in d.items()}
               for side, d in ttft.items()}
    return {"results": results, "ttft_ms": ttft_ms}


def headline(out: dict) -> dict:
    """Per ingress: Serve's floor at c=1 (no-op p50 over bare), lm's c=16 throughput with
    batching as a share of bare's, and the batching gain (on / off req/s at c=16)."""
    r = out["results"]
    h = {}
    for side in (*INGRESSES, "bare"):
        on, off = r[side]["on"][16], r[side]["off"][16]
        h[side] = {"batching_gain_c16": round(on["rps"] / off["rps"], 2)}
        if side != "bare":
            h[side].update(
                floor_p50_ms_c1=round(r[side]["noop"][1]["p50_ms"] - r["bare"]["noop"][1]["p50_ms"],
                                      2),
                lm_p50_over_bare_ms_c1=round(r[side]["off"][1]["p50_ms"]
                                             - r["bare"]["off"][1]["p50_ms"], 2),
                lm_rps_vs_bare_c16=round(on["rps"] / r["bare"]["on"][16]["rps"], 2),
                ttft_over_bare_ms_on=round(out["ttft_ms"][side]["on"]
                                           - out["ttft_ms"]["bare"]["on"], 2))
    return h


def section(out: dict, date: str) -> str:
    r, h, load_avg = out["results"], out["headline"], out["load_avg"]
    rows = []
    for b, what in (("noop", "no-op (Serve's floor)"), ("off", "lm, batching off"),
                    ("on", "lm, batching on")):
        for c in CONCURRENCY:
            cells = [f"{r[s][b][c]['p50_ms']} ms / {r[s][b][c]['rps']}"
                     for s in (*INGRESSES, "bare")]
            rows.append(f"| {what}, c={c} | " + " | ".join(cells) + " |")
    hp, py = h["haproxy"], h["python"]
    t = out["ttft_ms"]
    rows.append("| time to first token, streaming, c=1, batching on | "
                + " | ".join(f"{t[s]['on']} ms" for s in (*INGRESSES, "bare")) + " |")
    rows.append("| req/s batching on / off at c=16 | "
                + " | ".join(f"{h[s]['batching_gain_c16']}x" for s in (*INGRESSES, "bare"))
                + " |")
    goals = (f"Serve's floor <= 1 ms at c=1 — {goal(hp['floor_p50_ms_c1'] <= 1, load_avg)}; "
             f"`lm` at c=16 with batching >= 0.7 of bare — "
             f"{goal(hp['lm_rps_vs_bare_c16'] >= 0.7, load_avg)}; batching gain >= 3x — "
             f"{goal(hp['batching_gain_c16'] >= 3, load_avg)}.")
    return f"""{SECTION}

Measured by `python -m bench.ingress --write` on {date}: {machine()}; one-minute load average
at the end {load_avg}. Each Serve side is a throwaway `rayfleet local up --ingress <it>` cluster
(4 logical CPUs), one after the other, with bench.serve_latency's Serve config (one replica
per app); the bare side (the same classes in plain uvicorn processes) is measured interleaved
with each. `/v1/completions`, `max_tokens` 8, {out['rounds']} round(s),
{out['requests_per_worker']} requests per client per cell. Cells: p50 latency / requests per
second.

| | Python proxy | HAProxy (the kit's default) | bare uvicorn |
|---|---|---|---|
{chr(10).join(rows)}

Serve's floor (no-op p50 over bare, c=1): Python proxy {py['floor_p50_ms_c1']} ms, HAProxy
**{hp['floor_p50_ms_c1']} ms**. `lm` at c=16 with batching, share of bare's requests/s: Python
proxy {py['lm_rps_vs_bare_c16']}, HAProxy **{hp['lm_rps_vs_bare_c16']}**. Batching gain:
Python proxy {py['batching_gain_c16']}x, HAProxy **{hp['batching_gain_c16']}x**.

Goals (on 2 cores): {goals}
"""


def section_of(text: str) -> str:
    """This benchmark's section of an existing BENCHMARKS.md ('' when it has none)."""
    m = re.search(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", text, re.M | re.S)
    return m.group(0).rstrip("\n") if m else ""


def main(argv: list[str] | None = None) -> dict:
    import datetime

    ap = ArgumentParser(prog="bench.ingress")
    ap.add_argument("--rounds", type=at_least(1), default=2)
    ap.add_argument("--requests-per-worker", type=at_least(1), default=6,
                    help="requests per concurrent client per cell (at least 20 per cell)")
    ap.add_argument("--ttft-requests", type=at_least(1), default=10)
    ap.add_argument("--write", action="store_true", help="replace BENCHMARKS.md's section")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-ingress-") as tmp_s:
        tmp = Path(tmp_s)
        checkpoint = make_checkpoint(tmp / "ckpt")
        ports = {b: free_port() for b in APPS}
        bare = start_bare(ports, checkpoint)
        try:
            urls = {b: f"http://127.0.0.1:{p}/{b}" for b, p in ports.items()}
            wait_healthy([f"{u}/health" for u in urls.values()])
            out = measure(args, tmp, checkpoint, urls)
        finally:
            for proc in bare:
                proc.terminate()
                proc.wait(timeout=30)
    out.update(rounds=args.rounds, requests_per_worker=args.requests_per_worker,
               load_avg=round(os.getloadavg()[0], 1))
    out["headline"] = headline(out)
    print(json.dumps(out))
    if args.write:
        md = REPO / "BENCHMARKS.md"
        old = md.read_text()
        new = section(out, datetime.date.today().isoformat())
        mine = section_of(old)
        md.write_text(old.replace(mine, new) if mine else old.rstrip("\n") + "\n\n" + new)
    return out


if __name__ == "__main__":
    sys.exit(command(main, "bench.ingress"))
