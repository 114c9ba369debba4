"""`rayfleet logs CLUSTER_YAML RUN` and `rayfleet logs CLUSTER_YAML --cluster NAME`: what a
run left in the stack's bucket, read back after the cluster is gone.

The head's log shipper (rayfleet/agents/logship.py) copies each job's driver log, job.json
and its workers' Ray logs to ``s3://B/P/runs/<run>/logs/``; a training run writes its
checkpoints, metrics.csv and loss.png beside them (``runs/<run>/``). The autostop watcher
writes ``clusters/<cluster>/autostop.log``. The bucket comes from the facts `rayfleet render`
wrote beside the cluster YAML (an older YAML's header comment, for one release), or from
--storage (then the one argument is the run).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

from rayfleet.clusteryaml import facts_path, render_facts
from rayfleet.errors import ConfigError, RayfleetError, StorageError
from rayfleet.facts import CLUSTER_NAME, S3_BUCKET_NAME

# A run is a job's submission id or a training --name, one folder under runs/: anything that
# is not one folder name is refused here; a name that merely does not exist is answered with
# the runs that do.
RUN = re.compile(r"(?!\.\.?$)[^/\s]+")


class Bucket:
    """Reads under s3://bucket/prefix; every AWS failure becomes one line (StorageError)."""

    def __init__(self, uri: str, s3=None):
        m = re.fullmatch(rf"s3://({S3_BUCKET_NAME.pattern})/*(.*?)/*", uri)
        if not m:
            raise ConfigError("--storage", f"{uri!r} is not s3://BUCKET/PREFIX")
        self.bucket, self.prefix = m.group(1), m.group(2)
        self.uri = f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}"
        self.s3 = s3 or _client()

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _fail(self, e: Exception, what: str) -> StorageError:
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "404") and what == "list":
            why = f"bucket {self.bucket} does not exist (is this the stack's bucket?)"
        elif code in ("AccessDenied", "403", "AllAccessDisabled"):
            why = "access denied: your credentials may not read this prefix"
        elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            why = f"{code}: the AWS credentials are not valid here; refresh them"
        elif code:
            why = f"{code}: {e}"
        elif getattr(e, "kwargs", {}).get("endpoint_url"):  # connection refused, DNS, timeout
            why = f"cannot connect to {e.kwargs['endpoint_url'].split('?')[0]}"
        else:
            why = " ".join(str(e).split())
        return StorageError(f"cannot read {self.uri}: {why}")

    def list(self, *parts: str, folders: bool = False) -> dict[str, int] | list[str]:
        """Object key (relative to the folder) -> size; with folders, the subfolder names."""
        from botocore.exceptions import BotoCoreError, ClientError

        base = self.key(*parts) + "/"
        kw = {"Delimiter": "/"} if folders else {}
        found: dict[str, int] = {}
        names: list[str] = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base, **kw):
                for o in page.get("Contents", []):
                    name = o["Key"][len(base):]
                    if name and not name.endswith("/"):  # not the folder markers S3 tools make
                        found[name] = o["Size"]
                names += [p["Prefix"][len(base):].strip("/") for p in
                          page.get("CommonPrefixes", [])]
        except (BotoCoreError, ClientError) as e:
            raise self._fail(e, "list") from None
        return names if folders else found

    def read(self, *parts: str) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.key(*parts))["Body"].read()
        except (BotoCoreError, ClientError) as e:
            raise self._fail(e, "read") from None


def _client():
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise StorageError("no AWS credentials found (environment, AWS_PROFILE, ~/.aws, SSO or "
                           "an instance role): set them (e.g. `export AWS_PROFILE=...`), then "
                           "run rayfleet logs again")
    # A wrong endpoint or a missing network answers in seconds, not after minutes of retries.
    return session.client("s3", config=Config(connect_timeout=5, read_timeout=30,
                                              retries={"max_attempts": 2, "mode": "standard"}))


def _a_yaml(arg: str) -> bool:
    return Path(arg).suffix in (".yaml", ".yml") or Path(arg).is_file()


def positionals(first: str | None, second: str | None,
                storage: str | None) -> tuple[str | None, str | None]:
    """(cluster YAML, run) of `rayfleet logs CLUSTER_YAML [RUN]`, or of `rayfleet logs
    --storage s3://... [RUN]`, where the one argument is the run."""
    where = "rayfleet logs CLUSTER_YAML [RUN], or rayfleet logs --storage s3://BUCKET/PREFIX [RUN]"
    if storage is not None:
        if second is not None or (first is not None and _a_yaml(first)):
            raise ConfigError("CLUSTER_YAML", f"the cluster YAML and --storage both say where "
                                              f"to read from; give one: {where}")
        return None, first
    if first is None:
        return None, None
    if second is not None and _a_yaml(second) and not _a_yaml(first):
        raise ConfigError("CLUSTER_YAML", f"the cluster YAML comes first: rayfleet logs "
                                          f"{second} {first}")
    if second is None and not _a_yaml(first):
        raise ConfigError("CLUSTER_YAML", f"{first!r} is not a cluster YAML (no such file); "
                                          f"where to read from: {where}")
    return first, second


def storage_uri(storage: str | None, config: str | None) -> str:
    if storage:
        return storage
    if config:
        facts = render_facts(config)
        if facts is None:
            raise ConfigError("CLUSTER_YAML", f"{config} has no {facts_path(config).name} "
                                              "beside it and no '# Storage for jobs: s3://...' "
                                              "header (not written by `rayfleet render`?); "
                                              "pass --storage s3://BUCKET/PREFIX")
        return facts.storage_uri
    raise ConfigError("--storage", "where to read from: pass the cluster YAML `rayfleet render` "
                                   "wrote (rayfleet logs CLUSTER_YAML ...) or --storage "
                                   "s3://BUCKET/PREFIX (the stack's storage)")


def _closest(name: str, existing: list[str], what: str, where: str) -> str:
    if not existing:
        return f"no {what}s in {where} yet"
    close = difflib.get_close_matches(name, existing, n=3, cutoff=0.4)
    shown = close or sorted(existing)[-3:]
    return f"{'closest' if close else 'some'}: {', '.join(shown)}"


def human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def _when(ms) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def status_line(run: str, job: dict) -> str:
    line = (f"run {run}: {job.get('status')}  started {_when(job.get('start_time'))}  "
            f"ended {_when(job.get('end_time'))}  entrypoint: {job.get('entrypoint')}")
    if job.get("message"):
        line += f"  ({' '.join(str(job['message']).split())})"
    if not job.get("final"):
        line += f"  [copied at {job.get('copied_at')} while it ran: the cluster went before " \
                "its final copy]"
    return line


def _pick(name: str, files: dict[str, int], run: str) -> str:
    """--file NAME: a path under the run, or under its logs/, or a file name found once."""
    for candidate in (name.strip("/"), f"logs/{name.strip('/')}"):
        if candidate in files:
            return candidate
    by_base = [k for k in files if k.rsplit("/", 1)[-1] == name]
    if len(by_base) == 1:
        return by_base[0]
    if by_base:
        raise ConfigError("--file", f"{name!r} is more than one file of run {run}: "
                                    f"{', '.join(sorted(by_base))}; give its path")
    close = difflib.get_close_matches(name, list(files), n=3, cutoff=0.3)
    raise ConfigError("--file", f"run {run} has no file {name!r}"
                                + (f"; closest: {', '.join(close)}" if close else "")
                                + " (rayfleet logs RUN --list shows them)")


def show_run(bucket: Bucket, run: str, list_: bool, file: str | None, out_path: str | None,
             out) -> int:
    if not RUN.fullmatch(run or ""):
        raise ConfigError("RUN", f"{run!r} is not a run name (a job's submission id or a "
                                 "training --name, one folder name)")
    files = bucket.list("runs", run)
    if not files:
        runs = bucket.list("runs", folders=True)
        raise RayfleetError(f"no run {run!r} in {bucket.uri}runs/; "
                            + _closest(run, runs, "run", f"{bucket.uri}runs/"))
    if list_:
        width = max(len(k) for k in files)
        for k in sorted(files):
            print(f"{k:{width}}  {human(files[k]):>10}", file=out)
        return 0
    if file is not None:
        key = _pick(file, files, run)
        body = bucket.read("runs", run, key)
        if out_path:
            try:
                Path(out_path).write_bytes(body)
            except OSError as e:
                raise ConfigError("-o", f"cannot write {out_path}: {e.strerror}") from None
            print(f"wrote {out_path} ({human(len(body))})", file=out)
            return 0
        try:
            out.write(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError("--file", f"{key} is binary; write it with -o PATH") from None
        return 0
    if "logs/job.json" not in files:
        raise RayfleetError(f"run {run} has no job logs in {bucket.uri}runs/{run}/ (not "
                            "submitted as a Ray job, or the head had no log shipper); "
                            f"`rayfleet logs {run} --list` shows what it has")
    try:
        job = json.loads(bucket.read("runs", run, "logs/job.json"))
    except json.JSONDecodeError:
        raise StorageError(f"{bucket.uri}runs/{run}/logs/job.json is not JSON") from None
    print(status_line(run, job), file=out)
    if "logs/driver.log" in files:
        out.write(bucket.read("runs", run, "logs/driver.log").decode("utf-8", "replace"))
    workers = sum(k.startswith("logs/workers/") for k in files)
    print(f"-- {workers} worker log file(s), metrics and checkpoints: rayfleet logs {run} "
          "--list", file=out)
    return 0


def show_cluster(bucket: Bucket, cluster: str, out) -> int:
    if not CLUSTER_NAME.fullmatch(cluster or ""):
        raise ConfigError("--cluster", f"{cluster!r} is not a rayfleet cluster name (the "
                                       "YAML's cluster_name)")
    files = bucket.list("clusters", cluster)
    if "autostop.log" not in files:
        names = bucket.list("clusters", folders=True)
        raise RayfleetError(f"no clusters/{cluster}/autostop.log in {bucket.uri}; "
                            + _closest(cluster, names, "cluster", f"{bucket.uri}clusters/"))
    out.write(bucket.read("clusters", cluster, "autostop.log").decode("utf-8", "replace"))
    return 0


def main(run: str | None, storage: str | None = None, config: str | None = None,
         list_: bool = False, file: str | None = None, out_path: str | None = None,
         cluster: str | None = None, out=None, s3=None) -> int:
    out = out or sys.stdout
    if (run is None) == (cluster is None):
        raise ConfigError("RUN", "give a run (rayfleet logs CLUSTER_YAML RUN) or --cluster NAME, "
                                 "not both")
    if cluster is not None and (list_ or file):
        raise ConfigError("--cluster", "--list and --file are for a run")
    if out_path and not file:
        raise ConfigError("-o", "writes the file --file names; add --file NAME")
    if list_ and file:
        raise ConfigError("--list", "--list and --file go one at a time")
    bucket = Bucket(storage_uri(storage, config), s3)
    try:
        if cluster is not None:
            return show_cluster(bucket, cluster, out)
        return show_run(bucket, run, list_, file, out_path, out)
    except BrokenPipeError:
        # `rayfleet logs RUN | head`: the reader has all it wanted. Python would report the
        # pipe again when it flushes stdout at exit, so stdout goes nowhere from here on.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
