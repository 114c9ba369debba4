"""`make regen` (scripts/regen.py): the Ansible role, cluster-configs/onprem.yaml and
Pulumi.yaml's config block hold what the kit declares once, so `--check` passes on the
repository and names a file that drifts."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys

from rayfleet import facts
from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("regen", REPO / "scripts" / "regen.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)


def _checkout(root):
    """What regen reads and writes, copied under ``root``."""
    shutil.copytree(REPO / regen.ROLE, root / regen.ROLE)
    for path in (regen.ONPREM, regen.PULUMI, *regen.COPIES.values()):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, root / path)
    return root


def _named(capsys) -> list[str]:
    return [line.split(":")[0] for line in capsys.readouterr().err.splitlines()]


def test_regen_changes_nothing_on_the_repository():
    proc = subprocess.run([sys.executable, "scripts/regen.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"run `make regen`:\n{proc.stderr}"


def test_a_drifted_mirror_is_named_and_regen_puts_it_back(tmp_path, capsys):
    root = _checkout(tmp_path)
    assert regen.main(["--check"], root=root) == 0
    defaults = root / regen.DEFAULTS
    text = defaults.read_text()
    defaults.write_text(text.replace("\nray_node_gcs_port: 6379\n", "\nray_node_gcs_port: 6380\n"))
    guard = root / regen.ROLE / "files" / "haproxy_guard.py"
    guard.write_text(guard.read_text() + "# edited on the copy\n")
    capsys.readouterr()
    assert regen.main(["--check"], root=root) == 1
    assert _named(capsys) == [str(guard.relative_to(root)), str(regen.DEFAULTS)]
    assert regen.main([], root=root) == 0
    assert defaults.read_text() == text
    assert guard.read_bytes() == (REPO / "rayfleet" / "agents" / "haproxy_guard.py").read_bytes()


def test_a_moved_fact_is_named_in_every_file_that_mirrors_it(tmp_path, capsys, monkeypatch):
    root = _checkout(tmp_path)
    gcs = facts.RAY_PORTS_BY_NAME["gcs"]
    moved = dataclasses.replace(gcs, from_port=gcs.from_port + 1, to_port=gcs.to_port + 1)
    monkeypatch.setattr(facts, "RAY_PORTS",
                        tuple(moved if p is gcs else p for p in facts.RAY_PORTS))
    monkeypatch.setitem(facts.RAY_PORTS_BY_NAME, "gcs", moved)
    capsys.readouterr()
    assert regen.main(["--check"], root=root) == 1
    assert set(_named(capsys)) == {str(regen.DEFAULTS), str(regen.SPEC), str(regen.ONPREM)}
    assert regen.main([], root=root) == 0
    spec = (root / regen.SPEC).read_text()
    assert f"default: {moved.from_port}\n        description: GCS port" in spec
    # Only the mirrored values move: the rest of the file, comments included, stays.
    before = (REPO / regen.DEFAULTS).read_text().splitlines()
    after = (root / regen.DEFAULTS).read_text().splitlines()
    assert [(a, b) for a, b in zip(before, after, strict=True) if a != b] == [
        (f"ray_node_gcs_port: {gcs.from_port}", f"ray_node_gcs_port: {moved.from_port}")]


def test_a_mirror_with_its_key_gone_fails_in_one_line(tmp_path, capsys):
    root = _checkout(tmp_path)
    spec = root / regen.SPEC
    spec.write_text(spec.read_text().replace("ray_node_gcs_port:", "ray_node_gcs:"))
    capsys.readouterr()
    assert regen.main(["--check"], root=root) == 1
    assert capsys.readouterr().err == (
        f"regen: {regen.SPEC}: no `ray_node_gcs_port:` at indent 6 to write\n")


def test_a_stack_setting_declared_in_configkeys_is_written_to_pulumi_yaml(tmp_path, capsys,
                                                                          monkeypatch):
    from rayfleet import configkeys

    root = _checkout(tmp_path)
    key = configkeys.ConfigKey("gpuNickname", "string", "", "What the workers are called.")
    monkeypatch.setattr(regen, "SCHEMA", (*configkeys.SCHEMA, key))
    capsys.readouterr()
    assert regen.main(["--check"], root=root) == 1
    assert _named(capsys) == [str(regen.PULUMI)]
    assert regen.main([], root=root) == 0
    import yaml

    entry = yaml.safe_load((root / regen.PULUMI).read_text())["config"]["rayfleet:gpuNickname"]
    assert entry == {"type": "string", "default": "", "description": key.description}
