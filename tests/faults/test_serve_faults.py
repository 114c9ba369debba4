"""Fault 3 (docs/faults.md): a Serve replica killed while a load generator sends
requests. At least 99% of the requests succeed (for a client that retries as the openai client
does: twice, on a connection error or a 5xx), Serve replaces the replica, and the app reports
healthy with its full replica count again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from tests.conftest import BIN, run
from tests.workloads.conftest import deploy_lm, serve_shutdown

pytestmark = [pytest.mark.faults, pytest.mark.ray]

REQUESTS = 80
KILL_AFTER = 25
CLIENTS = 4
RETRIES = 2          # the openai client's default max_retries


def _call(url: str, body: dict | None = None, timeout: float = 30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _replicas(url: str, want: int, deadline_s: float = 120) -> dict[str, int]:
    """replica id -> pid, from /v1/stats (requests spread over the replicas)."""
    seen: dict[str, int] = {}
    deadline = time.time() + deadline_s
    while len(seen) < want and time.time() < deadline:
        try:
            s = _call(url + "/v1/stats", timeout=10)
            seen[s["replica"]] = s["pid"]
        except OSError:
            time.sleep(0.5)
    return seen


def _running_replicas(ray_cluster) -> int:
    out = run([str(BIN / "serve"), "status"], env=ray_cluster["env"], timeout=60).stdout
    app = (yaml.safe_load(out) or {}).get("applications", {}).get("lm", {})
    dep = app.get("deployments", {}).get("LMServer", {})
    if app.get("status") != "RUNNING" or dep.get("status") != "HEALTHY":
        return 0
    return dep.get("replica_states", {}).get("RUNNING", 0)


def test_killed_replica_under_load(ray_cluster, lm_checkpoint, tmp_path):
    url = deploy_lm(ray_cluster, lm_checkpoint, tmp_path, deployment={"autoscaling_config": {
        "min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 8}})
    try:
        before = _replicas(url, 2)
        assert len(before) == 2, before
        body = {"model": "rayfleet-lm", "prompt": "def ", "max_tokens": 2, "temperature": 0}
        lock, done = threading.Lock(), threading.Event()
        counts = {"sent": 0, "ok": 0, "first_try": 0, "failed": 0}
        errors: list[str] = []
        killed: dict[str, int] = {}

        def client():
            while True:
                with lock:
                    if counts["sent"] >= REQUESTS:
                        return
                    counts["sent"] += 1
                for attempt in range(RETRIES + 1):
                    try:
                        out = _call(url + "/v1/completions", body)
                        assert out["choices"][0]["finish_reason"] == "length"
                        with lock:
                            counts["ok"] += 1
                            counts["first_try"] += attempt == 0
                            if counts["ok"] == KILL_AFTER:
                                done.set()
                        break
                    # Any failure of an attempt counts: a replica killed mid-response also
                    # surfaces as http.client.IncompleteRead/RemoteDisconnected, not OSError.
                    except Exception as e:  # noqa: BLE001
                        if attempt == RETRIES:
                            with lock:
                                counts["failed"] += 1
                                errors.append(repr(e)[:200])
                        time.sleep(0.5 * (attempt + 1))

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        assert done.wait(180), f"load never reached {KILL_AFTER} answers: {counts} {errors}"
        victim, pid = next(iter(before.items()))
        os.kill(pid, signal.SIGKILL)          # the replica's actor process, mid-load
        killed[victim] = pid
        for t in threads:
            t.join(300)
        print(f"\nserve fault: {counts} errors={errors[:3]}")
        assert counts["ok"] + counts["failed"] == REQUESTS
        assert counts["ok"] >= 0.99 * REQUESTS, (counts, errors)

        # Serve notices the dead actor, starts a replacement, and reports healthy again.
        deadline = time.time() + 180
        while time.time() < deadline and _running_replicas(ray_cluster) < 2:
            time.sleep(2)
        assert _running_replicas(ray_cluster) == 2
        after = _replicas(url, 2)
        assert victim not in after and len(after) == 2, (killed, after)
    finally:
        serve_shutdown(ray_cluster)
