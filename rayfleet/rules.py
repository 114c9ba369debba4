"""The security rules: one registry, read by ``rayfleet lint``, the CrossGuard policy pack
(infra/policy_pack) and the error messages that cite a rule.

A rule's number, title and the external control it matches live here and nowhere else;
docs/security.md explains each one (a test keeps its headings equal to these titles) and a
test checks that every "rule N" cited anywhere in the repository is one of these.

``enforced`` says where a rule is checked:

- ``pack``: the policy pack, at ``pulumi preview/up --policy-pack infra/policy_pack``, over the
  resources the Pulumi program asks for (and in the kit's tests, over the same graph under
  Pulumi's mocks);
- ``config``: the stack configuration is refused before any resource exists
  (rayfleet/config.py);
- ``lint``: ``rayfleet lint`` over a Ray cluster YAML;
- ``test``: only the kit's own tests (what neither a resource nor a cluster YAML shows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DOC = "docs/security.md"


@dataclass(frozen=True)
class Rule:
    number: int
    title: str
    controls: str  # Checkov / AWS Security Hub / tfsec IDs; "" where none matches
    enforced: tuple[str, ...]

    @property
    def anchor(self) -> str:
        """Where a reader opens the rule: docs/security.md#rule-N."""
        return f"{DOC}#rule-{self.number}"

    @property
    def tag(self) -> str:
        """How messages cite it: ``rule 11 (CKV_AWS_53-56, S3.8)``."""
        return f"rule {self.number} ({self.controls or 'rayfleet'})"


_RULES = (
    Rule(1, "No world ingress to Ray's ports",
         "nearest EC2.18, CKV_AWS_277", ("pack",)),
    Rule(2, "No SSH from the world; SSM, or SSH from named CIDRs only",
         "CKV_AWS_24, AWS-0107", ("pack",)),
    Rule(3, "Every node type names its security groups, subnets and instance profile",
         "", ("lint",)),
    Rule(4, "Ray's ports open only to the cluster's own security group",
         "", ("pack", "lint")),
    Rule(5, "The VPC's default security group denies everything",
         "CKV2_AWS_12, EC2.2", ("pack",)),
    Rule(6, "Every security group and rule has a description",
         "CKV_AWS_23", ("pack",)),
    Rule(7, "Nodes in private subnets, without public IPs",
         "CKV_AWS_88, EC2.9", ("pack", "lint")),
    Rule(8, "VPC flow logs on, with a retention",
         "CKV2_AWS_11, EC2.6", ("pack", "config")),
    Rule(9, "IMDSv2 required, hop limit 1 (2 only where containers need it, with the reason)",
         "CKV_AWS_79, CKV_AWS_341, EC2.8", ("pack",)),
    Rule(10, "EBS volumes encrypted",
         "CKV_AWS_8, EC2.3", ("pack",)),
    Rule(11, "S3 public access blocked, all four flags",
         "CKV_AWS_53-56, S3.8", ("pack",)),
    Rule(12, "S3 server-side encryption (KMS or S3-managed)",
         "CKV_AWS_19/145", ("pack",)),
    Rule(13, "Bucket policies deny requests without TLS",
         "S3.5", ("pack",)),
    Rule(14, "Versioning, expiry of noncurrent versions, abort of incomplete uploads",
         "CKV_AWS_21, CKV_AWS_300", ("pack",)),
    Rule(15, "Bucket ACLs disabled (bucket owner enforced)",
         "CKV2_AWS_65, S3.12", ("pack",)),
    Rule(16, "No full-access or admin policies",
         "CKV_AWS_274, AWS-0345", ("pack",)),
    Rule(17, "Node roles reach only the bucket prefix; the head's EC2 writes need the "
             "cluster tag",
         "CKV_AWS_355, IAM.21", ("pack",)),
    Rule(18, "iam:PassRole only on the worker role",
         "AWS-0342", ("pack",)),
    Rule(19, "Node roles trust ec2.amazonaws.com only",
         "CKV_AWS_60/61", ("pack",)),
    Rule(20, "No secrets in user data, cluster YAMLs or logs",
         "CKV_AWS_46", ("pack", "lint")),
    Rule(21, "Ray token authentication on every node and client; the token file mode 0600",
         "", ("lint", "test")),
    Rule(22, "Dashboard and Jobs API only through a tunnel, never a public listener",
         "CVE-2023-48022", ("lint", "test")),
    Rule(23, "`ray down` terminates nodes (cache_stopped_nodes: false)",
         "", ("lint",)),
    Rule(24, "Operator CIDRs refuse the world and malformed ranges",
         "", ("config",)),
    Rule(25, "One pinned Ray version on client, head and workers",
         "", ("lint", "test")),
    Rule(26, "The head's EC2 read actions listed one by one",
         "CKV_AWS_355", ("pack", "test")),
    Rule(27, "Access to the checkpoint bucket is logged",
         "CKV_AWS_18, S3.9", ("pack",)),
    Rule(28, "Log groups encrypted with a customer-managed KMS key",
         "CKV_AWS_158", ("pack",)),
    Rule(29, "KMS keys carry an explicit key policy",
         "CKV2_AWS_64", ("pack",)),
    Rule(30, "Serve's HAProxy ingress: its pages on loopback, its replica ports from the "
             "cluster only",
         "", ("pack", "lint", "test")),
    Rule(31, "Reserved capacity: a template targets exactly its configured reservation, and a "
             "Capacity Block is never spot",
         "", ("pack", "lint")),
    Rule(32, "A GPU worker template's EFA interfaces and placement group are in the AZ it was "
             "built for",
         "", ("pack",)),
    Rule(33, "The GCS store: Redis encrypted at rest and in transit, behind an auth token, "
             "reachable from the cluster's security group only; only the head reads its token",
         "CKV_AWS_29, CKV_AWS_30, CKV_AWS_31, ElastiCache.4, ElastiCache.5",
         ("pack", "lint")),
)

RULES: Mapping[int, Rule] = {r.number: r for r in _RULES}


def rule(number: int) -> Rule:
    return RULES[number]
