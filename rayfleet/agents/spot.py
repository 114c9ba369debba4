"""Spot interruption watcher: one per node. Polls the instance metadata service (IMDSv2) for
the spot interruption notice and the rebalance recommendation and tells Ray about them.

    python spot.py [--poll-s 2] [--imds URL] [--address HOST:PORT] [--ray-temp-dir /tmp/ray]
                   [--node-id HEX]

Interruption notice (spot/instance-action: terminate, stop or hibernate, about 2 minutes
ahead): the notice is published for the training workers on this node (they checkpoint at
their next step boundary), then the node is drained through Ray with reason preemption and
the notice's time as deadline, so no new work lands on it and Ray Train counts its loss as a
preemption (FailureConfig.max_preemption_failures), not a failure.

Capacity Block end: on a node of a Capacity Block (render writes the block's reservation id to
BLOCK_FILE on its node type's nodes), EC2 terminates the block's instances from BLOCK_LEAD_S
(30 minutes) before its end. The agent reads the block's EndDate from EC2
(DescribeCapacityReservations, with the instance role; again every --block-reread-s, as a
block can be extended) and, --block-margin-s before EC2 starts terminating, handles a notice of kind
capacity-block-end as an interruption: published, then drained with EC2's termination start as
the deadline. Ray Train then resumes the run on the nodes the stack's order gives next.

GPU faults (the passive watch, on a node with nvidia-smi): every --gpu-poll-s, the kernel log's
new NVIDIA XID events (journalctl -k) and the GPUs' uncorrectable ECC counts (nvidia-smi).
An XID of FATAL_XIDS, or a count above the one at the agent's start, is handled as an
interruption: published (the workers checkpoint at their next step), then the node is drained
with a GPU_DRAIN_S deadline, after which Ray Train resumes elsewhere and the autoscaler, the
node idle, replaces it.

Rebalance recommendation (events/recommendations/rebalance): published only, no drain. It is
an early, uncertain signal (minutes to hours ahead, often never followed by an interruption):
a checkpoint is cheap, but a drained node idles its GPUs, and Ray Train 2.60 restarts a run
whose node is draining once the deadline passes (120 s after a drain without one).

The notice goes to the GCS internal KV (namespace KV_NAMESPACE, key notice_key(node id)): a
worker reads one small key, with no driver of its own. The GCS is reached with Ray's GcsClient
and the node's RAY_AUTH_MODE=token / RAY_AUTH_TOKEN_PATH, without `ray.init` (a connected
driver would look like a user job to the autostop watcher). Each notice is handled once.
One log line per decision, UTC-stamped, on stdout; SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

try:    # in the kit; on a node the agents' folder is this script's, on sys.path
    from rayfleet.agents.gpugate import FATAL_XIDS, GPU_QUERY, parse_ecc, parse_xids
except ImportError:
    from gpugate import FATAL_XIDS, GPU_QUERY, parse_ecc, parse_xids

KV_NAMESPACE = b"rayfleet"
KEY_PREFIX = "spot-notice:"
IMDS_DEFAULT = "http://169.254.169.254"
IMDS_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # botocore's variable
TOKEN_TTL_S = 21600
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
REGION_PATH = "/latest/meta-data/placement/region"
BLOCK_FILE = "~/.rayfleet/capacity-block"   # the node's Capacity Block id, when it is in one
BLOCK_LEAD_S = 30 * 60      # EC2 starts terminating a block's instances this long before its end
BLOCK_REREAD_S = 600
GPU_DRAIN_S = 120
DRAIN_REASON_PREEMPTION = 2  # autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION


def notice_key(node_id_hex: str) -> bytes:
    return (KEY_PREFIX + node_id_hex).encode()


def log(msg: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    print(f"{now[:-4]}Z spot: {msg}", flush=True)


class BadArgs(Exception):
    pass


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="spot.py", description="Watch IMDSv2 for a spot interruption notice or rebalance "
        "recommendation; publish it to this node's training workers and drain the node "
        "through Ray on an interruption.")
    p.add_argument("--poll-s", type=float, default=2.0,
                   help="seconds between IMDS polls (default 2; notices come ~2 min ahead)")
    p.add_argument("--imds", default=None, metavar="URL",
                   help=f"metadata endpoint (default ${IMDS_ENV}, else {IMDS_DEFAULT})")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="the head's GCS (default $RAY_ADDRESS, else what `ray start` wrote "
                   "to <ray-temp-dir>/ray_current_cluster)")
    p.add_argument("--ray-temp-dir", default="/tmp/ray", metavar="DIR",
                   help="this node's Ray temp dir: its raylet socket names the node "
                   "(default /tmp/ray)")
    p.add_argument("--block-margin-s", type=float, default=300.0, metavar="SECONDS",
                   help="on a Capacity Block, drain this long before EC2 starts terminating "
                   "its instances, 30 minutes before the block ends (default 300)")
    p.add_argument("--block-reread-s", type=float, default=BLOCK_REREAD_S, metavar="SECONDS",
                   help="how often the block's end is read again from EC2: an extended block "
                   f"ends later (default {BLOCK_REREAD_S})")
    p.add_argument("--block-file", default=BLOCK_FILE, metavar="PATH",
                   help=f"where this node's Capacity Block id is, if it is in one (default "
                   f"{BLOCK_FILE})")
    p.add_argument("--gpu-poll-s", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between reads of the kernel log's XID events and the GPUs' "
                   "ECC counts, where nvidia-smi is installed (default 30)")
    p.add_argument("--node-id", default=None, metavar="HEX",
                   help="this node's Ray node id (default: the node whose raylet socket is "
                   "under --ray-temp-dir)")
    p.error = lambda message: (_ for _ in ()).throw(BadArgs(message))  # type: ignore[method-assign]
    a = p.parse_args(argv)
    if not a.poll_s > 0:
        raise BadArgs(f"--poll-s must be > 0 seconds, got {a.poll_s:g}")
    if not a.gpu_poll_s > 0:
        raise BadArgs(f"--gpu-poll-s must be > 0 seconds, got {a.gpu_poll_s:g}")
    if not a.block_reread_s > 0:
        raise BadArgs(f"--block-reread-s must be > 0 seconds, got {a.block_reread_s:g}")
    if not 0 <= a.block_margin_s < BLOCK_LEAD_S:
        raise BadArgs(f"--block-margin-s must be 0 or more and under {BLOCK_LEAD_S} s (the "
                      f"block's last {BLOCK_LEAD_S // 60} minutes are EC2's), got "
                      f"{a.block_margin_s:g}")
    a.imds = (a.imds or os.environ.get(IMDS_ENV) or IMDS_DEFAULT).rstrip("/")
    if not a.imds.startswith(("http://", "https://")):
        raise BadArgs(f"metadata endpoint must be an http:// URL, got {a.imds!r}")
    if a.node_id is not None:
        try:
            if len(bytes.fromhex(a.node_id)) != 28:
                raise ValueError
        except ValueError:
            raise BadArgs(f"--node-id must be a Ray node id (56 hex digits), got "
                          f"{a.node_id!r}") from None
    if os.environ.get("RAY_AUTH_MODE") == "token":
        # Ray's C++ client aborts the process on a missing token file: say it in one line.
        path = os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")
        if not Path(path).expanduser().is_file():
            raise BadArgs(f"RAY_AUTH_MODE=token but the token file {path} does not exist")
    return a


# -- IMDSv2 -----------------------------------------------------------------------------------

class Imds:
    """IMDSv2 with a cached session token (refreshed on 401 or near expiry)."""

    def __init__(self, endpoint: str, timeout: float = 2.0):
        self.endpoint, self.timeout = endpoint, timeout
        # IMDS is link-local: never through an HTTP proxy from the environment.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.token, self.token_until = None, 0.0

    def _token(self) -> str:
        if self.token is None or time.monotonic() > self.token_until:
            req = urllib.request.Request(
                self.endpoint + "/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            with self.opener.open(req, timeout=self.timeout) as r:
                self.token = r.read().decode().strip()
            self.token_until = time.monotonic() + TOKEN_TTL_S - 60
        return self.token

    def get_json(self, path: str) -> dict | None:
        """The document at path, or None on 404 (no such notice)."""
        text = self.get_text(path)
        return None if text is None else json.loads(text)

    def get_text(self, path: str) -> str | None:
        """The value at path, or None on 404."""
        for attempt in (1, 2):
            req = urllib.request.Request(self.endpoint + path,
                                         headers={"X-aws-ec2-metadata-token": self._token()})
            try:
                with self.opener.open(req, timeout=self.timeout) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 1:
                    self.token = None  # expired or revoked: one fresh token, then give up
                    continue
                raise
        return None


def parse_time_ms(text: str) -> int | None:
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return int(t.timestamp() * 1000)


def read_notices(imds: Imds) -> list[dict]:
    """The notices IMDS has now, interruption first; each with a `key` naming it once."""
    out = []
    action = imds.get_json(INSTANCE_ACTION)
    if action:
        out.append({"kind": "interruption", "action": action.get("action"),
                    "time": action.get("time"), "deadline_ms": parse_time_ms(action.get("time")),
                    "key": f"interruption/{action.get('action')}/{action.get('time')}"})
    rebalance = imds.get_json(REBALANCE)
    if rebalance:
        out.append({"kind": "rebalance", "time": rebalance.get("noticeTime"),
                    "deadline_ms": None, "key": f"rebalance/{rebalance.get('noticeTime')}"})
    return out


def iso_ms(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


class Block:
    """This node's Capacity Block, if it is in one: its end, read from EC2. `ec2(region)` gives
    a boto3 EC2 client (the instance role's credentials; AWS_ENDPOINT_URL_EC2 where set)."""

    def __init__(self, args: argparse.Namespace, imds: Imds, ec2=None):
        self.margin_s, self.reread_s, self.imds = args.block_margin_s, args.block_reread_s, imds
        path = Path(args.block_file).expanduser()
        self.id = path.read_text().strip() if path.is_file() else None
        self._ec2 = ec2 or _boto3_ec2
        self.end_ms: int | None = None
        self.read_at = -math.inf

    def notice(self, now: float) -> dict | None:
        """The block-end notice once it is due, else None; reads EC2 when the last read is
        --block-reread-s old (raises what EC2 raises: the caller says it and retries)."""
        if self.id is None:
            return None
        if now - self.read_at >= self.reread_s or self.end_ms is None:
            self.end_ms = self._read_end()
            self.read_at = now
        stop_ms = self.end_ms - BLOCK_LEAD_S * 1000
        if now * 1000 < stop_ms - self.margin_s * 1000:
            return None
        return {"kind": "capacity-block-end", "action": "terminate", "time": iso_ms(stop_ms),
                "deadline_ms": stop_ms, "reservation": self.id, "ends": iso_ms(self.end_ms),
                "key": f"block/{self.id}/{self.end_ms}"}

    def drain_at(self) -> str:
        return iso_ms(self.end_ms - int((BLOCK_LEAD_S + self.margin_s) * 1000))

    def _read_end(self) -> int:
        region = self.imds.get_text(REGION_PATH) or os.environ.get("AWS_DEFAULT_REGION")
        (r,) = self._ec2(region).describe_capacity_reservations(
            CapacityReservationIds=[self.id])["CapacityReservations"]
        if r.get("ReservationType") != "capacity-block" or not r.get("EndDate"):
            raise ValueError(f"{self.id} is not a Capacity Block with an end date")
        end = r["EndDate"]
        return int(end.timestamp() * 1000) if isinstance(end, datetime.datetime) \
            else parse_time_ms(str(end))


def _boto3_ec2(region: str | None):
    import boto3

    return boto3.client("ec2", region_name=region)


class Gpus:
    """The passive watch: new fatal XIDs and uncorrectable ECC errors, where nvidia-smi is."""

    def __init__(self, run=subprocess.run):
        self.on = shutil.which("nvidia-smi") is not None
        self._run = run
        self.cursor: str | None = None
        self.baseline: dict[str, int | None] = {}

    def _out(self, argv: list[str]) -> str:
        return self._run(argv, capture_output=True, text=True, timeout=60, check=True).stdout

    def _journal(self, after: str | None) -> str:
        """Kernel log lines after the cursor (none: the last line, for its cursor), the new
        cursor kept (journalctl prints one only after a line it shows)."""
        text = self._out(["journalctl", "-k", "--no-pager", "-o", "cat", "--show-cursor",
                          *(["--after-cursor", after] if after else ["-n", "1"])])
        lines = text.splitlines()
        if lines and lines[-1].startswith("-- cursor: "):
            self.cursor = lines.pop().removeprefix("-- cursor: ")
        return "\n".join(lines)

    def start(self) -> str:
        self.baseline = parse_ecc(self._out(GPU_QUERY))
        self._journal(None)
        return (f"{len(self.baseline)} GPU(s), uncorrectable ECC errors "
                f"{[self.baseline[i] for i in sorted(self.baseline)]}; watching the kernel "
                f"log for XIDs {sorted(FATAL_XIDS)}")

    def faults(self) -> list[str]:
        found = [f"Xid {x} on {pci} ({FATAL_XIDS[x]})"
                 for pci, x in parse_xids(self._journal(self.cursor)) if x in FATAL_XIDS]
        now = parse_ecc(self._out(GPU_QUERY))
        found += [f"GPU {i}: {n - self.baseline[i]} new uncorrectable ECC error(s)"
                  for i, n in sorted(now.items()) if n is not None
                  and self.baseline.get(i) is not None and n > self.baseline[i]]
        return found


def gpu_notice(faults: list[str], now: float) -> dict:
    deadline = int((now + GPU_DRAIN_S) * 1000)
    return {"kind": "gpu-fault", "action": "drain", "time": iso_ms(deadline),
            "deadline_ms": deadline, "what": "; ".join(faults), "key": "gpu-fault"}


# -- Ray --------------------------------------------------------------------------------------

class Ray:
    """This node in the cluster's GCS: found by its raylet socket (or --node-id)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.gcs = None
        self.node_id: str | None = args.node_id
        self.node_ip = ""

    def address(self) -> str | None:
        if self.args.address or os.environ.get("RAY_ADDRESS"):
            return self.args.address or os.environ["RAY_ADDRESS"]
        f = Path(self.args.ray_temp_dir) / "ray_current_cluster"
        return f.read_text().strip() if f.is_file() else None

    def connect(self) -> bool:
        """Find the GCS and this node in it; False (to retry later) while either is missing."""
        if self.gcs is None:
            address = self.address()
            if not address:
                return False
            from ray._raylet import GcsClient

            self.gcs = GcsClient(address=address)
        nodes = self.gcs.get_all_node_info(timeout=10)
        socket = (Path(self.args.ray_temp_dir) / "session_latest" / "sockets" / "raylet")
        socket = str(socket.resolve()) if socket.exists() else None
        for node_id, info in nodes.items():
            alive = info.state == 0  # GcsNodeInfo.ALIVE
            if alive and (node_id.hex() == self.node_id
                          or (self.node_id is None and info.raylet_socket_name == socket)):
                self.node_id, self.node_ip = node_id.hex(), info.node_manager_address
                return True
        return False

    def publish(self, notice: dict) -> None:
        value = {k: v for k, v in notice.items() if k != "key"}
        value["seen_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
        self.gcs.internal_kv_put(notice_key(self.node_id), json.dumps(value).encode(), True,
                                 KV_NAMESPACE, timeout=10)

    def drain(self, notice: dict) -> tuple[bool, str]:
        why = {"capacity-block-end": f"Capacity Block {notice.get('reservation')} ends at "
                                     f"{notice.get('ends')}: EC2 terminates from "
                                     f"{notice['time']}",
               "gpu-fault": f"GPU fault: {notice.get('what')}"}.get(
            notice["kind"], f"spot interruption notice: {notice['action']} at {notice['time']}")
        return self.gcs.drain_node(self.node_id, DRAIN_REASON_PREEMPTION, why,
                                   notice["deadline_ms"] or 0)


# -- the watch loop ---------------------------------------------------------------------------

def watch(args: argparse.Namespace, stop: threading.Event, ec2=None) -> None:
    imds, ray = Imds(args.imds), Ray(args)
    block, gpus = Block(args, imds, ec2), Gpus()
    block_said = None                    # the block end last said
    gpu_fault: dict | None = None        # the passive watch's notice, once it found a fault
    gpus_read = -math.inf
    handled: dict[str, set[str]] = {}   # notice key -> steps done ("published", "drained")
    said = ""                            # the last waiting/failing line, said once
    log(f"watching {args.imds} every {args.poll_s:g} s" + (
        f", and Capacity Block {block.id}" if block.id else ""))

    def once(line: str) -> None:
        nonlocal said
        if line != said:
            log(line)
            said = line

    while not stop.is_set():
        try:
            notices = read_notices(imds)
        except (OSError, ValueError) as e:
            once(f"metadata service unreachable ({e}); retrying every {args.poll_s:g} s")
            notices = None
        if notices is not None and said.startswith("metadata service unreachable"):
            once("metadata service reachable again")
        if notices is not None and block.id:
            try:
                due = block.notice(time.time())
                notices.extend([due] if due else [])
                if block.end_ms != block_said:   # at the first read, and when it moves
                    block_said = block.end_ms
                    log(f"Capacity Block {block.id} ends at {iso_ms(block.end_ms)}; this "
                        f"node drains at {block.drain_at()}")
            except Exception as e:  # EC2 away or refusing: said once, read again next poll
                once(f"Capacity Block {block.id}: its end could not be read ({e}); retrying")
        if gpus.on and time.monotonic() - gpus_read >= args.gpu_poll_s and not gpu_fault:
            gpus_read = time.monotonic()
            try:
                if gpus.cursor is None:
                    log(f"GPU watch: {gpus.start()}")
                elif found := gpus.faults():
                    gpu_fault = gpu_notice(found, time.time())
                    log(f"GPU fault: {gpu_fault['what']}")
            except Exception as e:  # a tool failing: said once, tried again at the next read
                once(f"GPU watch: could not read the GPUs or the kernel log ({e}); retrying")
        if gpu_fault and notices is not None:
            notices.append(gpu_fault)
        if not ray.node_ip:
            # Found once: a node id never changes while its raylet lives (a new raylet is
            # a new node, with a new agent from its start commands).
            try:
                if ray.connect():
                    once(f"this node is {ray.node_id} ({ray.node_ip})")
                else:
                    once("waiting for the GCS and this node's raylet to appear")
            except Exception as e:  # a GCS restart, a network blip: the next poll retries
                once(f"GCS not reachable ({e}); retrying")
        if ray.node_ip:
            for n in [n for n in notices or [] if len(handled.get(n["key"], ())) < 2]:
                handle(ray, n, handled.setdefault(n["key"], set()), once)
        stop.wait(args.poll_s)


def handle(ray: Ray, notice: dict, done: set[str], once) -> None:
    what = {"interruption": f"interruption notice ({notice['action']} at {notice['time']})",
            "capacity-block-end": f"Capacity Block {notice.get('reservation')} end (EC2 "
                                  f"terminates from {notice['time']})",
            "gpu-fault": f"GPU fault ({notice.get('what')})",
            }.get(notice["kind"], f"rebalance recommendation (at {notice['time']})")
    try:
        if "published" not in done:
            # First: the checkpoint is what bounds the work lost; the drain only steers
            # new work away.
            ray.publish(notice)
            done.add("published")
            log(f"{what}: published to this node's training workers (checkpoint at their "
                f"next step)")
        if notice["kind"] == "rebalance":
            done.add("drained")  # a recommendation never drains (module docstring)
            return
        if "drained" not in done:
            accepted, why = ray.drain(notice)
            done.add("drained")
            log(f"{what}: node {ray.node_id} drained (reason preemption, deadline "
                f"{notice['time']})" if accepted else f"{what}: drain refused by Ray: {why}")
    except Exception as e:  # the GCS away for a moment: retried at the next poll
        once(f"{what}: could not reach the GCS ({e}); retrying")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except BadArgs as e:
        print(f"spot.py: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_term(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    watch(args, stop)
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
