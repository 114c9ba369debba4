"""Spot notice: training work redone after a spot node is lost, with and without the
interruption notice, side by side on two-node local clusters (a 1-CPU head, a 1-CPU second
node standing in for the spot node).

Each run: 1 Ray Train worker on the second node (`--model small`, a checkpoint every 20
steps), the spot agent (rayfleet/agents/spot.py) watching a stand-in IMDSv2 server on
loopback. With the notice, the server starts answering the interruption notice at step
--notice-at (mid-interval); without, it never does. The node is SIGKILLed, as EC2 reclaims
it, once step --kill-at is logged (with the notice: and its checkpoint is registered); the run
resumes on the head. Work redone = the last step the lost worker logged - the step resumed
from, in steps and in seconds (x the median step time of the run's metrics.csv).

    python -m bench.spot_notice [--notice-at 25] [--kill-at 32] [--write]  # --write: its section
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from bench import ArgumentParser, at_least, command, machine
from rayfleet.agents.spot import BLOCK_LEAD_S
from rayfleet.commands.host import free_port
from rayfleet.commands.localstate import ray_temp_dir
from workloads.common import runs
from workloads.common.storage import resolve

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BENCH_MD = REPO / "BENCHMARKS.md"
BEGIN, END = "<!-- spot-section -->", "<!-- /spot-section -->"
AGENT = REPO / "rayfleet" / "agents" / "spot.py"
CHECKPOINT_EVERY = 20
STEP = re.compile(r"\[rayfleet\] step (\d+)/\d+ ")
NOTICE = re.compile(r"\[rayfleet\] (?:spot notice|Capacity Block end|GPU fault) on .*: "
                    r"checkpoint at step (\d+)")
RESUMED = re.compile(r"\[rayfleet\] resumed from step (\d+)")


class StandInImds:
    """IMDSv2 on 127.0.0.1 as a spot instance sees it: a session token from PUT
    /latest/api/token (TTL header required), 401 without it; 404 for the notices until the
    caller flips them on."""

    def __init__(self):
        self.token = os.urandom(16).hex()
        self.docs: dict[str, dict] = {}      # path -> JSON answered (else 404)
        self.unauthorized = 0                # GETs refused for a missing or wrong token
        imds = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                if self.path != "/latest/api/token":
                    return self._send(404)
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400)
                self._send(200, imds.token.encode())

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != imds.token:
                    imds.unauthorized += 1
                    return self._send(401)
                doc = imds.docs.get(self.path)
                body = doc if isinstance(doc, str) else json.dumps(doc)   # text or a document
                self._send(404) if doc is None else self._send(200, body.encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def interrupt(self, action: str = "terminate", in_s: float = 120) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
        self.docs["/latest/meta-data/spot/instance-action"] = {"action": action, "time": when}
        return when

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StandInEc2:
    """EC2's query API on 127.0.0.1 for the one call the spot agent makes on a Capacity Block
    node, DescribeCapacityReservations, answered in EC2's XML (boto3 parses it as EC2's) for
    the block set here; another action or id is refused as EC2 refuses it."""

    BLOCK = "cr-0b10c0000000000e1"

    def __init__(self):
        self.end = int(time.time()) + 10 * 3600   # a block with hours left
        self.calls = 0
        ec2 = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                form = dict(urllib.parse.parse_qsl(body))
                ec2.calls += 1
                if (form.get("Action"), form.get("CapacityReservationId.1")) != (
                        "DescribeCapacityReservations", ec2.BLOCK):
                    return self._send(400, "<Response><Errors><Error><Code>InvalidRequest"
                                           "</Code><Message>not served here</Message></Error>"
                                           "</Errors><RequestID>0</RequestID></Response>")
                end = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ec2.end))
                self._send(200, f"""<?xml version="1.0" encoding="UTF-8"?>
<DescribeCapacityReservationsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
<requestId>0</requestId><capacityReservationSet><item>
<capacityReservationId>{ec2.BLOCK}</capacityReservationId><instanceType>p5.48xlarge</instanceType>
<state>active</state><reservationType>capacity-block</reservationType><endDate>{end}</endDate>
</item></capacityReservationSet></DescribeCapacityReservationsResponse>""")

            def _send(self, code: int, text: str) -> None:
                body = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def end_block(self, in_s: float = 120) -> str:
        """The block now ends so that EC2 starts terminating in_s from now (whole seconds);
        returns that time, as the agent's notice names it."""
        stop = int(time.time() + in_s)
        self.end = stop + BLOCK_LEAD_S   # EC2 terminates the block's instances from then
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stop))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def two_node_cluster(root: Path):
    """A head (`rayfleet local up`, 1 CPU, state under root) plus a second raylet joined with
    `ray start --address` (1 CPU) in its own process group, so the caller can SIGKILL exactly
    that node. Token auth on both, as on a real multi-node cluster. The GCS health check is
    tightened (1 s x 3) so a dead node is noticed in seconds, not 15 s. Yields {"env",
    "worker" (its Popen), "worker_temp_dir", "home"}."""
    home = root / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAYFLEET_HOME=str(home), RAY_health_check_period_ms="1000",
               RAY_health_check_failure_threshold="3")
    gcs = free_port()
    up = subprocess.run([str(BIN / "rayfleet"), "local", "up", "--num-cpus", "1",
                         "--object-store-memory", "300MB", "--port", str(gcs),
                         "--dashboard-port", str(free_port())],
                        env=env, capture_output=True, text=True, timeout=180)
    if up.returncode != 0:
        raise RuntimeError(f"rayfleet local up failed: {up.stderr[-2000:]}")
    exports = subprocess.run([str(BIN / "rayfleet"), "local", "env"], env=env, check=True,
                             capture_output=True, text=True).stdout
    client_env = dict(ln.removeprefix("export ").split("=", 1) for ln in exports.splitlines())
    temp_dir = tempfile.mkdtemp(prefix="rf5-", dir="/tmp")  # not /tmp/ray: others' clusters
    log = root / "worker-node.log"
    worker = subprocess.Popen(
        [str(BIN / "ray"), "start", "--address", f"127.0.0.1:{gcs}", "--block",
         "--num-cpus", "1", "--object-store-memory", str(200 << 20),
         "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir, "--disable-usage-stats",
         *[f"--{flag}={free_port()}" for flag in (
             "node-manager-port", "object-manager-port", "metrics-export-port",
             "runtime-env-agent-port", "dashboard-agent-grpc-port",
             "dashboard-agent-listen-port")]],
        env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(home / "auth_token"),
             "PYTHONUNBUFFERED": "1"},  # its log is how we know it has joined
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    head_pid = json.loads((home / "local" / "cluster.json").read_text())["pid"]
    old_home = os.environ.get("RAYFLEET_HOME")
    os.environ["RAYFLEET_HOME"] = str(home)
    try:
        head_temp = ray_temp_dir()  # the head's Ray session folder, removed at the end
    finally:
        os.environ.pop("RAYFLEET_HOME") if old_home is None else \
            os.environ.update(RAYFLEET_HOME=old_home)
    try:
        # `ray start` says so once its raylet has registered with the head's GCS.
        deadline = time.time() + 180
        while b"Ray runtime started" not in log.read_bytes():
            if worker.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the second node did not join:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield {"env": {**env, **client_env}, "worker": worker, "worker_temp_dir": temp_dir,
               "home": home}
    finally:
        # Both nodes are our own process groups; nothing is left to shut down gracefully,
        # so SIGKILL each group, then let `rayfleet local down` find the head gone.
        for pgid in (worker.pid, head_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        worker.wait(timeout=30)
        subprocess.run([str(BIN / "rayfleet"), "local", "down"], env=env,
                       capture_output=True, timeout=120)
        for folder in (temp_dir, head_temp):
            shutil.rmtree(folder, ignore_errors=True)


# Holds the head's one CPU until the run's worker is placed, so it lands on the second node
# (the spot one) and, once released, the resumed run fits on the head.
HOLD_HEAD = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(logging_level="ERROR", log_to_driver=False)
pg = placement_group([{"CPU": 1, "node:__internal_head__": 0.001}])
ray.get(pg.ready(), timeout=120)
print("held", flush=True)
sys.stdin.read()
"""

DRAINING = """
import json, os
from ray._raylet import GcsClient
nodes = GcsClient(address=os.environ["RAY_ADDRESS"]).get_draining_nodes()
print(json.dumps({k if isinstance(k, str) else k.hex(): v for k, v in nodes.items()}))
"""


def draining_nodes(env: dict) -> dict[str, int]:
    """Ray's own view: {node id hex: drain deadline ms} of the nodes draining now."""
    out = subprocess.run([str(BIN / "python"), "-c", DRAINING], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class Lines:
    """A process's stdout+stderr lines, read as they come."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.times = proc, [], []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.times.append(time.time())
            self.lines.append(line.rstrip("\n"))

    def find(self, rx: re.Pattern, after: int = 0) -> re.Match | None:
        for line in self.lines[after:]:
            if m := rx.search(line):
                return m
        return None

    def text(self) -> str:
        return "\n".join(self.lines)


def wait(what: str, fn, procs=(), timeout: float = 240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := fn():
            return value
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.proc.args[:3]} exited {p.proc.returncode} before "
                                   f"{what}:\n{p.text()[-4000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def max_step(lines: list[str]) -> int:
    return max((int(m.group(1)) for ln in lines if (m := STEP.search(ln))), default=0)


def run_scenario(cluster: dict, root: Path, notice_at: int | None, kill_at: int,
                 max_steps: int, checkpoint_every: int = CHECKPOINT_EVERY,
                 agent_poll_s: float = 0.5, trigger: str = "spot") -> dict:
    """One run on `cluster` (two_node_cluster's): the spot agent for its second node, the
    notice at step notice_at (None: never), the node killed at step >= kill_at; then the
    resumed run to the end. The notice is EC2's: a spot interruption (trigger "spot"), or
    the second node's Capacity Block moved to end 30 minutes and a moment from now ("block":
    the node is in a block, EC2 its stand-in). Returns what happened, with the logs."""
    env, imds, ec2 = cluster["env"], StandInImds(), StandInEc2()
    node_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
    node_env.update(AWS_EC2_METADATA_SERVICE_ENDPOINT=imds.url, PYTHONUNBUFFERED="1")
    block_args = []
    if trigger == "block":
        imds.docs["/latest/meta-data/placement/region"] = "us-east-1"
        (root / "capacity-block").write_text(ec2.BLOCK + "\n")
        # The agent's EC2 calls go to the stand-in, with keys of no account (never IMDS's).
        node_env.update(AWS_ENDPOINT_URL_EC2=ec2.url, AWS_ACCESS_KEY_ID="stand-in",
                        AWS_SECRET_ACCESS_KEY="stand-in")
        block_args = ["--block-file", str(root / "capacity-block"), "--block-reread-s",
                      str(agent_poll_s), "--block-margin-s", "600"]
    fire = ec2.end_block if trigger == "block" else imds.interrupt
    name = trigger if notice_at else "no-notice"
    # The run as it is in storage, read through the run store: the checkpoint Ray Train has
    # registered (what a restart resumes from) and, at the end, the run's metrics.csv.
    storage = resolve(str(root / "runs"), check_writable=False)
    procs = []
    try:
        hold = subprocess.Popen([str(BIN / "python"), "-c", HOLD_HEAD], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        procs.append(hold)
        held = Lines(hold)
        agent = subprocess.Popen(
            [str(BIN / "python"), str(AGENT), "--poll-s", str(agent_poll_s),
             "--ray-temp-dir", cluster["worker_temp_dir"], *block_args], env=node_env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(agent)
        agent_log = Lines(agent)
        wait("the head's CPU held", lambda: "held" in held.lines, [held])
        node = wait("the agent to find its node", lambda: agent_log.find(
            re.compile(r"this node is ([0-9a-f]{56})")), [agent_log]).group(1)
        train = subprocess.Popen(
            [str(BIN / "python"), "-m", "workloads.train", "--smoke-test", "--model", "small",
             "--batch-size", "32", "--num-workers", "1", "--max-steps", str(max_steps),
             "--checkpoint-every", str(checkpoint_every), "--log-every", "1", "--seed", "3",
             "--name", name, "--storage-path", str(root / "runs")],
            env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(train)
        out = Lines(train)
        t0 = time.time()
        wait("the first step", lambda: max_step(out.lines) >= 1, [out])
        hold.stdin.close()  # the worker is placed: the head's CPU is free for the resume
        rec: dict = {"node": node, "notice_at": notice_at}
        if notice_at:
            wait(f"step {notice_at}", lambda: max_step(out.lines) >= notice_at, [out])
            rec["notice_step_logged"] = max_step(out.lines)
            flipped = time.time()
            rec["deadline"] = fire()
            rec["checkpoint_step"] = int(wait("the notice's checkpoint", lambda: out.find(
                NOTICE), [out]).group(1))
            rec["notice_to_checkpoint_s"] = round(time.time() - flipped, 2)
            rec["registered_step"] = wait("the notice's checkpoint registered", lambda: (
                (runs.latest_registered(storage, name) or {}).get("metrics", {}).get("step")
                == rec["checkpoint_step"] and rec["checkpoint_step"]), [out])
            rec["agent_drained"] = wait("the agent's drain", lambda: agent_log.find(
                re.compile(r"node ([0-9a-f]{56}) drained")), [agent_log]).group(1)
            rec["draining"] = draining_nodes(env)
        wait(f"step {kill_at}", lambda: max_step(out.lines) >= kill_at, [out])
        os.killpg(cluster["worker"].pid, signal.SIGKILL)  # EC2 takes the instance back
        rec["killed_at_logged"] = max_step(out.lines)
        resumed = wait("the resume", lambda: out.find(RESUMED), [out], timeout=300)
        train.wait(timeout=300)
        rec["wall_s"] = round(time.time() - t0, 1)
        rec["returncode"] = train.returncode
        before = out.lines[:next(i for i, ln in enumerate(out.lines) if RESUMED.search(ln))]
        rec["resumed_from"] = int(resumed.group(1))
        rec["lost_at"] = max_step(before)   # the last step the lost worker logged
        rec["redone_steps"] = rec["lost_at"] - rec["resumed_from"]
        # Every step is logged (--log-every 1): the run's metrics.csv has each one's time.
        step_s = [h["step_time_s"] for h in runs.read_metrics(storage, name)]
        rec["step_ms"] = round(statistics.median(step_s[2:] or step_s) * 1000, 1) \
            if step_s else None
        rec["redone_s"] = round(rec["redone_steps"] * rec["step_ms"] / 1000, 2) \
            if step_s else None
        rec["imds_unauthorized"] = imds.unauthorized
        rec["ec2_calls"] = ec2.calls
        rec["train_log"], rec["agent_log"] = out.text(), agent_log.text()
        return rec
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=20)
                if p.poll() is None:
                    p.kill()
        imds.close()
        ec2.close()


def summarize(with_notice: dict, without: dict) -> dict:
    keys = ("resumed_from", "lost_at", "redone_steps", "redone_s", "step_ms", "wall_s")
    out = {"with": {k: with_notice[k] for k in keys}, "without": {k: without[k] for k in keys}}
    out["with"].update({k: with_notice[k] for k in ("checkpoint_step",
                                                    "notice_to_checkpoint_s")})
    w, wo = with_notice["redone_steps"], without["redone_steps"]
    out["ratio"] = round(wo / w, 1) if w else None
    return out


def section(s: dict, notice_at: int, kill_at: int, when: str, machine: str) -> str:
    w, wo = s["with"], s["without"]
    ratio = f"**{s['ratio']}x** less" if s["ratio"] else "all of it saved"
    load = f", one-minute load average {s['load_avg']}" if s.get("load_avg") else ""
    return f"""{BEGIN}
## 5. Spot interruption notice: work redone after losing a spot node

`python -m bench.spot_notice --notice-at {notice_at} --kill-at {kill_at}`, {when}, on {machine}
(no GPU{load}). Two-node local cluster (1-CPU head, 1-CPU second node as the spot node), one Ray
Train worker on the second node, `--model small --batch-size 32`, a checkpoint every
{CHECKPOINT_EVERY} steps. The stand-in IMDSv2 server answers the interruption notice from step
{notice_at} (mid-interval); the spot agent polls it every 0.5 s, the worker reads its node's
notice key every 1 s. The node is SIGKILLed once step {kill_at} is logged, in both runs; the
run resumes on the head.

| | resumed from step | last step of the lost worker | work redone | run wall time |
|---|---|---|---|---|
{_row("with the notice", f"{w['resumed_from']} (the notice's checkpoint: step "
      f"{w['checkpoint_step']}, {w['notice_to_checkpoint_s']} s after the notice)", w)}
{_row("without", wo['resumed_from'], wo)}

Work redone with the notice: {ratio} ({wo['redone_steps']} -> {w['redone_steps']} steps;
median step {w['step_ms']:.0f} / {wo['step_ms']:.0f} ms). The notice saves the steps between
the last regular checkpoint and the notice (up to a whole interval); the notice's checkpoint
comes at the first step boundary after the worker reads the notice (agent poll + worker read
+ one step). What is still redone is what trains between that checkpoint and the node's end:
here the steps until the kill; on EC2 up to the 2-minute warning. Run wall times include
start-up, the restart and the shared machine's noise: compare the work-redone column.
{END}"""


def _row(name: str, resumed, r: dict) -> str:
    return (f"| {name} | {resumed} | {r['lost_at']} | {r['redone_steps']} steps, "
            f"{r['redone_s']} s | {r['wall_s']} s |")


def section_of(text: str) -> str:
    """The spot section of an existing BENCHMARKS.md ("" when there is none)."""
    if BEGIN in text and END in text:
        return text[text.index(BEGIN):text.index(END) + len(END)]
    return ""


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(prog="bench.spot_notice")
    ap.add_argument("--notice-at", type=at_least(2), default=25,
                    help="step at which the notice appears (default 25, mid-interval)")
    ap.add_argument("--kill-at", type=at_least(3), default=32,
                    help="step after which the node is killed (default 32)")
    ap.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = ap.parse_args(argv)
    if args.kill_at <= args.notice_at:
        ap.error(f"--kill-at must come after --notice-at ({args.notice_at})")
    max_steps = 2 * CHECKPOINT_EVERY + 20
    runs = {}
    for mode in ("with", "without"):
        with tempfile.TemporaryDirectory(prefix="rf-spot-") as tmp, \
                two_node_cluster(Path(tmp)) as cluster:
            runs[mode] = run_scenario(cluster, Path(tmp), args.notice_at if mode == "with"
                                      else None, args.kill_at, max_steps)
    s = summarize(runs["with"], runs["without"])
    s["load_avg"] = round(os.getloadavg()[0], 1)
    print(json.dumps(s, indent=1))
    if args.write:
        text = section(s, args.notice_at, args.kill_at, time.strftime("%Y-%m-%d"), machine())
        old = BENCH_MD.read_text() if BENCH_MD.exists() else ""
        new = old.replace(section_of(old), text) if section_of(old) else \
            old.rstrip("\n") + "\n\n" + text + "\n"
        BENCH_MD.write_text(new)
    return {**s, "notice_at": args.notice_at, "kill_at": args.kill_at}


if __name__ == "__main__":
    sys.exit(command(main, "bench.spot_notice"))
