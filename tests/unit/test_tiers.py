"""tests/tiers.py: a tier this machine cannot run is a skip locally and a failure where
RAYFLEET_REQUIRE names it, with the same one line; run as pytest runs it (a pytest process of
its own on a small test file, and on a `gpu` test through this suite's conftest)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.tiers import REQUIRE_ENV, TIERS, unavailable

CANNOT = """
from tests.tiers import unavailable

def test_needs_the_tier():
    unavailable("{tier}", "this machine lacks it")
"""


def _pytest(tmp_path, require: str | None, *args: str, files: dict | None = None,
            extra_env: dict | None = None):
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in (REQUIRE_ENV, "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(REPO), **(extra_env or {}))
    if require is not None:
        env[REQUIRE_ENV] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_unavailable_tier_skips_locally_and_fails_when_required(tmp_path, tier="fakecloud"):
    files = {"test_t.py": CANNOT.format(tier=tier)}
    local = _pytest(tmp_path, None, "test_t.py", files=files)
    assert local.returncode == 0, local.stdout
    assert "1 skipped" in local.stdout, local.stdout
    assert f"{tier} tier unavailable: this machine lacks it" in local.stdout

    required = _pytest(tmp_path, f"prometheus,{tier}", "test_t.py")
    assert required.returncode == 1, required.stdout
    assert "1 failed" in required.stdout, required.stdout
    line = (f"{tier} tier unavailable: this machine lacks it (required by {REQUIRE_ENV}="
            f"prometheus,{tier}; unset it to skip instead)")
    assert line in required.stdout, required.stdout
    assert "Traceback" not in required.stdout   # one line, not a stack

    # Another tier required: this one still skips.
    other = next(t for t in sorted(TIERS) if t != tier)
    assert _pytest(tmp_path, other, "test_t.py").returncode == 0


def test_unknown_required_tier_stops_the_run_naming_the_tiers(tmp_path):
    proc = _pytest(tmp_path, "fakeclod", "test_t.py",
                   files={"test_t.py": "def test_x():\n    pass\n",
                          "conftest.py": "from tests.conftest import pytest_configure\n"})
    assert proc.returncode != 0
    assert ("RAYFLEET_REQUIRE names an unknown tier 'fakeclod' (did you mean 'fakecloud'?)"
            in proc.stdout + proc.stderr), proc.stdout + proc.stderr


def test_gpu_test_without_cuda_fails_under_make_test_gpu(tmp_path):
    """This suite's own hook (tests/conftest.py) on a `gpu` test, CUDA hidden."""
    files = {"conftest.py": "from tests.conftest import pytest_runtest_setup\n",
             "test_g.py": "import pytest\n\n@pytest.mark.gpu\ndef test_g():\n    pass\n",
             "pytest.ini": "[pytest]\nmarkers =\n    gpu: needs CUDA\n"}
    no_cuda = {"CUDA_VISIBLE_DEVICES": ""}
    local = _pytest(tmp_path, None, "test_g.py", files=files, extra_env=no_cuda)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout
    assert "gpu tier unavailable: needs CUDA" in local.stdout
    required = _pytest(tmp_path, "gpu", "test_g.py", extra_env=no_cuda)
    # Failed in set-up: pytest counts it an error, and exits 1.
    assert required.returncode == 1 and "1 error" in required.stdout, required.stdout
    assert "gpu tier unavailable: needs CUDA" in required.stdout
    assert "required by RAYFLEET_REQUIRE=gpu" in required.stdout


def test_helper_in_process(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "fakecloud")
    with pytest.raises(pytest.fail.Exception, match="fakecloud tier unavailable: no root"):
        unavailable("fakecloud", "no root")
    monkeypatch.delenv(REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception, match="fakecloud tier unavailable: no root"):
        unavailable("fakecloud", "no root")
