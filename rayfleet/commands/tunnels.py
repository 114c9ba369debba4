"""The background tunnels `rayfleet env CLUSTER_YAML` keeps to a cluster's head: one
``ray dashboard --port LOCAL --remote-port REMOTE CLUSTER_YAML`` per port (Ray's own SSH port
forward, through the YAML's SSM proxy command), each in a process group of its own, its output
in a log of its own, recorded with its start ticks in the cluster's state folder (a 0600 file),
so that only a process this kit started is ever signalled (host.start_ticks)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from dataclasses import asdict, dataclass
from pathlib import Path

from rayfleet.commands.host import alive, start_ticks
# The kit's own probes of a port here and of a dashboard (its token sent straight, never
# through a proxy).
from rayfleet.commands.localhead import listening, status_of
from rayfleet.errors import ClusterError

STATE_FILE = "tunnels.json"
LOCK_FILE = "tunnels.lock"
# A tunnel's `ray dashboard` and its ssh end on SIGTERM at once; what is left after this is
# killed.
STOP_GRACE_S = 5.0
# The dashboard's endpoint a tunnel is proven with: it takes the token (Ray 2.60's dashboard
# leaves only health checks and static files open).
VERSION_PATH = "/api/version"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Tunnel:
    """One background `ray dashboard`: what it forwards and the process that does it."""

    role: str          # "dashboard", "serve", "metrics"
    pid: int           # its process group's leader (start_new_session)
    start_ticks: int | None
    local_port: int    # on 127.0.0.1 here
    remote_port: int   # on the head's loopback
    log: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def ours(self) -> bool:
        """Whether the process recorded is still running, and is the one recorded."""
        return (self.start_ticks is not None and alive(self.pid)
                and start_ticks(self.pid) == self.start_ticks)


def ray_binary() -> str:
    """The `ray` the user runs `ray up` with: the one on PATH, else the one beside this
    interpreter."""
    found = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    if not os.access(found, os.X_OK):
        raise ClusterError("no `ray` on PATH: the tunnels are Ray's own (`ray dashboard`); "
                           "install the kit (make setup) or put its .venv/bin on PATH")
    return found


def start(role: str, local: int, remote: int, cluster_yaml: Path,
          folder: Path) -> tuple[Tunnel, subprocess.Popen]:
    """`ray dashboard --port local --remote-port remote cluster_yaml` in the background, in a
    process group of its own, its output in ``folder``/tunnel-<role>.log (0600)."""
    log = folder / f"tunnel-{role}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        proc = subprocess.Popen([ray_binary(), "dashboard", "--port", str(local),
                                 "--remote-port", str(remote), str(cluster_yaml)],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Tunnel(role, proc.pid, start_ticks(proc.pid), local, remote, str(log)), proc


def _running(pgid: int) -> bool:
    """Whether the process group ``pgid`` has a member that is not a zombie (one of this
    process's own is reaped; another's waits for its parent, and is counted as gone)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0]:
            pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal(tunnel: Tunnel, sig: int) -> str | None:
    """``sig`` to the tunnel's process group; why not, in words, where it is not sent. A pid
    that now names another process (its start ticks differ) is forgotten, never signalled. A
    pid that names no process may still lead a group (its ssh left behind): the kernel gives
    no new process a pid that is still a group's id, so that group is the tunnel's, as
    `rayfleet local down` reasons too."""
    if alive(tunnel.pid) and start_ticks(tunnel.pid) != tunnel.start_ticks:
        return f"forgot (pid {tunnel.pid} is another process's now; not signalled)"
    try:
        os.killpg(tunnel.pid, sig)
    except ProcessLookupError:
        return "already gone"
    return None


# ssh(1)'s options that take an argument: in a tunnel's ssh command line, what comes before
# the destination.
_SSH_ARG_OPTIONS = set("BbcDEeFIiJLlmOopQRSWw")


def _ssh_argv(pgid: int) -> list[str] | None:
    """The command line of the ssh in the process group ``pgid`` (a tunnel's), if one runs."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            comm = text[text.index("(") + 1:text.rindex(")")]
            if comm == "ssh" and text.rsplit(")", 1)[1].split()[2] == str(pgid):
                return [a.decode() for a in
                        (stat.parent / "cmdline").read_bytes().split(b"\0") if a]
        except (OSError, ValueError, IndexError):
            continue
    return None


def cancel_command(argv: list[str]) -> list[str] | None:
    """`ssh -O cancel` of the local forwards in an ssh command line, through its control
    socket; None where it has no -L or no ControlPath. Ray's ssh shares one connection per
    cluster (ControlMaster=auto), so a tunnel's -L is held by that connection's master, which
    outlives the tunnel's own ssh (by ControlPersist, or while another command uses it): the
    forward itself is cancelled, and the master, which the tunnel may not have started, is left
    alone."""
    opts, i = [], 1
    while i < len(argv):
        arg = argv[i]
        if len(arg) == 2 and arg[0] == "-" and arg[1] in _SSH_ARG_OPTIONS and i + 1 < len(argv):
            opts += [arg, argv[i + 1]]
            i += 2
        elif arg.startswith("-"):
            i += 1   # a flag (-tt, -N): not -O's
        else:
            shared = any(o.startswith("ControlPath=") for o in opts[1::2])
            return [argv[0], "-O", "cancel", *opts, arg] if "-L" in opts and shared else None
    return None


def _cancel(commands: list[list[str]]) -> None:
    for cmd in commands:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=15)


def stop(*stopping: Tunnel, grace: float = STOP_GRACE_S) -> list[str]:
    """SIGTERM each tunnel's process group (tunnels' rules: _signal), SIGKILL what is left of
    them after ``grace``, then cancel their forwards where a shared ssh connection holds them
    (cancel_command); what was done to each, in words."""
    cancels = [c for t in stopping if t.ours() and (argv := _ssh_argv(t.pid))
               and (c := cancel_command(argv))]
    said = [_signal(t, signal.SIGTERM) for t in stopping]
    end = time.monotonic() + grace
    while time.monotonic() < end and any(_running(t.pid) for t, s in zip(stopping, said,
                                                                          strict=True)
                                         if s is None):
        time.sleep(0.05)
    for i, t in enumerate(stopping):
        if said[i] is None:
            said[i] = f"stopped (pid {t.pid})"
            if _running(t.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(t.pid, signal.SIGKILL)
                said[i] = f"killed after {grace:g} s (pid {t.pid})"
    _cancel(cancels)
    return said


# What `answers` says of a tunnel.
OK, NOT_YET, REFUSED = "ok", "not yet", "refused"


def answers(tunnel: Tunnel, token: str) -> tuple[str, int | None]:
    """(OK, NOT_YET or REFUSED, the HTTP status): its local port takes a TCP connection and,
    for the dashboard's, GET /api/version with the token answers 200 (401/403: REFUSED)."""
    if not listening(tunnel.local_port):
        return NOT_YET, None
    if tunnel.role != "dashboard":
        return OK, None
    try:
        code = status_of(tunnel.url + VERSION_PATH, token)
    except (urllib.error.URLError, OSError, ValueError):
        return NOT_YET, None   # ssh takes the connection before the head's end is up
    if code in (401, 403):
        return REFUSED, code
    return (OK if code == 200 else NOT_YET), code


def last_said(log: str | Path, token: str) -> str:
    """The last line with words in ``log`` (colours stripped, the token never quoted)."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return "(no output)"
    lines = [ln for ln in (_ANSI.sub("", ln).strip() for ln in text.splitlines())
             if re.search(r"\w", ln)]
    line = lines[-1] if lines else "(no output)"
    return line.replace(token, "***")[:300] if token else line[:300]


# ----------------------------------------------------------------------------- state

@contextlib.contextmanager
def locked(folder: Path):
    """One `rayfleet env` at a time per cluster (a second waits for the first)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load(folder: Path, err=None) -> list[Tunnel]:
    """The tunnels recorded in ``folder``; a record that cannot be read names no process to
    signal, and is said and ignored."""
    path = folder / STATE_FILE
    try:
        data = json.loads(path.read_text())
        return [Tunnel(**t) for t in data["tunnels"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"rayfleet: ignored {path}: not a record of tunnels ({e}); nothing in it is "
              "signalled", file=err or sys.stderr)
        return []


def save(folder: Path, cluster_yaml: Path, tunnels: list[Tunnel]) -> None:
    """Record ``tunnels`` (0600, replaced whole); none: the record is removed."""
    path = folder / STATE_FILE
    if not tunnels:
        path.unlink(missing_ok=True)
        return
    tmp = folder / f".{STATE_FILE}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"yaml": str(cluster_yaml), "tunnels": [asdict(t) for t in tunnels]}, f,
                  indent=2)
    os.replace(tmp, path)
