"""Serve's ingress on every node (``rayfleet render --ingress``): HAProxy through the kit's guard
(rayfleet.ingress), or Serve's own Python proxy; what the start commands add for it."""

from __future__ import annotations

from rayfleet.ingress import GUARD_NAME, haproxy_env
from rayfleet.launcher.remote import REMOTE_AGENTS

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


def ingress_commands(ingress: str) -> str:
    """What the start commands add, after the auth exports, for Serve's ingress."""
    if ingress == "python":
        return ""
    env = haproxy_env(REMOTE_HAPROXY, f"{REMOTE_AGENTS.replace('~', '$HOME', 1)}/"
                                      f"{GUARD_NAME}.py")
    return (f"; rm -rf {REMOTE_HAPROXY}; install -d -m 700 {REMOTE_HAPROXY}; export "
            + " ".join(f"{k}={v}" for k, v in env.items()))
