"""The run's temporary folder (tests/scratch.py): made once, TMPDIR for every child, removed
by a passing run, kept by a failing one, and swept by the next run only when its maker is dead
and it is this user's real folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rayfleet.commands.host import start_ticks
from tests import scratch


def _made_by(base: Path, name: str, pid: int, ticks) -> Path:
    path = base / name
    path.mkdir()
    (path / scratch.OWNER).write_text(f"{pid} {ticks}\n")
    return path


def test_children_write_under_the_folder_which_a_passing_run_removes(tmp_path, monkeypatch):
    monkeypatch.delenv(scratch.ENV, raising=False)
    monkeypatch.setenv("TMPDIR", os.environ.get("TMPDIR", "/tmp"))
    try:
        path = scratch.enter(base=tmp_path)
        assert path.parent == tmp_path and path.name.startswith(scratch.PREFIX)
        assert path.stat().st_mode & 0o777 == 0o700 and scratch.made_here(path)
        child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp())"],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert Path(child).parent == path
        # A worker (or a pytest a test starts) finds the folder and uses it, not its own.
        assert scratch.enter(base=tmp_path / "elsewhere") == path
        failed = scratch.leave(path, passed=False)
        assert failed == f"this run's temporary files are kept in {path} (the next run " \
                         f"removes them)" and path.is_dir()
        assert scratch.stale(tmp_path) == []          # its maker (this process) lives
        assert scratch.leave(path, passed=True) is None and not path.exists()
    finally:
        tempfile.tempdir = None


def test_only_a_dead_runs_own_real_folder_is_swept(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = _made_by(tmp_path, "rftdead", gone.pid, 12345)
    alive = _made_by(tmp_path, "rftalive", os.getpid(), start_ticks(os.getpid()))
    # The pid lives, but it is another process than the one recorded (a reused pid).
    reused = _made_by(tmp_path, "rftreused", os.getpid(), 1)
    unowned = tmp_path / "rftnorecord"
    unowned.mkdir()
    others = _made_by(tmp_path, "rftothers", gone.pid, 12345)
    os.chown(others, 65534, 65534)
    target = _made_by(tmp_path / "..", f"rftlinked{os.getpid()}", gone.pid, 12345)
    (tmp_path / "rftlink").symlink_to(target.resolve())
    unrelated = _made_by(tmp_path, "pytest-of-someone", gone.pid, 12345)
    try:
        assert scratch.stale(tmp_path) == [dead, reused]
        assert not scratch.made_here(reused)
        assert scratch.sweep(tmp_path) == [dead, reused]
        assert not dead.exists() and not reused.exists()
        for kept in (alive, unowned, others, target, unrelated, tmp_path / "rftlink"):
            assert kept.exists(), kept
    finally:
        import shutil

        shutil.rmtree(target, ignore_errors=True)
