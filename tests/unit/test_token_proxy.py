"""No token through a proxy: every client of the kit that carries a cluster's token talks to
the cluster's address directly, with http_proxy/https_proxy pointing at a trap proxy that
records whatever reaches it. (logship and spot open their URLs the same way.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rayfleet.commands import host, localhead, localstate, status
from tests.moto.pulumi_moto import load_agent

TOKEN = "sekret-token-for-the-trap"


def _server(seen: list, answer: bytes, code: int = 200) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def trap(monkeypatch):
    """(what the trap proxy saw, what the cluster saw, the cluster's URL)."""
    proxied, direct = [], []
    proxy = _server(proxied, b"{}", 502)
    cluster = _server(direct, json.dumps({"result": True, "data": {"clusterStatus": {}}})
                      .encode())
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    for key in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(key, url)
    for key in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(key, raising=False)
    yield proxied, direct, f"http://127.0.0.1:{cluster.server_address[1]}"
    proxy.shutdown()
    cluster.shutdown()


def test_the_kits_own_clients_bypass_the_proxy(trap):
    proxied, direct, address = trap
    status.fetch(address, TOKEN)                          # rayfleet status
    localhead.status_of(f"{address}/api/version", TOKEN)  # local's Jobs API probe
    load_agent("autostop").Dashboard(address, TOKEN).get("/api/jobs/")   # auto-stop
    assert proxied == [], proxied
    assert [auth for _, auth in direct] == [f"Bearer {TOKEN}"] * 3, direct


def test_rays_clients_in_a_local_env_shell_bypass_the_proxy(trap, tmp_path, monkeypatch):
    """What `rayfleet local env` exports keeps Ray's clients (requests) off the proxy, the
    user's own NO_PROXY entries kept."""
    proxied, direct, address = trap
    monkeypatch.setenv("NO_PROXY", "corp.example")
    cluster = localstate.LocalCluster(
        pid=1, gcs_port=1, dashboard_port=int(address.rsplit(":", 1)[1]), client_port=1,
        agent_port=1, num_cpus=None, num_gpus=None, object_store_memory=None, log="x",
        started_at=0.0)
    env = {**os.environ, **cluster.client_env()}
    assert env["NO_PROXY"].split(",")[0] == "corp.example", env["NO_PROXY"]
    code = ("import os, requests; requests.get(os.environ['RAY_DASHBOARD_ADDRESS'] + "
            f"'/api/version', headers={{'Authorization': 'Bearer {TOKEN}'}}, timeout=10)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert proxied == [] and direct == [("/api/version", f"Bearer {TOKEN}")], (proxied, direct)
    # Without it, the same request goes to the proxy: the trap is a real one.
    del env["NO_PROXY"], env["no_proxy"]
    subprocess.run([sys.executable, "-c", code.replace(", timeout=10)", ", timeout=10)"
                                                       ".status_code")], env=env, timeout=60)
    assert [auth for _, auth in proxied] == [f"Bearer {TOKEN}"], proxied


def test_no_proxy_with_adds_loopback_once(monkeypatch):
    monkeypatch.setenv("no_proxy", "a.example,127.0.0.1")
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert host.no_proxy_with() == "a.example,127.0.0.1,localhost,::1"
