"""`rayfleet keypair CLUSTER_YAML` on moto: the key pair the YAML names is created in EC2 with
its private key written 0600 (whatever the umask), once; run again it changes nothing; a file
without its key pair, a key pair without its file, a key others can read and a file that cannot
be written are each one line and exit 2, with nothing overwritten or left half-made."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
import yaml

from rayfleet.commands import cli, keypair
from tests.conftest import REPO

pytestmark = pytest.mark.moto

NAME = "rayfleet-dev-operator"   # what the example YAML's node types name


@pytest.fixture
def yaml_path(tmp_path, monkeypatch):
    """The example cluster YAML, its ~/.ssh/<name>.pem under a HOME in tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "cluster.yaml"
    shutil.copy(REPO / "cluster-configs" / "aws-a100.example.yaml", path)
    return path


@pytest.fixture
def pem(tmp_path):
    return tmp_path / "home" / ".ssh" / f"{NAME}.pem"


def _run(path, capsys) -> tuple[int, str, str]:
    rc = cli.main(["keypair", str(path)])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    assert err.startswith("rayfleet: error: ") and err.count("\n") == 1, err
    return err


def _names(ec2) -> list[str]:
    return [k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"]]


def test_creates_the_key_pair_and_its_0600_key_once(yaml_path, pem, ec2, capsys):
    old = os.umask(0)   # a plain open() would leave the key readable by everyone
    try:
        rc, out, err = _run(yaml_path, capsys)
    finally:
        os.umask(old)
    assert (rc, err) == (0, ""), err
    assert out == f"created key pair {NAME} in us-east-1: {pem} (0600)\n"
    assert stat.S_IMODE(pem.stat().st_mode) == 0o600
    assert stat.S_IMODE(pem.parent.stat().st_mode) == 0o700
    assert pem.read_text().startswith("-----BEGIN RSA PRIVATE KEY-----")
    [pair] = ec2.describe_key_pairs(KeyNames=[NAME], IncludePublicKey=True)["KeyPairs"]
    assert not pair.get("Tags")   # no ray-cluster-name: sweep would call it a leftover
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(pem)], capture_output=True,
                             text=True, check=True).stdout.split()[:2]
    assert derived == pair["PublicKey"].split()[:2]   # the file is the pair's private key

    key = pem.read_bytes()
    rc, out, err = _run(yaml_path, capsys)
    assert (rc, err) == (0, ""), err
    assert out == f"key pair {NAME} in us-east-1 and {pem} already exist\n"
    assert pem.read_bytes() == key and _names(ec2) == [NAME]


def test_a_file_that_is_not_the_pairs_key_is_refused_and_left_as_it_was(yaml_path, pem, ec2,
                                                                         capsys):
    assert _run(yaml_path, capsys)[0] == 0
    pem.unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-N", "", "-f", str(pem)], check=True)
    key = pem.read_bytes()
    rc, out, err = _run(yaml_path, capsys)
    assert rc == 2 and out == ""
    assert "is not the private key of EC2's key pair" in _one_line(err), err
    assert pem.read_bytes() == key and _names(ec2) == [NAME]


def test_an_existing_file_is_never_overwritten(yaml_path, pem, ec2, capsys):
    pem.parent.mkdir(parents=True)
    pem.write_text("someone's key\n")
    rc, out, err = _run(yaml_path, capsys)
    assert rc == 2 and out == ""
    assert "would overwrite" in _one_line(err) and "aws ec2 import-key-pair" in err
    assert pem.read_text() == "someone's key\n" and _names(ec2) == []


def test_a_key_pair_without_its_file_is_refused(yaml_path, pem, ec2, capsys):
    ec2.create_key_pair(KeyName=NAME)
    rc, out, err = _run(yaml_path, capsys)
    assert rc == 2 and out == ""
    assert f"aws ec2 delete-key-pair --region us-east-1 --key-name {NAME}" in _one_line(err)
    assert str(pem) in err and not pem.exists() and _names(ec2) == [NAME]


def test_a_key_others_can_read_is_refused_and_left_as_it_was(yaml_path, pem, ec2, capsys):
    ec2.create_key_pair(KeyName=NAME)
    pem.parent.mkdir(parents=True)
    pem.write_text("the key\n")
    pem.chmod(0o640)
    rc, out, err = _run(yaml_path, capsys)
    assert rc == 2 and out == ""
    assert f"chmod 600 {pem}" in _one_line(err)
    assert stat.S_IMODE(pem.stat().st_mode) == 0o640 and pem.read_text() == "the key\n"


def test_a_key_that_cannot_be_written_leaves_no_key_pair(yaml_path, pem, ec2, capsys,
                                                         monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(keypair.os, "fsync", full)
    rc, out, err = _run(yaml_path, capsys)
    assert rc == 2 and out == ""
    assert "No space left on device" in _one_line(err) and "deleted again" in err
    assert _names(ec2) == [] and not pem.exists()


def test_node_types_naming_different_key_pairs_are_refused_before_any_call(yaml_path, capsys):
    cfg = yaml.safe_load(yaml_path.read_text())
    worker = next(n for n in cfg["available_node_types"] if n != cfg["head_node_type"])
    cfg["available_node_types"][worker]["node_config"]["KeyName"] = "another"
    yaml_path.write_text(yaml.safe_dump(cfg))
    rc, out, err = _run(yaml_path, capsys)   # no `aws` fixture: a call would reach out
    assert rc == 2 and out == ""
    assert "different key pairs (another, rayfleet-dev-operator)" in _one_line(err)


def test_an_unreachable_endpoint_is_one_line(yaml_path, pem, monkeypatch, capsys):
    from rayfleet.commands.host import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_MAX_ATTEMPTS": "1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(k, raising=False)
    rc, out, err = _run(yaml_path, capsys)
    assert rc == 2 and out == ""
    assert f"EC2 in us-east-1: Could not connect to the endpoint URL: \"{endpoint}/\"" \
        in _one_line(err)   # AWS_ENDPOINT_URL honoured
    assert not pem.exists()
