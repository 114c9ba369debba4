"""The security rules that concern infrastructure, as checks over the resource graph.

Each check is a pure function from a list of :class:`Resource` (type token, logical name, the
properties Pulumi holds for it, the URNs each property came from) to the :class:`Violation` s
it finds; every violation names the offending resource and the rule with its external ID
(Checkov / AWS Security Hub / tfsec). Numbers, titles and IDs come from ``rayfleet.rules``;
docs/security.md explains each rule.

This module is the checks' one entry point: :data:`CHECKS` maps each rule to its check, and
``pack.py`` turns each into a mandatory CrossGuard stack policy (``pulumi preview/up
--policy-pack infra/policy_pack``); the kit's tests run the same policies over the graph the
program asks for under Pulumi's mocks. The checks live by what they check: ``security_groups``,
``network`` (the VPC), ``compute`` (what a node boots with), ``placement`` (reserved capacity,
AZs), ``storage`` (S3), ``kms``, ``iam`` and ``gcs_store``, over the shared ``graph``.

Rules 4 and 31 read the stack's config too (operatorCidrs, capacityReservations), handed in by
the pack as keyword arguments. Rules 3, 21, 22, 23 and 25 concern the cluster YAML and the
nodes' runtime, not the resource graph: ``rayfleet lint`` checks those; rule 24 is the stack
configuration's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from .compute import rule_9_imdsv2, rule_10_ebs_encrypted, rule_20_no_secrets_in_user_data
from .gcs_store import rule_33_gcs_store
from .iam import (
    rule_16_no_broad_managed_policies,
    rule_17_scoped_node_roles,
    rule_18_pass_role_worker_only,
    rule_19_ec2_trust_only,
    rule_26_listed_describe_actions,
)
from .kms import rule_28_log_groups_cmk, rule_29_explicit_key_policy
from .network import rule_7_private_nodes, rule_8_flow_logs
from .placement import rule_31_reserved_capacity, rule_32_worker_template_in_its_az
from .security_groups import (
    rule_1_no_world_ray_ports,
    rule_2_no_world_ssh,
    rule_4_ray_ports_from_cluster_only,
    rule_5_default_sg_denies_all,
    rule_6_descriptions,
    rule_30_ingress_ports_from_cluster,
)
from .storage import (
    rule_11_public_access_block,
    rule_12_encryption,
    rule_13_tls_only,
    rule_14_versioning_lifecycle,
    rule_15_acls_disabled,
    rule_27_bucket_access_logged,
)

# The graph's vocabulary and the views the rules read it through, named here too so that one
# import serves whoever reads the checks' results or builds and picks resources (the tests).
from .graph import (  # noqa: F401
    BUCKET_ACLS,
    BUCKET_POLICY,
    BUCKETS,
    CACHE_CLUSTER,
    DEFAULT_SG,
    FLOW_LOG,
    IGW,
    INSTANCE,
    INSTANCE_PROFILE,
    KMS_KEY,
    LAUNCH_TEMPLATE,
    LIFECYCLE,
    LOG_GROUP,
    LOGGING,
    OWNERSHIP,
    PLACEMENT_GROUP,
    POLICY,
    POLICY_ATTACHMENTS,
    PUBLIC_ACCESS_BLOCK,
    REPLICATION_GROUP,
    ROLE,
    ROLE_ATTACHMENT,
    ROLE_POLICY,
    ROUTE,
    ROUTE_ASSOC,
    ROUTE_TABLE,
    SECRET,
    SG,
    SG_EGRESS,
    SG_INGRESS,
    SG_RULE,
    SSE,
    SUBNET,
    VERSIONING,
    VOLUME,
    VPC,
    Resource,
    Violation,
    _list,
)
from .network import public_subnets  # noqa: F401
from .security_groups import permissions  # noqa: F401

CHECKS: Mapping[int, Callable[..., Iterator[Violation]]] = {
    1: rule_1_no_world_ray_ports, 2: rule_2_no_world_ssh, 4: rule_4_ray_ports_from_cluster_only,
    5: rule_5_default_sg_denies_all, 6: rule_6_descriptions, 7: rule_7_private_nodes,
    8: rule_8_flow_logs, 9: rule_9_imdsv2, 10: rule_10_ebs_encrypted,
    11: rule_11_public_access_block, 12: rule_12_encryption, 13: rule_13_tls_only,
    14: rule_14_versioning_lifecycle, 15: rule_15_acls_disabled,
    16: rule_16_no_broad_managed_policies, 17: rule_17_scoped_node_roles,
    18: rule_18_pass_role_worker_only, 19: rule_19_ec2_trust_only,
    20: rule_20_no_secrets_in_user_data, 26: rule_26_listed_describe_actions,
    27: rule_27_bucket_access_logged, 28: rule_28_log_groups_cmk,
    29: rule_29_explicit_key_policy, 30: rule_30_ingress_ports_from_cluster,
    31: rule_31_reserved_capacity, 32: rule_32_worker_template_in_its_az,
    33: rule_33_gcs_store,
}
