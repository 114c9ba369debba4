"""The spot agent (rayfleet/agents/spot.py) without a cluster: it stands alone, refuses bad
settings in one line, reads IMDSv2 with a session token, and stops cleanly on SIGTERM. Its
Ray side (drain, KV) is tests/faults/test_spot_notice.py's."""

from __future__ import annotations

import ast
import datetime
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.spot_notice import StandInEc2, StandInImds
from rayfleet.agents import spot

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "rayfleet" / "agents"
NODE_ENV = {"ray", "torch", "boto3", "botocore"}  # what a node has besides the stdlib


@pytest.mark.parametrize("agent", sorted(AGENTS.glob("*.py")), ids=lambda p: p.name)
def test_agents_import_only_the_stdlib_and_the_node_environment(agent):
    """And an agent shipped beside it: as ``rayfleet.agents.X`` in the kit, as ``X`` on a node,
    where render puts X in the same folder (the scorer's folder for fallover)."""
    from rayfleet.launcher.agents import AGENT_NAMES, SCORER_ALSO

    tops = set()
    for node in ast.walk(ast.parse(agent.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{agent.name}: relative import (a node has no package)"
            if node.module.startswith("rayfleet"):
                assert node.module == "rayfleet.agents" or node.module.startswith(
                    "rayfleet.agents."), (agent.name, node.module)
                continue
            tops.add(node.module.split(".")[0])
    beside = set(SCORER_ALSO if agent.stem == "fallover" else AGENT_NAMES) - {agent.stem}
    assert tops - set(sys.stdlib_module_names) - NODE_ENV - beside == set(), tops


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
    (["--block-margin-s", "1800"], {},
     "--block-margin-s must be 0 or more and under 1800 s (the block's last 30 minutes are "
     "EC2's), got 1800"),
    (["--block-reread-s", "0"], {}, "--block-reread-s must be > 0 seconds, got 0"),
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


class _Ec2:
    """describe_capacity_reservations of one reservation, its end settable."""

    def __init__(self, end: datetime.datetime, kind: str = "capacity-block"):
        self.end, self.kind, self.calls = end, kind, 0

    def __call__(self, region):
        assert region == "us-east-1"
        return self

    def describe_capacity_reservations(self, CapacityReservationIds):
        self.calls += 1
        return {"CapacityReservations": [{"CapacityReservationId": CapacityReservationIds[0],
                                          "ReservationType": self.kind,
                                          "EndDate": self.end}]}


def _block(tmp_path, imds, ec2, *args):
    (tmp_path / "block").write_text("cr-0b10c0000000000e1\n")
    imds.docs[spot.REGION_PATH] = "us-east-1"
    a = spot.parse_args(["--block-file", str(tmp_path / "block"), *args])
    return spot.Block(a, spot.Imds(imds.url), ec2)


def test_a_blocks_end_is_due_its_margin_before_ec2_starts_terminating(tmp_path, imds):
    utc = datetime.timezone.utc
    end = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=utc)
    ec2 = _Ec2(end)
    block = _block(tmp_path, imds, ec2, "--block-margin-s", "300")
    stop = end.timestamp() - 1800                       # EC2 terminates from 11:30
    assert block.notice(stop - 301) is None and block.drain_at() == "2026-12-01T11:25:00Z"
    due = block.notice(stop - 299)
    assert due == {"kind": "capacity-block-end", "action": "terminate",
                   "time": "2026-12-01T11:30:00Z", "deadline_ms": int(stop * 1000),
                   "reservation": "cr-0b10c0000000000e1", "ends": "2026-12-01T12:00:00Z",
                   "key": f"block/cr-0b10c0000000000e1/{int(end.timestamp() * 1000)}"}
    assert ec2.calls == 1                               # read again only after --block-reread-s
    # Extended by an hour: read again, no longer due; a new end is a new notice.
    ec2.end = end + datetime.timedelta(hours=1)
    assert block.notice(stop - 299 + spot.BLOCK_REREAD_S) is None and ec2.calls == 2
    assert block.notice(stop + 3600 - 10)["key"] != due["key"]


def test_no_block_file_no_ec2_call_and_a_reservation_not_a_block_is_refused(tmp_path, imds):
    ec2 = _Ec2(datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc), kind="default")
    none = spot.Block(spot.parse_args(["--block-file", str(tmp_path / "absent")]),
                      spot.Imds(imds.url), ec2)
    assert none.notice(time.time()) is None and ec2.calls == 0
    with pytest.raises(ValueError, match="is not a Capacity Block with an end date"):
        _block(tmp_path, imds, ec2).notice(time.time())


def test_the_agent_reads_the_blocks_end_from_ec2s_own_answer(tmp_path, imds):
    """The agent as a node runs it: its block file, IMDS's region, boto3 against a stand-in
    answering EC2's XML: one line with the block's end and when this node drains (the GCS it
    waits for is tests/faults/test_spot_notice.py's)."""
    ec2 = StandInEc2()
    try:
        (tmp_path / "block").write_text(ec2.BLOCK + "\n")
        imds.docs[spot.REGION_PATH] = "us-east-1"
        env = {"PATH": "/usr/bin:/bin", spot.IMDS_ENV: imds.url, "AWS_ENDPOINT_URL_EC2": ec2.url,
               "AWS_ACCESS_KEY_ID": "stand-in", "AWS_SECRET_ACCESS_KEY": "stand-in"}
        proc = subprocess.Popen([sys.executable, str(AGENTS / "spot.py"), "--poll-s", "0.2",
                                 "--ray-temp-dir", str(tmp_path), "--block-file",
                                 str(tmp_path / "block")], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            lines = [proc.stdout.readline() for _ in range(2)]
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ec2.end))
        drains = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ec2.end - 1800 - 300))
        assert lines[0].endswith(f"spot: watching {imds.url} every 0.2 s, and Capacity Block "
                                 f"{ec2.BLOCK}\n"), lines
        assert lines[1].endswith(f"spot: Capacity Block {ec2.BLOCK} ends at {end}; this node "
                                 f"drains at {drains}\n"), lines
        assert ec2.calls == 1 and imds.unauthorized == 0
    finally:
        ec2.close()


# -- the passive GPU watch ----------------------------------------------------------------

SAMPLES = Path(__file__).parent / "gpu_samples"

# Stand-ins for the node's tools, reading the samples the test points them at: nvidia-smi
# prints $ECC_CSV; journalctl prints $KERNEL_LOG's lines after the cursor (a line count), or
# the last one (-n 1), as `journalctl -k -o cat --show-cursor` does: the cursor last, and only
# after a line it shows.
STAND_INS = {
    "nvidia-smi": '#!/bin/sh\ncat "$ECC_CSV"\n',
    "journalctl": """#!/usr/bin/env python3
import os, sys
lines = open(os.environ["KERNEL_LOG"]).read().splitlines()
after = int(sys.argv[sys.argv.index("--after-cursor") + 1]) if "--after-cursor" in sys.argv \\
    else len(lines) - 1
if lines[after:]:
    print("\\n".join(lines[after:] + [f"-- cursor: {len(lines)}"]))
""",
}


def test_xids_and_ecc_counts_are_read_from_the_tools_output():
    xids = spot.parse_xids((SAMPLES / "xid-kernel.log").read_text())
    assert xids == [("PCI:0000:10:1c", 13), ("PCI:0000:b9:00", 74), ("PCI:0000:a0:1d", 79)]
    assert [x for _, x in xids if x in spot.FATAL_XIDS] == [74, 79]   # 13: the application's
    ecc = spot.parse_ecc((SAMPLES / "ecc-healthy.csv").read_text())
    assert ecc == {str(i): 0 for i in range(8)}
    assert spot.parse_ecc((SAMPLES / "ecc-uncorrected.csv").read_text())["3"] == 2


@pytest.mark.parametrize("fault,says", [
    ("xid", "GPU fault: Xid 74 on PCI:0000:b9:00 (NVLink error); Xid 79 on PCI:0000:a0:1d "
            "(GPU has fallen off the bus)"),
    ("ecc", "GPU fault: GPU 3: 2 new uncorrectable ECC error(s)"),
])
def test_the_agent_finds_a_fatal_xid_or_a_new_ecc_error_as_the_node_logs_it(
        tmp_path, imds, fault, says):
    """The agent as a node with GPUs runs it, nvidia-smi and journalctl its stand-ins over the
    samples: one line with what it watches, then, once the kernel logs the samples' XIDs (or
    GPU 3 counts 2 uncorrectable errors), one line naming the fault (its notice's Ray side is
    the spot notice's: tests/faults/test_spot_notice.py)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ecc, log = tmp_path / "ecc.csv", tmp_path / "kern.log"
    ecc.write_text((SAMPLES / "ecc-healthy.csv").read_text())
    log.write_text("nvidia 0000:10:1c.0: enabling device (0000 -> 0002)\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", spot.IMDS_ENV: imds.url, "ECC_CSV": str(ecc),
           "KERNEL_LOG": str(log)}
    proc = subprocess.Popen([sys.executable, str(AGENTS / "spot.py"), "--poll-s", "0.1",
                             "--gpu-poll-s", "0.2", "--ray-temp-dir", str(tmp_path)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]   # watching, waiting, GPU watch
        if fault == "xid":
            with log.open("a") as f:
                f.write((SAMPLES / "xid-kernel.log").read_text())
        else:
            ecc.write_text((SAMPLES / "ecc-uncorrected.csv").read_text())
        lines.append(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    said = [ln.split(" spot: ", 1)[1].rstrip("\n") for ln in lines]
    assert ("GPU watch: 8 GPU(s), uncorrectable ECC errors [0, 0, 0, 0, 0, 0, 0, 0]; "
            "watching the kernel log for XIDs [48, 64, 74, 79, 94, 95, 119, 120]") in said, said
    assert said[-1] == says, said


def test_a_gpu_fault_is_published_then_drains_the_node_with_its_deadline():
    class Ray:
        node_id, calls = "ab" * 28, []

        def publish(self, notice):
            self.calls.append(("publish", notice["kind"]))

        def drain(self, notice):
            self.calls.append(("drain", notice["deadline_ms"]))
            return True, ""

    ray, done, said = Ray(), set(), []
    notice = spot.gpu_notice(["Xid 79 on PCI:0000:a0:1d (GPU has fallen off the bus)"], 1000.0)
    assert notice["deadline_ms"] == (1000 + spot.GPU_DRAIN_S) * 1000
    spot.handle(ray, notice, done, said.append)
    assert ray.calls == [("publish", "gpu-fault"), ("drain", notice["deadline_ms"])]
    assert done == {"published", "drained"} and said == []
