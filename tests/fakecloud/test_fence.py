"""The fake cloud's fences and teardown, on the real harness (tests/fakecloud/cloud.py) without
Ray: a node cannot send outside 198.18.0.0/15, IPv4 or IPv6 (tried from inside one, the route
there present, so it is the firewall that stops it), nor reach a service of this machine on the
gateway that the fake cloud did not start (moto's port answers), nor this machine's sockets in
/run; the stand-in `aws` reaches only what the bridge routes,
nothing the fake cloud starts follows a proxy variable; teardown outlives a hung `ray down` and
a second SIGTERM; what a SIGKILLed run left is removed at the next start.

The only addresses these tests send to: loopback, the fake range, and, from inside a fenced
node (where the firewall drops it before it is routed), 192.0.2.1 (TEST-NET-1), 2001:db8::1
(IPv6's documentation prefix) and this machine's own address."""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, wait_until
from tests.tiers import unavailable

from .cloud import (BRIDGE_ENV, FAKE_RANGE, PROXY_VARS, REGION, STATE, FakeCloud, Unavailable,
                    require_tools, sh)

pytestmark = [pytest.mark.moto, pytest.mark.fakecloud]
HERE = Path(__file__).resolve().parent
VPC = "198.18.0.0/16"
TEST_NET = "192.0.2.1"   # RFC 5737: documentation only, never routed anywhere
TEST_NET6 = "2001:db8::1"   # RFC 3849: the same, for IPv6


@pytest.fixture
def tools():
    try:
        require_tools()
    except Unavailable as e:
        unavailable("fakecloud", str(e))


@pytest.fixture
def tmp_path(tools):
    """A folder outside /tmp (a node mounts its own /tmp over it: its files must not be
    there), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="rayfleet-fence-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Trap:
    """A loopback listener standing in for a proxy host: it counts whoever connects."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.hits = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()


def _keypair(tmp_path: Path) -> str:
    key = tmp_path / "key"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    return (tmp_path / "key.pub").read_text().strip()


def _in_node(netns: str, code: str, timeout: float = 30) -> dict:
    """Python ``code`` run inside the node's network namespace; it prints one JSON line."""
    proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _in_node_mounts(node, command: str) -> str:
    """``command``'s output, run as the node's own processes see the machine: in its network,
    mount, UTS and PID namespaces (those of its sshd)."""
    (sshd,) = [p for p in sh("ip", "netns", "pids", node.netns).stdout.split()
               if Path(f"/proc/{p}/comm").read_text().strip() == "sshd"]
    return sh("nsenter", "-t", sshd, "-n", "-m", "-u", "-p", "sh", "-c", command).stdout


def _host_address() -> str | None:
    """This machine's own non-loopback IPv4 address (outside the fake range), if it has one."""
    for link in json.loads(sh("ip", "-j", "-4", "addr").stdout):
        for a in link.get("addr_info", []):
            ip = ipaddress.ip_address(a["local"])
            if not ip.is_loopback and ip not in FAKE_RANGE:
                return str(ip)
    return None


TRY_TO_LEAVE = """
import errno, json, socket
out = {}
for key, family, addr in (("udp", socket.AF_INET, %(test_net)r),
                          ("udp6", socket.AF_INET6, %(test_net6)r)):
    try:
        socket.socket(family, socket.SOCK_DGRAM).sendto(b"x", (addr, 9))
        out[key] = "sent"
    except OSError as e:
        out[key] = e.errno
def tcp(addr, port, read=False):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((addr, port))
        return s.recv(64).decode(errors="replace") if read else "connected"
    except OSError as e:
        return e.errno if e.errno is not None else "timeout"
out["host"] = tcp(%(host)r, %(host_port)d) if %(host)r else None
out["peer"] = tcp(%(peer)r, 22, read=True)
out["gateway"] = tcp(%(gateway)r, %(gw_port)d)
out["moto"] = tcp(%(gateway)r, %(moto_port)d)
print(json.dumps(out))
"""


def test_a_node_cannot_leave_the_range_nor_the_stand_in_the_bridge(tools, tmp_path,
                                                                     monkeypatch):
    import boto3
    from botocore.config import Config

    trap = Trap()
    # Every proxy variable set, pointing at the trap: the fake cloud (moto, its readiness
    # probe, the nodes) and the stand-in `aws` must go direct all the same.
    for var in PROXY_VARS:
        monkeypatch.setenv(var, trap.url)
    cloud = FakeCloud(root=tmp_path / "cloud", vpc_cidr=VPC, wheelhouse=tmp_path)
    listeners: list[socket.socket] = []
    try:
        cloud.start(str(BIN / "moto_server"))
        # This test's own client goes direct by asking for no proxies (botocore reads the
        # environment only when given none): a connection to the trap fails the test.
        ec2 = boto3.client("ec2", endpoint_url=cloud.endpoint, region_name=REGION,
                           aws_access_key_id="testing", aws_secret_access_key="testing",
                           config=Config(proxies={}))
        cloud.keys["fence"] = _keypair(tmp_path)
        ec2.import_key_pair(KeyName="fence", PublicKeyMaterial=cloud.keys["fence"].encode())
        ami = ec2.describe_images()["Images"][0]["ImageId"]

        def launch(cidr: str, count: int) -> list[dict]:
            vpc = ec2.create_vpc(CidrBlock=cidr)["Vpc"]["VpcId"]
            subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr.replace("/16", "/24")
                                       )["Subnet"]["SubnetId"]
            return ec2.run_instances(ImageId=ami, MinCount=count, MaxCount=count,
                                     SubnetId=subnet, KeyName="fence")["Instances"]

        a_inst, b_inst = launch(VPC, 2)
        (elsewhere,) = launch("198.19.0.0/16", 1)   # in the range, not on the bridge
        a = cloud.start_node(a_inst["InstanceId"], a_inst["PrivateIpAddress"], "fence")
        b = cloud.start_node(b_inst["InstanceId"], b_inst["PrivateIpAddress"], "fence")

        # Nothing the fake cloud started holds a proxy variable: moto, and every process in
        # each node (its init, sshd).
        for node in (a, b):
            assert node.proc.poll() is None, node.log.read_text()
        lasting = {cloud.moto_proc.pid, a.proc.pid, b.proc.pid}
        read = set()
        for pid in lasting | {int(pid) for n in (a, b) for pid in sh(
                "ip", "netns", "pids", n.netns).stdout.split()}:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):
                continue   # a node's init step that has ended (mount, hostname)
            held = [v.decode() for v in environ if v.split(b"=")[0].decode() in PROXY_VARS]
            assert held == [], (pid, held)
            read.add(pid)
        assert lasting <= read, (lasting, read)

        # Forwarding is off in the node; the host's is reported (the fence does not need it).
        fwd = sh("ip", "netns", "exec", a.netns, "cat", "/proc/sys/net/ipv4/ip_forward").stdout
        assert fwd.strip() == "0"
        print(f"host net.ipv4.ip_forward={Path('/proc/sys/net/ipv4/ip_forward').read_text()}")

        # Routes out of the range, as a node with a default route would have: the packets
        # would go to the gateway (this machine), so only the firewall can stop them.
        host = _host_address()
        gw_listener = socket.create_server((cloud.gateway, 0))
        listeners.append(gw_listener)
        gw_port = gw_listener.getsockname()[1]
        host_port = 0
        if host:   # a port bound but not listening: a SYN that got there would be refused
            closed = socket.socket()
            closed.bind((host, 0))
            listeners.append(closed)
            host_port = closed.getsockname()[1]
        for dst in (TEST_NET, host):
            if dst:
                sh("ip", "-n", a.netns, "route", "add", f"{dst}/32", "via", cloud.gateway)
                (route,) = json.loads(sh("ip", "-n", a.netns, "-j", "route", "get", dst).stdout)
                assert route.get("dev") == "eth0" and route.get("gateway") == cloud.gateway
        # And an IPv6 route off the node, to an address of its own (no duplicate detection:
        # usable at once).
        sh("ip", "-n", a.netns, "-6", "addr", "add", "2001:db8:1::2/64", "dev", "eth0", "nodad")
        sh("ip", "-n", a.netns, "-6", "route", "add", "2001:db8::/32", "dev", "eth0")
        moto_port = int(cloud.endpoint.rsplit(":", 1)[1])
        probe = dict(test_net6="::1", host="", host_port=0, peer=b.ip, gateway=cloud.gateway,
                     gw_port=gw_port, moto_port=moto_port)
        wait_until("node b's sshd", lambda: _in_node(a.netns, TRY_TO_LEAVE % dict(
            probe, test_net="127.0.0.1"))["peer"].__str__().startswith("SSH-2.0-"), 30, 0.5)

        before, host_before = cloud.fence_drops(a.netns), cloud.gateway_drops()
        out = _in_node(a.netns, TRY_TO_LEAVE % dict(probe, test_net=TEST_NET,
                                                    test_net6=TEST_NET6, host=host or "",
                                                    host_port=host_port))
        dropped = cloud.fence_drops(a.netns) - before
        # The UDP datagrams to TEST-NET, IPv4 and IPv6, were refused by the firewall (EPERM:
        # netfilter dropped them on the way out), and their drops were counted; a SYN to this
        # machine's own address never got there (not even refused).
        assert out["udp"] == errno.EPERM, out
        assert out["udp6"] == errno.EPERM, out
        if host:
            assert out["host"] in (errno.EPERM, errno.ETIMEDOUT, "timeout"), out
        assert out["peer"].startswith("SSH-2.0-"), out     # an in-range peer answers
        assert dropped >= (3 if host else 2), (dropped, out)
        # The gateway is this machine: moto, the fake cloud's own service there, answers; a
        # listener of this machine's on the gateway address (as a service on 0.0.0.0 would be)
        # gets nothing, the SYNs dropped by this machine's side of the bridge and counted.
        assert out["moto"] == "connected", out
        assert out["gateway"] in (errno.ETIMEDOUT, "timeout"), out
        assert cloud.gateway_drops() > host_before, out

        # A node's /run is its own: this machine's sockets there (nscd's, D-Bus's, Docker's)
        # are not in it. A listening socket here, and a node's sshd's view of /run.
        host_sock = socket.socket(socket.AF_UNIX)
        host_sock.bind(f"/run/rayfleet-fence-{cloud.suffix}.sock")
        host_sock.listen()
        listeners.append(host_sock)
        try:
            seen = _in_node_mounts(a, "ls -a /run")
        finally:
            os.unlink(f"/run/rayfleet-fence-{cloud.suffix}.sock")
        # Only what the node made itself: sshd's folder, /run/lock, mount's utab.
        assert set(seen.split()) <= {".", "..", "lock", "sshd", "mount"}, seen
        assert f"rayfleet-fence-{cloud.suffix}.sock" not in seen and "sshd" in seen.split()

        # The stand-in `aws`: into a node through the bridge, with every proxy variable set.
        def aws(target: str, **extra) -> subprocess.CompletedProcess:
            env = {"PATH": os.environ["PATH"], "AWS_ENDPOINT_URL": cloud.endpoint,
                   "AWS_DEFAULT_REGION": REGION, BRIDGE_ENV: cloud.bridge,
                   **{v: trap.url for v in PROXY_VARS}, **extra}
            return subprocess.run([sys.executable, str(HERE / "aws"), "ssm", "start-session",
                                   "--region", REGION, "--target", target, "--document-name",
                                   "AWS-StartSSHSession", "--parameters", "portNumber=22"],
                                  input=b"", capture_output=True, env=env, timeout=30)

        ok = aws(a.instance_id)
        assert ok.returncode == 0 and ok.stdout.startswith(b"SSH-2.0-"), ok
        # An instance in the range whose address the bridge does not route (the host sends
        # the rest of the range to a blackhole): refused before anything is sent.
        refused = aws(elsewhere["InstanceId"])
        assert refused.returncode == 255, refused
        assert (f"{elsewhere['PrivateIpAddress']} is not routed via the fake cloud's bridge "
                f"{cloud.bridge}").encode() in refused.stderr, refused.stderr
        unknown = aws(a.instance_id, **{BRIDGE_ENV: ""})
        assert unknown.returncode == 255 and b"no RAYFLEET_FAKECLOUD_BRIDGE" in unknown.stderr
        assert trap.hits == 0   # nothing went through a proxy
    finally:
        for s in listeners:
            s.close()
        trap.sock.close()
        problems = cloud.close()
    assert problems == []


CHILD = """
import json, sys, time
from pathlib import Path
from tests.fakecloud.cloud import FakeCloud, stop_on_first_sigterm, teardown

root, moto, pub, down_timeout = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
cloud = FakeCloud(root=root, vpc_cidr="198.18.0.0/16", wheelhouse=root)
stop_on_first_sigterm()
try:
    cloud.start(moto)
    cloud.keys["k"] = pub
    node = cloud.start_node("i-0fe0ce00000000001", "198.18.0.20", "k")
    print("READY", json.dumps({"suffix": cloud.suffix, "netns": node.netns,
                               "moto": cloud.moto_proc.pid, "node": node.proc.pid}), flush=True)
    time.sleep(600)
finally:
    # As the rehearsal's `finally`: `ray down` (here one that hangs), then the fake cloud.
    problems = teardown(cloud, ["sleep", "600"], down_timeout=down_timeout)
    print("PROBLEMS", json.dumps(problems), flush=True)
"""


class Child:
    """A process holding a fake cloud with one node, as a rehearsal would."""

    def __init__(self, tmp_path: Path, down_timeout: float = 5):
        self.root = tmp_path / "cloud"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(self.root), str(BIN / "moto_server"),
             _keypair(tmp_path), str(down_timeout)], cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.info = json.loads(self.wait_for("READY ").split(" ", 1)[1])

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no {prefix!r} line from the child:\n"
                                     f"{''.join(self.output)[-3000:]}")
            self.output.append(line)
            if line.startswith(prefix):
                return line.strip()


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def _gone(info: dict) -> list[str]:
    """What of the child's fake cloud is still here (empty when it is all gone)."""
    left = [ns for ns in sh("ip", "netns", "list").stdout.split() if ns == info["netns"]]
    if sh("ip", "link", "show", f"rfc{info['suffix']}", check=False).returncode == 0:
        left.append(f"bridge rfc{info['suffix']}")
    if "blackhole" in sh("ip", "route", "show", str(FAKE_RANGE), "type", "blackhole").stdout:
        left.append("blackhole route")
    if sh("nft", "list", "table", "inet", f"rfg{info['suffix']}", check=False).returncode == 0:
        left.append(f"nft table rfg{info['suffix']}")
    left += [f"pid {info[k]} ({k})" for k in ("moto", "node") if _alive(info[k])]
    if (STATE / info["suffix"]).exists():
        left.append("state file")
    return left


def test_teardown_outlives_a_hung_ray_down_and_a_second_sigterm(tools, tmp_path):
    child = Child(tmp_path, down_timeout=5)
    child.proc.send_signal(signal.SIGTERM)
    child.wait_for("fake cloud: tearing down")
    child.proc.send_signal(signal.SIGTERM)   # while its `ray down` hangs
    problems = json.loads(child.wait_for("PROBLEMS ").split(" ", 1)[1])
    child.proc.wait(timeout=30)
    out = "".join(child.output)
    assert "fake cloud: SIGTERM during teardown: ignored until the fake cloud is removed" in out
    assert problems == ["sleep 600 still running after 5 s: killed it; removing the nodes "
                        "anyway"], out
    assert _gone(child.info) == [], out


def test_what_a_killed_run_left_is_removed_at_the_next_start(tools, tmp_path, capsys):
    child = Child(tmp_path)
    node_dir = child.root / "nodes" / "i-0fe0ce00000000001"
    venv = node_dir / "home" / "rayfleet-venv" / "lib"
    venv.mkdir(parents=True)
    (venv / "torch.so").write_bytes(b"\0" * 4096)   # what makes a node folder gigabytes
    child.proc.kill()
    child.proc.wait(timeout=30)
    assert _gone(child.info) != []   # SIGKILL: nothing was removed

    later = FakeCloud(root=tmp_path / "later", vpc_cidr=VPC, wheelhouse=tmp_path)
    try:
        later.start(str(BIN / "moto_server"))
    finally:
        assert later.close() == []
    said = [ln for ln in capsys.readouterr().out.splitlines() if "killed run" in ln]
    assert said == [f"fake cloud: removed what a killed run (pid {child.proc.pid}) left: "
                    f"{child.info['netns']}, bridge rfc{child.info['suffix']}, nft table "
                    f"rfg{child.info['suffix']}, blackhole "
                    f"{FAKE_RANGE}, moto pid {child.info['moto']}, node folder {node_dir}"]
    assert _gone(child.info) == []
    assert [p.name for p in node_dir.iterdir()] == ["node.log"]   # the log stays
