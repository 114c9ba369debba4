"""A throwaway `rayfleet local` cluster for benchmarks: its own state folder and free ports,
so it never touches the user's cluster; and Serve's CLI against a cluster's environment."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayfleet.commands.host import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def local_cluster(num_cpus: int = 4, extra_env: dict | None = None, ingress: str | None = None):
    """extra_env reaches `ray start` and so every Ray process (e.g. RAY_SERVE_* settings);
    ingress is Serve's (`rayfleet local up --ingress`; default the kit's)."""
    with tempfile.TemporaryDirectory(prefix="rayfleet-bench-") as home:
        env = {**os.environ, **(extra_env or {}), "RAYFLEET_HOME": home}
        # The bench package on every Ray process's path (Serve's floor app is bench code).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        subprocess.run([str(BIN / "rayfleet"), "local", "up", "--num-cpus", str(num_cpus),
                        "--object-store-memory", "1GB", "--port", str(free_port()),
                        "--dashboard-port", str(free_port()),
                        *(["--ingress", ingress] if ingress else [])], env=env, check=True,
                       capture_output=True)
        try:
            exports = subprocess.run([str(BIN / "rayfleet"), "local", "env"], env=env,
                                     check=True, capture_output=True, text=True).stdout
            env.update(dict(ln.removeprefix("export ").split("=", 1)
                            for ln in exports.splitlines()))
            yield env
        finally:
            subprocess.run([str(BIN / "rayfleet"), "local", "down"], env=env,
                           capture_output=True)


@contextlib.contextmanager
def cluster_env(env: dict | None, num_cpus: int = 4, extra_env: dict | None = None,
                ingress: str | None = None):
    """The caller's cluster environment when given (`make bench` runs every benchmark on one
    cluster: one start-up instead of three), else a throwaway cluster for this benchmark
    (started with extra_env)."""
    if env is not None:
        yield env
        return
    with local_cluster(num_cpus, extra_env, ingress) as fresh:
        yield fresh


def serve_cmd(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`serve ARGS` with the cluster's environment (its address and token)."""
    return subprocess.run([str(BIN / "serve"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def serve_status(env: dict):
    """serve status's tail, for a timeout's message."""
    return lambda: serve_cmd(env, "status", timeout=60).stdout[-3000:]


def deploy(env: dict, config: dict, folder: Path, name: str) -> None:
    """`serve deploy` of a Serve config (written to folder/name.yaml), retried while a fresh
    cluster's dashboard is not up yet."""
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    deadline = time.time() + 180
    while True:
        proc = serve_cmd(env, "deploy", str(path))
        # A fresh cluster's dashboard (which `serve deploy` talks to) can lag its `ray start`
        # on a busy machine: connection refused for a while.
        if proc.returncode == 0 or "Failed to connect to Ray" not in proc.stderr \
                or time.time() > deadline:
            break
        time.sleep(3)
    if proc.returncode != 0:
        raise RuntimeError(f"serve deploy {name}: {(proc.stderr or proc.stdout)[-2000:]}")
