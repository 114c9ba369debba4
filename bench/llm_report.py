"""bench.llm_serve's sides (what each is, by name) and its BENCHMARKS.md section: the table,
the goals' verdicts, Ray's OpenAI ingress side by side with what the kit ships."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench import goal, machine

BENCH_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
BEGIN, END = "<!-- llm-section -->", "<!-- /llm-section -->"
CONCURRENCY = (1, 8, 32)
KIT = "llm"                     # the side of the llm app as the kit ships it (api vllm)
BARE_LABEL = "bare vLLM"
LM_LABEL = "`lm` (transformers)"
# Goals (issue 45), against bare vLLM: Serve's serving CPU per request at c=32 at most this
# many times bare's; requests/s at c=32 at least this share of bare's; TTFT p50 / p99 over
# bare's at c=1 at most these (ms); a whole stream at c=1 at most this many times bare's.
CPU_GOAL_X, RPS_GOAL, TTFT_P50_GOAL_MS, TTFT_P99_GOAL_MS, STREAM_GOAL_X = 2, 0.9, 5, 20, 1.2
# Serve's ingress of the run's cluster, as the section names it (a run recorded before HAProxy
# became the kit's default names none: it went through Serve's Python proxy).
INGRESS_WORDS = {"python": "Serve's Python proxy",
                 "haproxy": "HAProxy, the kit's Serve ingress"}
STARTUP = (("eager", "`enforce_eager: true`, empty cache"),
           ("compiled", "default (inductor), empty compile cache"),
           ("compiled-warm", "default (inductor), the cache the row above wrote"))


def ray_side(ms: float) -> str:
    """The side of the llm app with `--api ray` and that stream_batching_interval_ms."""
    return f"ray{ms:g}"


def sides_of(stream_ms) -> tuple[str, ...]:
    return ("bare", KIT, *(ray_side(ms) for ms in stream_ms), "lm")


def app_of(side: str) -> str:
    """The Serve app (and route /<app>) of a Serve side."""
    return side if side in (KIT, "lm") else f"llm-ray-{float(side[3:]):g}ms"


def label(side: str) -> str:
    if side == "bare":
        return BARE_LABEL
    if side == "lm":
        return LM_LABEL
    if side == KIT:
        return "`llm` as shipped (`api: vllm`)"
    ms = float(side[3:])
    return f"`llm`, `api: ray`, {ms:g} ms" + (" (Ray's default)" if ms == 50 else "")


def _ms(v) -> str:
    return "-" if v is None else f"{v:g} ms"


def _signed(v) -> str:
    return "-" if v is None else f"{v:+g} ms"


def _cpu(r: dict) -> str:
    if "cpu_serving_ms_per_req" not in r:
        return "-"
    return f"{r['cpu_serving_ms_per_req']:g} + {r['cpu_engine_ms_per_req']:g}"


def _rounds(r: dict) -> str:
    return f" ({', '.join(f'{v:g}' for v in r['rps_rounds'])})" if r.get("rps_rounds") else ""


def _cell(out: dict, side: str, c: int) -> dict:
    res = out["results"].get(side, {})
    return res.get(c) or res.get(str(c)) or {}


def table(out: dict) -> str:
    rows = ["| side | c | TTFT p50 / p99 | request p50 | req/s (each round) | tokens/s | CPU ms "
            "per request: serving + engine | vs bare: TTFT p50, req/s |",
            "|---|---|---|---|---|---|---|---|"]
    for c in CONCURRENCY:
        for side in out["results"]:
            r = _cell(out, side, c)
            if not r:
                continue
            key = f"{side}/c{c}"
            vs = "-" if side == "bare" else (
                f"{_signed(out['ttft_p50_over_bare_ms'].get(key))}, "
                f"{out['rps_vs_bare'].get(key, '-')}x")
            rows.append(f"| {label(side)} | {c} | {_ms(r['ttft_p50_ms'])} / "
                        f"{_ms(r['ttft_p99_ms'])} | {_ms(r['latency_p50_ms'])} | {r['rps']}"
                        f"{_rounds(r)} | {r['tok_s']} | {_cpu(r)} | {vs} |")
    return "\n".join(rows)


def goals(out: dict, side: str = KIT) -> list[tuple[str, bool | None, str]]:
    """(goal, met, what was measured) for one Serve side; met is None where a cell is
    missing."""
    bare1, bare32 = _cell(out, "bare", 1), _cell(out, "bare", 32)
    kit1, kit32 = _cell(out, side, 1), _cell(out, side, 32)
    over, p99 = out["ttft_p50_over_bare_ms"], out["ttft_p99_over_bare_ms"]
    rows: list[tuple[str, bool | None, str]] = []
    cpu, bcpu = kit32.get("cpu_serving_ms_per_req"), bare32.get("cpu_serving_ms_per_req")
    x = round(cpu / bcpu, 1) if cpu is not None and bcpu else None
    rows.append((f"serving CPU per request at c=32 <= {CPU_GOAL_X}x bare's",
                 None if x is None else x <= CPU_GOAL_X, f"{x}x ({cpu:g} vs {bcpu:g} ms)"
                 if x is not None else "-"))
    r32 = out["rps_vs_bare"].get(f"{side}/c32")
    rows.append((f"requests/s at c=32 >= {RPS_GOAL} of bare's",
                 None if r32 is None else r32 >= RPS_GOAL, f"{r32}x"))
    o1, q1 = over.get(f"{side}/c1"), p99.get(f"{side}/c1")
    rows.append((f"TTFT over bare's at c=1: p50 <= {TTFT_P50_GOAL_MS} ms, p99 <= "
                 f"{TTFT_P99_GOAL_MS} ms", None if o1 is None or q1 is None else
                 o1 <= TTFT_P50_GOAL_MS and q1 <= TTFT_P99_GOAL_MS,
                 f"{_signed(o1)} p50, {_signed(q1)} p99"))
    s, b = kit1.get("latency_p50_ms"), bare1.get("latency_p50_ms")
    sx = round(s / b, 2) if s is not None and b else None
    rows.append((f"a whole stream at c=1 (p50) <= {STREAM_GOAL_X}x bare's",
                 None if sx is None else sx <= STREAM_GOAL_X,
                 f"{sx}x ({_ms(s)} vs {_ms(b)})" if sx is not None else "-"))
    return rows


def goals_table(out: dict, verdict) -> str:
    sides = [s for s in out["results"] if s not in ("bare", "lm")]
    rows = ["| goal | " + " | ".join(label(s) for s in sides) + " |",
            "|---|" + "---|" * len(sides)]
    per_side = {s: goals(out, s) for s in sides}
    for i, (text, _, _) in enumerate(per_side[sides[0]]):
        cells = [f"{verdict(ok) if ok is not None else '-'}: {got}"
                 for _, ok, got in (per_side[s][i] for s in sides)]
        rows.append(f"| {text} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def startup_table(startup: dict) -> str:
    if not startup:
        return "(Start-up not measured in this run: `--startup-rounds 0`.)"
    rows = ["| replica start-up | `serve deploy` -> first answer (median) | runs |",
            "|---|---|---|"]
    for variant, text in STARTUP:
        s = startup.get(variant)
        if s:
            rows.append(f"| {text} | {s['median_s']} s | "
                        f"{', '.join(f'{t} s' for t in s['runs_s'])} |")
    return "\n".join(rows)


def section(out: dict, when: str, machine_words: str) -> str:
    lm, m = out["lm_vs_llm"], out["model"]
    others = out.get("others_cpu_pct")

    def verdict(ok: bool) -> str:
        """bench's met/missed; flagged when other work took a tenth of the CPU or more (the
        load average would flag every run: it counts this run's own busy processes)."""
        busy = others is not None and others >= 10
        return goal(ok) + (f" (with other work taking {others}% of the CPU, which says "
                           "little: re-run on an idle machine)" if busy else "")

    flags = " ".join(f"{k}={v}" for k, v in out["engine_kwargs"].items())
    ms_list = [f"{ms:g}" for ms in out["stream_ms"]]
    intervals = ", ".join(ms_list[:-1]) + " and " + ms_list[-1] if len(ms_list) > 1 else \
        "".join(ms_list)
    gap = (f", each cell {out['idle_gap_s']:g} s after the previous one (vLLM's workers "
           "busy-wait 1 s after their last step)" if out.get("idle_gap_s") else "")
    ray = (f"and with `--api ray` (Ray Serve LLM's OpenAI ingress deployment in front of the "
           f"engine's, what the kit shipped before), once per `stream_batching_interval_ms` "
           f"({intervals}); " if ms_list else "")
    return f"""{BEGIN}
## 6. Serve LLM (`llm`, vLLM) vs bare vLLM's OpenAI server, and `lm` on the same export

`{out['command']}`, {when}, on {machine_words} (no GPU; vLLM's
CPU build); one-minute load average {out['load_before']} before the measured rounds,
{out['load_avg']} after (which counts this run's own busy processes); other work on the
machine took {out.get('others_cpu_pct', '?')}% of its CPU time during the rounds.
One model folder, `workloads.common.tiny_hf`'s tiny Llama (hidden
{m['hidden']}, {m['layers']} layers, fp32), served at once by: bare vLLM (`python -m
vllm.entrypoints.openai.api_server` with the engine arguments of the generated config:
`{flags}`); the `llm` app from `python -m workloads.serve.llm_config --device cpu` (one
replica, through {INGRESS_WORDS[out.get('ingress', 'python')]}) as the kit ships it (`api:
vllm`: the engine's replica is the ingress and serves vLLM's own OpenAI server), {ray}and
`lm` (cluster-configs/serve/lm.yaml, one replica) on the same folder. Every request streams
`/v1/completions` (`max_tokens` {out['max_tokens']}, greedy, `ignore_eos`); TTFT = time to the
first SSE event carrying text. c=1: {out['ttft_requests']} sequential requests per side per
round; c=8 and 32: an aiohttp client keeping that many in flight,
{out['requests_per_worker']} requests each. {out['rounds']} rounds, the sides interleaved cell
by cell, the order rotated each round{gap}. CPU per request: user + system time of the side's
processes during its cells (serving: Serve's proxy and replicas, or vLLM's API server;
engine: vLLM's engine core and worker). The model's forward pass is tiny, so this measures
serving overhead, not vLLM's kernels; vLLM, Ray and the load generator share the
{os.cpu_count()} cores.

{table(out)}

The goals, per Serve side:

{goals_table(out, verdict)}

The public anchor (GPU, Ray 2.56): 64.8 vs 16.9 ms TTFT at c=1, -12% throughput at c=32.

`lm` vs `llm` as shipped, both through Serve, on the same export: requests/s
{', '.join(f"{k}: {v['rps']}x" for k, v in lm.items())}; TTFT p50
{', '.join(f"{k}: {_signed(v['ttft_p50_ms'])}" for k, v in lm.items())}.

{startup_table(out.get('startup') or {})}

Where Serve's CPU went before, what removed it, and how to read these numbers:
[docs/benchmarks.md](docs/benchmarks.md).
{END}"""


def section_of(text: str) -> str:
    """The llm section of an existing BENCHMARKS.md ("" when there is none)."""
    if BEGIN in text and END in text:
        return text[text.index(BEGIN):text.index(END) + len(END)]
    return ""


def write_section(out: dict) -> None:
    text = section(out, out.get("date") or time.strftime("%Y-%m-%d"), machine())
    old = BENCH_MD.read_text() if BENCH_MD.exists() else ""
    new = old.replace(section_of(old), text) if section_of(old) else \
        old.rstrip("\n") + "\n\n" + text + "\n"
    BENCH_MD.write_text(new)
