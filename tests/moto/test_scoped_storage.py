"""The kit's S3 calls work on a node role's credentials, which may touch only the stack's key
prefix (the Pulumi program's own storage policy, run under Pulumi's mocks),
with moto judging S3 as AWS does (tests/fakecloud/motoserver.py, IAM on): the run store
resolves, Ray Train's folder and upload calls go through, a path outside the prefix is refused
in one line. pyarrow's own S3 filesystem is refused the folder (its HeadBucket), which is why
the kit wraps it (workloads/common/s3scope.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pyarrow.fs as pafs
import pytest

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
        arn = iam.create_role(RoleName="node", AssumeRolePolicyDocument=json.dumps(trust))
        iam.put_role_policy(RoleName="node", PolicyName="storage", PolicyDocument=policy)
        c = boto3.client("sts", **kw).assume_role(RoleArn=arn["Role"]["Arn"],
                                                  RoleSessionName="i-node")["Credentials"]
        urllib.request.urlopen(urllib.request.Request(
            url + "/moto-api/reset-auth", data=b"0", method="POST",
            headers={"Content-Type": "text/plain"}), timeout=10)
        yield {"AWS_ACCESS_KEY_ID": c["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": c["SecretAccessKey"],
               "AWS_SESSION_TOKEN": c["SessionToken"], "AWS_DEFAULT_REGION": "us-west-2",
               "AWS_ENDPOINT_URL_S3": url}, bucket
    finally:
        proc.kill()
        proc.wait()


def _on_role(role_env, monkeypatch) -> str:
    env, bucket = role_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return bucket


def test_the_run_store_and_ray_trains_folder_calls_work_on_the_prefix(role_env, monkeypatch,
                                                                         tmp_path):
    from ray.train.v2._internal.execution.storage import _upload_to_fs_path

    from workloads.common import storage

    bucket = _on_role(role_env, monkeypatch)
    store = storage.resolve(f"s3://{bucket}/{PREFIX}runs")
    # As Ray Train's StorageContext does: the run's folder, its marker, a checkpoint upload.
    run = store.join("exp1")
    store.fs.create_dir(run)
    with store.fs.open_output_stream(f"{run}/.validate_storage_marker"):
        pass
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"weights")
    _upload_to_fs_path(str(tmp_path / "ckpt"), store.fs, f"{run}/checkpoint_000000")
    assert store.read_bytes(f"{run}/checkpoint_000000/model.pt") == b"weights"
    store.fs.delete_dir(f"{run}/checkpoint_000000")   # num_to_keep's pruning: a batch delete
    names = {i.base_name for i in store.fs.get_file_info(pafs.FileSelector(run))}
    assert names == {".validate_storage_marker"}, names
    # pyarrow's own filesystem asks about the bucket first, and the role may not.
    with pytest.raises(OSError, match="HeadBucket"):
        store.filesystem.create_dir(f"{run}/other", recursive=True)


def test_a_path_outside_the_prefix_is_refused_in_one_line(role_env, monkeypatch):
    from rayfleet.errors import StorageError
    from workloads.common import storage

    bucket = _on_role(role_env, monkeypatch)
    with pytest.raises(StorageError, match=rf"^s3://{bucket}/runs: not writable: "
                                           r".*ACCESS_DENIED") as e:
        storage.resolve(f"s3://{bucket}/runs")
    assert "\n" not in str(e.value)


def test_a_missing_bucket_is_named_so(aws_env, monkeypatch):
    # Asked about the prefix, S3 cannot say the bucket is missing; the write probe does.
    from rayfleet.errors import StorageError
    from workloads.common import storage

    for k, v in aws_env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(StorageError, match=r"^s3://rayfleet-no-such-bucket/rayfleet/runs: "
                                           r"bucket 'rayfleet-no-such-bucket' does not exist"):
        storage.resolve("s3://rayfleet-no-such-bucket/rayfleet/runs")
