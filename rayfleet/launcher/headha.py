"""rayfleet:headHa in the cluster YAML: the head at its fixed address, the GCS store's token
read at boot, the head's Ray under the kit's supervisor with its tables in the stack's Redis,
and every node's raylet waiting for a replaced head (rule 33)."""

from __future__ import annotations

import shlex

from rayfleet import gcsft, raystart
from rayfleet.facts import GCS_STORE_CA_BUNDLE
from rayfleet.launcher.remote import REMOTE_AGENTS, VENV
from rayfleet.launcher.why import Why
from rayfleet.stack import StackOutputs

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
PLACEMENT_WHY = {
    "SubnetIds": "Private subnets of every AZ: on a capacity error Ray moves on to the next "
                 "subnet.",
    "SubnetIds HA": "rayfleet:headHa: one subnet, the workers', as the head's address is fixed "
                    "in it.",
    "PrivateIpAddress": "Every head launches here (a CIDR reservation of the stack keeps EC2 "
                        "from handing it to anything else), so a replaced head comes back "
                        "where the workers' raylets dial their GCS. Ray's NetworkInterfaces "
                        "cannot carry an existing interface (its bootstrap needs each entry's "
                        "subnet, which EC2 refuses beside an interface id).",
}


def head_placement(o: StackOutputs) -> dict[str, Why]:
    """The head's subnets: every private subnet, or with rayfleet:headHa the workers' one and
    the fixed address in it."""
    if o.head_ha is None:
        return {"SubnetIds": Why(list(o.private_subnet_ids), PLACEMENT_WHY["SubnetIds"])}
    at = o.head_ha.head_address
    return {"SubnetIds": Why([at.subnet_id], PLACEMENT_WHY["SubnetIds HA"]),
            "PrivateIpAddress": Why(at.private_ip, PLACEMENT_WHY["PrivateIpAddress"])}


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
