"""In-process moto (``mock_aws``), one resource per fixture, chained (DESIGN convention 7)."""

from __future__ import annotations

import pytest

REGION = "us-east-1"


@pytest.fixture
def aws(monkeypatch):
    """Fake credentials and an in-process moto for every AWS service; nothing leaves the box."""
    from moto import mock_aws

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
                 # moto's 1,300 default AMIs take seconds per test to load; tests register
                 # the one image they use (the `ami` fixture).
                 "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(k, raising=False)
    with mock_aws():
        yield


@pytest.fixture
def ec2(aws):
    import boto3

    return boto3.client("ec2", region_name=REGION)


@pytest.fixture
def aws_calls(monkeypatch):
    """Every AWS API operation botocore makes in this process, in order."""
    import botocore.client

    calls: list[str] = []
    real = botocore.client.BaseClient._make_api_call

    def counting(self, operation, params):
        calls.append(operation)
        return real(self, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", counting)
    return calls


@pytest.fixture
def ami(ec2) -> str:
    """A registered image, standing in for the Deep Learning AMI."""
    return ec2.register_image(Name="dlami-standin", RootDeviceName="/dev/sda1",
                              Architecture="x86_64")["ImageId"]
