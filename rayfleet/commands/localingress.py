"""Serve's ingress on the local cluster: `ray start`'s environment for it (rayfleet.ingress has
the variables), HAProxy's files in a 0700 folder of this cluster's own and its ports."""

from __future__ import annotations

import shutil

from rayfleet.commands.host import free_ports
from rayfleet.commands.localstate import agent, haproxy_folder
from rayfleet.errors import ClusterError
from rayfleet.ingress import GUARD_NAME, haproxy_env


def ingress_env(ingress: str) -> tuple[dict[str, str], int | None]:
    """`ray start`'s environment for Serve's ingress, and HAProxy's exporter port.

    HAProxy's files go to a 0700 folder of this cluster's own; its stats page, exporter and
    Serve's fallback proxy get free ports of their own (two HAProxies never share a port: Ray
    starts them without SO_REUSEPORT)."""
    if ingress != "haproxy":
        return {}, None
    folder = haproxy_folder()
    shutil.rmtree(folder, ignore_errors=True)  # a previous run's sockets and state
    try:
        # In a shared /tmp: what this user cannot remove (another user's folder, a link
        # planted there) is refused, never used.
        folder.mkdir(mode=0o700)
    except OSError as e:
        raise ClusterError(f"cannot make HAProxy's folder {folder} ({e.strerror}): remove it, "
                           f"or use --ingress python") from None
    folder.chmod(0o700)
    # Free ports of their own, never the usual ones: HAProxy and the fallback proxy bind them
    # only when Serve starts, so two clusters that both found the usual port free at `up`
    # would collide at their first `serve deploy`.
    stats, exporter, http, grpc = free_ports(4)
    fallback = {"serve-fallback-proxy": http, "serve-fallback-proxy-grpc": grpc}
    guard = agent(GUARD_NAME)
    return haproxy_env(str(folder), str(guard), stats, exporter, fallback), exporter
