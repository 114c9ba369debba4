"""Fixtures: the Pulumi program built under mocks for four stacks, once per session.

- ``dev``: the worked example, Pulumi.dev.yaml.
- ``minimal``: every default, and S3-managed encryption, no budget, no operator CIDRs.
- ``ha``: the worked example with rayfleet:headHa on (the GCS store, the head's fixed address).
- ``maximal``: every option on — 6 AZs, a NAT per AZ, IPv4 and IPv6 operator CIDRs, p4de,
  Ray in Docker (IMDS hop limit 2), a pinned AMI, a budget.
"""

from __future__ import annotations


import pytest
import yaml

from .harness import ROOT, Built, run_program

MINIMAL = {"rayfleet:bucketEncryption": "s3"}
MAXIMAL = {
    "rayfleet:clusterName": "fleet-max",
    "rayfleet:region": "us-west-2",
    "rayfleet:azCount": 6,
    "rayfleet:workerAz": "us-west-2d",
    "rayfleet:vpcCidr": "10.64.0.0/16",
    "rayfleet:natGateways": "per-az",
    "rayfleet:flowLogRetentionDays": 365,
    "rayfleet:operatorCidrs": ["10.8.0.0/16", "192.168.10.0/24", "2001:db8::/48"],
    "rayfleet:headInstanceType": "m7i.4xlarge",
    # Two types as an engineer falling back from A100s to H100s lists them: the p5's 32
    # network cards are the most EFA interfaces a template carries.
    "rayfleet:workerInstanceTypes": ["p4d.24xlarge", "p5.48xlarge"],
    "rayfleet:minWorkers": 2,
    "rayfleet:maxWorkers": 8,
    "rayfleet:onDemandWorkers": 3,
    "rayfleet:headRootVolumeGb": 300,
    "rayfleet:workerRootVolumeGb": 2000,
    "rayfleet:amiId": "ami-0fedcba9876543210",
    "rayfleet:rayInDocker": True,
    "rayfleet:bucketPrefix": "fleet-max-ckpt-",
    "rayfleet:bucketKeyPrefix": "teams/ml/",
    "rayfleet:bucketEncryption": "kms",
    "rayfleet:noncurrentVersionDays": 90,
    "rayfleet:abortMultipartDays": 2,
    "rayfleet:budgetMonthlyUsd": 50000,
    "rayfleet:budgetEmails": ["oncall@example.com", "finance@example.com"],
    "rayfleet:vllm": "cpu",
}


def dev_config() -> dict:
    return yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())["config"]


def ha_config() -> dict:
    return {**dev_config(), "rayfleet:headHa": True}


STACKS = {"dev": dev_config, "minimal": lambda: dict(MINIMAL), "maximal": lambda: dict(MAXIMAL),
          "ha": ha_config}


@pytest.fixture(scope="session")
def built() -> dict[str, Built]:
    """{stack: Built}, each built once for the whole session (a build takes ~2 s)."""
    return {name: run_program(config(), stack=name) for name, config in STACKS.items()}


@pytest.fixture(scope="session", params=sorted(STACKS))
def stack(request, built) -> tuple[str, dict, Built]:
    """Each of the four stacks in turn: (name, config, Built)."""
    return request.param, STACKS[request.param](), built[request.param]
