"""The node roles' storage policy (the Pulumi program's own, run under Pulumi's mocks) judged
by the fake cloud's moto with IAM on (tests/fakecloud/motoserver.py): on it, the run store
resolves and Ray Train's folder, marker, upload and pruning calls work, a file not written yet
is missing (404), and a path outside the key prefix is refused in one line. Beside it, the same
policy's strict reading (its s3:prefix condition without IfExists, what the roles had before)
shows why the program writes IfExists: there pyarrow's bucket check (HeadBucket), which the
kit's storage check and Ray Train's run folder make, and a look at a file not written yet are
refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pyarrow.fs as pafs
import pytest

from rayfleet.errors import StorageError
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.moto

PREFIX = "rayfleet/"


def _worker_policy() -> tuple[str, str]:
    """The worker role's storage policy as the Pulumi program writes it (under the mocks of
    tests/infra/harness.py), and the bucket it names."""
    from tests.infra.harness import run_program

    (policy,) = [r.inputs["policy"] for r in run_program({"rayfleet:region": "us-west-2"})
                 .resources if r.name == "rayfleet-iam-worker-storage"]
    bucket = json.loads(policy)["Statement"][0]["Resource"].removeprefix("arn:aws:s3:::")
    assert f'"{PREFIX}*"' in policy, policy
    return policy, bucket


@pytest.fixture(scope="module")
def role_env(tmp_path_factory):
    """A moto server with IAM on, the bucket, and the environment of a node on its role."""
    import boto3

    port = free_port()
    log = tmp_path_factory.mktemp("moto-iam") / "moto.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests/fakecloud/motoserver.py"),
                                 "-H", "127.0.0.1", "-p", str(port)], stdout=f,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"moto did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        kw = dict(endpoint_url=url, region_name="us-west-2", aws_access_key_id="testing",
                  aws_secret_access_key="testing")
        policy, bucket = _worker_policy()
        boto3.client("s3", **kw).create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        iam = boto3.client("iam", **kw)
        trust = {"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Action": "sts:AssumeRole",
            "Principal": {"Service": "ec2.amazonaws.com"}}]}
        # The program's policy, and its strict reading: the prefix condition without IfExists
        # (what the roles had before; a request that names no prefix is refused).
        strict = policy.replace('"StringLikeIfExists"', '"StringLike"')
        assert strict != policy, policy
        envs = {}
        for name, doc in (("program", policy), ("strict", strict)):
            arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
            iam.put_role_policy(RoleName=name, PolicyName="storage", PolicyDocument=doc)
            c = boto3.client("sts", **kw).assume_role(RoleArn=arn["Role"]["Arn"],
                                                      RoleSessionName="i-node")["Credentials"]
            envs[name] = {"AWS_ACCESS_KEY_ID": c["AccessKeyId"],
                          "AWS_SECRET_ACCESS_KEY": c["SecretAccessKey"],
                          "AWS_SESSION_TOKEN": c["SessionToken"],
                          "AWS_DEFAULT_REGION": "us-west-2", "AWS_ENDPOINT_URL_S3": url}
        urllib.request.urlopen(urllib.request.Request(
            url + "/moto-api/reset-auth", data=b"0", method="POST",
            headers={"Content-Type": "text/plain"}), timeout=10)
        yield envs, bucket
    finally:
        proc.kill()
        proc.wait()


def _on_role(role_env, monkeypatch, role: str = "program") -> str:
    envs, bucket = role_env
    for k, v in envs[role].items():
        monkeypatch.setenv(k, v)
    return bucket


def test_the_run_store_and_ray_trains_calls_work_on_the_programs_role(role_env, monkeypatch,
                                                                        tmp_path):
    from ray.train.v2._internal.execution.storage import _upload_to_fs_path

    from workloads.common import storage

    bucket = _on_role(role_env, monkeypatch)
    store = storage.resolve(f"s3://{bucket}/{PREFIX}runs")   # its check: HeadBucket
    run = store.join("exp1")
    # A run's first look for its own bookkeeping: missing, not refused.
    assert store.fs.get_file_info(f"{run}/state.json").type == pafs.FileType.NotFound
    # As Ray Train's StorageContext does: the run's folder, its marker, a checkpoint upload.
    store.fs.create_dir(run)
    with store.fs.open_output_stream(f"{run}/.validate_storage_marker"):
        pass
    _upload_to_fs_path(str(_checkpoint(tmp_path)), store.fs, f"{run}/checkpoint_000000")
    assert store.read_bytes(f"{run}/checkpoint_000000/model.pt") == b"weights"
    store.fs.delete_dir(f"{run}/checkpoint_000000")   # num_to_keep's pruning: a batch delete
    names = {i.base_name for i in store.fs.get_file_info(pafs.FileSelector(run))}
    assert names == {".validate_storage_marker"}, names


def test_the_strict_reading_refuses_the_bucket_check_and_a_missing_file(role_env, monkeypatch):
    from workloads.common import storage

    bucket = _on_role(role_env, monkeypatch, "strict")
    with pytest.raises(StorageError, match="HeadBucket"):
        storage.resolve(f"s3://{bucket}/{PREFIX}runs")   # the kit's storage check
    fs = storage.s3_filesystem()
    run = f"{bucket}/{PREFIX}runs/exp2"
    with pytest.raises(OSError, match="ACCESS_DENIED during HeadBucket"):
        fs.create_dir(run)   # Ray Train's StorageContext, before a run's first step
    with pytest.raises(OSError, match="ACCESS_DENIED during HeadObject"):
        fs.get_file_info(f"{run}/state.json")   # a file not written yet


def _checkpoint(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"weights")
    return tmp_path / "ckpt"


def test_a_path_outside_the_prefix_is_refused_in_one_line(role_env, monkeypatch):
    from workloads.common import storage

    bucket = _on_role(role_env, monkeypatch)
    with pytest.raises(StorageError, match=rf"^s3://{bucket}/runs: not writable: "
                                           r".*ACCESS_DENIED") as e:
        storage.resolve(f"s3://{bucket}/runs")
    assert "\n" not in str(e.value)
