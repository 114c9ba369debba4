"""The HAProxy guard as an allowlist (rayfleet/agents/haproxy_guard.py) and its watcher of the
running HAProxy (haproxy_watch.py). Each crafted config below is Ray 2.60's own rendering
with one construct injected that HAProxy's reader accepts; the guard refuses each in one line.
The watcher is shown stopping a real HAProxy whose sockets go beyond its allowed binds."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from rayfleet.agents import haproxy_guard as guard
from rayfleet.agents import haproxy_watch as watcher
from tests.conftest import REPO, free_port, wait_until
from tests.unit.test_ingress import rays_config

GUARD = REPO / "rayfleet" / "agents" / "haproxy_guard.py"

# Every directive keyword (and the action or option after http-request, option, stats, ...)
# Ray 2.60's template writes. A new one, or one moved, fails here first: read it, teach the
# guard (or keep it refused), then update this set.
RAY_TEMPLATE_KEYWORDS = {
    "acl", "backend", "balance", "bind", "close-spread-time", "default_backend", "defaults",
    "errorfile", "frontend", "global", "hard-stop-after", "http-check expect",
    "http-request del-header", "http-request lua.route_via_ingress_request_router",
    "http-request return", "http-request set-header", "http-request set-log-level",
    "http-request set-var(txn.ingress_request_router_app)",
    "http-request set-var(txn.ingress_request_router_recoverable)",
    "http-request set-var-fmt(txn.serve_app)", "http-request set-var-fmt(txn.serve_deployment)",
    "http-request set-var-fmt(txn.serve_route)", "http-request use-service",
    "http-request wait-for-body", "http-reuse always", "listen", "load-server-state-from-file",
    "log", "log-format-sd", "lua-load-per-thread", "maxconn", "mode", "nbthread", "no log",
    "option abortonclose", "option http-no-delay", "option httpchk", "option httplog",
    "option idle-close-on-response", "option log-health-checks", "option redispatch",
    "option splice-request", "option splice-response", "option tcp-check", "retries",
    "retry-on", "server", "server-state-base", "server-state-file", "stats enable",
    "stats refresh", "stats socket", "stats timeout", "stats uri", "tcp-check connect",
    "tcp-check expect", "tcp-check send-binary", "timeout client", "timeout connect",
    "timeout http-keep-alive", "timeout http-request", "timeout queue", "timeout server",
    "timeout tunnel", "tune.bufsize", "tune.h2.be.initial-window-size",
    "tune.h2.be.max-concurrent-streams", "tune.h2.fe.initial-window-size",
    "tune.h2.fe.max-concurrent-streams", "tune.h2.max-frame-size", "unique-id-format",
    "use-server", "use_backend"}
TWO_WORDS = ("http-request", "option", "stats", "tcp-check", "timeout", "http-check",
             "http-reuse", "no")


def test_rays_template_writes_no_directive_the_guard_was_not_read_against():
    from ray.serve._private import haproxy_templates as t

    found = set()
    for template in (t.HAPROXY_CONFIG_TEMPLATE, t.HAPROXY_HEALTHZ_RULES_TEMPLATE,
                     t.HAPROXY_GRPC_HEALTHZ_RULES_TEMPLATE):
        for line in template.splitlines():
            text = re.sub(r"\{%-?.*?-?%\}", "", line).strip()
            if not text or text.startswith(("#", "{{")):
                continue
            words = text.split()
            found.add(" ".join(words[:2]) if words[0] in TWO_WORDS else words[0])
    assert found == RAY_TEMPLATE_KEYWORDS, (
        f"Ray's HAProxy template changed: new {sorted(found - RAY_TEMPLATE_KEYWORDS)}, gone "
        f"{sorted(RAY_TEMPLATE_KEYWORDS - found)}; check them against haproxy_guard.py first")


def _inject(where: str, line: str):
    """Ray's config with ``line`` after the header ``where`` (or at the end, where None)."""
    def change(text: str) -> str:
        if where is None:
            return text + line + "\n"
        head = next(ln for ln in text.splitlines() if ln.strip() == where)
        return text.replace(head + "\n", f"{head}\n{line}\n", 1)
    return change


def _replace(pattern: str, repl: str):
    return lambda text: re.sub(pattern, repl, text, count=1, flags=re.M)


CRAFTED = {
    # Listeners HAProxy would open on every interface.
    "admin socket over TCP": (_replace(r"stats socket \S+", "stats socket ipv4@0.0.0.0:9999"),
                              "not a unix path"),
    "bind address list": (_replace(r"bind \*:8000", "bind 127.0.0.1:8000,0.0.0.0:8001"),
                          "address form"),
    "bind family prefix": (_replace(r"bind \*:8000", "bind ipv4@0.0.0.0:8000"),
                           "address form"),
    "bind port range": (_replace(r"bind \*:8000", "bind 127.0.0.1:8000-8010"), "address form"),
    "bind option": (_replace(r"bind \*:8000", "bind *:8000 v4v6 level admin"),
                    "a bind it does not allow"),
    "env expansion": (_replace(r"bind \*:8000", 'bind "${HOST}:8000"'), "HAProxy would expand"),
    "bare expansion": (_replace(r"bind \*:8000", "bind $HOST:8000"), "HAProxy would expand"),
    "escape": (_replace(r"bind \*:8000", "bind \\*:8000"), "an escape it does not reproduce"),
    "hex escape": (lambda t: t.replace("bind *:8000", 'bind "\\x2a:8000"'),
                   "an escape it does not"),
    "indented section": (_inject("listen stats", "   listen evil\n  bind 0.0.0.0:7777"),
                         "unknown listen 'evil'"),
    "udp listener": (_inject(None, "log-forward lf\n    dgram-bind 0.0.0.0:514"),
                     "a log-forward section"),
    "dgram-bind in a frontend": (_inject("frontend http_frontend", "    dgram-bind :514"),
                                 "does not allow"),
    "second mode": (_replace(r"expose-fd listeners", "expose-fd listeners mode 666"),
                    "stats socket options"),
    "program": (_inject(None, "program evil\n    command /bin/sh -c id"), "a program section"),
    "lua-load": (_inject("global", "    lua-load /tmp/x.lua"), "does not allow in global"),
    "lua action": (_inject("frontend http_frontend", "    http-request lua.evil"), "lua.evil"),
    "conditional block": (_inject("global", ".if defined(X)\n    maxconn 10\n.endif"),
                          "a .if block"),
    "hash in a word": (_replace(r"bind \*:8000", "bind *:8000#x"), "inside a word"),
    "file response": (_inject("backend default_backend",
                              "    http-request return status 200 file /etc/shadow"),
                      "'file' \\(reads a file"),
    "acl from a file": (_inject("frontend http_frontend", "    acl a src -f /etc/passwd"),
                        "'-f' \\(reads a file"),
    "error page elsewhere": (_replace(r"errorfile 502 \S+", "errorfile 502 /etc/shadow"),
                             "outside the admin socket's private folder"),
    "server on a unix socket": (_replace(r"server r1 127\.0\.0\.1:30000",
                                         "server r1 unix@/var/run/docker.sock"),
                                "address form"),
    "nameserver": (_inject("backend default_backend", "    nameserver ns 8.8.8.8:53"),
                   "does not allow"),
    "server in a frontend": (_inject("frontend http_frontend", "    server s 10.0.0.1:80"),
                             "does not allow"),
    "use-service": (_inject("frontend http_frontend",
                            "    http-request use-service lua.evil"), "use-service"),
    "quoted external-check": (_inject("backend http-lm", "    option 'external-check'"),
                              "external-check"),
    "peers": (_inject(None, "peers p\n    peer a 10.0.0.1:10000"), "a peers section"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_construct_is_refused_in_one_line(tmp_path, case):
    change, why = CRAFTED[case]
    raw = rays_config(tmp_path)
    crafted = change(raw)
    assert crafted != raw, case   # the injection took
    with pytest.raises(guard.GuardError, match=why) as e:
        guard.guard(crafted)
    assert "\n" not in str(e.value)


def test_quotes_are_read_as_haproxy_reads_them_and_written_back_plain(tmp_path):
    """Quoted words are words; Ray's route table (JSON in double quotes, its quotes escaped)
    is written back so that HAProxy itself accepts it."""
    routes = 'string "{\\"/probe\\":\\"it\'s\\"}" if routes'
    raw = rays_config(tmp_path).replace("bind *:8000", "'bind' \"*:8000\"")
    raw = re.sub(r'string "Route table is not populated yet\." if routes', lambda m: routes, raw)
    assert routes in raw
    safe = guard.guard(raw)
    assert "    bind 127.0.0.1:8000" in safe.splitlines()
    assert "string \"{\\\"/probe\\\":\\\"it's\\\"}\" if routes" in safe, safe
    path = tmp_path / "h" / "n" / "haproxy.cfg"
    path.write_text(raw)
    done = subprocess.run([sys.executable, str(GUARD), "-c", "-f", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "valid" in (done.stdout + done.stderr).lower(), done
    assert guard.split("""a 'b c'"d" "e'f" g""") == ["a", "b cd", "e'f", "g"]
    for words in (["x", "a b"], ["y", "it's"], ["z", ""]):
        assert guard.split(guard.join(words)) == words


def _start_haproxy_alone(cfg, tmp_path) -> subprocess.Popen:
    """HAProxy in a network namespace of its own (nothing here listens on the world): its
    0.0.0.0 is that namespace's loopback alone. Same pid: unshare and sh exec it."""
    return subprocess.Popen(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" '
                             '-db -f "$1"', guard.real_binary(), str(cfg)],
                            stdout=open(tmp_path / "haproxy.log", "w"), stderr=subprocess.STDOUT)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_watcher_stops_a_haproxy_holding_more_than_it_was_allowed(tmp_path):
    """A real HAProxy (started without the guard) with a TCP listener on every interface, a
    UDP one (log-forward) and an admin socket any user may open: the watcher names all three
    and stops it."""
    folder = tmp_path / "hap"
    folder.mkdir(mode=0o700)
    ok, extra = free_port(), free_port()
    udp = 21514   # below the kernel's ephemeral range: asked for, a listener
    sock = folder / "admin.sock"
    cfg = folder / "haproxy.cfg"
    cfg.write_text(f"global\n    stats socket {sock} mode 666 level admin\ndefaults\n"
                   f"    mode http\n    timeout connect 1s\n    timeout client 1s\n"
                   f"    timeout server 1s\nfrontend http_frontend\n    bind 127.0.0.1:{ok}\n"
                   f"    bind 0.0.0.0:{extra}\nlog-forward lf\n    dgram-bind 0.0.0.0:{udp}\n"
                   "    log stderr format raw local0\n")
    proc = _start_haproxy_alone(cfg, tmp_path)
    try:
        everything = {("127.0.0.1", ok), ("0.0.0.0", extra)}
        wait_until("HAProxy's sockets", lambda: proc.poll() is None and os.path.exists(
            sock) and len(watcher.problems(proc.pid, {("127.0.0.1", ok)}, str(sock))) == 3)
        start = watcher._ticks(proc.pid)
        assert watcher.problems(proc.pid, everything, str(sock)) == [
            f"a UDP socket on 0.0.0.0:{udp}", f"the admin socket {sock} mode 0o666"]
        found = watcher.watch(proc.pid, start, {("127.0.0.1", ok)}, str(sock), poll_s=0.2)
        assert found == [f"a TCP listener on 0.0.0.0:{extra}", f"a UDP socket on 0.0.0.0:{udp}",
                         f"the admin socket {sock} mode 0o666"], found
        assert proc.wait(timeout=30) is not None   # stopped
        # Only that process: a watcher given the wrong start time signals nothing.
        other = subprocess.Popen(["sleep", "30"])
        assert watcher.watch(other.pid, "1", set(), None) == [] and other.poll() is None
        other.kill()
    finally:
        proc.kill()
        proc.wait()


def test_the_guard_leaves_a_watcher_and_the_guarded_haproxy_passes_it(tmp_path):
    """As Ray runs it: the guard rewrites the config, leaves its watcher (a session of its
    own, not HAProxy's child) and becomes HAProxy, whose sockets are what it was allowed."""
    raw = rays_config(tmp_path, grpc=False)
    path = tmp_path / "h" / "n" / "haproxy.cfg"
    port = free_port()
    path.write_text(raw.replace("bind *:8000", f"bind *:{port}"))
    env = {**os.environ, "RAYFLEET_HAPROXY_BIND": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, str(GUARD), "-db", "-f", str(path)], env=env,
                            stdout=open(tmp_path / "haproxy.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_until("HAProxy on the Serve port", lambda: _listening(port))
        watchers = subprocess.run(["pgrep", "-f", f"haproxy_watch.py --pid {proc.pid} "],
                                  capture_output=True, text=True).stdout.split()
        assert len(watchers) == 1, watchers
        with open(f"/proc/{watchers[0]}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) != proc.pid   # not its child
        allowed = {(h, int(p)) for h, p in re.findall(r"^\s*bind ([\d.]+):(\d+)",
                                                      path.read_text(), re.M)}
        assert watcher.problems(proc.pid, allowed, str(path.parent / "admin.sock")) == []
        time.sleep(2)
        assert proc.poll() is None, (tmp_path / "haproxy.log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    wait_until("the watcher to leave with its HAProxy", lambda: not os.path.exists(
        f"/proc/{watchers[0]}"), timeout=15)
