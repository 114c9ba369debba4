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

Given several configs it writes one holding all their apps (`serve deploy` replaces every app
on the cluster with one file's, so apps that run together are deployed from one file): names
and route prefixes must differ, the other settings agree, and `--arg APP.KEY=VALUE` names the
app an argument is for. An app whose module has `check_apps` is checked against the whole
file too (rag over vLLM: its generator app must be in it):

    rayfleet serve-config cluster-configs/generated/llm-sft-cpu.yaml \
        cluster-configs/serve/rag-llm.yaml -o cluster-configs/generated/rag-llm.yaml
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
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


def load_configs(paths: list[str]) -> dict[str, Any]:
    """One Serve config holding every app of `paths`' configs."""
    merged: dict[str, Any] = {}
    apps: list[dict[str, Any]] = []
    for path in paths:
        cfg = load_config(path)
        for key, value in cfg.items():
            if key == "http_options" and isinstance(value, dict):
                value = _same_port(merged.get(key), value, path, paths[0])
            if key != "applications" and merged.setdefault(key, value) != value:
                raise RayfleetError(f"{path}: its {key} differs from {paths[0]}'s (one Serve "
                                    f"config has one {key})")
        for app in cfg["applications"]:
            for key, default in (("name", "default"), ("route_prefix", "/")):
                taken = [a for a in apps if a.get(key, default) == app.get(key, default)]
                if taken:
                    raise RayfleetError(f"{path}: app {app.get('name', default)!r} has the "
                                        f"{key} {app.get(key, default)!r} of an app listed "
                                        "before it; each app needs its own")
            apps.append(app)
    return {**merged, "applications": apps}


def _same_port(first: dict | None, value: dict, path: str, first_path: str) -> dict:
    """value with the first config's port: Serve keeps the port it started with whatever a
    later deploy says, so only a note; any other http option must agree (the host decides
    who can connect)."""
    if first is None or first.get("port") == value.get("port"):
        return value
    print(f"[rayfleet] note: {path}: http_options.port {value.get('port')} left for "
          f"{first_path}'s {first.get('port')}", file=sys.stderr, flush=True)
    return {**value, "port": first.get("port")}


def args_of(app: dict[str, Any], overrides: dict[str, Any], apps: list[dict]) -> dict:
    """The app's args with the --arg values for it: `APP.KEY` for one app, a plain `KEY` for
    every app of a one-app config."""
    names = [a.get("name", "default") for a in apps]
    args = dict(app.get("args") or {})
    for key, value in overrides.items():
        target, dot, rest = key.partition(".")
        if dot and target in names:
            if target == app.get("name", "default"):
                args[rest] = value
        elif len(apps) > 1:
            raise ConfigError("--arg", f"{key}=...: this config has the apps "
                              f"{', '.join(names)}; name one, e.g. {names[-1]}.{key}=...")
        else:
            args[key] = value
    return args


def check_apps(apps: list[dict[str, Any]], source: str) -> None:
    """Each app whose module has `check_apps(args, apps)`, checked against the whole file."""
    import importlib

    for app in apps:
        name = app["import_path"].partition(":")[0]
        cross = getattr(importlib.import_module(CHECKERS.get(name, name)), "check_apps", None)
        if cross is not None:
            try:
                cross(app.get("args") or {}, apps)
            except RayfleetError as e:
                raise RayfleetError(f"{source}: app {app.get('name', 'app')}: {e}") from None


def _looks_relative(value: Any) -> bool:
    """A path relative to the operator's folder: on a node it would resolve inside the
    unpacked package, where git-ignored run folders never are."""
    return (isinstance(value, str) and "/" in value and "://" not in value
            and not value.startswith(("/", "~")))


def with_package(cfg: dict[str, Any], uri: str, overrides: dict[str, Any],
                 source: str) -> dict[str, Any]:
    apps = []
    for app in cfg["applications"]:
        args = args_of(app, overrides, cfg["applications"])
        for key, value in args.items():
            if _looks_relative(value):
                raise ConfigError(
                    f"{source}: {app.get('name', 'app')}.args.{key}",
                    f"{value!r} is relative to this folder, which no node has; give an s3:// "
                    f"URI or an absolute path every node has (--arg {key}=...)")
        runtime_env = {**(app.get("runtime_env") or {}), "working_dir": uri}
        apps.append({**app, "args": args, "runtime_env": runtime_env})
    check_apps(apps, source)
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


def _names(configs: list[str]) -> tuple[str, str]:
    """(what the header says ran, the default output's name) for these configs."""
    return (" ".join(configs),
            "serve-" + "-".join(Path(c).stem for c in configs) + ".yaml")


def checked_config(configs: list[str], arg_pairs: list[str] | None = None,
                   out: str | None = None) -> Path:
    """Each app's args checked by the app module's `check_args` and written resolved."""
    import importlib

    configs = [configs] if isinstance(configs, str) else list(configs)
    source, default = _names(configs)
    cfg = load_configs(configs)
    overrides = parse_args_overrides(arg_pairs)
    apps = []
    for app in cfg["applications"]:
        args = args_of(app, overrides, cfg["applications"])
        name = app["import_path"].partition(":")[0]
        module = importlib.import_module(CHECKERS.get(name, name))
        check = getattr(module, "check_args", None)
        if check is not None:
            try:
                args = check(args)
            except RayfleetError as e:
                raise RayfleetError(f"{source}: app {app.get('name', 'app')}: {e}") from None
        apps.append({**app, "args": args})
    check_apps(apps, source)
    dest = Path(out) if out else GENERATED / default
    return _write(dest, f"# Written by `rayfleet serve-config {source}`: args checked.\n",
                  {**cfg, "applications": apps})


def serve_config(configs: list[str], package_to: str, working_dir: str = ".",
                 arg_pairs: list[str] | None = None, out: str | None = None) -> Path:
    """Check everything, then package, upload and write; returns the written config."""

    if not _URI.match(package_to):
        raise ConfigError("--package-to", f"{package_to!r} must be s3://BUCKET/PREFIX (the "
                          "stack's bucket) or file:///PATH on storage every node shares")
    wd = Path(working_dir).expanduser().resolve()
    if not wd.is_dir():
        raise ConfigError("--working-dir", f"{working_dir} is not a folder")
    configs = [configs] if isinstance(configs, str) else list(configs)
    source, default = _names(configs)
    cfg = load_configs(configs)
    overrides = parse_args_overrides(arg_pairs)
    # The whole config is checked (with a placeholder URI) before anything is uploaded.
    with_package(cfg, package_to, overrides, source)
    dest = Path(out) if out else GENERATED / default
    zip_path = package(wd)
    try:
        uri = upload(zip_path, package_to)
    finally:
        shutil.rmtree(zip_path.parent, ignore_errors=True)
    result = with_package(cfg, uri, overrides, source)
    return _write(dest, f"# Written by `rayfleet serve-config {source}`: its code is {uri}.\n",
                  result)
