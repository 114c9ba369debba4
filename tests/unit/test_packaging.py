"""The kit works from a wheel, outside any checkout: versions and pins come from the installed
metadata, data files (the instance catalog) from the package. Builds the wheel, installs it into
a scratch venv (no network: --no-deps, the dependencies seen through this venv's
site-packages) and runs `rayfleet render`, `lint` and `cost` from a folder that is not the
repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rayfleet import stack
from rayfleet.commands import render

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "cluster-configs" / "examples" / "dev-outputs.json"


def _run(cmd: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return proc


def test_wheel_installed_outside_the_checkout_renders_and_lints(tmp_path):
    # Build from a copy of what the wheel is made of, so the checkout gets no build/ folder.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("rayfleet", "workloads", "infra"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", tmp_path / "dist", src], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("rayfleet-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     tmp_path, env).stdout.strip())
    # The dependencies (ray, pyyaml, ...) from this venv, after the scratch venv's own
    # packages; a path in a .pth file does not run that folder's own .pth files, so the
    # checkout's editable install stays out.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
          "--no-index", "-q", wheel], tmp_path, env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(EXAMPLE, work / "outputs.json")
    where = _run([python, "-c", "import rayfleet; print(rayfleet.__file__)"], work, env).stdout
    assert Path(where.strip()).is_relative_to(site), where
    env["RAYFLEET_HOME"] = str(tmp_path / "home")
    rayfleet = venv / "bin" / "rayfleet"
    _run([rayfleet, "render", "outputs.json", "--token-file", tmp_path / "token"], work, env)
    generated = work / "cluster-configs" / "generated" / "dev.yaml"
    # The same YAML as from the checkout: pins from the wheel's metadata, types from its
    # catalog.
    o = stack.parse(EXAMPLE.read_text())
    assert generated.read_text() == render.render_text(o, str(tmp_path / "token"))
    lint = _run([rayfleet, "lint", generated], work, env)
    assert "0 error(s)" in lint.stdout
    cost = _run([rayfleet, "cost", generated], work, env)
    assert json.loads(EXAMPLE.read_text())["rayfleet"]["node_types"]["workers"][0][
        "instance_type"] in cost.stdout
