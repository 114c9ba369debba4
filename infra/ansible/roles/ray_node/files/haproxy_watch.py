#!/usr/bin/env python3
"""The HAProxy guard's watcher: looks at the HAProxy it was left for (pid and start time)
until that process exits, and stops it (SIGTERM), saying why in one line on stderr (Ray's
HAProxy log), once it holds a socket beyond what the guard allowed its config:

- a TCP listener on an address:port other than the binds the guard wrote (--allow);
- a UDP socket that takes datagrams from anywhere (bound off loopback, not connected, to a
  port outside the kernel's ephemeral range: HAProxy's log senders sit inside that range);
- a listening Unix socket other than the admin socket (--admin-socket);
- the admin socket open to anyone but its owner.

rayfleet/agents/haproxy_guard.py starts it, just before it becomes HAProxy (which is why a
guard without it beside it starts nothing). Standard library only: a node agent.

    haproxy_watch.py --pid PID --start TICKS --admin-socket PATH --allow HOST:PORT ...
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import socket
import stat
import sys
import time


def _ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _hex_address(text: str) -> tuple[ipaddress._BaseAddress, int]:
    """/proc/net/{tcp,udp}[6]'s ``HEXIP:HEXPORT`` (the IP in host byte order, 32-bit words)."""
    ip, port = text.split(":")
    raw = b"".join(bytes.fromhex(ip[i:i + 8])[::-1] for i in range(0, len(ip), 8))
    return ipaddress.ip_address(raw), int(port, 16)


def problems(pid: int, allowed: set[tuple[str, int]], admin_socket: str | None) -> list[str]:
    """What HAProxy ``pid`` holds beyond ``allowed``: a TCP listener on another address, a UDP
    socket that takes datagrams from anywhere, a listening Unix socket but its admin socket,
    or that socket open to anyone but its owner."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue   # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ok = {(ipaddress.ip_address(socket.gethostbyname(h) if h == "localhost" else h.strip("[]")),
           p) for h, p in allowed}
    # A UDP socket HAProxy sends logs from is bound by the kernel to an ephemeral port of this
    # range (and never read); one bound to a port outside it was asked for: a listener.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/{pid}/net/{proto}") as f:
                rows = [ln.split() for ln in list(f)[1:]]
        except FileNotFoundError:
            if not os.path.isdir(f"/proc/{pid}"):
                raise
            continue   # IPv6 off on this machine: no such sockets
        for row in rows:
            if row[9] not in inodes:
                continue
            (ip, port), (_, far) = _hex_address(row[1]), _hex_address(row[2])
            if proto.startswith("tcp") and row[3] == "0A" and (ip, port) not in ok:
                found.append(f"a TCP listener on {ip}:{port}")
            elif proto.startswith("udp") and far == 0 and not ip.is_loopback and not (
                    low <= port <= high):
                found.append(f"a UDP socket on {ip}:{port}")
    with open(f"/proc/{pid}/net/unix") as f:
        for row in (ln.split() for ln in list(f)[1:]):
            # HAProxy binds the admin socket as PATH.<pid>.tmp, then renames it into place.
            if row[6] in inodes and int(row[3], 16) & 0x10000 and (len(row) < 8 or not (
                    admin_socket and re.fullmatch(re.escape(admin_socket) + r"(\.\d+\.tmp)?",
                                                  row[7]))):
                found.append(f"a listening Unix socket {row[7] if len(row) > 7 else '(unnamed)'}")
    if admin_socket and os.path.exists(admin_socket):
        mode = stat.S_IMODE(os.stat(admin_socket).st_mode)
        if mode & 0o077:
            found.append(f"the admin socket {admin_socket} mode {oct(mode)}")
    return found


def watch(pid: int, start: str | None, allowed, admin_socket, out=sys.stderr,
          poll_s: float = 1.0) -> list[str]:
    """Look at HAProxy ``pid`` until it exits; on a problem, say it and SIGTERM it (only while
    it is still that process). Returns the problems found (none: it exited clean)."""
    while _ticks(pid) == start and start is not None:
        try:
            found = problems(pid, allowed, admin_socket)
        except OSError as e:   # fails closed: sockets it cannot read are not taken for safe
            found = [] if _ticks(pid) != start else [f"sockets it cannot read ({e})"]
        if found and _ticks(pid) == start:
            print(f"rayfleet haproxy guard: stopping HAProxy (pid {pid}): it holds "
                  f"{'; '.join(found)}, beyond what its config was allowed", file=out,
                  flush=True)
            os.kill(pid, signal.SIGTERM)
            return found
        time.sleep(poll_s)
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="haproxy_watch.py", description="Stop HAProxy PID once "
                                "it holds a socket beyond what its guarded config allows.")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--start", required=True, help="its start time (/proc/PID/stat field 22)")
    p.add_argument("--admin-socket", default=None)
    p.add_argument("--allow", action="append", default=[], metavar="HOST:PORT",
                   help="a TCP listener its config binds (repeated)")
    p.add_argument("--poll-s", type=float, default=1.0)
    args = p.parse_args(argv)
    allowed = set()
    for item in args.allow:
        host, _, port = item.rpartition(":")
        if not port.isdigit():
            print(f"haproxy_watch.py: error: --allow {item!r}: not HOST:PORT", file=sys.stderr)
            return 2
        allowed.add((host, int(port)))
    return 1 if watch(args.pid, args.start, allowed, args.admin_socket,
                      poll_s=args.poll_s) else 0


if __name__ == "__main__":
    sys.exit(main())
