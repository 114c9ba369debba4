"""The whole Pulumi program under mocks: what it builds, what it exports, what it refuses."""

from __future__ import annotations

import fnmatch
import importlib.util
import ipaddress
import json
import re
from pathlib import Path

import pulumi
import pytest

from infra.policy_pack import checks as policy
from rayfleet.stack import SCHEMA_VERSION
from rayfleet.config import StackConfig
from rayfleet.facts import RAY_CLUSTER_TAG, RAY_PORTS, loopback_port

from .conftest import MAXIMAL
from .harness import AMI_ID, run_program

pytestmark = pytest.mark.unit

COMPONENTS = {"rayfleet:infra:Network", "rayfleet:infra:Security", "rayfleet:infra:Storage",
              "rayfleet:infra:Iam", "rayfleet:infra:GpuNodes", "rayfleet:infra:Budget",
              "rayfleet:infra:GcsStore", "rayfleet:infra:HeadAddress"}


def config_of(values: dict) -> StackConfig:
    return StackConfig.from_mapping(values)


# ----------------------------------------------------------------------------- structure

def test_every_aws_resource_is_a_named_child_of_a_component(stack):
    _, _, b = stack
    components = {r.urn: r.name for r in b.resources if r.type in COMPONENTS}
    for r in b.resources:
        if not r.type.startswith("aws:"):
            continue
        assert r.parent in components, f"{r.label} is not inside a component"
        assert r.name.startswith(f"{components[r.parent]}-"), \
            f"{r.label} is not named after its component {components[r.parent]!r}"


def test_every_aws_resource_uses_the_stacks_explicit_provider(stack):
    _, values, b = stack
    (provider,) = b.of_type("pulumi:providers:aws")
    assert provider.inputs["region"] == config_of(values).region
    # Provider inputs reach the engine JSON-encoded.
    tags = json.loads(provider.inputs["defaultTags"])["tags"]
    assert tags["rayfleet:managed-by"] == "pulumi"
    for r in b.resources:
        if r.type.startswith("aws:"):
            assert provider.name in r.provider, f"{r.label} falls back to the ambient provider"


def test_lookups_go_through_the_explicit_provider(stack):
    _, _, b = stack
    tokens = {c.token for c in b.calls}
    assert tokens == {"aws:index/getAvailabilityZones:getAvailabilityZones",
                      "aws:index/getCallerIdentity:getCallerIdentity", "aws:ec2/getAmi:getAmi"}
    assert all("-aws::" in c.provider for c in b.calls)


def test_ami_is_the_deep_learning_ami_unless_pinned(built):
    (dev_lookup,) = [c for c in built["dev"].calls if c.token == "aws:ec2/getAmi:getAmi"]
    filters = {f["name"]: f["values"] for f in dev_lookup.args["filters"]}
    assert dev_lookup.args["owners"] == ["amazon"] and dev_lookup.args["mostRecent"]
    assert "Deep Learning" in filters["name"][0] and filters["architecture"] == ["x86_64"]
    (max_lookup,) = [c for c in built["maximal"].calls if c.token == "aws:ec2/getAmi:getAmi"]
    assert max_lookup.args["filters"] == [{"name": "image-id",
                                           "values": [MAXIMAL["rayfleet:amiId"]]}]
    for lt in built["dev"].of_type(policy.LAUNCH_TEMPLATE):
        assert lt.inputs["imageId"] == AMI_ID


# ----------------------------------------------------------------------------- network

def test_subnets_span_the_configured_azs_workers_az_first(stack):
    _, values, b = stack
    c = config_of(values)
    out = b.outputs["rayfleet"]
    assert len(out["availability_zones"]) == len(set(out["availability_zones"])) \
        == c.network.az_count
    if c.network.worker_az:
        assert out["availability_zones"][0] == c.network.worker_az
    assert out["worker_availability_zone"] == out["availability_zones"][0]
    subnets = b.of_type(policy.SUBNET)
    assert len(subnets) == 2 * c.network.az_count
    vpc = ipaddress.ip_network(c.network.vpc_cidr)
    assert all(ipaddress.ip_network(s.inputs["cidrBlock"]).subnet_of(vpc) for s in subnets)


def test_exported_subnets_are_private_and_route_through_nat(stack):
    _, _, b = stack
    out = b.outputs["rayfleet"]
    public = {s.outputs["id"] for s in policy.public_subnets(b.resources)}
    assert len(public) == len(out["private_subnet_ids"])
    assert not set(out["private_subnet_ids"]) & public
    assert out["worker_subnet_id"] in out["private_subnet_ids"]
    nat_routes = [r for r in b.of_type(policy.ROUTE) if r.inputs.get("natGatewayId")]
    assert len(nat_routes) == len(out["private_subnet_ids"])


@pytest.mark.parametrize("stack_name,expected", [("dev", 1), ("maximal", 6)])
def test_nat_gateways_single_or_one_per_az(built, stack_name, expected):
    # dev: natGateways single; maximal: per-az over 6 AZs, each AZ leaving through its own.
    b = built[stack_name]
    nats = b.of_type("aws:ec2/natGateway:NatGateway")
    assert len(nats) == expected
    private_nat_targets = {r.inputs["natGatewayId"] for r in b.of_type(policy.ROUTE)
                           if r.inputs.get("natGatewayId")}
    assert private_nat_targets == {n.outputs["id"] for n in nats}


def test_s3_gateway_endpoint_serves_the_private_route_tables(stack):
    _, values, b = stack
    (endpoint,) = b.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
    assert endpoint.inputs["serviceName"] == f"com.amazonaws.{config_of(values).region}.s3"
    assert endpoint.inputs["vpcEndpointType"] == "Gateway"
    assert len(endpoint.inputs["routeTableIds"]) == config_of(values).network.az_count


# ----------------------------------------------------------------------------- security

def test_every_ray_port_is_open_to_the_cluster_group_only(stack):
    _, _, b = stack
    sg = b.outputs["rayfleet"]["cluster_security_group_id"]
    opened = {(p.from_port, p.to_port) for p in policy.permissions(b.resources)
              if p.group == sg and p.direction == "ingress" and p.groups == (sg,)}
    assert opened == {(p.from_port, p.to_port) for p in RAY_PORTS}


def test_operator_access_is_ssm_only_unless_cidrs_are_named(stack):
    _, values, b = stack
    c = config_of(values)
    out = b.outputs["rayfleet"]
    cidr_rules = [p for p in policy.permissions(b.resources)
                  if p.direction == "ingress" and p.cidrs]
    assert out["operator_access"] == c.access.mode
    assert {(p.cidrs[0], p.from_port) for p in cidr_rules} == \
        {(cidr, port) for cidr in c.access.operator_cidrs for port in (22, 8265)}


def test_no_group_opens_the_prometheus_port(stack):
    # Prometheus (`rayfleet render --metrics`) listens on the head's 127.0.0.1 only and is
    # reached through the dashboard's tunnel: no ingress rule admits its port, from anything.
    _, _, b = stack
    prometheus = loopback_port("prometheus")
    efa = b.outputs["rayfleet"]["efa_security_group_id"]
    for p in policy.permissions(b.resources):
        if p.direction != "ingress":
            continue
        if p.all_ports:
            # Only the EFA group's all-traffic rule from itself (the next test).
            assert p.group == efa and p.groups == (efa,) and not p.cidrs, p
        else:
            assert not p.from_port <= prometheus <= p.to_port, p


def test_efa_group_admits_only_itself(stack):
    _, _, b = stack
    efa = b.outputs["rayfleet"]["efa_security_group_id"]
    rules = [p for p in policy.permissions(b.resources) if p.group == efa]
    assert {p.direction for p in rules} == {"ingress", "egress"}
    assert all(p.groups == (efa,) and not p.cidrs for p in rules)


# ----------------------------------------------------------------------------- nodes

# EFA interfaces (one per network card) of each worker type, as AWS's EFA page lists them.
EFA_CARDS = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5e.48xlarge": 32,
             "p5en.48xlarge": 16}


def test_worker_templates_carry_efa_placement_and_market(stack):
    _, values, b = stack
    c = config_of(values)
    out = b.outputs["rayfleet"]
    head = b.named(f"{c.cluster_name}-nodes-head")
    assert out["launch_templates"]["head"]["id"] == head.outputs["id"]
    workers = out["node_types"]["workers"]
    # One template per (allowed type, market), in the stack's order, each type's spot first.
    assert [(w["instance_type"], w["market"]) for w in workers] == [
        (t, m) for t in c.nodes.worker_instance_types for m in ("spot", "ondemand")]
    assert len(b.of_type(policy.LAUNCH_TEMPLATE)) == 1 + 2 * len(c.nodes.worker_instance_types)
    for w in workers:
        t, market = w["instance_type"], w["market"]
        lt = b.named(f"{c.cluster_name}-nodes-worker-{t.replace('.', '-')}-{market}")
        assert w["launch_template"]["id"] == lt.outputs["id"]
        assert lt.inputs["instanceInitiatedShutdownBehavior"] == "terminate"
        nics = lt.inputs["networkInterfaces"]
        assert len(nics) == w["efa_interfaces"] == EFA_CARDS[t], t
        assert [n["networkCardIndex"] for n in nics] == list(range(EFA_CARDS[t]))
        assert [n["deviceIndex"] for n in nics] == [0] + [1] * (EFA_CARDS[t] - 1)
        assert all(n["interfaceType"] == "efa" and n["subnetId"] == out["worker_subnet_id"]
                   and not n.get("associatePublicIpAddress") for n in nics)
        assert lt.inputs["placement"]["groupName"] == out["placement_group"]
        assert lt.inputs["instanceType"] == t
        assert ("instanceMarketOptions" in lt.inputs) == (market == "spot")
        if market == "spot":
            assert lt.inputs["instanceMarketOptions"]["marketType"] == "spot"
    assert "networkInterfaces" not in head.inputs
    assert head.inputs["instanceInitiatedShutdownBehavior"] == "terminate"
    assert head.inputs["instanceType"] == c.nodes.head_instance_type
    (pg,) = b.of_type("aws:ec2/placementGroup:PlacementGroup")   # shared by every type
    assert pg.inputs["strategy"] == "cluster"


def test_nodes_are_tagged_for_the_head_role_and_sweep(stack):
    _, values, b = stack
    c = config_of(values)
    for lt in b.of_type(policy.LAUNCH_TEMPLATE):
        specs = {s["resourceType"]: s["tags"] for s in lt.inputs["tagSpecifications"]}
        assert specs["instance"][RAY_CLUSTER_TAG] == c.cluster_name
        assert specs["volume"][RAY_CLUSTER_TAG] == c.cluster_name
        if "spot" in lt.name:
            assert "spot-instances-request" in specs


def test_root_volumes_are_gp3_and_sized_from_config(stack):
    _, values, b = stack
    c = config_of(values)
    sizes = {}
    for lt in b.of_type(policy.LAUNCH_TEMPLATE):
        (root,) = lt.inputs["blockDeviceMappings"]
        assert root["deviceName"] == "/dev/sda1" and root["ebs"]["volumeType"] == "gp3"
        sizes[lt.name.rsplit("-nodes-", 1)[1]] = root["ebs"]["volumeSize"]
    assert sizes == {"head": c.nodes.head_root_volume_gb,
                     **{f"worker-{t.replace('.', '-')}-{m}": c.nodes.worker_root_volume_gb
                        for t in c.nodes.worker_instance_types for m in ("spot", "ondemand")}}


def test_hop_limit_is_two_only_with_ray_in_docker(built):
    for name, expected in (("dev", 1), ("maximal", 2)):
        for lt in built[name].of_type(policy.LAUNCH_TEMPLATE):
            assert lt.inputs["metadataOptions"]["httpPutResponseHopLimit"] == expected
    assert built["maximal"].outputs["rayfleet"]["imds_hop_limit"] == 2


# ----------------------------------------------------------------------------- storage, IAM

def test_encryption_is_the_stacks_kms_key_or_s3_managed(built):
    for name, algorithm in (("dev", "aws:kms"), ("minimal", "AES256")):
        b = built[name]
        sse = b.named(f"{b.outputs['rayfleet']['cluster_name']}-storage-encryption")
        default = sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]
        assert default["sseAlgorithm"] == algorithm
        # The flow-log group's key is every stack's (rule 28); the bucket's, only kms's.
        keys = [k for k in b.of_type("aws:kms/key:Key") if "-storage-" in k.name]
        if algorithm == "aws:kms":
            (key,) = keys
            assert default["kmsMasterKeyId"] == key.outputs["arn"]
            assert key.inputs["enableKeyRotation"] is True
            assert b.outputs["rayfleet"]["kms_key_arn"] == key.outputs["arn"]
        else:
            assert not keys and b.outputs["rayfleet"]["kms_key_arn"] is None


def test_node_roles_reach_only_the_configured_key_prefix(stack):
    _, values, b = stack
    c = config_of(values)
    bucket_arn = b.outputs["rayfleet"]["bucket_arn"]
    for kind in ("head", "worker"):
        doc = json.loads(b.named(f"{c.cluster_name}-iam-{kind}-storage").inputs["policy"])
        by_sid = {s["Sid"]: s for s in doc["Statement"]}
        assert by_sid["ReadWriteClusterPrefix"]["Resource"] == \
            f"{bucket_arn}/{c.storage.key_prefix}*"
        assert f"{c.storage.key_prefix}*" in \
            by_sid["ListClusterPrefix"]["Condition"]["StringLikeIfExists"]["s3:prefix"]
        assert ("UseBucketKeyThroughS3" in by_sid) == (c.storage.encryption == "kms")


def test_instance_profiles_wrap_the_node_roles(stack):
    _, _, b = stack
    out = b.outputs["rayfleet"]
    profiles = {p.outputs["arn"]: p for p in b.of_type(policy.INSTANCE_PROFILE)}
    roles = {r.outputs["id"]: r for r in b.of_type(policy.ROLE)}
    for kind in ("head", "worker"):
        profile = profiles[out["instance_profiles"][kind]["arn"]]
        role = roles[profile.inputs["role"]]
        assert role.inputs["tags"]["rayfleet:node-role"] == kind
        assert role.outputs["arn"] == out["roles"][kind]["arn"]


# ----------------------------------------------------------------------------- outputs

def test_stack_output_schema(stack):
    name, values, b = stack
    c = config_of(values)
    assert set(b.outputs) == {"rayfleet"}
    out = b.outputs["rayfleet"]
    assert out["schema_version"] == SCHEMA_VERSION
    assert set(out) == {
        "schema_version", "stack", "cluster_name", "region", "availability_zones",
        "worker_availability_zone", "vpc_id", "private_subnet_ids", "worker_subnet_id",
        "cluster_security_group_id", "efa_security_group_id", "operator_access",
        "operator_cidrs", "instance_profiles", "roles", "launch_templates", "node_types",
        "max_workers",
        "placement_group", "ami_id", "imds_hop_limit", "bucket", "bucket_arn",
        "storage_uri", "kms_key_arn", "ray_ports", "budget_name", "autostop_minutes",
        "vllm",
        # Only with rayfleet:headHa: a stack without it exports exactly what it did before.
        *(["head_ha"] if c.head_ha else [])}
    assert (out["cluster_name"], out["region"]) == (c.cluster_name, c.region)
    assert out["storage_uri"] == f"s3://{out['bucket']}/{c.storage.key_prefix}"
    assert out["bucket"].startswith(c.storage.bucket_prefix)
    nt = out["node_types"]
    assert nt["head"]["gpus"] == 0 and all(w["gpus"] == 8 for w in nt["workers"])
    # The minimum is the preferred type's; each type's two markets split maxWorkers, which
    # the cluster-wide max_workers bounds for all types together.
    assert sum(w["min_workers"] for w in nt["workers"]) == c.nodes.min_workers
    assert sum(w["min_workers"] for w in nt["workers"][2:]) == 0
    for i in range(0, len(nt["workers"]), 2):
        assert nt["workers"][i]["max_workers"] + nt["workers"][i + 1]["max_workers"] == \
            c.nodes.max_workers
    assert out["max_workers"] == c.nodes.max_workers
    assert (out["budget_name"] is not None) == c.budget.enabled
    assert out["autostop_minutes"] == c.autostop_minutes   # render's default for the stack
    assert out["vllm"] == c.vllm == ("cpu" if name == "maximal" else "cuda")   # render's --vllm
    assert out["ray_ports"]["gcs"] == [6379, 6379]
    json.dumps(out)  # plain JSON: what `pulumi stack output --json` hands render


def test_render_reads_back_what_the_program_exports(stack):
    """The contract both ends share: the export parses into the same StackOutputs, whose
    node types are the catalog's for the configured instance types."""
    from rayfleet import stack as contract

    _, values, b = stack
    c = config_of(values)
    parsed = contract.parse(json.dumps(b.outputs))
    assert parsed.to_dict() == b.outputs["rayfleet"]
    assert [(w.instance_type, w.vcpus, w.accelerator_type) for w in parsed.node_types.workers] \
        == [(s.name, s.vcpus, s.accelerator_type) for s in c.nodes.workers for _ in "ab"]
    assert parsed.node_types.head.vcpus == c.nodes.head.vcpus


def test_budget_alerts_the_configured_addresses(built):
    (budget,) = built["maximal"].of_type("aws:budgets/budget:Budget")
    assert budget.inputs["limitAmount"] == "50000" and budget.inputs["timeUnit"] == "MONTHLY"
    for n in budget.inputs["notifications"]:
        assert n["subscriberEmailAddresses"] == MAXIMAL["rayfleet:budgetEmails"]
    assert not built["minimal"].of_type("aws:budgets/budget:Budget")


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("values,key", [
    ({"rayfleet:operatorCidrs": ["0.0.0.0/0"]}, "rayfleet:operatorCidrs"),
    ({"rayfleet:region": "us-west-1"}, "rayfleet:workerInstanceTypes"),
    ({"rayfleet:workerInstanceTypes": ["p4d.24xlarge", "p4d.24xlarge"]},
     "rayfleet:workerInstanceTypes"),
    # An older stack's single-type key: one line naming the new one, nothing created.
    ({"rayfleet:workerInstanceType": "p4d.24xlarge"}, "rayfleet:workerInstanceType"),
    ({"rayfleet:minWorkers": 5}, "rayfleet:minWorkers"),
    ({"rayfleet:bucketPrefix": "Bad_Bucket"}, "rayfleet:bucketPrefix"),
    ({"rayfleet:maxWorker": 4}, "rayfleet:maxWorker"),
    ({"aws:region": "eu-west-1"}, "aws:region"),
])
def test_bad_config_stops_the_program_before_any_resource(values, key):
    with pytest.raises(pulumi.RunError) as info:
        run_program(values, stack="bad")
    # RunError is how a Pulumi program exits cleanly: the user sees this one line.
    message = str(info.value)
    assert message.startswith(f"{key}: ") and "\n" not in message
    assert info.value.registrations == []


def aws_resources(registrations: list[dict]) -> list[str]:
    return [r["name"] for r in registrations if r["type"].startswith("aws:")]


def test_worker_az_must_be_an_available_zone_of_the_region():
    with pytest.raises(pulumi.RunError,
                       match="rayfleet:workerAz: us-east-1f is not an available AZ of us-east-1; "
                             "allowed: us-east-1a, us-east-1b, us-east-1c") as info:
        run_program({"rayfleet:workerAz": "us-east-1f"}, zones=3)
    assert aws_resources(info.value.registrations) == []


def test_az_count_beyond_the_regions_zones_is_refused():
    with pytest.raises(pulumi.RunError,
                       match="rayfleet:azCount: is 4 but us-east-2 has 3") as info:
        run_program({"rayfleet:region": "us-east-2", "rayfleet:azCount": 4}, zones=3)
    assert aws_resources(info.value.registrations) == []


def test_repeated_builds_in_one_session_are_independent(built):
    again = run_program({"rayfleet:bucketEncryption": "s3"}, stack="minimal")
    assert sorted((r.type, r.name) for r in again.resources) == \
        sorted((r.type, r.name) for r in built["minimal"].resources)
    assert again.outputs == built["minimal"].outputs
    assert pulumi.get_stack() == "minimal"


def _allowed(statements: list[dict], action: str) -> bool:
    return any(s.get("Effect") == "Allow" and any(
        fnmatch.fnmatchcase(action, pattern) for pattern in policy._list(s.get("Action")))
        for s in statements)


def test_head_role_allows_what_rays_autoscaler_calls_and_no_more(built):
    # The EC2 calls of the installed Ray's AWS node provider, read from its source so that a
    # Ray upgrade that starts calling something new fails here rather than on a live cluster.
    # Ray is a hard dependency: its provider missing is a failure, not a skip.
    spec = importlib.util.find_spec("ray.autoscaler._private.aws.node_provider")
    assert spec is not None, "Ray's AWS node provider moved or Ray is not installed"
    source = Path(spec.origin).read_text()
    calls = set(re.findall(r"\.(describe_\w+|\w+_instances|create_tags)\b", source))
    # boto3 resource methods: instances.filter is DescribeInstances, create_instances is
    # RunInstances.
    calls |= {"describe_instances"} if ".instances.filter(" in source else set()
    calls = {"run_instances" if c == "create_instances" else c for c in calls}
    actions = {"ec2:" + "".join(w.title() for w in c.split("_")) for c in calls}
    # Stop/start serve only cache_stopped_nodes: true; rayfleet renders false (rule 23).
    deliberately_denied = {"ec2:StopInstances", "ec2:StartInstances"}
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "ec2:CreateTags"} <= actions
    doc = json.loads(built["dev"].named("rayfleet-dev-iam-head-autoscaler").inputs["policy"])
    for action in actions - deliberately_denied:
        assert _allowed(doc["Statement"], action), f"head role cannot {action}"
    for action in deliberately_denied & actions:
        assert not _allowed(doc["Statement"], action), f"head role may {action}"
    # And no EC2 read beyond what the provider calls (rule 26): listed one by one, equal.
    granted_reads = {a for s in doc["Statement"] if s.get("Effect") == "Allow"
                     for a in policy._list(s.get("Action")) if a.startswith("ec2:Describe")}
    assert granted_reads == {a for a in actions if a.startswith("ec2:Describe")}
