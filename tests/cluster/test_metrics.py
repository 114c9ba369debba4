"""`rayfleet local up --metrics` on the session's real cluster: a real Prometheus (Debian's)
scrapes it through Ray's service-discovery file, and a training run's loss and tokens/s and
Serve's request counts come back from Prometheus's HTTP API, as do the kit dashboard's panels.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, free_port, run, summary_of
from tests.workloads.conftest import serve_shutdown

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RUN = "metrics-run"
REQUESTS = 4
STEPS = 5
# Ray exports metrics every 10 s and Prometheus scrapes every 5 s: a value shows up within
# ~15 s of being set on a quiet machine; the rest is for a busy one.
VISIBLE_WITHIN_S = 60


def rayfleet(ray_cluster, *args, timeout=120):
    return run([str(BIN / "rayfleet"), "local", "up", *args], env=ray_cluster["env"],
               timeout=timeout)


def stop_prometheus(home: Path) -> None:
    """Stop the Prometheus `--metrics` started, leaving the session's cluster up."""
    from rayfleet.commands import metrics

    old = os.environ.get("RAYFLEET_HOME")
    os.environ["RAYFLEET_HOME"] = str(home)
    try:
        metrics.stop_local()
    finally:
        if old is None:
            os.environ.pop("RAYFLEET_HOME")
        else:
            os.environ["RAYFLEET_HOME"] = old


@pytest.fixture(scope="module", autouse=True)
def prometheus_binary():
    from tests.unit.test_metrics import installed_or_skip

    return installed_or_skip()


def test_taken_prometheus_port_is_one_line_and_starts_nothing(ray_cluster):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = rayfleet(ray_cluster, "--metrics", "--prometheus-port", str(port))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"rayfleet: error: port {port} (Prometheus) is already in use by another process; "
        "stop it or pick another with --prometheus-port"]
    assert not (ray_cluster["home"] / "prometheus" / "prometheus.json").exists()
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def prometheus(ray_cluster):
    port = free_port()
    proc = rayfleet(ray_cluster, "--metrics", "--prometheus-port", str(port), timeout=600)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        url = f"http://127.0.0.1:{port}"
        assert f"prometheus: {url}  (loopback only" in proc.stdout
        assert "rayfleet/dashboards/rayfleet.json" in proc.stdout
        assert "/metrics/grafana/dashboards/  (Ray's)" in proc.stdout
        yield {"url": url, "stdout": proc.stdout, "started": time.time()}
    finally:
        stop_prometheus(ray_cluster["home"])


def api(url: str, path: str, **params) -> dict:
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}",
                                timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def latest(url: str, expr: str) -> list[dict]:
    # last_over_time over a range: a finished run's gauges stop being exported (Ray drops
    # them two export intervals later) and Prometheus marks them stale for instant queries.
    return api(url, "query", query=f"last_over_time(({expr})[10m:5s])")["result"]


def wait_for(url: str, expr: str, ok) -> list[dict]:
    deadline = time.time() + VISIBLE_WITHIN_S
    while True:
        result = latest(url, expr)
        if result and ok(result):
            return result
        if time.time() > deadline:
            raise AssertionError(f"{expr}: {result} after {VISIBLE_WITHIN_S}s")
        time.sleep(2)


# A small real Serve app, deployed from a driver process of its own (Ray reads token-auth
# settings once per process): the proxy counts and times its requests like any app's. The
# kit's `lm` app would cost a torch replica; its serving is tests/workloads/test_serve.py's.
ECHO_APP = """
import sys
from ray import serve

@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Echo:
    async def __call__(self, request):
        return "ok"

serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
serve.run(Echo.bind(), name="echo", route_prefix="/echo")
"""


@pytest.fixture(scope="module")
def workloads(ray_cluster, prometheus, tmp_path_factory):
    """A short training run and, meanwhile, a few requests to a Serve app."""
    storage = tmp_path_factory.mktemp("metrics-runs")
    train = subprocess.Popen(
        [str(BIN / "python"), "-m", "workloads.train", "--smoke-test", "--max-steps", str(STEPS),
         # Two ranks: the slowest rank's gauges need another to compare with.
         "--num-workers", "2", "--name", RUN, "--storage-path", str(storage)],
        env=ray_cluster["env"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        port = free_port()
        run([str(BIN / "python"), "-c", ECHO_APP, str(port)], env=ray_cluster["env"],
            check=True, timeout=180)
        for _ in range(REQUESTS):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/echo", timeout=30) as r:
                assert r.status == 200 and r.read() == b"ok"
        out, err = train.communicate(timeout=400)
        assert train.returncode == 0, out[-3000:] + err[-2000:]
        summary = summary_of(out)
        with open(summary["metrics_csv"]) as f:
            last = list(csv.DictReader(f))[-1]
        yield {"last": last, "summary": summary}
    finally:
        if train.poll() is None:
            train.kill()
            train.communicate()
        serve_shutdown(ray_cluster)


def test_training_loss_and_tokens_per_s_are_in_prometheus(prometheus, workloads):
    # The run's last logged values, although it ends a second or two after logging them: a
    # Ray 2.60 worker flushes its metrics as it exits (ray-project/ray#66180, stats::
    # FlushMetrics), and the agent keeps a gauge for two export intervals after that.
    last = workloads["last"]
    run_filter = f'{{run="{RUN}"}}'
    loss = wait_for(prometheus["url"], f"ray_rayfleet_train_loss{run_filter}",
                    lambda r: float(r[0]["value"][1]) == float(last["loss"]))
    assert float(loss[0]["value"][1]) == workloads["summary"]["final_loss"]
    wait_for(prometheus["url"], f"ray_rayfleet_train_tokens_per_s{run_filter}",
             lambda r: float(r[0]["value"][1]) == float(last["tokens_per_s"]))
    wait_for(prometheus["url"], f"ray_rayfleet_train_step{run_filter}",
             lambda r: float(r[0]["value"][1]) == STEPS)
    # The straggler measure: the last window's slowest rank over the others' median.
    wait_for(prometheus["url"], f"ray_rayfleet_train_slowest_ratio{run_filter}",
             lambda r: float(r[0]["value"][1]) == float(last["slowest_ratio"]))


def test_status_says_where_prometheus_is(ray_cluster, prometheus):
    proc = run([str(BIN / "rayfleet"), "local", "status"], env=ray_cluster["env"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"prometheus: {prometheus['url']}  (loopback only" in proc.stdout


def test_every_target_is_scraped_on_loopback_and_up(prometheus, workloads):
    """Every target Ray's service-discovery file names is on loopback, and its last scrape
    succeeded (health `up`): a target listed but failing would leave its panels empty."""
    deadline = time.time() + VISIBLE_WITHIN_S
    while True:
        targets = api(prometheus["url"], "targets")["activeTargets"]
        assert targets and all(t["scrapeUrl"].startswith("http://127.0.0.1:") for t in targets)
        # "unknown" until a target's first scrape (every 5 s); "down" may be a scrape that
        # raced a process starting, so both get until the deadline.
        not_up = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets
                  if t["health"] != "up"]
        if not not_up:
            break
        assert time.time() < deadline, f"targets not up after {VISIBLE_WITHIN_S}s: {not_up}"
        time.sleep(2)


def test_haproxy_exporter_is_scraped(prometheus, workloads):
    """Serve's ingress is HAProxy (the kit's default): its own exporter, on loopback, is a
    Prometheus target, and the echo app's backend counts requests there (the dashboard's
    ingress panel reads it). Not all REQUESTS: HAProxy's counters start again at each reload,
    and Ray reloads it when Serve's routing changes (a CI run on a loaded machine saw 1 of the
    4 after one); never more than were sent."""
    expr = 'sum(haproxy_backend_http_requests_total{proxy="http-echo"})'
    wait_for(prometheus["url"], expr, lambda r: 1 <= float(r[0]["value"][1]) <= REQUESTS)
    jobs = {t["labels"]["job"] for t in api(prometheus["url"], "targets")["activeTargets"]}
    assert "haproxy" in jobs, jobs


def test_serve_request_count_is_in_prometheus(prometheus, workloads):
    expr = ('sum(ray_serve_num_http_requests_total{application="echo",route="/echo",'
            'status_code="200"})')
    wait_for(prometheus["url"], expr, lambda r: float(r[0]["value"][1]) == REQUESTS)


def test_every_kit_dashboard_panel_is_valid_promql(prometheus, workloads):
    """Each panel's query as Grafana sends it (a range query, the template variables set):
    Prometheus accepts all; the training panels show the run."""
    from rayfleet.commands import metrics

    dashboard = json.loads(metrics.kit_dashboard().read_text())
    # The ingress panel is a rate(): it needs two scrapes of the echo backend's counter, which
    # test_haproxy_exporter_is_scraped waits for only once (a loaded CI run came here with one).
    wait_for(prometheus["url"],
             'rate(haproxy_backend_http_requests_total{proxy="http-echo"}[5m])', bool)
    end = time.time()
    seen = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$run", RUN).replace("$application", "echo")
            # Step 1 s: a finished run's gauges are there for a few scrapes only.
            data = api(prometheus["url"], "query_range", query=expr,
                       start=prometheus["started"], end=end, step=1)
            if "rayfleet_train" in expr:
                assert [r["metric"] for r in data["result"]] == [{"run": RUN}], (expr, data)
            if expr.startswith("sum by (proxy) (rate(haproxy_backend"):  # the ingress panel
                assert {"proxy": "http-echo"} in [r["metric"] for r in data["result"]], data
            seen += 1
    assert seen == sum(len(p["targets"]) for p in dashboard["panels"]) == 12
