"""Helpers for the serve tests (workloads/ and faults/): the `lm` Serve app deployed with
`serve deploy` as a user would. The session's trained checkpoint is `lm_checkpoint` in
tests/conftest.py."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tests.conftest import BIN, REPO, free_port, run


def deploy_lm(ray_cluster, checkpoint: str, config_dir: Path, deployment: dict | None = None,
              env_vars: dict | None = None, **args) -> str:
    """The user's path: write a copy of cluster-configs/serve/lm.yaml with this checkpoint and
    a free loopback port, `serve deploy` it, wait until /health answers. Returns the base URL.
    (`serve deploy` rather than an in-process `serve.run`: Ray reads token-auth settings once
    per process, and other test modules import ray before this one could set them.)"""
    port = free_port()
    cfg = yaml.safe_load((REPO / "cluster-configs" / "serve" / "lm.yaml").read_text())
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    cfg["applications"][0]["args"].update({"checkpoint": checkpoint, **args})
    cfg["applications"][0]["deployments"][0].update(deployment or {})
    if env_vars:
        # E.g. S3 credentials: the local cluster's processes have none, and the builder (which
        # checks an s3:// checkpoint) and the replicas (which fetch it) run in the app's
        # runtime_env, as an instance profile would give them on AWS.
        cfg["applications"][0]["runtime_env"] = {"env_vars": dict(env_vars)}
    path = config_dir / "lm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run([str(BIN / "serve"), "deploy", str(path)], env=ray_cluster["env"], check=True,
        timeout=120)
    return wait_healthy(ray_cluster, f"http://127.0.0.1:{port}", "lm")


def wait_healthy(ray_cluster, url: str, app: str, timeout: float = 180) -> str:
    """Wait until the app's /health answers 200; on timeout, fail with `serve status`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        time.sleep(1)
    status = run([str(BIN / "serve"), "status"], env=ray_cluster["env"]).stdout
    raise AssertionError(f"{app} app did not become healthy on {url}:\n{status[-3000:]}")


def serve_app(dashboard_url: str, token: str, app: str) -> dict:
    """Serve's details of ``app`` from the dashboard's REST API in one request (each deployment
    with its replicas, and their ``replica_states`` counted as `serve status` prints them), {}
    while there is none or the dashboard does not answer: the waits poll it, and each `serve
    status` costs about 2 CPU-s of start-up on 2 busy cores."""
    req = urllib.request.Request(f"{dashboard_url}/api/serve/applications/",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            found = json.loads(r.read()).get("applications", {}).get(app) or {}
    except OSError:   # the dashboard (or its tunnel) not answering yet
        return {}
    for dep in (found.get("deployments") or {}).values():
        states: dict[str, int] = {}
        for replica in dep.get("replicas") or []:
            states[replica["state"]] = states.get(replica["state"], 0) + 1
        dep["replica_states"] = states
    return found


def cluster_serve_app(ray_cluster, app: str) -> dict:
    """serve_app on the session's cluster, with its token."""
    token = Path(ray_cluster["client_env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    return serve_app(ray_cluster["dashboard_url"], token, app)


def serve_shutdown(ray_cluster) -> None:
    """Remove every Serve app and the proxy, so later tests get the CPUs back."""
    run([str(BIN / "serve"), "shutdown", "-y"], env=ray_cluster["env"], timeout=120)


def post_json(url: str, body: dict) -> tuple[int, dict]:
    """POST a JSON body; (status, JSON answer), error statuses included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
