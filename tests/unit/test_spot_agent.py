"""The spot agent (rayfleet/agents/spot.py) without a cluster: it stands alone, refuses bad
settings in one line, reads IMDSv2 with a session token, and stops cleanly on SIGTERM. Its
Ray side (drain, KV) is tests/faults/test_spot_notice.py's."""

from __future__ import annotations

import ast
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.spot_notice import StandInImds
from rayfleet.agents import spot

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "rayfleet" / "agents"
NODE_ENV = {"ray", "torch", "boto3", "botocore"}  # what a node has besides the stdlib


@pytest.mark.parametrize("agent", sorted(AGENTS.glob("*.py")), ids=lambda p: p.name)
def test_agents_import_only_the_stdlib_and_the_node_environment(agent):
    tops = set()
    for node in ast.walk(ast.parse(agent.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{agent.name}: relative import (a node has no package)"
            tops.add(node.module.split(".")[0])
    assert tops - set(sys.stdlib_module_names) - NODE_ENV == set(), tops


def test_the_notice_key_is_spelled_only_in_the_agent():
    hits = [p for folder in ("rayfleet", "workloads", "bench")
            for p in (REPO / folder).rglob("*.py")
            if spot.KEY_PREFIX in p.read_text() and p != AGENTS / "spot.py"]
    assert hits == []


def _agent(*args, env=None, **kw):
    return subprocess.run([sys.executable, str(AGENTS / "spot.py"), *args], env=env,
                          capture_output=True, text=True, timeout=60, **kw)


def test_help():
    out = _agent("--help")
    assert out.returncode == 0 and "--poll-s" in out.stdout and "IMDSv2" in out.stdout


@pytest.mark.parametrize("args,env,message", [
    (["--poll-s", "0"], {}, "--poll-s must be > 0 seconds, got 0"),
    (["--poll-s", "soon"], {}, "argument --poll-s: invalid float value: 'soon'"),
    (["--imds", "169.254.169.254"], {},
     "metadata endpoint must be an http:// URL, got '169.254.169.254'"),
    ([], {spot.IMDS_ENV: "ftp://x"}, "metadata endpoint must be an http:// URL, got 'ftp://x'"),
    (["--node-id", "abc"], {}, "--node-id must be a Ray node id (56 hex digits), got 'abc'"),
    ([], {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/nonexistent/token"},
     "RAY_AUTH_MODE=token but the token file /nonexistent/token does not exist"),
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
])
def test_bad_settings_are_one_line_and_exit_2(args, env, message):
    out = _agent(*args, env={"PATH": "/usr/bin:/bin", **env})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"spot.py: error: {message}" and out.stdout == ""


@pytest.fixture
def imds():
    server = StandInImds()
    yield server
    server.close()


def test_imds_reads_need_the_session_token_and_find_both_notices(imds):
    client = spot.Imds(imds.url)
    assert spot.read_notices(client) == []
    when = imds.interrupt("stop", in_s=120)
    imds.docs[spot.REBALANCE] = {"noticeTime": "2026-11-23T10:00:00Z"}
    imds.token = "rotated"  # the cached session token is now refused: one fresh token
    notices = spot.read_notices(client)
    assert [n["kind"] for n in notices] == ["interruption", "rebalance"]
    assert notices[0]["action"] == "stop" and notices[0]["time"] == when
    assert abs(notices[0]["deadline_ms"] / 1000 - (time.time() + 120)) < 2
    assert notices[1]["deadline_ms"] is None and notices[1]["key"].endswith("10:00:00Z")
    assert imds.unauthorized == 1  # the one refused read, before the refresh
    with pytest.raises(OSError):  # urllib: 401 without a token, as IMDSv2 answers
        import urllib.request

        urllib.request.urlopen(imds.url + spot.INSTANCE_ACTION, timeout=5)


class CountedReads(dict):
    """StandInImds.docs that counts the metadata reads answered (each poll: two GETs)."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.cond = threading.Condition()

    def get(self, key, default=None):
        with self.cond:
            self.reads += 1
            self.cond.notify_all()
        return super().get(key, default)

    def wait_for(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.reads >= n, timeout=60), self.reads


def test_agent_waits_for_its_node_logs_utc_lines_and_stops_on_sigterm(imds, tmp_path):
    imds.docs = reads = CountedReads()
    env = {"PATH": "/usr/bin:/bin", spot.IMDS_ENV: imds.url}
    proc = subprocess.Popen([sys.executable, str(AGENTS / "spot.py"), "--poll-s", "0.2",
                             "--ray-temp-dir", str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    waiting = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "waiting for the GCS" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Its first "no GCS yet" line, then three more polls (IMDS read with the token each
        # time): the line must not be said again.
        assert waiting.wait(timeout=60), lines
        reads.wait_for(reads.reads + 6)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        reader.join(timeout=20)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert err == "", err
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z spot: ", ln) for ln in lines)
    # One line per decision: the waiting line is said once, not once per poll.
    assert [ln.split(" spot: ")[1] for ln in lines] == [
        f"watching {imds.url} every 0.2 s",
        "waiting for the GCS and this node's raylet to appear", "stopped"], lines
    assert imds.unauthorized == 0
