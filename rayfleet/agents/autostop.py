"""Whole-cluster auto-stop: the head's watcher that tears an idle cluster down like `ray down`.

Ray's `idle_timeout_minutes` removes idle *workers* only; the head (and any min_workers) bills
until someone runs `ray down`. This watcher runs beside the head's Ray (started by the YAML that
`rayfleet render --autostop-minutes N` writes) and asks Ray's dashboard API every --poll-s
whether anything is going on: a job pending or running, or submitted in the last N minutes; a
Serve application; a user's actor alive or being (re)started, detached ones included (Ray's own
long-lived actors are not); a task not finished, other than those internal actors' own.

Once none of these has held for N minutes it logs why (``<storage>/clusters/<cluster>/
autostop.log``, read back with ``rayfleet logs --cluster``) and tears down: it pauses the
head's autoscaler (SIGSTOP, so nothing is relaunched), lets the log shipper make its last copy,
terminates the workers until none of the cluster's is left, then the head: its own instance.
Right before each step it looks at Ray again; if anything is busy (or Ray cannot say) it
aborts, saying so, resumes the autoscaler and the shipper, and watches again. A state that
cannot be read counts as busy, is said in the log every window, and after
--unreadable-limit-minutes auto-stop disarms (says so, exits 1, tears nothing down). Every EC2
call is one the head role already makes for Ray's autoscaler (DescribeInstances, and
TerminateInstances on instances with this cluster's ray-cluster-name tag). It signals only its
own user's processes, known by pid and start time.

Terminate, never stop: a stopped cluster still bills its EBS volumes, and the kit renders
``cache_stopped_nodes: false`` so that `ray up` never restarts a stale node.

Run on the head as a standalone script (standard library, Ray and boto3 only; no ray.init: a
connected driver would itself count as a job):

    python autostop.py --cluster-name C --minutes 30 --storage s3://BUCKET/PREFIX \
        --address http://127.0.0.1:<dashboard port> --gcs-port <GCS port>
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
# The token never leaves for a proxy (http_proxy in the node's environment included).
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Ray's autoscaler: `ray start --head` runs one of these (v1, v2) with --gcs-address=HOST:PORT.
MONITOR_SCRIPTS = ("ray/autoscaler/_private/monitor.py", "ray/autoscaler/v2/monitor.py")


class Stop(Exception):   # SIGTERM: leave without tearing anything down
    pass


def log(message: str) -> None:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"{stamp} autostop: {message}", flush=True)


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
        # The token never goes to a proxy: the dashboard is this node's own.
        with NO_PROXY.open(req, timeout=30) as r:
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


class ClusterLog:
    """``<storage>/clusters/<cluster>/autostop.log`` in the bucket: one line per decision,
    appended (S3 objects are rewritten whole; the log is a few lines)."""

    def __init__(self, storage: str | None, cluster: str, s3=None):
        self.s3, self.bucket, self.key = s3, None, None
        if storage:
            self.bucket, _, prefix = storage.removeprefix("s3://").partition("/")
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


class Busy(Exception):   # work arrived (or Ray's state went unreadable): abort the teardown
    pass


class Proc:
    """A process of this user, known by pid *and* start time: a pid the kernel reused for
    another process is never signalled."""

    def __init__(self, pid: int):
        self.pid, self.start = pid, self.stat(pid)[19]   # field 22: start time in ticks
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            self.argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]

    @staticmethod
    def stat(pid: int) -> list[str]:   # /proc/PID/stat from field 3, its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()

    def alive(self) -> bool:
        """This process, not exited: a zombie (state Z: not reaped yet; a shipper this agent
        restarted is its own child, reaped here) has ended."""
        try:
            state, *_, start = self.stat(self.pid)[:20]
            if state == "Z" and start == self.start:
                os.waitpid(self.pid, os.WNOHANG)
            return state != "Z" and start == self.start
        except OSError:   # gone, or a zombie another process reaps
            return False

    def signal(self, sig: int) -> bool:
        try:
            return self.alive() and os.kill(self.pid, sig) is None
        except ProcessLookupError:
            return False


def own_processes(matches) -> list[Proc]:
    """This user's processes (never this one) whose argv ``matches``."""
    found = []
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()):
        try:
            if os.stat(f"/proc/{pid}").st_uid == os.getuid() and matches((p := Proc(pid)).argv):
                found.append(p)
        except (OSError, IndexError):
            continue   # gone meanwhile
    return found


def pause_autoscaler(gcs_port: int) -> list[Proc]:
    """SIGSTOP this cluster's autoscaler (the monitor whose --gcs-address ends in the port), so
    that it launches nothing while the cluster is torn down; resume() undoes it."""
    def is_monitor(argv: list[str]) -> bool:
        return (any(a.endswith(MONITOR_SCRIPTS) for a in argv)
                and any(a.startswith("--gcs-address=") and a.endswith(f":{gcs_port}")
                        for a in argv))

    paused = [p for p in own_processes(is_monitor) if p.signal(signal.SIGSTOP)]
    if paused:
        log(f"paused Ray's autoscaler (pid {' '.join(str(p.pid) for p in paused)})")
    else:
        log(f"no autoscaler of GCS port {gcs_port} found to pause; workers it launches are "
            "terminated too")
    return paused


def resume(paused: list[Proc]) -> None:
    for p in paused:   # SIGCONT: what pause_autoscaler stopped, if it is still that process
        if p.signal(signal.SIGCONT):
            log(f"resumed Ray's autoscaler (pid {p.pid})")


def stop_first(pattern: str, timeout_s: float = 60) -> list[tuple[list[str], dict, str, str]]:
    """SIGTERM this user's processes whose command line holds ``pattern`` (the log shipper, for
    its last copy) and wait for them to exit. Returns what restart() needs to start them again
    (argv, environment, working folder, stdout) if the teardown is aborted."""
    procs = own_processes(lambda argv: pattern in " ".join(argv))
    saved = []
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                environ = dict(kv.decode(errors="replace").split("=", 1)
                               for kv in f.read().split(b"\0") if b"=" in kv)
            saved.append((p.argv, environ, os.readlink(f"/proc/{p.pid}/cwd"),
                          os.readlink(f"/proc/{p.pid}/fd/1")))
        except OSError:
            continue
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(p.alive() for p in procs):
        if time.monotonic() > deadline:
            log(f"{pattern!r} still running after {timeout_s:.0f} s; going on")
            break
        time.sleep(1)
    return saved


def restart(saved) -> None:
    """Start again what stop_first stopped, as it was started (in its own session)."""
    for argv, environ, cwd, out in saved:
        target = out if out.startswith("/") else os.devnull
        with open(target, "ab") as f:
            proc = subprocess.Popen(argv, env=environ, cwd=cwd, stdout=f, stderr=f,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        log(f"restarted {' '.join(argv[:2])} (pid {proc.pid})")


def teardown(ec2, cluster: str, check=lambda step: None, wait_s: float = 300,
             poll_s: float = 5, say=log) -> list[str]:
    """As `ray down` does: the workers first, until none of the cluster's is left (one an
    autoscaler launches meanwhile included), then the head. Before each termination call,
    ``check(step)`` (raises Busy to abort), then ``say(line)``. Returns the ids terminated."""
    gone: list[str] = []
    deadline = time.monotonic() + wait_s
    while True:
        live = cluster_instances(ec2, cluster)
        workers = [i["InstanceId"] for i in live if not is_head(i)]
        if not workers:
            break
        new = [w for w in workers if w not in gone]
        if new:
            check(f"terminating {len(new)} worker(s)")
            say(f"terminating {len(new)} worker(s): {' '.join(new)}")
            ec2.terminate_instances(InstanceIds=new)
            gone += new
        if time.monotonic() > deadline:
            log(f"workers still shutting down after {wait_s:.0f} s; terminating the head "
                "anyway (EC2 finishes their termination)")
            break
        time.sleep(poll_s)
    heads = [i["InstanceId"] for i in cluster_instances(ec2, cluster) if is_head(i)]
    if heads:
        check("terminating the head")
        say(f"terminating the head: {' '.join(heads)}")
        ec2.terminate_instances(InstanceIds=heads)
    return gone + heads


def still_idle(ray: "Dashboard", window_s: float):
    """The check before each teardown step: Busy if anything is going on or Ray cannot say."""
    def check(step: str) -> None:
        try:
            reasons = busy_reasons(ray, time.time(), window_s)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            reasons = [f"Ray's state unreadable ({type(e).__name__}: {e})"]
        if reasons:
            raise Busy(f"before {step}: {'; '.join(reasons[:3])}")
    return check


class Unreadable(Exception):
    """Ray's state could not be read for --unreadable-limit-minutes: auto-stop disarms."""


def watch(ray: Dashboard, minutes: float, poll_s: float, clock=time.time, sleep=time.sleep,
          out=log, alert=log, unreadable_limit_s: float = 3600) -> str:
    """Poll until the cluster has been idle for ``minutes``; returns the reason to stop.

    A look that cannot read Ray's state counts as busy (work it cannot see is never killed);
    that is said through ``alert`` (the cluster's log in the bucket) at once and again every
    window, and after ``unreadable_limit_s`` of nothing but such looks, Unreadable is raised:
    auto-stop disarms, saying so, and the cluster stays up until `ray down`."""
    window = minutes * 60
    idle_since = clock()   # nothing is known before the watcher starts: count from here
    last = None
    unreadable_since = alerted = None
    while True:
        now = clock()
        try:
            reasons = busy_reasons(ray, now, window)
            unreadable_since = alerted = None
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            reasons = [f"Ray's state unreadable ({type(e).__name__}: {e})"]
            unreadable_since = now if unreadable_since is None else unreadable_since
            if now - unreadable_since >= unreadable_limit_s:
                raise Unreadable(f"Ray's state unreadable for {(now - unreadable_since) / 60:.0f}"
                                 f" min ({type(e).__name__}: {e})") from None
            if alerted is None or now - alerted >= window:
                alert(f"busy: {reasons[0]}; counted as busy, disarming after "
                      f"{unreadable_limit_s / 60:g} min of it")
                alerted = now
        if reasons:
            idle_since = now
            said = "; ".join(reasons[:3]) + (f" (+{len(reasons) - 3} more)"
                                             if len(reasons) > 3 else "")
            if said != last and unreadable_since is None:
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
    # Required, as --gcs-port: the ports are rayfleet.facts', which `rayfleet render` writes in.
    p.add_argument("--address", required=True, metavar="URL",
                   help="the head's dashboard, e.g. http://127.0.0.1:<dashboard port>")
    p.add_argument("--gcs-port", type=int, required=True,
                   help="the head's GCS port: its autoscaler is paused during the teardown")
    p.add_argument("--unreadable-limit-minutes", type=float, default=60.0,
                   help="disarm (tear nothing down, say so, exit 1) once Ray's state has been "
                        "unreadable this long; until then that counts as busy")
    p.add_argument("--region", default=None, help="AWS region (default: the node's)")
    p.add_argument("--poll-s", type=float, default=None, help="seconds between looks "
                   "(default: a sixth of the idle window, at most 30)")
    p.add_argument("--stop-first", default=None, metavar="PATTERN",
                   help="SIGTERM this user's processes whose command line holds PATTERN and "
                        "wait for them before the teardown (the log shipper's last copy); "
                        "started again if the teardown is aborted")
    p.add_argument("--dry-run", action="store_true",
                   help="decide and log, but terminate nothing (then exit 0)")
    args = p.parse_args(argv)
    args.poll_s = min(30.0, args.minutes * 10) if args.poll_s is None else args.poll_s
    problems = [f"{flag}: must be more than 0, got {value:g}" for flag, value in (
        ("--minutes", args.minutes), ("--poll-s", args.poll_s),
        ("--unreadable-limit-minutes", args.unreadable_limit_minutes)) if not value > 0]
    if not 0 < args.gcs_port < 65536:
        problems.append(f"--gcs-port: must be a port (1-65535), got {args.gcs_port}")
    if args.storage and not (args.storage.startswith("s3://")
                             and args.storage.removeprefix("s3://").split("/")[0]):
        problems.append(f"--storage: must be s3://BUCKET[/PREFIX], got {args.storage!r}")
    if problems:
        print(f"autostop.py: error: {problems[0]}", file=sys.stderr)
        sys.exit(2)
    return args


def tear_down(args: argparse.Namespace, ec2, ray: Dashboard, say=log) -> list[str]:
    """The autoscaler paused, the log shipper's last copy, then the instances, one more look
    at Ray before each step; on Busy, what was paused or stopped runs again."""
    check = still_idle(ray, args.minutes * 60)
    paused, stopped = pause_autoscaler(args.gcs_port), []
    try:
        if args.stop_first:
            check("stopping the log shipper")
            stopped = stop_first(args.stop_first)
        return teardown(ec2, args.cluster_name, check, say=say)
    except Exception:   # Busy, or an EC2 call that failed: nothing stays paused or stopped
        restart(stopped)
        resume(paused)
        raise


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
    ray = Dashboard(args.address, secret)
    try:
        cluster_log.write(f"armed on {args.cluster_name}: down after {args.minutes:g} idle "
                          f"min (looking every {args.poll_s:g} s)")
        while True:
            try:
                reason = watch(ray, args.minutes, args.poll_s, alert=cluster_log.write,
                               unreadable_limit_s=args.unreadable_limit_minutes * 60)
            except Unreadable as e:
                cluster_log.write(f"disarmed: {e}; nothing torn down: the cluster runs (and "
                                  "bills) until `ray down` or `rayfleet sweep --delete`")
                return 1
            if args.dry_run:
                cluster_log.write(f"would tear {args.cluster_name} down: {reason} (--dry-run)")
                return 0
            cluster_log.write(f"tearing {args.cluster_name} down: {reason}")
            try:
                gone = tear_down(args, session.client("ec2"), ray, cluster_log.write)
            except Busy as e:
                cluster_log.write(f"teardown aborted {e}; watching again")
                continue
            except Exception as e:   # noqa: BLE001 (said, and the watch goes on)
                cluster_log.write(f"teardown failed ({type(e).__name__}: {e}); watching again")
                continue
            cluster_log.write(f"terminated {len(gone)} instance(s): {' '.join(gone)}")
            return 0
    except Stop:
        log("SIGTERM: leaving, nothing torn down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
