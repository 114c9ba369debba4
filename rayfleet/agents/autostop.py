"""Whole-cluster auto-stop: the head's watcher that tears an idle cluster down like `ray down`.

Ray's `idle_timeout_minutes` removes idle *workers* only; the head (and any min_workers) bills
until someone runs `ray down`. This watcher runs beside the head's Ray (started by the cluster
YAML that `rayfleet render --autostop-minutes N` writes) and asks Ray itself, every --poll-s,
whether anything is going on:

- a job (submitted, or a driver connected with ray.init) that is pending or running, or one
  submitted in the last N minutes;
- a Serve application;
- an actor of a user that is alive or being (re)started, detached ones included: a user's
  detached actor is work the user left running. Ray's own long-lived actors (Ray Data's stats
  and autoscaling coordinators, the job supervisors, Serve's controller and proxies, whose
  applications are counted above) are not;
- a task that is not finished, other than one of those internal actors' own.

Once none of these has held for N minutes it writes its reason to the cluster's log in the
bucket (``<storage>/clusters/<cluster>/autostop.log``, read back with
``rayfleet logs --cluster``), lets the log shipper make its last copy, then terminates the
cluster's workers, waits for them to go, and terminates the head: its own instance. Every EC2
call is one the head role already makes for Ray's autoscaler (DescribeInstances, and
TerminateInstances on instances carrying this cluster's ray-cluster-name tag).

Terminate, never stop: a stopped cluster still bills its EBS volumes, and the kit renders
``cache_stopped_nodes: false`` so that `ray up` never restarts a stale node; a stopped head
would be one. Everything worth keeping is already in the bucket (checkpoints, logs).

Run on the head as a standalone script (the node has the node environment, not the kit):

    python autostop.py --cluster-name C --minutes 30 --storage s3://BUCKET/PREFIX \
        --address http://127.0.0.1:<dashboard port>

Standard library, Ray and boto3 only; it talks to Ray over the dashboard's HTTP API with the
cluster's token (no ray.init: a connected driver would itself count as a job).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

# Ray's own long-lived actors, by namespace: none of them is a user's work. Ray Data, Ray
# Train and Serve create them detached, and they outlive the job that made them.
# tests/unit/test_autostop_units.py fails when the installed Ray names one not listed here.
INTERNAL_NAMESPACES = frozenset({
    "serve",                            # controller and proxies (applications counted apart)
    "SUPERVISOR_ACTOR_RAY_NAMESPACE",   # one JobSupervisor per submitted job
    "_dataset_stats_actor",             # Ray Data: stats
    "_dataset_stats_summary_actor",     # Ray Data: stats summaries
    "DataUsageCollectionActor",         # Ray Data: usage tags
    "AutoscalingCoordinator",           # Ray Data: resource coordinator
    "AutoscalingRequester",             # Ray Data: autoscaler requests
    "ActorLocationTracker",             # Ray Data: actor locality
    "ray.dataset",                      # Ray Data: batch prefetchers
    "ray_data_shuffle_disk",            # Ray Data: disk shuffle file servers
    "_train_state_actor",               # Ray Train: run state for the dashboard
    "llm_serve_telemetry",              # Serve LLM (the llm app): usage telemetry
    "llm_batch_telemetry",              # Ray Data LLM: usage telemetry
})
# Serve LLM's per-app actors ("serve::<app>::<deployment>": the prefix-aware router's tree); the
# app itself is counted apart, while it is deployed.
INTERNAL_NAMESPACE_PREFIXES = ("serve::",)
LIVE_ACTOR_STATES = ("ALIVE", "PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING")
DONE_TASK_STATES = frozenset({"FINISHED", "FAILED"})
LIVE_JOB_STATES = frozenset({"PENDING", "RUNNING"})


class Stop(Exception):
    """SIGTERM: leave without tearing anything down."""


def log(message: str) -> None:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"{stamp} autostop: {message}", flush=True)


# --------------------------------------------------------------------------- Ray's state

class Dashboard:
    """The head's dashboard HTTP API, with the cluster's token."""

    def __init__(self, address: str, token: str | None):
        self.address = address.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def get(self, path: str, **query) -> object:
        url = f"{self.address}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        req = urllib.request.Request(url, headers=self.headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def state(self, resource: str, **query) -> list[dict]:
        """A state API listing (/api/v0/<resource>); raises if Ray says it is partial."""
        body = self.get(f"/api/v0/{resource}", limit=10000, detail=1, **query)
        if not body.get("result"):
            raise RuntimeError(f"/api/v0/{resource}: {body.get('msg')}")
        data = body["data"]["result"]
        if data.get("partial_failure_warning"):
            raise RuntimeError(f"/api/v0/{resource}: {data['partial_failure_warning']}")
        return data["result"]


def busy_reasons(ray: Dashboard, now_s: float, window_s: float) -> list[str]:
    """Why the cluster is not idle now (empty: idle). Raises when Ray cannot say: a cluster
    whose state cannot be read is never taken for idle."""
    reasons = []
    for job in ray.get("/api/jobs/"):
        name = job.get("submission_id") or job.get("job_id")
        if job.get("status") in LIVE_JOB_STATES:
            reasons.append(f"job {name} is {job['status'].lower()}")
        elif (job.get("start_time") or 0) / 1000 > now_s - window_s:
            at = dt.datetime.fromtimestamp(job["start_time"] / 1000, dt.timezone.utc)
            reasons.append(f"job {name} was submitted at {at:%H:%M:%S} UTC")
    apps = ray.get("/api/serve/applications/").get("applications") or {}
    reasons += [f"Serve application {name!r} is deployed" for name in sorted(apps)]
    internal_actors = set()
    for actor in ray.state("actors"):
        namespace = actor.get("ray_namespace") or ""
        if namespace in INTERNAL_NAMESPACES or namespace.startswith(INTERNAL_NAMESPACE_PREFIXES):
            internal_actors.add(actor["actor_id"])
        elif actor.get("state") in LIVE_ACTOR_STATES:
            reasons.append(f"actor {actor.get('class_name')} ({actor['actor_id'][:8]}, "
                           f"job {actor.get('job_id')}) is {actor['state'].lower()}")
    for task in ray.state("tasks"):
        if task.get("state") in DONE_TASK_STATES or task.get("actor_id") in internal_actors:
            continue
        if task.get("type") == "DRIVER_TASK":
            continue   # a driver is its job, counted above
        reasons.append(f"task {task.get('name')} of job {task.get('job_id')} is "
                       f"{str(task.get('state')).lower()}")
    return reasons


# --------------------------------------------------------------------------- the log

class ClusterLog:
    """``<storage>/clusters/<cluster>/autostop.log`` in the bucket: one line per decision,
    appended (S3 objects are rewritten whole; the log is a few lines)."""

    def __init__(self, storage: str | None, cluster: str, s3=None):
        self.s3, self.bucket, self.key = s3, None, None
        if storage:
            bucket, _, prefix = storage.removeprefix("s3://").partition("/")
            self.bucket = bucket
            self.key = "/".join(p for p in (prefix.strip("/"), "clusters", cluster,
                                             "autostop.log") if p)

    def write(self, line: str) -> None:
        log(line)
        if not self.bucket:
            return
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        try:
            try:
                old = self.s3.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
            except self.s3.exceptions.NoSuchKey:
                old = b""
            self.s3.put_object(Bucket=self.bucket, Key=self.key,
                               Body=old + f"{stamp} {line}\n".encode())
        except Exception as e:   # noqa: BLE001 (the log must never stop the teardown)
            log(f"could not write s3://{self.bucket}/{self.key}: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------- the teardown

def cluster_instances(ec2, cluster: str) -> list[dict]:
    """This cluster's instances that are not gone yet."""
    from ray.autoscaler.tags import TAG_RAY_CLUSTER_NAME

    pages = ec2.get_paginator("describe_instances").paginate(Filters=[
        {"Name": f"tag:{TAG_RAY_CLUSTER_NAME}", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping",
                                                   "stopped"]}])
    return [i for p in pages for r in p["Reservations"] for i in r["Instances"]]


def is_head(instance: dict) -> bool:
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

    return any(t["Key"] == TAG_RAY_NODE_KIND and t["Value"] == NODE_KIND_HEAD
               for t in instance.get("Tags") or [])


def teardown(ec2, cluster: str, wait_s: float = 300, poll_s: float = 5) -> list[str]:
    """As `ray down` does: the workers first, and once they are gone the head. Returns the
    instance ids terminated, workers first."""
    live = cluster_instances(ec2, cluster)
    workers = [i["InstanceId"] for i in live if not is_head(i)]
    heads = [i["InstanceId"] for i in live if is_head(i)]
    if workers:
        log(f"terminating {len(workers)} worker(s): {' '.join(workers)}")
        ec2.terminate_instances(InstanceIds=workers)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            left = [i["InstanceId"] for i in cluster_instances(ec2, cluster)
                    if i["InstanceId"] in workers]
            if not left:
                break
            time.sleep(poll_s)
        else:
            log(f"workers still shutting down after {wait_s:.0f} s; terminating the head "
                "anyway (EC2 finishes their termination)")
    if heads:
        log(f"terminating the head: {' '.join(heads)}")
        ec2.terminate_instances(InstanceIds=heads)
    return workers + heads


def stop_first(pattern: str, timeout_s: float = 60) -> None:
    """SIGTERM the processes matching ``pattern`` (pgrep -f; the log shipper, for its last
    copy), never this one, and wait for them to exit."""
    def others() -> list[int]:
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        return [pid for pid in map(int, found.stdout.split()) if pid != os.getpid()]

    for pid in others():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while others():
        if time.monotonic() > deadline:
            log(f"{pattern!r} still running after {timeout_s:.0f} s; going on")
            return
        time.sleep(1)


# --------------------------------------------------------------------------- the watcher

def watch(ray: Dashboard, minutes: float, poll_s: float, clock=time.time, sleep=time.sleep,
          out=log) -> str:
    """Poll until the cluster has been idle for ``minutes``; returns the reason to stop."""
    window = minutes * 60
    idle_since = clock()   # nothing is known before the watcher starts: count from here
    last = None
    while True:
        now = clock()
        try:
            reasons = busy_reasons(ray, now, window)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            reasons = [f"Ray's state unreadable ({type(e).__name__}: {e})"]
        if reasons:
            idle_since = now
            said = "; ".join(reasons[:3]) + (f" (+{len(reasons) - 3} more)"
                                             if len(reasons) > 3 else "")
            if said != last:
                out(f"busy: {said}")
        elif now - idle_since >= window:
            return (f"idle for {(now - idle_since) / 60:.1f} min (no job, Serve application, "
                    f"user actor or task; none submitted in the last {minutes:g} min)")
        elif last is not None:
            out(f"idle since {dt.datetime.fromtimestamp(idle_since, dt.timezone.utc):%H:%M:%S}"
                f" UTC; stopping after {minutes:g} min")
        last = said if reasons else None
        sleep(poll_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="autostop.py", description="Tear this Ray cluster down (workers, then the head) "
        "once it has been idle for --minutes, as `ray down` would.")
    p.add_argument("--cluster-name", required=True, help="the cluster YAML's cluster_name")
    p.add_argument("--minutes", type=float, required=True,
                   help="idle minutes before the cluster is torn down")
    p.add_argument("--storage", default=None, metavar="s3://BUCKET/PREFIX",
                   help="the stack's storage: the decision is logged under "
                        "clusters/<cluster>/autostop.log there")
    # Required: the dashboard's port is rayfleet.facts', which this standalone script cannot
    # import; `rayfleet render` writes it into the head's start command.
    p.add_argument("--address", required=True, metavar="URL",
                   help="the head's dashboard, e.g. http://127.0.0.1:<dashboard port>")
    p.add_argument("--region", default=None, help="AWS region (default: the node's)")
    p.add_argument("--poll-s", type=float, default=30.0, help="seconds between looks")
    p.add_argument("--stop-first", default=None, metavar="PATTERN",
                   help="SIGTERM processes matching PATTERN (pkill -f) and wait for them "
                        "before the teardown, e.g. the log shipper's last copy")
    p.add_argument("--dry-run", action="store_true",
                   help="decide and log, but terminate nothing (then exit 0)")
    args = p.parse_args(argv)
    problems = []
    if not args.minutes > 0:
        problems.append(f"--minutes: must be more than 0, got {args.minutes:g}")
    if not args.poll_s > 0:
        problems.append(f"--poll-s: must be more than 0, got {args.poll_s:g}")
    if args.storage and not (args.storage.startswith("s3://")
                             and args.storage.removeprefix("s3://").split("/")[0]):
        problems.append(f"--storage: must be s3://BUCKET[/PREFIX], got {args.storage!r}")
    if problems:
        print(f"autostop.py: error: {problems[0]}", file=sys.stderr)
        sys.exit(2)
    return args


def token() -> str | None:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if os.environ.get("RAY_AUTH_MODE") == "token" and path:
        with open(os.path.expanduser(path)) as f:
            return f.read().strip()
    return os.environ.get("RAY_AUTH_TOKEN")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def _term(*_):
        raise Stop

    signal.signal(signal.SIGTERM, _term)
    try:
        secret = token()
    except OSError as e:
        print(f"autostop.py: error: cannot read the Ray token ({e})", file=sys.stderr)
        return 2
    import boto3

    session = boto3.Session(region_name=args.region)
    cluster_log = ClusterLog(args.storage, args.cluster_name,
                             session.client("s3") if args.storage else None)
    try:
        cluster_log.write(f"armed on {args.cluster_name}: down after {args.minutes:g} idle "
                          f"min (looking every {args.poll_s:g} s)")
        reason = watch(Dashboard(args.address, secret), args.minutes, args.poll_s)
        if args.dry_run:
            cluster_log.write(f"would tear {args.cluster_name} down: {reason} (--dry-run)")
            return 0
        cluster_log.write(f"tearing {args.cluster_name} down: {reason}")
        if args.stop_first:
            stop_first(args.stop_first)
        gone = teardown(session.client("ec2"), args.cluster_name)
        cluster_log.write(f"terminated {len(gone)} instance(s): {' '.join(gone)}")
    except Stop:
        log("SIGTERM: leaving, nothing torn down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
