"""Fixtures shared by the fault tests: a two-node local Ray cluster."""

import subprocess
import time

import pytest

from bench.spot_notice import two_node_cluster as _two_node_cluster


def wait_for(what: str, fn, proc: subprocess.Popen | None = None, timeout: float = 300):
    """fn()'s first truthy value, polled every 0.2 s; fails naming `what` on timeout or when
    `proc` exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {what}:\n"
                                 f"{proc.stdout.read()[-3000:] if proc.stdout else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def two_node_cluster(tmp_path):
    """A head (`rayfleet local up`, 1 CPU) plus a second 1-CPU raylet in its own process
    group, token auth on both, a 3 s dead-node detection (bench.spot_notice's, shared with
    the spot benchmark): {"env", "worker" (Popen), "worker_temp_dir", "home"}."""
    with _two_node_cluster(tmp_path) as cluster:
        yield cluster
