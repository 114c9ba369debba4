#!/usr/bin/env python3
"""The head's supervisor on a local HA cluster (`rayfleet local up --ha`): it starts the head
with `ray start` and starts the GCS again, on the same node, when it dies.

What Ray 2.60 does itself, with the GCS's tables in Redis (RAY_REDIS_ADDRESS): a gcs_server
started again with the same command line reads the tables back, and every raylet, the head's
included, waits for it (RAY_gcs_rpc_server_reconnect_timeout_s) and re-registers. Nothing in Ray
starts it again: KubeRay restarts the head pod; `ray start --block` does the opposite, and on
any of its processes' unexpected exit kills all the others and exits (ray/scripts/scripts.py).
So the HA head is started without ``--block``, under this program:

- it makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER), runs the `ray start` command
  given after ``--`` (appending ``--redis-password`` read from the 0600 file: this program's
  own command line, which lives as long as the cluster, never holds it), and waits for it; a
  `ray start` that fails is stopped and run again, START_ATTEMPTS times in all (Ray's raylet
  gives its dashboard agent a fixed 15 s to start, which a busy node can miss);
- Ray's processes stay in this program's process group and, once `ray start` has exited, are
  its children: it reaps them and sees gcs_server's exit at once. It reads gcs_server's command
  line, environment, working folder and log files from /proc when it starts supervising, and
  on an exit starts the same command again (not logged: it holds the password), at most once
  a second, recording each restart in ``--status`` (JSON); after MAX_RESTARTS exits in a row,
  each within ``--stable-s`` of its start, it stops the head instead and exits 1;
- SIGTERM (`rayfleet local down`, or the next `ray up`'s first head command) stops the group:
  SIGTERM to every process, SIGKILL to what is left after ``--grace-s``, then it exits 0. A
  SIGTERM that comes while a failed `ray start` is being cleaned up is kept: no retry follows,
  and one during `ray start` ends it; either way it exits 1 (Ray was never supervised);
- it leads its own process group (it makes one if started inside another's), so the group it
  stops is never its caller's; anything that goes wrong after `ray start` stops the head,
  says why in one line and in ``--status``, as does a failure before Ray is started.

    gcs_supervisor.py --password-file F --status S [--grace-s 14] -- ray start --head ...

Its status file is written from its start (``gcs_pid`` null until `ray start` has exited and
gcs_server is found; ``exit`` set when `ray start` failed). On a cloud head, which `ray up`
starts over SSH, the supervisor is started detached and a second call waits for it:

    gcs_supervisor.py --status S --wait SECONDS

exits 0 once gcs_server is supervised, or 1 in one line when the supervisor ended first (its
`ray start` failed: its log says why) or the time ran out.

Standard library only: a node agent (rayfleet/agents/__init__.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
GCS_COMM = "gcs_server"
MIN_RESTART_INTERVAL_S = 1.0
# A GCS that keeps dying (say its Redis is gone) is not coming back by being started again:
# after MAX_RESTARTS exits in a row, each within --stable-s of its start, the supervisor stops
# the head instead, and `rayfleet local status` says it is down. One that ran longer than that
# before it died starts the count over.
MAX_RESTARTS, STABLE_S = 5, 600.0
# A `ray start` that fails is run again this many times in all, this far apart: a transient
# failure (see Supervisor.run) passes on the next try, a real one fails every time.
START_ATTEMPTS, START_RETRY_DELAY_S = 3, 2.0


def log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} gcs_supervisor: {msg}", flush=True)


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (this one excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            pids.append(int(entry))
    return pids


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Launch:
    """How a process was started, read from /proc while it runs."""

    def __init__(self, pid: int):
        self.argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        env = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
        self.env = dict(kv.split(b"=", 1) for kv in env if b"=" in kv)
        self.cwd = os.readlink(f"/proc/{pid}/cwd")
        # Ray opens gcs_server.out/.err for it; a restart appends to the same files.
        self.outputs = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)]

    def start(self) -> subprocess.Popen:
        files = [open(p, "ab") if p.startswith("/") else subprocess.DEVNULL
                 for p in self.outputs]
        try:
            # Same process group (this one's), same session: `down` stops it with the rest.
            return subprocess.Popen(self.argv, env=self.env, cwd=self.cwd,
                                    stdin=subprocess.DEVNULL, stdout=files[0], stderr=files[1])
        finally:
            for f in files:
                if f is not subprocess.DEVNULL:
                    f.close()


class Supervisor:
    def __init__(self, status: Path, grace_s: float, stable_s: float = STABLE_S,
                 gcs_wait_s: float = 30.0):
        self.status, self.grace_s = status, grace_s
        self.stable_s, self.gcs_wait_s = stable_s, gcs_wait_s
        self.stopping = False
        self.terminated = False   # a SIGTERM came: nothing is started again after it
        self.restarts: list[dict] = []
        self.gcs_pid: int | None = None
        self.gcs_proc: subprocess.Popen | None = None
        self.started_at = time.time()

    def write_status(self, **extra) -> None:
        tmp = self.status.with_suffix(".tmp")
        tmp.write_text(json.dumps({"supervisor_pid": os.getpid(), "gcs_pid": self.gcs_pid,
                                   "started_at": self.started_at,
                                   "restarts": self.restarts, **extra}, indent=2))
        tmp.replace(self.status)

    def on_sigterm(self, *_) -> None:
        self.terminated = self.stopping = True

    def find_gcs(self, timeout_s: float = 30) -> int:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = [p for p in group_pids(os.getpgrp()) if comm(p) == GCS_COMM]
            if found:
                return found[0]
            time.sleep(0.2)
        raise RuntimeError("no gcs_server in the head's process group after `ray start`")

    def run(self, ray_start: list[str], attempts: int = START_ATTEMPTS) -> int:
        self.write_status()
        for attempt in range(1, attempts + 1):
            starter = subprocess.Popen(ray_start, stdin=subprocess.DEVNULL)
            while starter.poll() is None:
                if self.stopping:
                    starter.terminate()
                time.sleep(0.2)
            if starter.returncode == 0 or self.stopping or attempt == attempts:
                break
            # Ray 2.60's raylet exits when its dashboard agent has not written its port file
            # within a fixed 15 s (ray-project/ray#65983), which a busy or cold node misses;
            # what the failed start left is stopped, and `ray start` runs again.
            log(f"`ray start` exited {starter.returncode} (attempt {attempt} of {attempts}); "
                "stopping what it started and starting the head again")
            self.stop(quiet=True)
            self.stopping = self.terminated   # a SIGTERM during that stop is kept
            if self.terminated:
                break
            time.sleep(START_RETRY_DELAY_S)
        if starter.returncode != 0 or self.stopping:
            # Quietly: `ray start`'s own last line is what `rayfleet local up` shows.
            self.write_status(exit=f"`ray start` exited {starter.returncode}")
            self.stop(quiet=True)
            # `ray start` ended by a signal (ours, after a SIGTERM): a failure, not -signum.
            return starter.returncode if starter.returncode >= 0 else 1
        try:
            return self.supervise()
        except Exception as e:   # noqa: BLE001 (whatever it is, the head must not be orphaned)
            log(f"stopping the head: {type(e).__name__}: {e}")
            self.write_status(exit=f"the supervisor failed: {type(e).__name__}: {e}")
            self.stop()
            return 1

    def supervise(self) -> int:
        self.gcs_pid = self.find_gcs(self.gcs_wait_s)
        launch = Launch(self.gcs_pid)
        self.write_status()
        log(f"supervising gcs_server (pid {self.gcs_pid})")
        last_start = time.time()
        streak = 0
        while not self.stopping:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, code = 0, 0
            if pid == 0:
                time.sleep(0.1)
                continue
            if pid != self.gcs_pid or self.stopping:
                continue  # another of Ray's processes, reaped
            died = time.time()
            how = (f"signal {os.WTERMSIG(code)}" if os.WIFSIGNALED(code)
                   else f"exit code {os.WEXITSTATUS(code)}")
            streak = streak + 1 if died - last_start < self.stable_s else 1
            if streak > MAX_RESTARTS:
                log(f"gcs_server (pid {pid}) ended ({how}), its {streak}th exit in a row within "
                    f"{self.stable_s:g} s of its start: not starting it again; stopping the head")
                self.write_status(exit=f"gcs_server ended {streak} times in a row")
                self.stop()
                return 1
            time.sleep(max(0.0, last_start + MIN_RESTART_INTERVAL_S - died))
            if self.stopping:
                break
            last_start = time.time()
            # Kept: a Popen dropped while its child runs would reap it behind waitpid's back.
            new = self.gcs_proc = launch.start()
            self.restarts.append({"old_pid": pid, "exit": how, "died_at": died,
                                  "new_pid": new.pid, "started_at": last_start})
            self.gcs_pid = new.pid
            self.write_status()
            log(f"gcs_server (pid {pid}) ended ({how}); started it again as pid {new.pid} "
                f"{last_start - died:.2f} s later")
        self.stop()
        return 0

    def stop(self, quiet: bool = False) -> None:
        """Every process of the group in three waves, each given its share of the grace period:
        the raylet first, as Ray's own teardown does (it ends its workers), then the other
        processes while the GCS they may still report to is up (the autoscaler's monitor
        waits on it and would otherwise sit out the whole period), then the GCS; SIGKILL to
        whatever is left at the end."""
        self.stopping = True
        started, pgid = time.time(), os.getpgrp()
        if pgid != os.getpid():   # never the caller's group (main() makes this one's own)
            log(f"not stopping process group {pgid}: it is not this supervisor's")
            return
        waves = (lambda name: name == "raylet", lambda name: name != GCS_COMM,
                 lambda name: True)
        for i, wave in enumerate(waves):
            end = started + self.grace_s * (i + 1) / len(waves)
            for pid in group_pids(pgid):
                if wave(comm(pid)):
                    signal_pid(pid, signal.SIGTERM)
            while time.time() < end and any(wave(comm(p)) for p in group_pids(pgid)):
                reap()
                time.sleep(0.1)
        left = group_pids(pgid)
        names = [f"{comm(pid)} ({pid})" for pid in left]
        for pid in left:
            signal_pid(pid, signal.SIGKILL)
        end = time.time() + 5
        while time.time() < end and group_pids(pgid):
            reap()
            time.sleep(0.1)
        if not quiet or left:
            log(f"stopped the head in {time.time() - started:.1f} s"
                + (f" (killed after {self.grace_s:g} s: {', '.join(names)})" if left else ""))


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def wait(status: Path, timeout_s: float) -> int:
    """Until the supervisor that writes ``status`` supervises gcs_server: 0, or 1 with one line
    on stderr when it ended first or ``timeout_s`` ran out."""
    deadline = time.time() + timeout_s
    seen: dict = {}
    while time.time() < deadline:
        try:
            seen = json.loads(status.read_text())
        except (OSError, ValueError):
            seen = {}
        if seen.get("gcs_pid"):
            print(f"gcs_supervisor: supervising gcs_server (pid {seen['gcs_pid']})")
            return 0
        if seen.get("exit"):
            print(f"gcs_supervisor: {seen['exit']}: the head did not start", file=sys.stderr)
            return 1
        pid = seen.get("supervisor_pid")
        if pid and not comm(pid):
            print(f"gcs_supervisor: the supervisor (pid {pid}) ended before gcs_server started",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"gcs_supervisor: no supervised gcs_server after {timeout_s:g} s ({status}: "
          f"{'not written' if not seen else 'gcs_pid still null'})", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv and "--wait" in argv:
        parser = argparse.ArgumentParser(prog="gcs_supervisor.py")
        parser.add_argument("--status", required=True, type=Path)
        parser.add_argument("--wait", required=True, type=float, metavar="SECONDS")
        args = parser.parse_args(argv)
        return wait(args.status, args.wait)
    if "--" not in argv and {"-h", "--help"} & set(argv):
        print("usage: gcs_supervisor.py --password-file F --status S [--grace-s 14] -- "
              "ray start --head ...\n       gcs_supervisor.py --status S --wait SECONDS")
        return 0
    if "--" not in argv:
        print("gcs_supervisor: usage: gcs_supervisor.py --password-file F --status S -- "
              "ray start --head ...  |  gcs_supervisor.py --status S --wait SECONDS",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="gcs_supervisor.py")
    parser.add_argument("--password-file", required=True, type=Path)
    parser.add_argument("--status", required=True, type=Path)
    parser.add_argument("--grace-s", type=float, default=14.0)
    parser.add_argument("--stable-s", type=float, default=STABLE_S,
                        help="a gcs_server that ran this long before it died starts the "
                             "count of exits in a row over")
    parser.add_argument("--gcs-wait-s", type=float, default=30.0,
                        help="how long `ray start`'s gcs_server may take to appear")
    args = parser.parse_args(argv[:split])
    ray_start = argv[split + 1:]
    sup = Supervisor(args.status, args.grace_s, args.stable_s, args.gcs_wait_s)
    signal.signal(signal.SIGTERM, sup.on_sigterm)
    signal.signal(signal.SIGINT, sup.on_sigterm)

    def refuse(why: str) -> int:   # before Ray starts: said, and in --status for --wait
        print(f"gcs_supervisor: {why}", file=sys.stderr)
        sup.write_status(exit=why)
        return 2

    try:
        password = args.password_file.read_text().strip()
    except OSError as e:
        return refuse(f"cannot read {args.password_file}: {e.strerror}")
    if not password:
        return refuse(f"{args.password_file} is empty")
    if os.getpgrp() != os.getpid():
        try:
            os.setpgid(0, 0)   # a group of its own: stop() signals only what it started
        except OSError as e:
            return refuse(f"cannot lead a process group of its own: {e.strerror}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return refuse(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    return sup.run([*ray_start, f"--redis-password={password}"])


if __name__ == "__main__":
    sys.exit(main())
