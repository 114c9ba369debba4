"""`rayfleet serve-config`: a Serve config whose code reaches every node of a remote cluster.

`serve deploy` sends a config, not code: `import_path: workloads.serve.lm:app_builder` must be
importable on every node, and the node environment does not install the kit. Ray's answer is
`runtime_env.working_dir` set to a remote zip (`serve deploy` refuses a local folder there).
This command zips the working directory exactly as `ray job submit --working-dir .` does (Ray's
own packaging: .gitignore and .rayignore honoured, content-addressed name), puts it in the
stack's bucket (or any s3:// or file:// prefix every node can read), and writes a copy of the
config with that working_dir and the given args:

    rayfleet serve-config cluster-configs/serve/lm.yaml --package-to s3://BUCKET/rayfleet/pkgs \\
        --arg checkpoint=s3://BUCKET/rayfleet/runs/my-run/checkpoint_000100
    serve deploy cluster-configs/generated/serve-lm.yaml

Nodes fetch the zip with their instance role (the worker and head roles may read the bucket)
through smart_open, part of the node environment.

Without --package-to (a cluster on this machine, which imports the kit from this checkout), it
checks instead what Serve would only find out after `serve deploy` had answered "success": each
app's args, through the app module's own `check_args` (checkpoints whole, embeddings finished,
`checkpoint: latest` resolved), and writes the copy with the resolved args:

    rayfleet serve-config cluster-configs/serve/lm.yaml --arg checkpoint=/abs/run/checkpoint_x
    serve deploy cluster-configs/generated/serve-lm.yaml
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rayfleet.errors import ConfigError, RayfleetError

# Relative to where the command runs (the user's checkout), as README shows it.
GENERATED = Path("cluster-configs") / "generated"
# The bucket's name is S3's to judge (a missing or malformed one fails the upload in one line).
_URI = re.compile(r"^(s3://[^/\s]+(/\S*)?|file:///\S*)$")
# Apps whose module cannot be imported here: ray.serve.llm needs vLLM at import time, so the
# `llm` app's args are checked by the kit's generator of that config.
CHECKERS = {"ray.serve.llm": "workloads.serve.llm_config"}


def parse_args_overrides(pairs: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError("--arg", f"expects KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def load_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise RayfleetError(f"{path}: no such Serve config") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RayfleetError(f"{path}: not a readable YAML file ({type(e).__name__})") from None
    apps = cfg.get("applications") if isinstance(cfg, dict) else None
    if not isinstance(apps, list) or not apps or not all(
            isinstance(a, dict) and a.get("import_path") for a in apps):
        raise RayfleetError(f"{path}: not a Serve config (needs `applications:`, each with an "
                            "import_path)")
    return cfg


def _looks_relative(value: Any) -> bool:
    """A path relative to the operator's folder: on a node it would resolve inside the
    unpacked package, where git-ignored run folders never are."""
    return (isinstance(value, str) and "/" in value and "://" not in value
            and not value.startswith(("/", "~")))


def with_package(cfg: dict[str, Any], uri: str, overrides: dict[str, Any],
                 source: str) -> dict[str, Any]:
    apps = []
    for app in cfg["applications"]:
        args = {**(app.get("args") or {}), **overrides}
        for key, value in args.items():
            if _looks_relative(value):
                raise ConfigError(
                    f"{source}: {app.get('name', 'app')}.args.{key}",
                    f"{value!r} is relative to this folder, which no node has; give an s3:// "
                    f"URI or an absolute path every node has (--arg {key}=...)")
        runtime_env = {**(app.get("runtime_env") or {}), "working_dir": uri}
        apps.append({**app, "args": args, "runtime_env": runtime_env})
    return {**cfg, "http_options": remote_http_options(cfg.get("http_options")),
            "applications": apps}


# A remote cluster serves through HAProxy on every node (rayfleet.ingress): each ingress replica
# answers HAProxy on other nodes too, on the host Serve's http_options give, so a loopback host
# would leave replicas on workers unreachable. Every interface there: the security group admits
# the pinned direct-ingress ports from the cluster only (rule 30), and the guard keeps
# HAProxy's own frontend on loopback, reached through the tunnel.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def remote_http_options(http_options: dict[str, Any] | None) -> dict[str, Any]:
    options = dict(http_options or {})
    if options.get("host", "127.0.0.1") in LOOPBACK_HOSTS:
        options["host"] = "0.0.0.0"
    return options


def package(working_dir: Path) -> Path:
    """The working directory zipped as Ray packages a job's --working-dir, in a temp file
    named by its content hash (_ray_pkg_<hash>.zip)."""
    # Ray's own packaging (what `ray job submit` runs): the same files, the same excludes.
    from ray._private.runtime_env import packaging

    # Ray logs every .gitignore it honours at INFO: noise on the operator's terminal.
    logging.getLogger(packaging.__name__).setLevel(logging.WARNING)
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    excludes = [".git"]  # history, not code
    name = packaging.get_uri_for_directory(str(working_dir), include_gitignore,
                                           excludes).split("://")[1]
    out = Path(tempfile.mkdtemp(prefix="rayfleet-pkg-")) / name
    # One top-level folder: Ray strips it when it unpacks a remote zip.
    packaging.create_package(str(working_dir), out, include_gitignore,
                             include_parent_dir=True, excludes=excludes)
    return out


def upload(zip_path: Path, prefix: str) -> str:
    """Put the zip under prefix (skipped when that content is already there); its URI."""
    uri = prefix.rstrip("/") + "/" + zip_path.name
    if uri.startswith("file://"):
        dest = Path(uri.removeprefix("file://"))
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".part")
            shutil.copyfile(zip_path, tmp)
            tmp.replace(dest)
        return uri
    import boto3
    import botocore.exceptions

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return uri
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code not in ("404", "NoSuchKey", "NotFound"):
            raise RayfleetError(f"s3://{bucket}: {code or e} (check the bucket name and your "
                                "credentials)") from None
    except botocore.exceptions.BotoCoreError as e:
        raise RayfleetError(f"s3://{bucket}: {e}") from None
    try:
        s3.upload_file(str(zip_path), bucket, key)
    except (botocore.exceptions.ClientError, boto3.exceptions.S3UploadFailedError) as e:
        raise RayfleetError(f"uploading to s3://{bucket}/{key} failed: {e}") from None
    return uri


def _write(dest: Path, header: str, cfg: dict[str, Any]) -> Path:
    import yaml

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(header + f"# Next: serve deploy {dest}\n" + yaml.safe_dump(cfg, sort_keys=False))
    tmp.replace(dest)
    return dest


def checked_config(config: str, arg_pairs: list[str] | None = None,
                   out: str | None = None) -> Path:
    """Each app's args checked by the app module's `check_args` and written resolved."""
    import importlib

    cfg = load_config(config)
    overrides = parse_args_overrides(arg_pairs)
    apps = []
    for app in cfg["applications"]:
        args = {**(app.get("args") or {}), **overrides}
        name = app["import_path"].partition(":")[0]
        module = importlib.import_module(CHECKERS.get(name, name))
        check = getattr(module, "check_args", None)
        if check is not None:
            try:
                args = check(args)
            except RayfleetError as e:
                raise RayfleetError(f"{config}: app {app.get('name', 'app')}: {e}") from None
        apps.append({**app, "args": args})
    dest = Path(out) if out else GENERATED / f"serve-{Path(config).stem}.yaml"
    return _write(dest, f"# Written by `rayfleet serve-config {config}`: args checked.\n",
                  {**cfg, "applications": apps})


def serve_config(config: str, package_to: str, working_dir: str = ".",
                 arg_pairs: list[str] | None = None, out: str | None = None) -> Path:
    """Check everything, then package, upload and write; returns the written config."""

    if not _URI.match(package_to):
        raise ConfigError("--package-to", f"{package_to!r} must be s3://BUCKET/PREFIX (the "
                          "stack's bucket) or file:///PATH on storage every node shares")
    wd = Path(working_dir).expanduser().resolve()
    if not wd.is_dir():
        raise ConfigError("--working-dir", f"{working_dir} is not a folder")
    cfg = load_config(config)
    overrides = parse_args_overrides(arg_pairs)
    # The whole config is checked (with a placeholder URI) before anything is uploaded.
    with_package(cfg, package_to, overrides, config)
    dest = Path(out) if out else GENERATED / f"serve-{Path(config).stem}.yaml"
    zip_path = package(wd)
    try:
        uri = upload(zip_path, package_to)
    finally:
        shutil.rmtree(zip_path.parent, ignore_errors=True)
    result = with_package(cfg, uri, overrides, config)
    return _write(dest, f"# Written by `rayfleet serve-config {config}`: its code is {uri}.\n",
                  result)
