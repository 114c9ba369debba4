"""Storage paths: a local folder or s3://bucket/prefix, including S3-compatible endpoints
(MinIO, moto) through pyarrow's ``endpoint_override``.

`resolve` checks the location is reachable and writable *before* any training starts, so a
typo in a bucket name costs seconds, not a failed run at the first checkpoint.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from rayfleet import clusteryaml, runstore
from rayfleet.errors import ConfigError, StorageError
from rayfleet.facts import is_bucket_name


def default_root() -> str:
    """Where runs, datasets and embeddings go when no path is given: $RAYFLEET_STORAGE (the
    run store `rayfleet render` names to every node of a cloud cluster), else ~/rayfleet-runs
    (on the node that runs the job: the head, for a cluster's jobs)."""
    return os.environ.get(runstore.STORAGE_ENV) or os.path.expanduser("~/rayfleet-runs")


def check_shared(uri: str, flag: str, cluster: dict | None = None, environ=os.environ) -> None:
    """Refuse, in one line and before any worker starts, an output its cluster cannot keep: a
    folder on one node of a cloud cluster that can have more than one (its workers write to
    their own disks, gone at `ray down`), and an s3:// path outside the prefix the node roles
    may write ($RAYFLEET_STORAGE_PREFIX, where set). ``cluster``: the head's autoscaling
    config (read from the head's file when None)."""
    prefix = environ.get(runstore.PREFIX_ENV) or ""
    store = environ.get(runstore.STORAGE_ENV) or ""
    if store.startswith("s3://"):
        instead = f"leave {flag} out, for the run store {store}"
    else:   # a cluster an older kit rendered names no run store
        instead = (f"give the run store, {runstore.root(prefix) if prefix else '<storage_uri>runs'}"
                   " (a re-rendered cluster makes it the default)")
    where = prefix or "the stack's storage_uri"
    if not uri.startswith("s3://"):
        cluster = clusteryaml.autoscaler_config() if cluster is None else cluster
        if clusteryaml.ClusterYaml(cluster).spans_cloud_nodes():
            raise ConfigError(flag, f"{uri} is a folder on one node, and this cloud cluster can "
                                    "have more than one: the other nodes' writes would land on "
                                    f"their own disks and go at `ray down`; {instead}, or give "
                                    f"another s3:// path under {where}")
    elif prefix and not runstore.inside(uri, prefix):
        raise ConfigError(flag, f"{uri} is outside {prefix}, the only prefix this cluster's "
                                f"nodes may write; {instead}, or give another path under it")


def job_package_dir(cwd: str | None = None) -> str | None:
    """The folder Ray unpacked `--working-dir` into, when this process runs inside it (a Ray
    job's driver does: <temp>/.../runtime_resources/working_dir_files/_ray_pkg_<hash>)."""
    parts = Path(cwd or os.getcwd()).parts
    for i, part in enumerate(parts):
        if part.startswith("_ray_pkg_") and i and parts[i - 1] == "working_dir_files":
            return str(Path(*parts[:i + 1]))
    return None


def user_path(value: str, flag: str, *, output: bool) -> str:
    """A local path or s3:// URI from the command line, made absolute. Inside a Ray job, a
    relative path is relative to Ray's temporary copy of the working directory: an input that
    was uploaded with it is read from there, but an output would be written there and lost
    with it (and a later job would not find it), so a relative output, or an input that is not
    in the upload, is refused in one line that says what to give instead."""
    if value.startswith("s3://"):
        return value
    local = Path(value.removeprefix("file://")).expanduser()
    if local.is_absolute():
        return str(local)
    package = job_package_dir()
    if package and (output or not local.exists()):
        what = ("what is written there is lost with it" if output else
                "it is not there (only files uploaded with --working-dir are)")
        raise ConfigError(flag, f"{value} is a relative path, and this job runs in Ray's "
                                f"temporary copy of the working directory ({package}): {what}; "
                                f"give an absolute path (on a local cluster: "
                                f"\"$PWD/{value}\") or s3://bucket/prefix")
    return str(local.resolve())


@dataclass(frozen=True)
class Storage:
    uri: str                          # what the user gave, normalised
    path: str                         # path inside the filesystem (no scheme)
    filesystem: pafs.FileSystem | None  # None: local path, Ray's default handling

    def join(self, *parts: str) -> str:
        return "/".join([self.path.rstrip("/"), *parts])

    @property
    def fs(self) -> pafs.FileSystem:
        return self.filesystem or pafs.LocalFileSystem()

    def write_bytes(self, rel: str, data: bytes) -> str:
        target = self.join(rel)
        if self.filesystem is None:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_output_stream(target) as f:
            f.write(data)
        return target if self.filesystem is None else f"s3://{target}"

    def read_bytes(self, rel_or_abs: str) -> bytes:
        with self.fs.open_input_stream(rel_or_abs) as f:
            return f.read()


def s3_endpoint(explicit: str | None = None) -> str | None:
    return (explicit or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


def s3_filesystem(endpoint: str | None = None) -> pafs.S3FileSystem:
    endpoint = s3_endpoint(endpoint)
    kwargs: dict = {"region": os.environ.get("AWS_DEFAULT_REGION")
                    or os.environ.get("AWS_REGION") or "us-east-1"}
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    # Explicit keys travel with the (pickled) filesystem to Ray workers, whose processes do
    # not inherit the driver's environment. Without them, each node's own credential chain
    # (the instance profile on EC2) is used, which is what a cluster should do.
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        kwargs.update(access_key=os.environ["AWS_ACCESS_KEY_ID"],
                      secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                      session_token=os.environ.get("AWS_SESSION_TOKEN"))
    # Fail fast instead of pyarrow's default of retrying an unreachable endpoint for minutes.
    kwargs.update(connect_timeout=5, request_timeout=30,
                  retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3))
    return pafs.S3FileSystem(**kwargs)


def resolve(uri: str, *, endpoint: str | None = None, check_writable: bool = True,
            create: bool = True) -> Storage:
    """Parse and check a storage location. Raises StorageError with one line.
    create=False: a local folder that does not exist is an error, not made (for reading)."""
    if not uri:
        raise StorageError("storage path is empty; give a folder or s3://bucket/prefix")
    if uri.startswith("s3://"):
        rest = uri[len("s3://"):].strip("/")
        bucket, _, prefix = rest.partition("/")
        if not is_bucket_name(bucket):
            raise StorageError(f"{uri}: {bucket!r} is not a valid S3 bucket name "
                               "(3-63 lowercase letters, digits, dots, hyphens)")
        fs = s3_filesystem(endpoint)
        try:
            info = fs.get_file_info(bucket)
        except OSError as e:
            raise StorageError(f"{uri}: bucket {bucket!r} is not reachable: "
                               f"{_first_line(e)}") from e
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"{uri}: bucket {bucket!r} does not exist (or these "
                               "credentials cannot see it)")
        storage = Storage(uri=f"s3://{rest}", path=rest, filesystem=fs)
    else:
        local = Path(uri.removeprefix("file://")).expanduser().resolve()
        if not create and not local.exists():
            raise StorageError(f"{uri}: does not exist")
        try:
            local.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"{uri}: cannot create the folder ({e.strerror})") from e
        storage = Storage(uri=str(local), path=str(local), filesystem=None)
    if check_writable:
        probe = f".rayfleet-probe-{uuid.uuid4().hex[:8]}"
        try:
            storage.write_bytes(probe, b"ok")
            storage.fs.delete_file(storage.join(probe))
        except OSError as e:
            raise StorageError(f"{storage.uri}: not writable: {_first_line(e)}") from e
    return storage


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an error, shortened at a word boundary (never mid-word)."""
    text = str(e).strip().splitlines()
    if not text:
        return type(e).__name__
    line = text[0]
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return cut + " ..."
