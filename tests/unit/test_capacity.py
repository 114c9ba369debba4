"""Reading the autoscaler's report: `rayfleet status` (through a dashboard answering over HTTP
as Ray's does) and the training driver's fail-fast when every type fails to launch.

The report is built by Ray's own code: ``AutoscalerSummary`` with a
``NodeProviderAvailabilityTracker`` fed EC2's capacity error, turned to JSON as Ray's monitor
writes it to the GCS, and, for the dashboard, wrapped by Ray's ``to_google_style`` as its
``/api/cluster_status`` route answers (every snake_case key camelCased). The rehearsal on the
fake cloud reads the real thing from a real head (tests/fakecloud/test_ray_up.py).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time

import pytest

from rayfleet import capacity
from rayfleet.commands import cli
from workloads.train import options, placement

ORDER = ["ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
         "ray.worker.p4de.24xlarge.spot"]
MESSAGE = ("We currently do not have sufficient p4d.24xlarge capacity in the Availability Zone "
           "you requested (us-east-1b). Our system will be working on provisioning additional "
           "capacity.")


def ray_report(failed: list[str], running: dict[str, int] | None = None,
               launching: dict[str, int] | None = None, ago: float = 3) -> str:
    """The GCS value Ray's monitor writes: ``{"autoscaler_report": asdict(summary), ...}``."""
    from ray.autoscaler._private.autoscaler import AutoscalerSummary
    from ray.autoscaler._private.node_provider_availability_tracker import (
        NodeProviderAvailabilityTracker,
    )
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    now = time.time()
    tracker = NodeProviderAvailabilityTracker(timer=lambda: now)
    for name in failed:
        tracker.update_node_availability(
            name, now - ago, NodeLaunchException("InsufficientInstanceCapacity", MESSAGE, None))
    summary = AutoscalerSummary(active_nodes={"ray.head.default": 1, **(running or {})},
                                idle_nodes=None, pending_nodes=[],
                                pending_launches=launching or {}, failed_nodes=[],
                                node_availability_summary=tracker.summary())
    return json.dumps({"time": now, "autoscaler_report": dataclasses.asdict(summary)})


def test_rows_name_each_type_and_ec2s_reason():
    rep = capacity.report(ray_report(ORDER[:2], running={ORDER[2]: 1}))
    rows = {r.name: r for r in capacity.node_types(rep, ORDER)}
    assert [r.name for r in capacity.node_types(rep, ORDER)][:3] == ORDER
    assert rows[ORDER[2]].running == 1 and rows[ORDER[2]].error is None
    line = rows[ORDER[0]].line()
    assert line.startswith(f"{ORDER[0]}: 0 running, 0 pending; last launch failed at ")
    assert line.endswith(f"InsufficientInstanceCapacity: {MESSAGE}")
    # A type running is not "all failing", whatever the others say.
    assert capacity.all_failing(rep, ORDER) == []


def test_all_failing_only_when_every_candidate_failed_and_none_runs_or_launches():
    assert capacity.all_failing(capacity.report(ray_report(ORDER[:2])), ORDER) == []
    rows = capacity.all_failing(capacity.report(ray_report(ORDER)), ORDER)
    assert [r.name for r in rows] == ORDER
    line = capacity.failing_line(rows)
    assert "\n" not in line and line.count("InsufficientInstanceCapacity") == 3
    assert capacity.all_failing(capacity.report(ray_report(ORDER, launching={ORDER[1]: 1})),
                                ORDER) == []
    assert capacity.all_failing({}, ORDER) == [] and capacity.all_failing(
        capacity.report(ray_report(ORDER)), []) == []
    # Failures from before the question (an earlier job's) are no verdict: the autoscaler tries
    # those types again once new work asks for them.
    rep = capacity.report(ray_report(ORDER))
    assert capacity.all_failing(rep, ORDER, since=time.time() + 60) == []
    assert len(capacity.all_failing(rep, ORDER, since=time.time() - 60)) == 3


class _Dashboard(http.server.BaseHTTPRequestHandler):
    body = b"{}"
    token = "sekrit"

    def do_GET(self):   # noqa: N802
        ok = self.headers.get("Authorization") == f"Bearer {self.token}"
        self.send_response(200 if ok and self.path == "/api/cluster_status" else 401)
        self.end_headers()
        if ok:
            self.wfile.write(self.body)

    def log_message(self, *_):
        pass


@pytest.fixture
def dashboard():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_rayfleet_status_reads_the_dashboard_in_the_yamls_order(dashboard, tmp_path,
                                                               monkeypatch, capsys):
    from ray.dashboard.utils import to_google_style

    value = json.loads(ray_report(ORDER, launching={}))
    _Dashboard.body = json.dumps({"result": True, "msg": "Got cluster status.", "data":
                                  to_google_style({"cluster_status": value})}).encode()
    token = tmp_path / "token"
    token.write_text("sekrit\n")
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({
        "cluster_name": "c", "head_node_type": "ray.head.default",
        "available_node_types": {"ray.head.default": {}, **{n: {} for n in ORDER},
                                 "ray.worker.p5.48xlarge.spot": {}}}))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert cli.main(["status", str(config), "--address", dashboard]) == 0
    lines = capsys.readouterr().out.splitlines()
    # One line per worker type in the YAML's order, the untouched p5 included; then the verdict.
    assert [ln.split(":")[0] for ln in lines[:4]] == [*ORDER, "ray.worker.p5.48xlarge.spot"]
    assert all("InsufficientInstanceCapacity: We currently" in ln for ln in lines[:3])
    assert lines[3] == "ray.worker.p5.48xlarge.spot: 0 running, 0 pending"
    # The p5 type has not failed: the autoscaler still has somewhere to go.
    assert len(lines) == 4


def test_rayfleet_status_says_when_nothing_was_reported_or_nothing_autoscales(
        dashboard, tmp_path, monkeypatch, capsys):
    token = tmp_path / "token"
    token.write_text("sekrit\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({"cluster_name": "c", "head_node_type": "ray.head.default",
                                  "available_node_types": {"ray.head.default": {},
                                                           ORDER[0]: {}}}))
    # The dashboard answers, but the autoscaler has written no report yet.
    _Dashboard.body = json.dumps({"result": True, "data": {"clusterStatus": {}}}).encode()
    assert cli.main(["status", str(config), "--address", dashboard]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "the autoscaler has not reported yet (it does every few seconds after `ray up`)",
        f"{ORDER[0]}: 0 running, 0 pending"]
    # A cluster YAML with no worker types: its head's report has nothing else to show.
    from ray.dashboard.utils import to_google_style

    config.write_text(json.dumps({"cluster_name": "c", "head_node_type": "ray.head.default",
                                  "available_node_types": {"ray.head.default": {}}}))
    _Dashboard.body = json.dumps({"result": True, "data": to_google_style(
        {"cluster_status": json.loads(ray_report([]))})}).encode()
    assert cli.main(["status", str(config), "--address", dashboard]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "no worker node types: the cluster does not autoscale (no `ray up` autoscaler report "
        "yet)"]


def test_rayfleet_status_without_the_token_is_one_line(dashboard, monkeypatch, capsys, tmp_path):
    token = tmp_path / "token"
    token.write_text("wrong\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert cli.main(["status", "--address", dashboard]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "refused the request (401)" in err, err
    assert cli.main(["status", "--address", "127.0.0.1:1"]) == 2
    assert "not the dashboard's http:// address" in capsys.readouterr().err


def test_the_driver_stops_waiting_when_every_fitting_type_fails():
    types = {n: {"CPU": 96, "GPU": 8, "accelerator_type:A100": 1} for n in ORDER}
    types["ray.worker.cpu"] = {"CPU": 16}
    opts = options.TrainOptions.parse(["--smoke-test", "--resources-per-worker",
                                      '{"accelerator_type:A100": 0.5}'])
    # The CPU type cannot hold an A100 worker: it is no candidate.
    assert placement.fitting_types(opts, types) == ORDER
    # Failures made after the watch starts, as the autoscaler tries each type for the run.
    failing = iter([ORDER[:1], ORDER[:2]] + [ORDER] * 1000)
    fired = threading.Event()
    watch = placement.LaunchWatch(ORDER, lambda: ray_report(next(failing), ago=0), poll_s=0.01,
                               on_fail=lambda line: fired.set())
    with watch:
        assert fired.wait(10)
    assert watch.line == capacity.failing_line(
        capacity.all_failing(capacity.report(ray_report(ORDER)), ORDER))
    assert watch.line.startswith("no allowed worker type can launch (ray.worker.p4d.24xlarge."
                                 "spot: InsufficientInstanceCapacity: We currently")
    # A run whose bundle no launchable type fits has nothing to watch.
    # (A report in which everything fails, read every 10 ms: a watch that ran would see it.)
    said: list[str] = []
    idle = placement.LaunchWatch([], lambda: ray_report(ORDER, ago=-60), poll_s=0.01,
                              on_fail=said.append)
    with idle:
        time.sleep(0.3)
    assert idle.line is None and said == [] and idle._thread.ident is None


def test_a_report_the_watch_cannot_read_is_said_once_and_no_verdict(capsys):
    said: list[str] = []

    def broken():
        raise ConnectionError("GCS unreachable")

    with placement.LaunchWatch(ORDER, broken, poll_s=0.01, on_fail=said.append):
        time.sleep(0.3)
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rayfleet] cannot read the autoscaler's report (ConnectionError: GCS "
                   "unreachable); a type that cannot launch is not noticed, the run waits on "
                   "Ray Train's placement timeout"] and said == [], out


def test_the_driver_ends_with_one_line_and_exit_2(tmp_path):
    """The watcher's own ending (not the main thread's: Ray Train V2 owns SIGINT in the driver
    and exits 1 without a word): the line run_main would print, exit 2, nothing else."""
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp_path / "report.json").write_text(ray_report(ORDER, ago=-60))   # tried after start
    probe = ("import pathlib, time\n"
             "from workloads.train import placement\n"
             f"r = pathlib.Path({str(tmp_path / 'report.json')!r}).read_text()\n"
             f"with placement.LaunchWatch({ORDER!r}, lambda: r, poll_s=0.01):\n"
             "    time.sleep(30)\n"
             "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("workloads.train: error: no allowed worker type can launch (")


def test_status_says_in_one_line_why_it_shows_no_gpu_health(tmp_path):
    """A cluster YAML of GPU types that is not render's: no storage to read the gate's verdicts
    from, said once (the verdicts themselves: tests/moto/test_health.py)."""
    from rayfleet.commands import status

    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({"cluster_name": "c", "available_node_types": {}}))
    (line,) = status._health(str(config))
    assert line.startswith(f"GPU health: not shown ({config}: not a Ray cluster YAML"), line
    config.write_text(json.dumps({"cluster_name": "c", "provider": {"type": "aws"},
                                  "available_node_types": {}}))
    assert status._health(str(config)) == [
        f"GPU health: not shown ({config} has no storage of `rayfleet render`'s)"]
