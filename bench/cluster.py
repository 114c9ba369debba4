"""A throwaway `rayfleet local` cluster for benchmarks: its own state folder and free ports,
so it never touches the user's cluster."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
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
