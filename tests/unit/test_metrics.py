"""rayfleet.commands.metrics without a cluster: the head's Prometheus commands run for real
(Debian's prometheus, installed when missing), the config, the kit dashboard, the port as a
fact, and `local up --metrics` refusing bad settings before anything starts."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from rayfleet.commands import host, metrics
from rayfleet.facts import LOOPBACK_PORTS
from tests.unit.test_facts import FACTS, _hits

RAYFLEET = [sys.executable, "-m", "rayfleet.commands.cli"]


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """Debian's prometheus, installed when missing (the test set-up's one apt-get)."""
    return installed_or_skip()


def installed_or_skip() -> str:
    """The binary; without it a skip, or a failure where RAYFLEET_REQUIRE names prometheus
    (tests/tiers.py)."""
    from rayfleet.errors import RayfleetError
    from tests.tiers import unavailable

    try:
        return metrics.ensure_binary(out=sys.stderr)
    except RayfleetError as e:   # no apt-get, no Debian mirror: said in one line
        unavailable("prometheus", f"Debian's prometheus is not installed and cannot be: {e}")


def test_sd_file_is_the_one_ray_writes():
    from ray._private import ray_constants

    assert metrics.SD_FILE == ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE


def test_prometheus_port_is_a_fact_written_once():
    assert metrics.PROMETHEUS_PORT == LOOPBACK_PORTS["prometheus"][0]
    numbers = "|".join(str(p) for p, _ in LOOPBACK_PORTS.values())
    # The Ansible role's defaults carry rayfleet.ingress's environment (HAProxy's two ports),
    # which `make regen` writes there (tests/unit/test_regen.py).
    role_defaults = FACTS.parents[1] / "infra/ansible/roles/ray_node/defaults/main.yml"
    assert _hits(rf"\b({numbers})\b", FACTS, role_defaults) == []


def _listeners(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on port (/proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local_addr, state = line.split()[1], line.split()[3]
            addr, hexport = local_addr.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def test_head_commands_start_prometheus_on_loopback_and_return(prometheus_binary, tmp_path):
    """The commands as Ray's SSH runner runs them (bash, one at a time), with this machine's
    prometheus already on PATH: each returns at once, Prometheus answers on 127.0.0.1 only,
    with file SD on Ray's file under /tmp/ray; a second round replaces the first Prometheus."""
    port = host.free_port()
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{Path(prometheus_binary).parent}:"
           f"{os.environ['PATH']}"}
    pids = []
    try:
        for _ in range(2):
            for cmd in metrics.head_commands(port):
                # A command that left Prometheus holding its stdout would hang here.
                proc = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True,
                                      text=True, timeout=30)
                assert proc.returncode == 0, (cmd, proc.stderr)
            pids.append(int((tmp_path / "rayfleet-prometheus" / "pid").read_text()))
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + metrics.READY_TIMEOUT_S
            while not metrics.ready(url):
                assert time.time() < deadline, (tmp_path / "rayfleet-prometheus" /
                                                 "prometheus.log").read_text()[-2000:]
                time.sleep(0.3)
            assert _listeners(port) == {"0100007F"}  # 127.0.0.1, and nothing else
            with urllib.request.urlopen(f"{url}/api/v1/status/config", timeout=5) as r:
                config = yaml.safe_load(json.loads(r.read())["data"]["yaml"])
            job = config["scrape_configs"][0]
            assert job["file_sd_configs"][0]["files"] == [f"/tmp/ray/{metrics.SD_FILE}"]
        assert pids[0] != pids[1] and not host.alive(pids[0])
    finally:
        for pid in pids:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass


def test_head_commands_mask_the_package_service_before_installing():
    install = metrics.head_commands()[0]
    assert install.index("systemctl mask prometheus.service") < install.index("install")
    assert "--no-install-recommends" in install and "DPkg::Lock::Timeout" in install
    assert install.startswith("command -v prometheus >/dev/null ||")


def test_local_config_scrapes_on_loopback(tmp_path):
    config = yaml.safe_load(metrics.config_text(tmp_path / metrics.SD_FILE, loopback=True))
    (relabel,) = config["scrape_configs"][0]["relabel_configs"]
    # Prometheus anchors the regex and writes $1 for the group.
    match = re.fullmatch(relabel["regex"], "192.0.2.2:51259")
    assert relabel["replacement"].replace("$1", match.group(1)) == "127.0.0.1:51259"


def test_kit_dashboard_has_the_panels_on_a_datasource_variable():
    dashboard = json.loads(metrics.kit_dashboard().read_text())
    assert dashboard["templating"]["list"][0] == {
        "name": "datasource", "label": "Data source", "type": "datasource",
        "query": "prometheus", "current": {}}
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dashboard["panels"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
    assert "ray_rayfleet_train_loss" in exprs["Training loss"]
    assert "ray_rayfleet_train_tokens_per_s" in exprs["Training tokens/s"]
    assert "ray_rayfleet_train_data_wait_frac" in exprs["Data wait"]
    latency = exprs["Serve request latency (p50, p99)"]
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "ray_serve_http_request_latency_ms_bucket" in latency
    assert "ray_serve_deployment_queued_queries" in exprs["Serve queue length"]


def test_telemetry_gauges_are_the_dashboards():
    from workloads.train import telemetry

    text = metrics.kit_dashboard().read_text()
    for key, (name, _) in telemetry.GAUGES.items():
        if key != "step":
            assert f"ray_{name}" in text, name


@pytest.fixture
def home(tmp_path):
    return tmp_path / "state"


def _cli(home, *args):
    return subprocess.run(RAYFLEET + list(args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RAYFLEET_HOME": str(home)})


@pytest.mark.parametrize("args,needle", [
    (["--prometheus-port", "9999"], "--prometheus-port: goes with --metrics"),
    (["--metrics", "--prometheus-port", "70000"],
     "--prometheus-port: must be a TCP port between 1 and 65535, got 70000"),
])
def test_bad_metrics_flags_are_one_line_exit_2(home, args, needle):
    proc = _cli(home, "local", "up", *args)
    assert proc.returncode == 2 and needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (home / "local" / "cluster.json").exists()


def test_taken_prometheus_port_starts_no_cluster(home):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _cli(home, "local", "up", "--metrics", "--prometheus-port", str(port),
                    "--port", str(host.free_port()), "--dashboard-port", str(host.free_port()))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"rayfleet: error: port {port} (Prometheus) is already in use by another process; "
        "stop it or pick another with --prometheus-port"]
    assert not (home / "local" / "cluster.json").exists()
    assert not (home / "prometheus" / "prometheus.json").exists()


def test_local_prometheus_is_stopped_by_down(prometheus_binary, home, monkeypatch, tmp_path):
    """start_local as `up --metrics` calls it (no cluster here: the SD file is simply absent);
    `rayfleet local down` stops it, and only it."""
    monkeypatch.setenv("RAYFLEET_HOME", str(home))
    # Started from another process, as `up` does: not this one's child, so `down` sees it exit
    # rather than linger as this process's zombie.
    subprocess.run([sys.executable, "-c", "import sys; from rayfleet.commands import metrics; "
                    "metrics.start_local(sys.argv[1], int(sys.argv[2]), sys.argv[3])",
                    str(tmp_path / "ray-temp"), str(host.free_port()), prometheus_binary],
                   check=True, timeout=60)
    prom = metrics.load_local()
    try:
        assert prom is not None and metrics.ready(prom.url)
        assert _listeners(prom.port) == {"0100007F"}
        proc = _cli(home, "local", "down")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0] == f"prometheus stopped (pid {prom.pid})."
        assert not host.alive(prom.pid) and metrics.load_local() is None
    finally:
        metrics.stop_local()
