"""The fake cloud's moto (tests/fakecloud/motoserver.py) frees a terminated instance's address
as EC2 does: held while it shuts down (a launch at it refused with EC2's error), then a
replaced head may launch at it again, and an instance launched without an address meanwhile
does not take it first. With access control on, it judges S3 as AWS does
for the node roles' one condition (`s3:prefix`) and leaves the other services unjudged. Run in
a child process: the module patches moto's classes for the process that imports it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.moto

SCENARIO = """
import importlib.util, sys, time, boto3
from botocore.config import Config
from moto import mock_aws
if sys.argv[1] == "patched":
    spec = importlib.util.spec_from_file_location("ms", "tests/fakecloud/motoserver.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
with mock_aws():
    ec2 = boto3.client("ec2", region_name="us-east-1",
                       config=Config(retries={"total_max_attempts": 1}))
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    def launch(**kw):
        return ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                                 SubnetId=subnet, **kw)["Instances"][0]
    def head():
        try:
            return launch(PrivateIpAddress="10.0.0.200")["PrivateIpAddress"]
        except Exception as e:
            return f"refused {getattr(e, 'response', {}).get('Error', {}).get('Code') or e}"
    first = launch(PrivateIpAddress="10.0.0.200")
    ec2.terminate_instances(InstanceIds=[first["InstanceId"]])
    print("shutting down", head())
    print("other", launch()["PrivateIpAddress"])
    time.sleep(1.5)   # past the hold the test sets
    print("head", head())
"""


def _run(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCENARIO, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing",
                               "RAYFLEET_FAKECLOUD_ADDRESS_HOLD_S": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_replaced_head_launches_at_its_fixed_address_after_an_instance_without_one():
    assert _run("patched") == ("shutting down refused InvalidIPAddress.InUse\n"
                               "other 10.0.0.4\nhead 10.0.0.200\n")


def test_plain_moto_refuses_it_which_is_why_the_fake_cloud_patches_it():
    # moto 5.2 alone keeps the address held: the fixed-address launch fails, even later.
    out = _run("plain").splitlines()
    assert out[0].startswith("shutting down refused") and out[-1].startswith("head refused")


# A node's role as the stack's storage policy shapes it (infra/components/iam.py; the fake-cloud
# rehearsal runs the program's own roles): list only under the prefix, read and write only
# under it.
IAM_SCENARIO = """
import importlib.util, json, sys, boto3
from botocore.exceptions import ClientError
from moto import mock_aws, settings
if sys.argv[1] == "patched":
    spec = importlib.util.spec_from_file_location("ms", "tests/fakecloud/motoserver.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
policy = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::bkt",
     "Condition": {"StringLike": {"s3:prefix": ["rayfleet/*", "rayfleet"]}}},
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
     "Resource": "arn:aws:s3:::bkt/rayfleet/*"}]}
trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
         "Principal": {"Service": "ec2.amazonaws.com"}}]}
with mock_aws():
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="bkt")
    iam = boto3.client("iam", region_name="us-east-1")
    role = iam.create_role(RoleName="node", AssumeRolePolicyDocument=json.dumps(trust))["Role"]
    iam.put_role_policy(RoleName="node", PolicyName="storage", PolicyDocument=json.dumps(policy))
    c = boto3.client("sts", region_name="us-east-1").assume_role(
        RoleArn=role["Arn"], RoleSessionName="i-1")["Credentials"]
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    kw = dict(region_name="us-east-1", aws_access_key_id=c["AccessKeyId"],
              aws_secret_access_key=c["SecretAccessKey"], aws_session_token=c["SessionToken"])
    s3 = boto3.client("s3", **kw)
    def said(what, call):
        try:
            call()
            print(what, "allowed")
        except ClientError as e:
            print(what, e.response["Error"]["Code"])
    said("put inside", lambda: s3.put_object(Bucket="bkt", Key="rayfleet/runs/x", Body=b"x"))
    said("put outside", lambda: s3.put_object(Bucket="bkt", Key="runs/x", Body=b"x"))
    said("list inside", lambda: s3.list_objects_v2(Bucket="bkt", Prefix="rayfleet/runs/"))
    said("list outside", lambda: s3.list_objects_v2(Bucket="bkt", Prefix="runs/"))
    said("list no prefix", lambda: s3.list_objects_v2(Bucket="bkt"))
    def batch(key):
        errors = s3.delete_objects(Bucket="bkt", Delete={"Objects": [{"Key": key}]}).get("Errors")
        if errors:
            raise ClientError({"Error": {"Code": errors[0]["Code"]}}, "DeleteObjects")
    said("batch delete inside", lambda: batch("rayfleet/runs/x"))
    said("batch delete outside", lambda: batch("runs/x"))
    said("get missing", lambda: s3.get_object(Bucket="bkt", Key="rayfleet/runs/none"))
    said("head missing", lambda: s3.head_object(Bucket="bkt", Key="rayfleet/runs/none"))
    said("ec2 not judged", lambda: boto3.client("ec2", **kw).describe_instances())
    # The same role with the condition's IfExists form (a request with no prefix passes).
    if_exists = json.loads(json.dumps(policy).replace('"StringLike"', '"StringLikeIfExists"'))
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 1000
    iam.put_role_policy(RoleName="node", PolicyName="storage",
                        PolicyDocument=json.dumps(if_exists))
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    said("IfExists: head missing", lambda: s3.head_object(Bucket="bkt",
                                                         Key="rayfleet/runs/none"))
    said("IfExists: list outside", lambda: s3.list_objects_v2(Bucket="bkt", Prefix="runs/"))
"""


def _run_iam(mode: str) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", IAM_SCENARIO, mode], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(ln.rsplit(" ", 1) for ln in proc.stdout.splitlines())


def test_s3_is_judged_by_the_roles_prefix_condition_as_aws_judges_it():
    assert _run_iam("patched") == {
        "put inside": "allowed", "put outside": "AccessDenied", "list inside": "allowed",
        "list outside": "AccessDenied", "list no prefix": "AccessDenied",
        "batch delete inside": "allowed", "batch delete outside": "AccessDenied",
        # A missing key, for a role that may list only under a prefix: 403, not 404.
        "get missing": "AccessDenied", "head missing": "AccessDenied", "ec2 not judged": "allowed",
        "IfExists: head missing": "404", "IfExists: list outside": "AccessDenied"}


def test_plain_moto_lets_a_prefix_condition_pass_and_judges_ec2():
    # moto 5.2 alone: the condition is never evaluated (every list allowed), and EC2 is judged
    # against a resource of "*" (this role has no EC2 statement: denied).
    got = _run_iam("plain")
    assert got["list outside"] == got["list no prefix"] == "allowed", got
    # ... and a batch delete judged on the bucket's ARN: denied even inside the prefix; a
    # missing key is 404 to anyone who may read it.
    assert got["batch delete inside"] == "AccessDenied", got
    assert got["get missing"] == "NoSuchKey" and got["head missing"] == "404", got
    assert got["ec2 not judged"] != "allowed", got
