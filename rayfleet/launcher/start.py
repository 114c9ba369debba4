"""The node start commands (``head_start_ray_commands``, ``worker_start_ray_commands``): every
node's `ray start` with token auth and the run store in its environment, its ports pinned to
what infra's security group opens, Serve's ingress and the v1 autoscaler; then the head's
agents, or a worker's spot agent."""

from __future__ import annotations

import shlex
from typing import Any

from rayfleet import raystart, runstore
from rayfleet.facts import BOOTSTRAP_CONFIG, loopback_port, port
from rayfleet.launcher.agents import (AUTOSCALER_V1, STOP_AGENTS, head_agents, scorer_env,
                                      spot_agent)
from rayfleet.launcher.agents import WHY as AGENTS_WHY
from rayfleet.launcher.headha import (HA_HEAD_WHY, HA_WORKER_WHY, gcs_env,
                                      gcs_store_token_command, head_ray_start)
from rayfleet.launcher.options import RenderOptions
from rayfleet.launcher.remote import RAY_BIN, REMOTE_TOKEN_ENV, VENV
from rayfleet.launcher.serveingress import INGRESS_WHY, ingress_commands
from rayfleet.launcher.why import Why
from rayfleet.stack import StackOutputs

# PATH: a job's entrypoint (`python -m workloads...`) runs with the node's PATH, and
# `python` must be the node environment's, not the image's.
AUTH_ENV = (f"export PATH={VENV.replace('~', '$HOME', 1)}/bin:$PATH RAY_AUTH_MODE=token "
            f"RAY_AUTH_TOKEN_PATH={REMOTE_TOKEN_ENV}")

WHY = {
    "head": "Token auth on (rule 21); the node environment first on PATH, so a job's `python` "
            "is its python; the run store (RAYFLEET_STORAGE, where the log shipper writes), its "
            "prefix and the region in every node's environment, which jobs and Serve replicas "
            "inherit (a run's checkpoints and logs in one folder); the dashboard and Jobs API "
            "listen on loopback only and are reached by an SSM tunnel (rule 22); every port "
            "pinned to what the security group opens",
    "prometheus": "; and Prometheus on the head's loopback (`ray dashboard --port "
                  f"{loopback_port('prometheus')} --remote-port {loopback_port('prometheus')} "
                  "<this file>`), scraping Ray's metrics",
    "worker": "Same token, run store, pinned ports and Serve ingress on every worker",
}


def storage_env(o: StackOutputs) -> str:
    """`` NAME=value ...`` for the auth export of every node's `ray start`, which every process
    Ray starts there inherits (jobs, Serve replicas, Train workers): the run store's root,
    where the log shipper writes too (a run N keeps its checkpoints and logs under the same
    ``runs/N/``); the one prefix the node roles may touch; and the region, which spares boto3
    and pyarrow a cross-region redirect to the bucket."""
    env = {runstore.STORAGE_ENV: runstore.root(o.storage_uri),
           runstore.PREFIX_ENV: o.storage_uri, "AWS_DEFAULT_REGION": o.region}
    return "".join(f" {k}={shlex.quote(v)}" for k, v in env.items())


def ray_start(**kwargs) -> str:
    """A node's `ray start` (:func:`rayfleet.raystart.argv`) with every Ray port pinned to
    what infra's security group opens (rule 4). Joined unquoted: the node's shell expands
    ``~`` and ``$RAY_HEAD_IP``."""
    return " ".join(raystart.argv(RAY_BIN, **kwargs))


def head_start(o: StackOutputs, opts: RenderOptions) -> Why:
    """The head's start commands, and what its comment says of them."""
    prefix = (f"ulimit -n {raystart.NOFILE}; {AUTH_ENV}{storage_env(o)}"
              f"{ingress_commands(opts.ingress)}; "
              f"{scorer_env(o)}{gcs_env(o, head=True)} ")
    commands = [
        # headHa: the supervisor first, or it starts again the GCS that `ray stop` ends.
        f"{STOP_AGENTS}; {RAY_BIN} stop" if o.head_ha else f"{RAY_BIN} stop; {STOP_AGENTS}",
        *([gcs_store_token_command(o)] if o.head_ha else []),
        *head_ray_start(o, prefix, ray_start(head=True, autoscaling_config=BOOTSTRAP_CONFIG)),
        *head_agents(o, AUTH_ENV, opts.autostop_minutes),
        *opts.prometheus,
    ]
    autostop = ("" if opts.autostop_minutes is None else
                AGENTS_WHY["autostop"].format(minutes=opts.autostop_minutes))
    return Why(commands, HA_HEAD_WHY * bool(o.head_ha) + WHY["head"] + INGRESS_WHY[opts.ingress]
               + AGENTS_WHY["scorer"] + AGENTS_WHY["head"] + autostop
               + (WHY["prometheus"] if opts.prometheus else "") + ".")


def worker_start(o: StackOutputs, opts: RenderOptions) -> Why:
    """Every worker's start commands, and what their comment says of them."""
    return Why([
        f"{RAY_BIN} stop; {STOP_AGENTS}",
        f"ulimit -n {raystart.NOFILE}; {AUTH_ENV}{storage_env(o)}{ingress_commands(opts.ingress)}; "
        f"{AUTOSCALER_V1}{gcs_env(o, head=False)} "
        + ray_start(head=False, address=f"$RAY_HEAD_IP:{port('gcs')}"),
        spot_agent(AUTH_ENV),
    ], HA_WORKER_WHY * bool(o.head_ha) + WHY["worker"] + AGENTS_WHY["spot"])


def start(o: StackOutputs, opts: RenderOptions) -> dict[str, Any]:
    """The fragment: the head's and the workers' start commands."""
    return {"head_start_ray_commands": head_start(o, opts),
            "worker_start_ray_commands": worker_start(o, opts)}
