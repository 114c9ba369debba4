"""The infrastructure security rules (docs/security.md), run as the CrossGuard policy pack
(infra/policy_pack) over the graph the program asks for under Pulumi's mocks.

For every rule: the four stacks (dev, minimal, maximal, ha) pass the pack, and at least one
mutation — a resource of the real graph changed the way a careless edit would change it, or
a resource added — makes the rule's policy report a violation naming the offending resource.
A few mutations go through the program itself under Pulumi's mocks.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
from collections.abc import Callable

import pulumi_aws as aws
import pytest

from infra.components import gpu_nodes
from infra.policy_pack import checks as policy
from infra.policy_pack import pack
from infra.policy_pack.checks import CHECKS, Resource
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from rayfleet.facts import GCS_STORE_PORT, TAG_AVAILABILITY_ZONE
from rayfleet.rules import RULES

from .conftest import MAXIMAL, dev_config
from .harness import Built, policy_resources, run_program

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class Reported:
    """One violation as the pack reports it to the engine."""

    message: str
    urn: str | None

    def _part(self, group: int) -> str:
        m = re.match(r"rule (\d+) \(([^)]*)\): (\S+ '[^']*')", self.message)
        assert m, f"unexpected policy message: {self.message}"
        return m.group(group)

    @property
    def rule(self) -> int:
        return int(self._part(1))

    @property
    def resource(self) -> str:
        return self._part(3)

    def __str__(self) -> str:
        return self.message


def check(resources: list[Resource], rules=None, *, operator_cidrs=(),
          capacity_reservations=()) -> list[Reported]:
    """What the policy pack reports over ``resources``, as `pulumi preview --policy-pack`."""
    return [Reported(m, u) for m, u in pack.evaluate(
        policy_resources(resources), rules, operator_cidrs=operator_cidrs,
        capacity_reservations=capacity_reservations)]


# ----------------------------------------------------------------------------- no violations

@pytest.mark.parametrize("rule", sorted(CHECKS), ids=lambda n: f"rule-{n}")
def test_rule_holds_on_every_stack(rule, stack):
    _, values, b = stack
    operator_cidrs = values.get("rayfleet:operatorCidrs", [])
    violations = check(b.resources, [rule], operator_cidrs=operator_cidrs)
    assert not violations, "\n".join(map(str, violations))


def test_the_pack_has_one_mandatory_policy_per_rule_the_graph_shows():
    assert set(CHECKS) == {n for n, r in RULES.items() if "pack" in r.enforced}
    policies = pack.policies([])
    assert [p.name for p in policies] == [f"rayfleet-rule-{n}" for n in sorted(CHECKS)]
    for p, n in zip(policies, sorted(CHECKS), strict=True):
        assert p.enforcement_level == pack.EnforcementLevel.MANDATORY
        assert RULES[n].title in p.description and f"docs/security.md#rule-{n}" in p.description


# ----------------------------------------------------------------------------- mutation kit

Mutation = Callable[[Built], tuple[list[Resource], str]]


def _pick(b: Built, name: str, typ: str | None) -> Resource:
    found = [r for r in b.resources if r.name == name and typ in (None, r.type)]
    assert len(found) == 1, f"{len(found)} resources named {name!r} (type {typ})"
    return found[0]


def edit(b: Built, name: str, change: Callable[[dict], object],
         typ: str | None = None) -> tuple[list[Resource], str]:
    """The graph with resource ``name``'s inputs changed in place of the original."""
    target = _pick(b, name, typ)
    inputs = copy.deepcopy(dict(target.inputs))
    change(inputs)
    # A value written in by hand no longer comes from the resource it came from.
    deps = {k: v for k, v in target.deps.items() if inputs.get(k) == target.inputs.get(k)}
    changed = dataclasses.replace(target, inputs=inputs, deps=deps)
    return [changed if r is target else r for r in b.resources], name


def drop(b: Built, name: str, reported: str,
         typ: str | None = None) -> tuple[list[Resource], str]:
    target = _pick(b, name, typ)
    return [r for r in b.resources if r is not target], reported


def add(b: Built, like: str, name: str, change: Callable[[dict], object],
        typ: str | None = None) -> tuple[list[Resource], str]:
    """The graph plus a copy of resource ``like`` renamed ``name`` and changed."""
    template = _pick(b, like, typ)
    inputs = copy.deepcopy(dict(template.inputs))
    change(inputs)
    extra = dataclasses.replace(template, name=name, inputs=inputs,
                                outputs={**template.outputs, "id": f"x-{name}"},
                                urn=template.urn.rsplit("::", 1)[0] + f"::{name}",
                                deps={k: v for k, v in template.deps.items()
                                      if inputs.get(k) == template.inputs.get(k)})
    return [*b.resources, extra], name


def policy_doc(inputs: dict, change: Callable[[list[dict]], object],
               key: str = "policy") -> None:
    doc = json.loads(inputs[key])
    change(doc["Statement"])
    inputs[key] = json.dumps(doc)


def sid(statements: list[dict], wanted: str) -> dict:
    (found,) = [s for s in statements if s.get("Sid") == wanted]
    return found


def world(cidr: str = "0.0.0.0/0", port: int = 8265, proto: str = "tcp"):
    def change(i: dict) -> None:
        i.pop("referencedSecurityGroupId", None)
        i.update(cidrIpv4=None, cidrIpv6=None, ipProtocol=proto, fromPort=port, toPort=port)
        i["cidrIpv6" if ":" in cidr else "cidrIpv4"] = cidr
    return change


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# Every mutation runs on the dev stack ("rayfleet-dev-..." names) unless marked maximal.
D = "rayfleet-dev"
# The dev stack's worker templates: p4d then p4de (Pulumi.dev.yaml), spot and on-demand each.
WORKER_TEMPLATES = tuple(f"worker-{t}-{m}" for t in ("p4d-24xlarge", "p4de-24xlarge")
                         for m in ("spot", "ondemand"))
MUTATIONS: dict[int, dict[str, Mutation]] = {
    1: {
        "dashboard open to 0.0.0.0/0": lambda b: add(
            b, f"{D}-security-dashboard", "oops-dashboard-world", world()),
        "worker ports open to ::/0": lambda b: add(
            b, f"{D}-security-worker-ports", "oops-workers-v6", world("::/0", 10050)),
        "all protocols from the world": lambda b: add(
            b, f"{D}-security-gcs", "oops-all-world", world(proto="-1", port=0)),
        "legacy SecurityGroupRule on 6379": lambda b: ([*b.resources, Resource(
            policy.SG_RULE, "oops-legacy-gcs", {
                "type": "ingress", "protocol": "tcp", "fromPort": 6379, "toPort": 6379,
                "cidrBlocks": ["0.0.0.0/0"], "securityGroupId": "sg-x", "description": "x"},
            urn="urn:pulumi:dev::rayfleet::aws:ec2/securityGroupRule:SecurityGroupRule::oops")],
            "oops-legacy-gcs"),
        "inline ingress on the cluster group": lambda b: edit(
            b, f"{D}-security-cluster", lambda i: i.update(ingress=[{
                "protocol": "tcp", "fromPort": 10001, "toPort": 10001,
                "cidrBlocks": ["0.0.0.0/0"], "description": "client"}])),
    },
    2: {
        "SSH from 0.0.0.0/0": lambda b: add(
            b, f"{D}-security-ssh", "oops-ssh-world", world(port=22)),
        "SSH from ::/0": lambda b: add(
            b, f"{D}-security-ssh", "oops-ssh-world-v6", world("::/0", 22)),
    },
    4: {
        "GCS from an office range": lambda b: add(
            b, f"{D}-security-gcs", "oops-gcs-office", world("203.0.113.0/24", 6379)),
        "dashboard from a CIDR that is not an operator CIDR": lambda b: add(
            b, f"{D}-security-dashboard", "oops-dashboard-office",
            world("203.0.113.0/24", 8265)),
        "object manager from another security group": lambda b: edit(
            b, f"{D}-security-object-manager",
            lambda i: i.update(referencedSecurityGroupId="sg-someone-else")),
    },
    5: {
        "default group keeps a rule": lambda b: edit(
            b, f"{D}-network-default-sg", lambda i: i.update(ingress=[{
                "protocol": "-1", "fromPort": 0, "toPort": 0, "self": True}])),
        "default group not adopted": lambda b: drop(
            b, f"{D}-network-default-sg", f"{D}-network-vpc"),
    },
    6: {
        "rule without description": lambda b: edit(
            b, f"{D}-security-gcs", lambda i: i.pop("description")),
        "group with the tool's default description": lambda b: edit(
            b, f"{D}-security-efa", lambda i: i.update(description="Managed by Pulumi")),
        "description EC2 rejects": lambda b: edit(
            b, f"{D}-security-egress-all", lambda i: i.update(description="node's egress")),
    },
    7: {
        "subnet maps public IPs": lambda b: edit(
            b, f"{D}-network-private-a", lambda i: i.update(mapPublicIpOnLaunch=True),
            policy.SUBNET),
        "worker interface gets a public IP": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-spot",
            lambda i: i["networkInterfaces"][0].update(associatePublicIpAddress="true")),
        "workers launched into a public subnet": lambda b: edit(
            b, f"{D}-nodes-worker-p4de-24xlarge-ondemand", lambda i: [
                n.update(subnetId="subnet-rayfleet-dev-network-public-b")
                for n in i["networkInterfaces"]]),
    },
    8: {
        "no flow log": lambda b: drop(b, f"{D}-network-flow-log", f"{D}-network-vpc"),
        "flow logs kept forever": lambda b: edit(
            b, f"{D}-network-flow-logs", lambda i: i.pop("retentionInDays"), policy.LOG_GROUP),
        "only rejected traffic logged": lambda b: edit(
            b, f"{D}-network-flow-log", lambda i: i.update(trafficType="REJECT")),
    },
    9: {
        "IMDSv1 allowed": lambda b: edit(
            b, f"{D}-nodes-head", lambda i: i["metadataOptions"].update(httpTokens="optional")),
        "hop limit 2 without a reason": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-spot",
            lambda i: i["metadataOptions"].update(httpPutResponseHopLimit=2)),
        "hop limit left to the AMI": lambda b: edit(
            b, f"{D}-nodes-worker-p4de-24xlarge-ondemand",
            lambda i: i["metadataOptions"].pop("httpPutResponseHopLimit")),
        "no metadata options at all": lambda b: edit(
            b, f"{D}-nodes-head", lambda i: i.pop("metadataOptions")),
    },
    10: {
        "unencrypted root": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-spot",
            lambda i: i["blockDeviceMappings"][0]["ebs"].update(encrypted="false")),
        "root volume left to the AMI": lambda b: edit(
            b, f"{D}-nodes-head", lambda i: i.pop("blockDeviceMappings")),
    },
    11: {
        "one flag off": lambda b: edit(
            b, f"{D}-storage-public-access-block",
            lambda i: i.update(restrictPublicBuckets=False)),
        "no public access block": lambda b: drop(
            b, f"{D}-storage-public-access-block", f"{D}-storage-bucket"),
    },
    12: {
        "no encryption configuration": lambda b: drop(
            b, f"{D}-storage-encryption", f"{D}-storage-bucket"),
        "unknown algorithm": lambda b: (edit(
            b, f"{D}-storage-encryption", lambda i: i["rules"][0][
                "applyServerSideEncryptionByDefault"].update(sseAlgorithm="none"))[0],
            f"{D}-storage-bucket"),
    },
    13: {
        "TLS condition inverted": lambda b: (edit(
            b, f"{D}-storage-policy", lambda i: policy_doc(i, lambda st: sid(
                st, "DenyInsecureTransport")["Condition"]["Bool"].update(
                {"aws:SecureTransport": "true"})))[0], f"{D}-storage-bucket"),
        "no bucket policy": lambda b: drop(b, f"{D}-storage-policy", f"{D}-storage-bucket"),
    },
    14: {
        "versioning suspended": lambda b: (edit(
            b, f"{D}-storage-versioning",
            lambda i: i["versioningConfiguration"].update(status="Suspended"))[0],
            f"{D}-storage-bucket"),
        "noncurrent versions kept forever": lambda b: (edit(
            b, f"{D}-storage-lifecycle", lambda i: i["rules"].pop(0))[0], f"{D}-storage-bucket"),
        "multipart rule disabled": lambda b: (edit(
            b, f"{D}-storage-lifecycle", lambda i: i["rules"][1].update(status="Disabled"))[0],
            f"{D}-storage-bucket"),
    },
    15: {
        "object writer owns objects": lambda b: (edit(
            b, f"{D}-storage-ownership", lambda i: i["rule"].update(
                objectOwnership="ObjectWriter"))[0], f"{D}-storage-bucket"),
        "public-read ACL": lambda b: edit(
            b, f"{D}-storage-bucket", lambda i: i.update(acl="public-read")),
    },
    16: {
        "AmazonEC2FullAccess attached": lambda b: add(
            b, f"{D}-iam-head-ssm", "oops-ec2-full",
            lambda i: i.update(policyArn="arn:aws:iam::aws:policy/AmazonEC2FullAccess")),
        "AdministratorAccess attached": lambda b: add(
            b, f"{D}-iam-worker-ssm", "oops-admin",
            lambda i: i.update(policyArn="arn:aws:iam::aws:policy/AdministratorAccess")),
        "inline Action *": lambda b: edit(
            b, f"{D}-iam-worker-storage", lambda i: policy_doc(
                i, lambda st: st.append({"Effect": "Allow", "Action": "*", "Resource": "*"}))),
        "inline s3:*": lambda b: edit(
            b, f"{D}-iam-head-storage", lambda i: policy_doc(
                i, lambda st: sid(st, "ReadWriteClusterPrefix").update(Action="s3:*"))),
    },
    17: {
        "worker reaches every bucket": lambda b: edit(
            b, f"{D}-iam-worker-storage", lambda i: policy_doc(
                i, lambda st: sid(st, "ReadWriteClusterPrefix").update(
                    Resource="arn:aws:s3:::*"))),
        "worker reaches the whole bucket": lambda b: edit(
            b, f"{D}-iam-worker-storage", lambda i: policy_doc(
                i, lambda st: sid(st, "ReadWriteClusterPrefix").update(
                    Resource=sid(st, "BucketMetadata")["Resource"] + "/*"))),
        "listing without a prefix condition": lambda b: edit(
            b, f"{D}-iam-worker-storage", lambda i: policy_doc(
                i, lambda st: sid(st, "ListClusterPrefix").pop("Condition"))),
        "head terminates any instance": lambda b: edit(
            b, f"{D}-iam-head-autoscaler", lambda i: policy_doc(
                i, lambda st: sid(st, "ManageOnlyClusterInstances").pop("Condition"))),
        "head launches untagged instances": lambda b: edit(
            b, f"{D}-iam-head-autoscaler", lambda i: policy_doc(
                i, lambda st: sid(st, "LaunchOnlyClusterTaggedInstances").pop("Condition"))),
        "worker may launch instances": lambda b: edit(
            b, f"{D}-iam-worker-storage", lambda i: policy_doc(
                i, lambda st: st.append({"Effect": "Allow", "Action": "ec2:RunInstances",
                                         "Resource": "*"}))),
    },
    18: {
        "PassRole on *": lambda b: edit(
            b, f"{D}-iam-head-autoscaler", lambda i: policy_doc(
                i, lambda st: sid(st, "PassOnlyTheWorkerRole").update(Resource="*"))),
        "PassRole on the head role itself": lambda b: edit(
            b, f"{D}-iam-head-autoscaler", lambda i: policy_doc(
                i, lambda st: sid(st, "PassOnlyTheWorkerRole").update(
                    Resource=b.outputs["rayfleet"]["roles"]["head"]["arn"]))),
    },
    19: {
        "node role trusts Lambda too": lambda b: edit(
            b, f"{D}-iam-head", lambda i: policy_doc(
                i, lambda st: st[0]["Principal"].update(
                    Service=["ec2.amazonaws.com", "lambda.amazonaws.com"]),
                key="assumeRolePolicy"), policy.ROLE),
        "role trusts every AWS account": lambda b: edit(
            b, f"{D}-iam-worker", lambda i: policy_doc(
                i, lambda st: st[0].update(Principal={"AWS": "*"}), key="assumeRolePolicy"),
            policy.ROLE),
    },
    20: {
        "Ray token in user data": lambda b: edit(
            b, f"{D}-nodes-head",
            lambda i: i.update(userData=b64("#!/bin/bash\nexport RAY_AUTH_TOKEN=abc\n"))),
        "AWS key in user data": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-spot", lambda i: i.update(userData=b64(
                "aws configure set aws_access_key_id AKIAABCDEFGHIJKLMNOP\n"))),
        "password assignment": lambda b: edit(
            b, f"{D}-nodes-worker-p4de-24xlarge-ondemand", lambda i: i.update(userData=b64(
                "DB_PASSWORD=hunter2hunter2\n"))),
    },
    26: {
        "ec2:Describe* back on the head": lambda b: edit(
            b, f"{D}-iam-head-autoscaler", lambda i: policy_doc(
                i, lambda st: sid(st, "DescribeWhatTheNodeProviderReads").update(
                    Action="ec2:Describe*"))),
        "instance user data readable": lambda b: edit(
            b, f"{D}-iam-head-autoscaler", lambda i: policy_doc(
                i, lambda st: sid(st, "DescribeWhatTheNodeProviderReads")["Action"].append(
                    "ec2:DescribeInstanceAttribute"))),
    },
    27: {
        "access logging removed": lambda b: drop(
            b, f"{D}-storage-access-logging", f"{D}-storage-bucket"),
        "access logs sent to a bucket outside the stack": lambda b: edit(
            b, f"{D}-storage-access-logging",
            lambda i: i.update(targetBucket="someone-elses-log-bucket")),
        "log bucket encrypted with KMS (S3 cannot deliver)": lambda b: (edit(
            b, f"{D}-storage-logs-encryption", lambda i: i["rules"][0][
                "applyServerSideEncryptionByDefault"].update(sseAlgorithm="aws:kms"))[0],
            f"{D}-storage-logs-bucket"),
        "log delivery not granted": lambda b: (edit(
            b, f"{D}-storage-logs-policy", lambda i: policy_doc(
                i, lambda st: st.remove(sid(st, "S3ServerAccessLogsOfTheDataBucket"))))[0],
            f"{D}-storage-logs-bucket"),
    },
    28: {
        "flow logs without a KMS key": lambda b: edit(
            b, f"{D}-network-flow-logs", lambda i: i.pop("kmsKeyId"), policy.LOG_GROUP),
        "key policy shuts CloudWatch Logs out": lambda b: edit(
            b, f"{D}-network-flow-logs-key", lambda i: policy_doc(
                i, lambda st: st.remove(sid(st, "CloudWatchLogsOfThisStack")))),
    },
    29: {
        "bucket key back on the default policy": lambda b: edit(
            b, f"{D}-storage-key", lambda i: i.pop("policy")),
        "flow-log key usable by anyone": lambda b: edit(
            b, f"{D}-network-flow-logs-key", lambda i: policy_doc(
                i, lambda st: st.append({"Effect": "Allow", "Principal": "*",
                                         "Action": "kms:*", "Resource": "*"}))),
    },
    31: {
        # The reservation stack's own mutations (a template that lost its target, ...) are
        # in test_reservations.py; the dev stack has none configured.
        "on-demand template given the capacity-block market type": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-ondemand",
            lambda i: i.update(instanceMarketOptions={"marketType": "capacity-block"})),
        "on-demand template aimed at a reservation the stack does not name": lambda b: edit(
            b, f"{D}-nodes-worker-p4de-24xlarge-ondemand",
            lambda i: i.update(capacityReservationSpecification={
                "capacityReservationTarget": {"capacityReservationId": "cr-0123456789abcdef0"}})),
    },
    32: {
        # The fallback stack's own mutations (a fallback template aimed at the workers' AZ)
        # are in test_fallback_azs.py; the dev stack keeps every worker in us-east-1b.
        "spot template's EFA interfaces moved to another AZ's private subnet": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-spot",
            lambda i: [n.update(subnetId=_pick(b, f"{D}-network-private-a", policy.SUBNET)
                                .outputs["id"]) for n in i["networkInterfaces"]]),
        "on-demand template tagged for an AZ its subnet and group are not in": lambda b: edit(
            b, f"{D}-nodes-worker-p4de-24xlarge-ondemand",
            lambda i: i["tags"].update({TAG_AVAILABILITY_ZONE: "us-east-1c"})),
        "spot template placed in a group this stack does not have": lambda b: edit(
            b, f"{D}-nodes-worker-p4de-24xlarge-spot",
            lambda i: i.update(placement={"groupName": "another-teams-group"})),
        "spot template's AZ tag dropped, its placement group kept": lambda b: edit(
            b, f"{D}-nodes-worker-p4d-24xlarge-spot",
            lambda i: i["tags"].pop(TAG_AVAILABILITY_ZONE)),
    },
    33: {
        # On the ha stack (STACK_OF): the dev stack with rayfleet:headHa.
        "store not encrypted at rest": lambda b: edit(
            b, f"{D}-gcs-redis", lambda i: i.update(atRestEncryptionEnabled=False)),
        "store not encrypted in transit": lambda b: edit(
            b, f"{D}-gcs-redis", lambda i: i.update(transitEncryptionEnabled=False)),
        "store takes clients without TLS (preferred)": lambda b: edit(
            b, f"{D}-gcs-redis", lambda i: i.update(transitEncryptionMode="preferred")),
        "store's auth token dropped": lambda b: edit(
            b, f"{D}-gcs-redis", lambda i: i.pop("authToken")),
        "store left to the VPC's default group": lambda b: edit(
            b, f"{D}-gcs-redis", lambda i: i.pop("securityGroupIds")),
        "store's group opened to the VPC's CIDR": lambda b: add(
            b, f"{D}-gcs-redis-from-cluster", "oops-redis-from-vpc",
            world("10.42.0.0/16", GCS_STORE_PORT)),
        "store's group opened to the world": lambda b: add(
            b, f"{D}-gcs-redis-from-cluster", "oops-redis-world",
            world("0.0.0.0/0", GCS_STORE_PORT)),
        "token readable by the worker role": lambda b: edit(
            b, f"{D}-gcs-head-token", lambda i: i.update(
                role=_pick(b, f"{D}-iam-worker", policy.ROLE).outputs["name"])),
        "head may read every secret": lambda b: edit(
            b, f"{D}-gcs-head-token",
            lambda i: policy_doc(i, lambda st: sid(st, "ReadTheGcsStoreToken").update(
                Resource="*"))),
        # The same read, spelled as IAM also matches it.
        **{f"token readable by the worker role as {action}": (
            lambda b, action=action: edit(b, f"{D}-gcs-head-token", lambda i: (i.update(
                role=_pick(b, f"{D}-iam-worker", policy.ROLE).outputs["name"]), policy_doc(
                i, lambda st: sid(st, "ReadTheGcsStoreToken").update(Action=action)))))
            for action in ("secretsmanager:Get*", "secretsmanager:GetSecret*",
                           "secretsmanager:getsecretvalue", "secretsmanager:?etSecretValue")},
        "token readable by the worker role through NotAction": lambda b: edit(
            b, f"{D}-gcs-head-token", lambda i: (i.update(
                role=_pick(b, f"{D}-iam-worker", policy.ROLE).outputs["name"]), policy_doc(
                i, lambda st: sid(st, "ReadTheGcsStoreToken").update(
                    NotAction="s3:*", Action=None)))),
        "a managed policy on the worker role": lambda b: add(
            b, f"{D}-iam-worker-ssm", "oops-worker-secrets", lambda i: i.update(
                policyArn="arn:aws:iam::aws:policy/SecretsManagerReadWrite")),
        "store's group opened to another security group": lambda b: add(
            b, f"{D}-gcs-redis-from-cluster", "oops-redis-from-other-group",
            lambda i: i.update(referencedSecurityGroupId="sg-0123456789abcdef0")),
        "store's group may send anywhere": lambda b: _egress(b),
    },
    30: {
        "direct-ingress rule widened to Ray's unpinned 30000-31000": lambda b: edit(
            b, f"{D}-security-serve-direct-ingress",
            lambda i: i.update(fromPort=30000, toPort=31000)),
        "fallback-proxy rule removed": lambda b: drop(
            b, f"{D}-security-serve-fallback-proxy", f"{D}-security-cluster"),
    },
}


def _egress(b: Built) -> tuple[list[Resource], str]:
    """The GCS store's group with an egress rule to the world (a copy of its ingress rule,
    turned around)."""
    resources, name = add(b, f"{D}-gcs-redis-from-cluster", "oops-redis-egress",
                          world("0.0.0.0/0", GCS_STORE_PORT))
    extra = resources[-1]
    return [*resources[:-1], dataclasses.replace(extra, type=policy.SG_EGRESS)], name


# The stack a rule's mutations run on, where not the dev stack: the resources they change exist
# only there.
STACK_OF = {33: "ha"}


def test_every_rule_has_a_mutation():
    assert set(MUTATIONS) == set(CHECKS)


@pytest.mark.parametrize("rule,mutation", [(r, m) for r in sorted(MUTATIONS)
                                           for m in MUTATIONS[r]],
                         ids=[f"rule-{r}-{m}" for r in sorted(MUTATIONS) for m in MUTATIONS[r]])
def test_rule_catches_its_mutation_naming_the_resource(rule, mutation, built):
    resources, offender = MUTATIONS[rule][mutation](built[STACK_OF.get(rule, "dev")])
    operator_cidrs = dev_config().get("rayfleet:operatorCidrs", [])
    violations = check(resources, [rule], operator_cidrs=operator_cidrs)
    assert violations, f"rule {rule} missed: {mutation}"
    assert any(f"'{offender}'" in str(v) for v in violations), \
        f"no violation names {offender!r}: " + "; ".join(map(str, violations))
    assert all(str(v).startswith(f"{RULES[rule].tag}: ") and v.urn for v in violations)
    assert all(str(v).endswith(f"(see docs/security.md#rule-{rule})") for v in violations)


def test_a_mutation_breaks_only_the_rules_it_should(built):
    # Opening the dashboard to the world breaks rule 1 and rule 4, and nothing else.
    resources, _ = MUTATIONS[1]["dashboard open to 0.0.0.0/0"](built["dev"])
    assert {v.rule for v in check(resources)} == {1, 4}


# ----------------------------------------------------------------------------- operator CIDRs

def test_operator_cidrs_may_reach_ssh_and_dashboard_but_nothing_else(built):
    b = built["maximal"]
    cidrs = MAXIMAL["rayfleet:operatorCidrs"]
    assert not check(b.resources, [4], operator_cidrs=cidrs)
    # The same graph judged as if no operator CIDRs were configured: every dashboard rule is
    # caught (SSH from a named range is rule 2's business, and allowed).
    caught = {v.resource for v in check(b.resources, [4], operator_cidrs=[])}
    assert caught == {f"SecurityGroupIngressRule 'fleet-max-security-operator-8265-{i}'"
                      for i in range(len(cidrs))}
    assert not check(b.resources, [1, 2], operator_cidrs=[])
    resources, name = add(b, "fleet-max-security-operator-8265-0", "oops-gcs-from-vpn",
                          lambda i: i.update(fromPort=6379, toPort=6379))
    assert [v.resource for v in check(resources, [4], operator_cidrs=cidrs)] == \
        [f"SecurityGroupIngressRule '{name}'"]


# ----------------------------------------------------------------------------- via the program

def test_world_open_dashboard_added_to_the_program_is_caught():
    def careless_change():
        # What the only public Pulumi+Ray example does: 8265 to the internet.
        aws.vpc.SecurityGroupIngressRule(
            "oops-dashboard", security_group_id="sg-rayfleet-dev-security-cluster",
            cidr_ipv4="0.0.0.0/0", ip_protocol="tcp", from_port=8265, to_port=8265,
            description="dashboard")

    b = run_program(dev_config(), extra=careless_change)
    violations = check(b.resources)
    assert {v.rule for v in violations} == {1, 4}
    assert all("SecurityGroupIngressRule 'oops-dashboard'" in str(v) for v in violations)


def test_secret_put_into_user_data_by_the_program_is_caught(monkeypatch):
    real = gpu_nodes.user_data

    def leaky(cluster_name: str, node_kind: str) -> str:
        script = base64.b64decode(real(cluster_name, node_kind)).decode()
        return b64(script + "echo RAY_AUTH_TOKEN=0123456789abcdef >> /etc/environment\n")

    monkeypatch.setattr(gpu_nodes, "user_data", leaky)
    b = run_program(dev_config())
    caught = {v.resource for v in check(b.resources, [20])}
    assert caught == {f"LaunchTemplate '{D}-nodes-{k}'"
                      for k in ("head", *WORKER_TEMPLATES)}


def test_hop_limit_two_in_the_program_needs_its_reason_tag(monkeypatch):
    monkeypatch.setattr(gpu_nodes, "HOP_LIMIT_REASON_TAG", "unrelated-tag")
    b = run_program({**dev_config(), "rayfleet:rayInDocker": True})
    assert {v.resource for v in check(b.resources, [9])} == {
        f"LaunchTemplate '{D}-nodes-{k}'" for k in ("head", *WORKER_TEMPLATES)}


def test_user_data_is_settings_only(built):
    for lt in built["dev"].of_type(policy.LAUNCH_TEMPLATE):
        script = base64.b64decode(lt.inputs["userData"]).decode()
        assert "RAY_AUTH_MODE=token" in script
        assert "RAY_AUTH_TOKEN" not in script


# ----------------------------------------------------------------------------- first preview

def first_preview(resources: list[Resource]) -> list[Resource]:
    """The graph as a stack's first `pulumi preview` hands it to the pack: nothing exists yet,
    so every id and ARN, and every property that comes from another resource, is unknown."""
    unknown = UNKNOWN_STRING_VALUE
    return [dataclasses.replace(
        r, inputs={k: unknown if r.deps.get(k) else v for k, v in r.inputs.items()},
        outputs={k: unknown for k in r.outputs}) for r in resources]


def test_first_preview_follows_references_and_never_guesses(built):
    b = built["dev"]
    cidrs = dev_config().get("rayfleet:operatorCidrs", [])
    skipped: list[str] = []
    assert not pack.evaluate(policy_resources(first_preview(b.resources)),
                             operator_cidrs=cidrs, not_runnable=skipped)
    # Rules whose references are followed through property dependencies run in full. The
    # rest read a value that only exists once AWS has made a resource (a policy document
    # naming an ARN, the KMS key's ARN in the encryption rule, the subnet in a launch
    # template): the engine reports them as not runnable in this preview, never as passed,
    # and they run at the next preview or `pulumi up` (docs/security.md says so).
    assert sorted(skipped) == sorted(pack.policy_name(n)
                                     for n in (7, 12, 13, 16, 17, 18, 26, 27))
    resources, offender = MUTATIONS[11]["no public access block"](b)
    caught = pack.evaluate(policy_resources(first_preview(resources)), [11])
    assert [m for m, _ in caught if f"'{offender}'" in m], caught


# ----------------------------------------------------------------------------- as the engine

def test_the_pack_blocks_over_the_engines_own_protocol(built, tmp_path):
    """infra/policy_pack started as `pulumi preview --policy-pack` starts it (its __main__.py,
    from its own folder, the stack's config in PULUMI_CONFIG), then asked over gRPC."""
    import os
    import subprocess
    import sys

    import grpc
    from google.protobuf import empty_pb2, struct_pb2
    from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

    from .harness import ROOT

    b = built["maximal"]
    env = {**os.environ, "PULUMI_CONFIG": json.dumps(
        {"rayfleet:operatorCidrs": json.dumps(MAXIMAL["rayfleet:operatorCidrs"])})}
    pack_dir = ROOT / "infra" / "policy_pack"
    proc = subprocess.Popen([sys.executable, "-u", str(pack_dir / "__main__.py")], cwd=pack_dir,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline() or 0)
        assert port, proc.stderr.read().decode()[-2000:]
        stub = analyzer_pb2_grpc.AnalyzerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        info = stub.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
        assert [p.name for p in info.policies] == [pack.policy_name(n) for n in sorted(CHECKS)]
        assert {p.enforcementLevel for p in info.policies} == {analyzer_pb2.MANDATORY}

        def analyze(resources: list[Resource]) -> list:
            request = analyzer_pb2.AnalyzeStackRequest(resources=[analyzer_pb2.AnalyzerResource(
                type=r.type, name=r.name, urn=r.urn, parent=r.parent,
                properties=_struct({**r.outputs, **r.inputs}),
                propertyDependencies={k: analyzer_pb2.AnalyzerPropertyDependencies(urns=v)
                                      for k, v in r.deps.items()}) for r in resources])
            return list(stub.AnalyzeStack(request, timeout=60).diagnostics)

        def _struct(props: dict) -> struct_pb2.Struct:
            s = struct_pb2.Struct()
            s.update(json.loads(json.dumps(props, default=str)))
            return s

        # The stack as the program asks for it passes, operator ranges included (read from the
        # stack's config); opening the dashboard to the world is stopped by rules 1 and 4.
        assert analyze(b.resources) == []
        resources, offender = add(b, "fleet-max-security-operator-8265-0", "oops-world-8265",
                                  world())
        found = analyze(resources)
        assert {d.policyName for d in found} == {pack.policy_name(1), pack.policy_name(4)}
        assert all(d.enforcementLevel == analyzer_pb2.MANDATORY and f"'{offender}'" in d.message
                   and d.urn.endswith(f"::{offender}") for d in found)
    finally:
        proc.kill()
        proc.wait()
