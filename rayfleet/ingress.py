"""Serve's ingress on every cluster the kit starts: HAProxy by default, Serve's Python proxy
as the opt-out.

Ray 2.60's HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY=1) puts HAProxy in front of every node and
lets each ingress replica answer HTTP itself (direct ingress), taking Serve's Python proxy out
of the request path (BENCHMARKS.md, section 5: Serve's own floor 9 ms -> under 1 ms). Ray's
defaults for it are not the kit's: stats and exporter pages on every interface, an admin
socket any local user may write, files under /tmp, direct-ingress ports from a 1000-port
range no firewall rule names. This module is the one home of the environment that changes
that, for `rayfleet local up`, the rendered cluster YAML and (through a test that keeps them
equal) the Ansible role:

- HAProxy runs through the node agent rayfleet/agents/haproxy_guard.py (stats and exporter on
  loopback, admin socket mode 600, anything unknown refused);
- its config, admin socket, server state and metrics socket live in ``folder``, a 0700 folder
  of the cluster's own, which the caller creates;
- the direct-ingress and fallback-proxy ports are rayfleet.facts.RAY_PORTS' (rule 30: opened
  only from the cluster's own security group).

Standard library only (a core module: local, render and the tests import it).
"""

from __future__ import annotations

from rayfleet.facts import INGRESS_PORTS, RAY_PORTS_BY_NAME, loopback_port

INGRESS_CHOICES = ("haproxy", "python")
DEFAULT_INGRESS = "haproxy"
GUARD_NAME = "haproxy_guard"
# The guard's watcher, which it starts from beside itself (haproxy_guard.WATCHER names it).
WATCH_NAME = "haproxy_watch"
# The variables that turn HAProxy on and point it at the guard: lint looks for them.
ENABLE = "RAY_SERVE_ENABLE_HA_PROXY"
BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
DRAIN_S = 5


def pinned_ports(overrides: dict[str, int] | None = None) -> dict[str, str]:
    """Ray's variables for the ingress ports of facts.RAY_PORTS (a range's flag names its low
    and high variable); ``overrides`` moves a single port (a local cluster beside another)."""
    env = {}
    for name in INGRESS_PORTS:
        p = RAY_PORTS_BY_NAME[name]
        if "/" in p.flag:
            lo, hi = p.flag.split("/")
            env[lo], env[hi] = str(p.from_port), str(p.to_port)
        else:
            env[p.flag] = str((overrides or {}).get(name, p.from_port))
    return env


def haproxy_env(folder: str, guard: str, stats_port: int | None = None,
                metrics_port: int | None = None,
                port_overrides: dict[str, int] | None = None) -> dict[str, str]:
    """The environment of `ray start` on a node whose Serve ingress is HAProxy."""
    return {
        ENABLE: "1",
        BINARY: guard,
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{folder}/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{folder}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{folder}/server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{folder}/metrics.sock",
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port or loopback_port("haproxy-stats")),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port or loopback_port("haproxy-metrics")),
        # A stopping ingress replica stays open this long so that load balancers in front of
        # it deregister it first. Ray's 30 s is for a cloud load balancer's health checks;
        # here the only one is HAProxy, which the controller reconfigures at once (and which
        # health-checks every 250 ms while a server changes state), so 30 s only made every
        # `serve shutdown`, scale-down and rollout wait. tests/faults/test_serve_faults.py
        # measures rollouts and a killed replica with this value: nothing lost.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAIN_S),
        **pinned_ports(port_overrides),
    }
