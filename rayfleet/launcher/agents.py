"""The node agents (rayfleet/agents/): which ones ship, where the YAML mounts them, how a node
starts one, the head's (log shipping, auto-stop), and the autoscaler's scorer on the head."""

from __future__ import annotations

import shlex
from pathlib import Path

from rayfleet import gcsft
from rayfleet.agents import fallover, gpugate
from rayfleet.facts import port
from rayfleet.ingress import GUARD_NAME, WATCH_NAME
from rayfleet.launcher.remote import REMOTE_AGENTS, VENV
from rayfleet.stack import StackOutputs

AGENTS = Path(__file__).resolve().parent.parent / "agents"
AGENT_NAMES = ("autostop", "logship", "spot", GUARD_NAME, WATCH_NAME, gcsft.SUPERVISOR_NAME,
               "envcheck", "gpugate")

# Re-running `ray up` restarts Ray on a node: its agents are restarted with it. The bracket
# keeps pkill from matching the shell that runs it (its own command line holds the pattern).
STOP_AGENTS = "pkill -f '[r]ayfleet-agents/' || true"

# The head's scorer lives in this folder, which only the head's `ray start` line puts on
# PYTHONPATH (the autoscaler imports it by name; the other agents stay off the path), with the
# GPU health gate's records it reads (SCORER_ALSO).
REMOTE_SCORER = f"{REMOTE_AGENTS}/autoscaler"
SCORER_ALSO = ("gpugate",)

# Python's bytecode cache of the head's processes, kept out of the agents folder: the head's
# autoscaler hashes that folder (a file mount) into each node's runtime config, and a worker whose
# hash differs is set up again and its Ray restarted (`ray stop`, a new node id). The scorer's
# __pycache__, written there when the autoscaler first imported it, made a second start of the
# head (a replacement head, or its `ray start` run again) restart every worker.
PYCACHE_PREFIX = "$HOME/.cache/rayfleet-pycache"

# Ray's v1 autoscaler, the one that loads the scorer: `ray up` exports v2's switch on before the
# head's start commands, and v2 keeps asking for a type EC2 just refused (fallover.py says how
# that was measured). Every node's `ray start` gets the same switch, as `RAY_UP_enable_autoscaler_
# v2=0 ray up` would set it.
AUTOSCALER_V1 = f"{fallover.AUTOSCALER_V2_ENV}=0"


def agents_folder(token_file: str) -> str:
    """Where render puts the node agents for the YAML's file_mounts: beside the token."""
    return str(Path(token_file).parent / "agents")


def agent_command(name: str, args: str, env: str) -> str:
    """Start one node agent in the background, detached from Ray's SSH session (setsid,
    nohup, every descriptor redirected: `ray up` waits for none of them)."""
    argv = " ".join(filter(None, (f"{VENV}/bin/python", f"{REMOTE_AGENTS}/{name}.py", args)))
    return f"{env}; setsid nohup {argv} > ~/rayfleet-{name}.log 2>&1 < /dev/null &"


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


def spot_agent(env: str) -> str:
    """A worker's spot agent: it watches for an interruption notice and drains the node."""
    return agent_command("spot", f"--address=$RAY_HEAD_IP:{port('gcs')}", env)


def scorer_env(o: StackOutputs) -> str:
    """The environment of the head's `ray start`: Ray's autoscaler loads the kit's scorer, which
    ranks the worker node types in the stack's order (rayfleet/agents/fallover.py)."""
    order = ",".join(t.ray_name for t in o.node_types.workers)
    return (f"{AUTOSCALER_V1} PYTHONPATH={REMOTE_SCORER.replace('~', '$HOME', 1)} "
            f"PYTHONPYCACHEPREFIX={PYCACHE_PREFIX} "
            f"{fallover.SCORER_ENV}={fallover.SCORER} {fallover.ORDER_ENV}={order} "
            f"{fallover.HEALTH_ENV}={shlex.quote(o.storage_uri)}")


# What the start commands' comments say of the agents.
WHY = {
    "scorer": "; the autoscaler scores worker types with the kit's scorer "
              "(rayfleet/agents/fallover.py): the stack's order, and past a type EC2 just "
              "refused (no capacity) to the next, and past a GPU type whose nodes the GPU "
              f"health gate refused {gpugate.CAP} times within {gpugate.CAP_WINDOW_S // 60} "
              "minutes; the scorer is a hook of Ray's v1 autoscaler, which every node's "
              "start selects (Ray 2.60's v2 keeps retrying a type EC2 "
              "refuses).",
    "head": " Then the head's agents: each job's logs copied to the bucket as it runs and when "
            "it ends (`rayfleet logs`)",
    "autostop": ", and the cluster torn down, head included, after {minutes} idle minutes "
                "(`rayfleet render --autostop-minutes`)",
    "spot": "; the spot agent watches the instance metadata for an interruption notice, drains "
            "the node and has training checkpoint at its next step.",
}
