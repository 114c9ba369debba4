"""Head agent: each Ray job's logs, copied to the stack's bucket so they outlive the cluster.

For every job submitted through the Jobs API, copies to
``s3://BUCKET/PREFIX/runs/<submission id>/logs/``: ``driver.log``, ``job.json`` (status,
entrypoint, times, metadata, message) and ``workers/<node ip>/worker-*.out|.err`` (the Ray
logs of the job's worker processes on every live node). Every --every-s while the job runs
(only files that changed), once more when it ends, then never again. `rayfleet logs <run>`
reads them back, also after `ray down`.

Standalone: it runs on cluster nodes that have the node environment (ray, boto3) but not the
kit, as ``python logship.py --storage s3://B/P --address http://127.0.0.1:<dashboard port>``,
with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH set and AWS credentials from the instance
profile (AWS_ENDPOINT_URL[_S3] is honored). It reads the cluster only over HTTP (Jobs and
state APIs, with the token): a connected driver would count as a user job to the autostop
watcher.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

PROG = "logship"
# Ray job statuses after which nothing more is written (ray.job_submission.JobStatus).
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# S3's bucket-name rule, rayfleet/facts.py's S3_BUCKET_NAME to the character: this script runs
# on nodes that do not have the kit, so it cannot import it, and facts does not import this
# (it would load the agent's modules into every import of facts); tests/unit/test_facts.py
# holds the two equal.
S3_BUCKET_NAME = re.compile(r"(?![^/]*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Ray names a worker's logs worker-<worker id>-<job id hex>-<pid>.out|.err.
WORKER_LOG = re.compile(r"worker-[0-9a-f]+-([0-9a-f]+)-\d+\.(out|err)")


def log(msg: str) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"{stamp} {msg}", flush=True)


class BadArgs(Exception):
    """A bad argument or setting at start: one line on stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BadArgs(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[1],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", required=True, metavar="s3://BUCKET/PREFIX",
                   help="the stack's storage URI; logs go under PREFIX/runs/<run>/logs/")
    p.add_argument("--address", required=True, metavar="URL",
                   help="the Jobs API (the dashboard), e.g. http://127.0.0.1:<dashboard port>")
    p.add_argument("--every-s", type=float, default=180.0, metavar="S",
                   help="copy a running job's logs this often (default 180)")
    p.add_argument("--poll-s", type=float, default=5.0, metavar="S",
                   help="look for new and ended jobs this often (default 5)")
    args = p.parse_args(argv)
    m = re.fullmatch(r"s3://([^/]+)/*(.*?)/*", args.storage)
    if not m or not S3_BUCKET_NAME.fullmatch(m.group(1)):
        raise BadArgs(f"--storage {args.storage!r} is not s3://BUCKET/PREFIX")
    args.bucket, args.prefix = m.group(1), m.group(2)
    if not re.fullmatch(r"https?://[^/\s]+", args.address.rstrip("/")):
        raise BadArgs(f"--address {args.address!r} is not http://HOST:PORT")
    args.address = args.address.rstrip("/")
    for flag in ("every_s", "poll_s"):
        if not getattr(args, flag) > 0:
            raise BadArgs(f"--{flag.replace('_', '-')} must be more than 0")
    return args


def read_token() -> str | None:
    """The cluster token, found as Ray finds it (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then
    ~/.ray/auth_token); None when token auth is off."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token").expanduser()
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise BadArgs(f"RAY_AUTH_MODE=token but the token {path} cannot be read: "
                      f"{e.strerror}") from None
    if not token:
        raise BadArgs(f"RAY_AUTH_MODE=token but the token file {path} is empty")
    return token


class Cluster:
    """The Jobs and state APIs over HTTP with the token: no driver, no ray.init."""

    def __init__(self, address: str, token: str | None):
        self.address, self.token = address, token
        # Never through an HTTP(S)_PROXY from the environment: the token is for the head only.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, path: str, **params) -> bytes:
        url = f"{self.address}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        req = urllib.request.Request(url)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with self.opener.open(req, timeout=30) as r:
            return r.read()

    def jobs(self) -> list[dict]:
        # Drivers started with ray.init (no submission id) are not Jobs API runs.
        return [j for j in json.loads(self.get("/api/jobs/")) if j.get("submission_id")]

    def driver_log(self, submission_id: str) -> bytes:
        sid = urllib.parse.quote(submission_id, safe="")
        return json.loads(self.get(f"/api/jobs/{sid}/logs"))["logs"].encode()

    def alive_nodes(self) -> list[dict]:
        data = json.loads(self.get("/api/v0/nodes", limit=10000))
        return [n for n in data["data"]["result"]["result"] if n.get("state") == "ALIVE"]

    def worker_logs(self, node_id: str, job_id: str) -> list[str]:
        data = json.loads(self.get("/api/v0/logs", node_id=node_id,
                                   glob=f"worker-*-{job_id}-*"))
        names = [f for group in data["data"]["result"].values() for f in group]
        return sorted(f for f in names if (m := WORKER_LOG.fullmatch(f)) and
                      m.group(1) == job_id)

    def log_file(self, node_id: str, filename: str) -> bytes:
        return self.get("/api/v0/logs/file", node_id=node_id, filename=filename, lines=-1)


def job_record(job: dict, final: bool) -> bytes:
    keep = ("submission_id", "job_id", "status", "entrypoint", "message", "error_type",
            "start_time", "end_time", "driver_exit_code", "metadata")
    # Not runtime_env: its env_vars may carry secrets, and the bucket outlives the cluster.
    record = {k: job.get(k) for k in keep}
    record.update(final=final, copied_at=datetime.now(timezone.utc).isoformat(
        timespec="seconds"))
    return json.dumps(record, indent=1).encode()


class Shipper:
    def __init__(self, args: argparse.Namespace, cluster: Cluster, s3):
        self.args, self.cluster, self.s3 = args, cluster, s3
        self.sent: dict[str, str] = {}          # key -> sha256 of what is in the bucket
        self.due: dict[str, float] = {}         # run -> when its next copy is due
        self.done: set[str] = set()             # runs whose final copy is in the bucket
        self.failed: set[str] = set()           # ended runs whose final copy failed
        self.api_error: str | None = None

    def key(self, run: str, name: str) -> str:
        return "/".join(p for p in (self.args.prefix, "runs", run, "logs", name) if p)

    def put(self, key: str, body: bytes) -> bool:
        digest = hashlib.sha256(body).hexdigest()
        if self.sent.get(key) == digest:
            return False
        self.s3.put_object(Bucket=self.args.bucket, Key=key, Body=body)
        self.sent[key] = digest
        return True

    def already_final(self, run: str) -> bool:
        """After a restart of the agent: an ended job whose final copy is already stored."""
        try:
            body = self.s3.get_object(Bucket=self.args.bucket,
                                      Key=self.key(run, "job.json"))["Body"].read()
            return bool(json.loads(body).get("final"))
        except Exception:  # missing, unreadable: copy it again
            return False

    def copy(self, job: dict, final: bool) -> None:
        run = job["submission_id"]
        files = {}
        try:
            files["driver.log"] = self.cluster.driver_log(run)
        except urllib.error.HTTPError as e:
            if not final:
                raise
            # An ended job whose log the cluster no longer has (its node is gone) would fail
            # every retry: copy the rest, and say so once.
            log(f"{run}: driver log not available ({one_line(e)}); copying the rest")
        job_id = job.get("job_id")
        if job_id:  # none until the driver has connected: no worker of it yet
            for node in self.cluster.alive_nodes():
                where = node.get("node_ip") or node["node_id"][:12]
                try:
                    for name in self.cluster.worker_logs(node["node_id"], job_id):
                        files[f"workers/{where}/{name}"] = self.cluster.log_file(
                            node["node_id"], name)
                except Exception as e:  # a node going away (spot, scale-down): not the rest
                    log(f"{run}: worker logs on node {where} not copied: {one_line(e)}")
        changed = [name for name, body in files.items() if self.put(self.key(run, name), body)]
        # Last: a job.json with final=true says the copy beside it is whole.
        self.put(self.key(run, "job.json"), job_record(job, final))
        where = f"s3://{self.args.bucket}/{self.key(run, '')}/"
        log(f"{run}: {'final copy' if final else 'copied'} ({job['status']}) to {where}: "
            f"{len(changed)} of {len(files)} files changed")

    def step(self, now: float, last_pass: bool = False) -> None:
        try:
            jobs = self.cluster.jobs()
        except Exception as e:  # the dashboard starting or restarting: try again next poll
            msg = f"cannot list jobs at {self.args.address}: {one_line(e)}"
            if msg != self.api_error:
                log(msg)
            self.api_error = msg
            return
        if self.api_error:
            log(f"Jobs API at {self.args.address} answers again")
            self.api_error = None
        for job in jobs:
            run, final = job["submission_id"], job.get("status") in TERMINAL
            if run in self.done:
                continue
            if "/" in run or run in (".", ".."):
                # Not one folder name under runs/: `rayfleet logs` could not name it.
                log(f"{run!r}: not copied: a submission id with '/' is not a run name")
                self.done.add(run)
                continue
            if run not in self.due and final and self.already_final(run):
                self.done.add(run)
                log(f"{run}: final copy already in the bucket")
                continue
            # A job that has just ended is copied at once, whenever its last copy was.
            due = now >= self.due.get(run, float("-inf")) or (final and run not in self.failed)
            if not (due or last_pass):
                continue
            self.due[run] = now + self.args.every_s
            try:
                self.copy(job, final)
            except Exception as e:  # S3 or the cluster: one line, the next try is due later
                log(f"{run}: copy failed, will retry: {one_line(e)}")
                if final:  # retried sooner than a running job's next copy
                    self.failed.add(run)
                    self.due[run] = now + min(self.args.every_s, 30.0)
                continue
            self.failed.discard(run)
            if final:
                self.done.add(run)
                # Never copied again: forget its files' digests.
                here = self.key(run, "")
                self.sent = {k: v for k, v in self.sent.items() if not k.startswith(here)}


def one_line(e: BaseException) -> str:
    code = getattr(e, "response", {}).get("Error", {}).get("Code") if hasattr(
        e, "response") else None
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{code}: {text}" if code and code not in text else text


def s3_client():
    import boto3
    from botocore.config import Config

    # Short timeouts and few retries: a slow or missing bucket costs one log line per try,
    # and never holds up the other jobs for long.
    return boto3.client("s3", config=Config(connect_timeout=10, read_timeout=60,
                                            retries={"max_attempts": 3, "mode": "standard"}))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        token = read_token()
    except BadArgs as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    shipper = Shipper(args, Cluster(args.address, token), s3_client())
    log(f"shipping job logs from {args.address} to s3://{args.bucket}/"
        f"{args.prefix + '/' if args.prefix else ''}runs/<run>/logs/ every {args.every_s:g}s "
        "while a job runs, and when it ends")
    while not stop.is_set():
        shipper.step(time.monotonic())
        stop.wait(args.poll_s)
    log("stopping: a last copy of every job not yet copied in full")
    shipper.step(time.monotonic(), last_pass=True)
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
