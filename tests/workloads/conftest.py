"""Fixtures for the data / serve / demo tests: one tiny trained checkpoint per session, and
the `lm` Serve app deployed with `serve deploy` as a user would."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, REPO, free_port, run, summary_of


@pytest.fixture(scope="session")
def lm_checkpoint(ray_cluster, tmp_path_factory) -> str:
    """A finished workloads.train checkpoint (tiny model, 10 steps), trained once."""
    storage = tmp_path_factory.mktemp("lm-runs")
    proc = run([str(BIN / "python"), "-m", "workloads.train", "--smoke-test", "--max-steps",
                "10", "--checkpoint-every", "10", "--name", "lm-fixture",
                "--storage-path", str(storage)], env=ray_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return summary_of(proc.stdout)["checkpoint"]


def deploy_lm(ray_cluster, checkpoint: str, config_dir: Path, **args) -> str:
    """The user's path: write a copy of cluster-configs/serve/lm.yaml with this checkpoint and
    a free loopback port, `serve deploy` it, wait until /health answers. Returns the base URL.
    (`serve deploy` rather than an in-process `serve.run`: Ray reads token-auth settings once
    per process, and other test modules import ray before this one could set them.)"""
    port = free_port()
    cfg = yaml.safe_load((REPO / "cluster-configs" / "serve" / "lm.yaml").read_text())
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    cfg["applications"][0]["args"].update({"checkpoint": checkpoint, **args})
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


def serve_shutdown(ray_cluster) -> None:
    """Remove every Serve app and the proxy, so later tests get the CPUs back."""
    run([str(BIN / "serve"), "shutdown", "-y"], env=ray_cluster["env"], timeout=120)
