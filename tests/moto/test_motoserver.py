"""The fake cloud's moto (tests/fakecloud/motoserver.py) frees a terminated instance's address
as EC2 does: a replaced head may launch at it again, and an instance launched without an
address meanwhile does not take it first. Run in a child process: the module patches moto's
Instance class for the process that imports it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.moto

SCENARIO = """
import importlib.util, sys, boto3
from moto import mock_aws
if sys.argv[1] == "patched":
    spec = importlib.util.spec_from_file_location("ms", "tests/fakecloud/motoserver.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
with mock_aws():
    ec2 = boto3.client("ec2", region_name="us-east-1")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    def launch(**kw):
        return ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                                 SubnetId=subnet, **kw)["Instances"][0]
    head = launch(PrivateIpAddress="10.0.0.200")
    ec2.terminate_instances(InstanceIds=[head["InstanceId"]])
    print("other", launch()["PrivateIpAddress"])
    try:
        print("head", launch(PrivateIpAddress="10.0.0.200")["PrivateIpAddress"])
    except Exception as e:
        print("head refused", type(e).__name__)
"""


def _run(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCENARIO, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_replaced_head_launches_at_its_fixed_address_after_an_instance_without_one():
    assert _run("patched") == "other 10.0.0.4\nhead 10.0.0.200\n"


def test_plain_moto_refuses_it_which_is_why_the_fake_cloud_patches_it():
    # moto 5.2 alone keeps the address held: the fixed-address launch fails.
    assert "head refused" in _run("plain")
