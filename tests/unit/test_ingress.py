"""Serve's HAProxy ingress (rayfleet.ingress, rayfleet/agents/haproxy_guard.py): the config
Ray's own code renders passes the guard with every listener on loopback and HAProxy accepts
the result; anything the guard does not know is refused in one line; and a change to Ray's
template fails here before it can open a port on a cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from rayfleet import ingress
from rayfleet.agents import haproxy_guard as guard
from rayfleet.facts import RAY_PORTS_BY_NAME
from tests.conftest import REPO

GUARD = REPO / "rayfleet" / "agents" / "haproxy_guard.py"

# Every line of Ray 2.60.0's HAProxy template that opens a listener, a socket or a section
# (ray/serve/_private/haproxy_templates.py). The guard knows exactly these; when Ray's
# template changes, this list fails first: read the new lines, teach the guard, update it.
RAY_TEMPLATE_LISTENERS = [
    "stats socket {{ config.socket_path }} mode 666 level admin expose-fd listeners",
    "defaults",
    "frontend prometheus",
    "bind :{{ config.metrics_port }}",
    "frontend http_frontend",
    "bind {{ config.frontend_host }}:{{ config.frontend_port }}",
    "backend default_backend",
    "backend {{ backend.name or 'unknown' }}",
    "backend {{ backend.name or 'unknown' }}-via-ingress-request-router",
    "frontend grpc_frontend",
    "bind {{ config.grpc_frontend_host }}:{{ config.grpc_frontend_port }} proto h2",
    "backend grpc_fallback_backend",
    "backend default_grpc_backend",
    "backend {{ backend.name or 'unknown' }}",
    "listen stats",
    "bind *:{{ config.stats_port }}",
]
_LISTENER = re.compile(r"^\s*((?:bind|stats socket|listen|frontend|backend|defaults|peers|"
                       r"userlist|program|resolvers|mailers|ring|cache|http-errors)\b.*)$")


def test_the_guard_knows_every_listener_of_rays_template():
    from ray.serve._private import haproxy_templates as t

    found = [m.group(1).strip() for line in t.HAPROXY_CONFIG_TEMPLATE.splitlines()
             if (m := _LISTENER.match(line))]
    assert found == RAY_TEMPLATE_LISTENERS, (
        "Ray's HAProxy template changed its listeners: check each new line against "
        "rayfleet/agents/haproxy_guard.py before updating RAY_TEMPLATE_LISTENERS")


def rays_config(tmp_path, host: str = "0.0.0.0", grpc: bool = True) -> str:
    """The config Ray 2.60's own HAProxyApi renders for one app, as a node's HAProxy gets it
    (files in a 0700 folder, a per-node folder inside, as rayfleet.ingress sets them)."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions, gRPCOptions

    # Short names: HAProxy refuses a socket path over 97 characters, and xdist's temp folders
    # are long.
    folder = tmp_path / "h"
    folder.mkdir(mode=0o700)
    node = folder / "n"
    node.mkdir()
    cfg = HAProxyConfig(
        http_options=HTTPOptions(host=host, port=8000),
        grpc_options=gRPCOptions(port=9000, grpc_servicer_functions=["a.b:add"] if grpc else []),
        socket_path=str(node / "admin.sock"), server_state_base=str(node),
        server_state_file=str(node / "server-state"), is_head=True,
        metrics_socket_path=str(node / "metrics.sock"))
    servers = [ServerConfig(name="r1", host="127.0.0.1", port=30000)]
    backend = BackendConfig(app_name="lm", name="http-lm", path_prefix="/", servers=servers)
    api = HAProxyApi(cfg=cfg, backend_configs={"lm": backend},
                     config_file_path=str(node / "haproxy.cfg"))
    api._generate_config_file_internal()
    return (node / "haproxy.cfg").read_text()


def _binds(text: str) -> list[str]:
    return re.findall(r"^\s*bind (\S+)", text, re.M)


def test_rays_config_through_the_guard_listens_on_loopback_only_and_haproxy_accepts_it(
        tmp_path):
    raw = rays_config(tmp_path)
    assert "*:" in " ".join(_binds(raw)) and "mode 666" in raw  # what Ray alone would do
    safe = guard.guard(raw)
    assert _binds(safe) and all(b.startswith("127.0.0.1:") for b in _binds(safe)), _binds(safe)
    assert re.search(r"stats socket \S+ mode 600 level admin", safe)
    # HAProxy's own check of the result, through the guard exactly as Ray calls it (-f CONFIG),
    # with -c: the guard rewrites the file in place and execs the real binary.
    path = tmp_path / "h" / "n" / "haproxy.cfg"
    done = subprocess.run([sys.executable, str(GUARD), "-c", "-f", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "valid" in (done.stdout + done.stderr).lower()
    assert path.read_text() == safe and oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_host_the_serve_config_names_is_kept(tmp_path):
    safe = guard.guard(rays_config(tmp_path, host="10.0.3.7", grpc=False),
                       bind="127.0.0.1", frontend="127.0.0.1")
    assert "bind 10.0.3.7:8000" in safe
    assert sorted(_binds(safe)) == sorted(["127.0.0.1:9101", "10.0.3.7:8000", "127.0.0.1:8404"])


@pytest.mark.parametrize("change,why", [
    (lambda t: t + "listen admin\n  bind *:9999\n", "unknown listen 'admin'"),
    (lambda t: t.replace("frontend http_frontend\n",
                         "frontend http_frontend\n    bind *:8081\n"), "second listener"),
    (lambda t: re.sub(r"^backend default_backend\n", "backend default_backend\n    bind :7777\n",
                      t, flags=re.M), "listener in backend"),
    (lambda t: t + "peers mypeers\n    peer a 10.0.0.1:10000\n", "a peers section"),
    (lambda t: re.sub(r"stats socket \S+", "stats socket ipv4@0.0.0.0:9999", t),
     "not a unix path"),
    (lambda t: re.sub(r"log 127\.0\.0\.1:514", "log 10.1.2.3:514", t), "off this machine"),
    (lambda t: re.sub(r"stats socket (\S+)/admin.sock", "stats socket \\1/" + "a" * 100, t),
     "over HAProxy's 97"),
    (lambda t: t.replace("frontend prometheus\n    bind :",
                         "frontend prometheus\n    bind 10.0.0.5:"), "neither every interface"),
])
def test_what_the_guard_does_not_know_is_refused_in_one_line(tmp_path, change, why):
    with pytest.raises(guard.GuardError, match=why):
        guard.guard(change(rays_config(tmp_path)))


def test_an_admin_socket_others_may_open_is_refused(tmp_path):
    raw = rays_config(tmp_path)
    os.chmod(tmp_path / "h", 0o755)
    with pytest.raises(guard.GuardError, match="not inside a folder only its owner can open"):
        guard.guard(raw)


def test_a_refused_config_starts_nothing_and_says_why_in_one_line(tmp_path):
    raw = rays_config(tmp_path)
    path = tmp_path / "h" / "n" / "haproxy.cfg"
    path.write_text(raw + "listen admin\n  bind *:9999\n")
    before = path.read_text()
    done = subprocess.run([sys.executable, str(GUARD), "-db", "-f", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "refusing Ray's HAProxy config" in done.stderr
    assert path.read_text() == before  # left as Ray wrote it, for the reader of the error


def test_haproxy_env_pins_the_facts_ports_and_keeps_files_in_the_folder():
    env = ingress.haproxy_env("/f", "/g/haproxy_guard.py")
    assert env[ingress.ENABLE] == "1" and env[ingress.BINARY] == "/g/haproxy_guard.py"
    assert all(v.startswith("/f/") or v == "/f" for k, v in env.items()
               if k.endswith(("_LOC", "_PATH", "_BASE", "_FILE")) and k != ingress.BINARY)
    direct = RAY_PORTS_BY_NAME["serve-direct-ingress"]
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (str(direct.from_port),
                                                               str(direct.to_port))
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == str(
        RAY_PORTS_BY_NAME["serve-fallback-proxy"].from_port)
    # Every variable is one Ray 2.60 reads.
    from ray.serve._private import constants

    source = open(constants.__file__).read()
    assert all(f'"{k}"' in source for k in env), [k for k in env if f'"{k}"' not in source]
