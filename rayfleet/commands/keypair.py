"""`rayfleet keypair CLUSTER_YAML`: the operator's SSH key pair a cluster YAML names, created
once: in EC2 (the KeyName of every node type, in provider.region) and its private key at
auth.ssh_private_key, created mode 0600 (its folder 0700), never readable by others, not for an
instant. Run again with both in place, it says so and exits 0. Either one alone is refused in
one line, nothing changed: a file is never overwritten, and EC2 keeps no private key to write.
The key pair carries no ray-cluster-name tag: it outlives `ray down`, and `rayfleet sweep`
would list it as a leftover."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from rayfleet.clusteryaml import ClusterYaml, load
from rayfleet.commands.sweep import aws_region
from rayfleet.errors import ConfigError, RayfleetError


def target(path: str) -> tuple[str, str, Path]:
    """(key name, region, private key file) of a cluster YAML, each checked."""
    cfg, _ = load(path)
    region = aws_region(cfg, path, "keypair creates an EC2 key pair",
                        "the key pair is made there")
    types = ClusterYaml(cfg).node_types()
    lacking = [t.name for t in types if not t.node_config.get("KeyName")]
    names = sorted({str(t.node_config["KeyName"]) for t in types if t.node_config.get("KeyName")})
    if not types or lacking:
        raise ConfigError("KeyName", f"{path}: node type(s) {', '.join(lacking) or '(none)'} "
                                     "name no KeyName in node_config; re-render the YAML with "
                                     "`rayfleet render`")
    if len(names) > 1:
        raise ConfigError("KeyName", f"{path}: the node types name different key pairs "
                                     f"({', '.join(names)}); one pair, one private key file: "
                                     "name the same KeyName in every node_config")
    key = (cfg.get("auth") or {}).get("ssh_private_key")
    if not isinstance(key, str) or not key:
        raise ConfigError("auth.ssh_private_key", f"{path} has none; name the file the key "
                                                  "pair's private key goes to")
    return names[0], region, Path(key).expanduser()


def _aws_errors():
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def _write(path: Path, material: str) -> None:
    """Create ``path`` mode 0600 with ``material``; never an existing file, nothing left
    behind on failure."""
    if not path.parent.is_dir():
        path.parent.mkdir(mode=0o700, parents=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)   # the umask can only narrow it
    try:
        os.fchmod(fd, 0o600)
        data = material if material.endswith("\n") else material + "\n"
        with os.fdopen(fd, "w", encoding="ascii") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if fd != -1:
            os.close(fd)
        path.unlink(missing_ok=True)
        raise


def _create(ec2, name: str, region: str, path: Path) -> None:
    material = ec2.create_key_pair(KeyName=name, KeyType="rsa")["KeyMaterial"]
    try:
        _write(path, material)
    except BaseException as e:
        undo = f"aws ec2 delete-key-pair --region {region} --key-name {name}"
        try:
            ec2.delete_key_pair(KeyName=name)
        except _aws_errors() as gone:
            raise RayfleetError(f"cannot write {path} ({e}), and deleting the key pair {name} "
                                f"just created in {region} failed too ({gone}): `{undo}`, "
                                "then run again") from None
        if not isinstance(e, OSError):
            raise
        raise RayfleetError(f"cannot write {path} ({e.strerror or e}); the key pair {name} "
                            f"created in {region} was deleted again, nothing changed") from None


def _check_pair(path: Path, ec2_public: str, name: str, region: str) -> None:
    """The file is the private half of EC2's key pair: its public key (as `ssh-keygen -y`
    derives it) is the one EC2 holds. A stale file of the same name would pass here and fail
    at `ray up`'s first ssh."""
    try:
        derived = subprocess.run(["ssh-keygen", "-y", "-P", "", "-f", str(path)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RayfleetError(f"cannot check {path} against EC2's key pair {name}: ssh-keygen "
                            f"({e}); `ray up` needs OpenSSH on this machine") from None
    if derived.returncode != 0:
        raise RayfleetError(f"{path} is not a private key ssh can read without a passphrase "
                            f"({derived.stderr.strip() or 'ssh-keygen -y failed'})")
    if derived.stdout.split()[:2] != ec2_public.split()[:2]:
        raise RayfleetError(f"{path} is not the private key of EC2's key pair {name} in "
                            f"{region} (their public keys differ): put that pair's .pem "
                            f"there, or move the file away, delete the key pair (`aws ec2 "
                            f"delete-key-pair --region {region} --key-name {name}`) and run "
                            "again")


def main(cluster_yaml: str, out=None, session=None) -> int:
    out = out or sys.stdout
    name, region, path = target(cluster_yaml)
    have_file = os.path.lexists(path)
    if have_file and not path.is_file():
        raise RayfleetError(f"{path} (auth.ssh_private_key) is not a file")
    import boto3

    try:
        session = session or boto3.session.Session(region_name=region)
        if session.get_credentials() is None:
            raise RayfleetError("no AWS credentials found (environment, AWS_PROFILE, ~/.aws, SSO "
                                "or an instance role): set them (e.g. `export AWS_PROFILE=...`), "
                                "then run keypair again")
        ec2 = session.client("ec2", region_name=region)
        pairs = ec2.describe_key_pairs(Filters=[{"Name": "key-name", "Values": [name]}],
                                       IncludePublicKey=True)["KeyPairs"]
        in_ec2 = bool(pairs)
        if have_file and in_ec2:
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                raise RayfleetError(f"{path} has mode {mode:04o}: ssh refuses a private key "
                                    f"others can read; `chmod 600 {path}`")
            _check_pair(path, pairs[0].get("PublicKey", ""), name, region)
            print(f"key pair {name} in {region} and {path} already exist", file=out)
            return 0
        if have_file:
            raise RayfleetError(f"{path} exists but EC2 has no key pair {name} in {region}, and "
                                "creating one would overwrite it: move the file away, or import "
                                f"its public key: `aws ec2 import-key-pair --region {region} "
                                f"--key-name {name} --public-key-material fileb://KEY.pub` "
                                f"(`ssh-keygen -y -f {path} > KEY.pub`)")
        if in_ec2:
            raise RayfleetError(f"EC2 has key pair {name} in {region} but {path} is missing, and "
                                "EC2 keeps no private key to write: put its .pem at "
                                f"{path}, or delete the key pair (`aws ec2 delete-key-pair "
                                f"--region {region} --key-name {name}`) and run again")
        _create(ec2, name, region, path)
    except _aws_errors() as e:
        raise RayfleetError(f"EC2 in {region}: {e}") from None
    print(f"created key pair {name} in {region}: {path} (0600)", file=out)
    return 0
