"""The run's own temporary folder: what the suite and everything it starts write to the temp
folder (pytest's tmp_path, the session cluster's Ray folder, Ray Train's and vLLM's files,
torch's elastic agent, multiprocessing, a killed job's downloads) goes under one folder this
run made, TMPDIR for every child. A passing run removes it; a failing run keeps it for its logs
and says where. A run killed before it could remove it leaves it, and the next run removes it,
once the process that made it is gone: each folder records its maker's pid and start time, and
only a folder of this user's, not a link, whose maker is dead is removed.

Before, a run left about a hundred entries in /tmp (vLLM's IPC sockets, Ray session folders,
torchelastic and multiprocessing folders, fetched model copies), for the next run to wade
through."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from rayfleet.commands.host import start_ticks

PREFIX = "rft"          # short: Ray's Unix socket paths under it must stay within 107 bytes
ENV = "RAYFLEET_TEST_TMPDIR"   # the controller's folder, inherited by pytest-xdist's workers
OWNER = ".owner"        # "<pid> <start ticks>" of the pytest process that made the folder


def enter(base: Path | None = None) -> Path:
    """This run's folder, made by the first pytest process (the xdist controller) and reused by
    its workers; TMPDIR points there from now on, for this process and every child."""
    inherited = os.environ.get(ENV)
    if inherited and Path(inherited).is_dir():
        path = Path(inherited)
    else:
        base = base or Path(tempfile.gettempdir())
        path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))   # 0700, this user's
        (path / OWNER).write_text(f"{os.getpid()} {start_ticks(os.getpid())}\n")
        os.environ[ENV] = str(path)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None   # gettempdir() reads TMPDIR again
    return path


def made_here(path: Path) -> bool:
    try:
        pid, ticks = (path / OWNER).read_text().split()
        return int(pid) == os.getpid() and ticks == str(start_ticks(os.getpid()))
    except (OSError, ValueError):
        return False


def leave(path: Path, passed: bool) -> str | None:
    """Remove the folder if this process made it and the run passed; otherwise None, or the
    line that says where a failed run's files are."""
    if not made_here(path):
        return None
    if passed:
        shutil.rmtree(path, ignore_errors=True)
        return None
    return f"this run's temporary files are kept in {path} (the next run removes them)"


def stale(base: Path) -> list[Path]:
    """Folders an earlier, now dead run made under ``base``: its name, this user's, a real
    folder (not a link), and an owner record naming a pid whose process is gone or is another
    one now. What does not read as such is never counted."""
    found = []
    for path in sorted(base.glob(f"{PREFIX}*")):
        try:
            st = os.lstat(path)
            pid, ticks = (path / OWNER).read_text().split()
        except (OSError, ValueError):
            continue
        if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                and str(start_ticks(int(pid))) != ticks):
            found.append(path)
    return found


def sweep(base: Path) -> list[Path]:
    """Remove what stale() finds; the folders removed."""
    gone = stale(base)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone
