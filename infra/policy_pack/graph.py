"""The resource graph as the checks read it: :class:`Resource`, :class:`Violation`, Pulumi's
type tokens, and the helpers every rule module shares.

During a preview, a property another resource has not produced yet (an ARN, an id) is
unknown: references between resources are followed through Pulumi's property dependencies
(:func:`_points_to`), and a check that needs an unknown value is reported by CrossGuard as not
runnable in that preview instead of guessing. Property names are Pulumi's camelCase.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rayfleet.rules import RULES as REGISTRY


@dataclass(frozen=True)
class Resource:
    type: str  # e.g. "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    name: str  # the logical (Pulumi) name
    inputs: Mapping[str, Any]
    outputs: Mapping[str, Any] = field(default_factory=dict)  # id, arn, name, bucket, ...
    urn: str = ""
    parent: str = ""
    provider: str = ""
    # property name -> URNs of the resources its value came from (Pulumi's
    # propertyDependencies): how a reference is followed while the referenced id is unknown.
    deps: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.type.rsplit(':', 1)[-1]} '{self.name}'"

    @property
    def refs(self) -> set[str]:
        """Every known value another resource may use to point at this one (id, name, ARN)."""
        out = {_known(self.outputs, k) for k in ("id", "arn", "name", "bucket")}
        out |= {_known(self.inputs, k) for k in ("name", "bucket")}
        return {str(v) for v in out if v}


@dataclass(frozen=True)
class Violation:
    rule: int
    external_id: str
    resource: str  # Resource.label
    message: str
    urn: str = ""  # the offending resource's, for CrossGuard's report

    def __str__(self) -> str:
        return f"rule {self.rule} ({self.external_id}): {self.resource} {self.message}"


# ----------------------------------------------------------------------------- type tokens

VPC = "aws:ec2/vpc:Vpc"
SUBNET = "aws:ec2/subnet:Subnet"
ROUTE = "aws:ec2/route:Route"
ROUTE_TABLE = "aws:ec2/routeTable:RouteTable"
ROUTE_ASSOC = "aws:ec2/routeTableAssociation:RouteTableAssociation"
IGW = "aws:ec2/internetGateway:InternetGateway"
SG = "aws:ec2/securityGroup:SecurityGroup"
DEFAULT_SG = "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SG_INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SG_EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"
FLOW_LOG = "aws:ec2/flowLog:FlowLog"
LOG_GROUP = "aws:cloudwatch/logGroup:LogGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
VOLUME = "aws:ebs/volume:Volume"
BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
SSE = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
       ("aws:s3/bucketServerSideEncryptionConfigurationV2:"
       "BucketServerSideEncryptionConfigurationV2"))
BUCKET_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
VERSIONING = ("aws:s3/bucketVersioning:BucketVersioning",
              "aws:s3/bucketVersioningV2:BucketVersioningV2")
LIFECYCLE = ("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
             "aws:s3/bucketLifecycleConfigurationV2:BucketLifecycleConfigurationV2")
OWNERSHIP = "aws:s3/bucketOwnershipControls:BucketOwnershipControls"
BUCKET_ACLS = ("aws:s3/bucketAcl:BucketAcl", "aws:s3/bucketAclV2:BucketAclV2")
LOGGING = ("aws:s3/bucketLogging:BucketLogging", "aws:s3/bucketLoggingV2:BucketLoggingV2")
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ROLE_ATTACHMENT = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
POLICY = "aws:iam/policy:Policy"
POLICY_ATTACHMENTS = ("aws:iam/policyAttachment:PolicyAttachment",
                      "aws:iam/userPolicyAttachment:UserPolicyAttachment",
                      "aws:iam/groupPolicyAttachment:GroupPolicyAttachment")
INSTANCE_PROFILE = "aws:iam/instanceProfile:InstanceProfile"
REPLICATION_GROUP = "aws:elasticache/replicationGroup:ReplicationGroup"
CACHE_CLUSTER = "aws:elasticache/cluster:Cluster"
SECRET = "aws:secretsmanager/secret:Secret"
KMS_KEY = "aws:kms/key:Key"


# ----------------------------------------------------------------------------- helpers

UNKNOWN = object()  # a value a preview cannot know yet


def _value(props: Mapping[str, Any], key: str) -> Any:
    """props[key]; None when absent; UNKNOWN where CrossGuard holds it as unknown (a preview,
    before the resource it comes from exists)."""
    try:
        return props.get(key)
    except Exception as err:  # pulumi_policy's UnknownValueError
        if type(err).__name__ == "UnknownValueError":
            return UNKNOWN
        raise


def _known(props: Mapping[str, Any], key: str) -> Any:
    value = _value(props, key)
    return None if value is UNKNOWN else value


def _points_to(r: Resource, key: str, target: Resource) -> bool:
    """Whether ``r``'s property ``key`` refers to ``target``: by value (id, name, ARN), or by
    the property's dependency on ``target`` when the value is not known yet."""
    value = _value(r.inputs, key)
    if value is None:
        return False
    if value is not UNKNOWN and str(value).removesuffix(":*") in target.refs:
        return True
    return bool(target.urn) and target.urn in r.deps.get(key, ())


def _lists(r: Resource, key: str, target: Resource) -> bool:
    """Whether ``r``'s list property ``key`` names ``target`` (by value, or by dependency while
    the value is unknown)."""
    value = _value(r.inputs, key)
    if value not in (None, UNKNOWN) and any(str(v) in target.refs for v in _list(value)):
        return True
    return bool(target.urn) and target.urn in r.deps.get(key, ())


def _referenced(lt: Resource, key: str, value: Any, candidates: Sequence[Resource]
                ) -> list[Resource]:
    """The candidates ``value`` (a property of ``lt`` under ``key``) refers to: by id, name or
    ARN when known, else through the property's dependencies (a preview)."""
    if value is not None and value is not UNKNOWN:
        return [c for c in candidates if str(value) in c.refs]
    return [c for c in candidates if c.urn and c.urn in lt.deps.get(key, ())]


def _all(resources: Iterable[Resource], *types: str) -> list[Resource]:
    return [r for r in resources if r.type in types]


def _v(rule: int, r: Resource | str, message: str) -> Violation:
    label = r.label if isinstance(r, Resource) else r
    return Violation(rule, REGISTRY[rule].controls or "rayfleet", label, message,
                     r.urn if isinstance(r, Resource) else "")


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def _list(value: Any) -> list:
    if value is None:
        return []
    # CrossGuard hands lists over as read-only sequences, not lists.
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return [value]


def _statements(doc: Any) -> list[dict]:
    doc = _json(doc)
    if not isinstance(doc, dict):
        return []
    return [s for s in _list(doc.get("Statement")) if isinstance(s, dict)]


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _actions(statement: dict) -> list[str]:
    return [str(a) for a in _list(statement.get("Action"))]


def _allows(statement: dict) -> bool:
    return statement.get("Effect") == "Allow"
