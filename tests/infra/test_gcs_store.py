"""rayfleet:headHa under Pulumi's mocks: off by default (nothing of it in a stack that does not
ask), and when on, the GCS store and the head's fixed address as docs/security.md (rule 33)
and docs/nodes.md describe them. The policy pack's rule 33 and its mutations are in
test_policy.py (the ``ha`` stack)."""

from __future__ import annotations

import ipaddress
import json

import pytest

from infra.components.gcs_store import head_address
from infra.policy_pack import checks as policy
from rayfleet import stack as contract
from rayfleet.commands import render
from rayfleet.facts import GCS_STORE_NODE_TYPE, GCS_STORE_PORT

pytestmark = pytest.mark.unit

HA_TYPES = ("aws:elasticache/replicationGroup:ReplicationGroup",
            "aws:elasticache/subnetGroup:SubnetGroup", "aws:secretsmanager/secret:Secret",
            "aws:secretsmanager/secretVersion:SecretVersion",
            "aws:ec2/subnetCidrReservation:SubnetCidrReservation")
D = "rayfleet-dev"
# Pulumi's marker of a secret value, as the mock monitor hands it over.
SECRET_SIG = "4dabf18193072939515e22adb298388d"


@pytest.mark.parametrize("name", ["dev", "minimal", "maximal"])
def test_off_by_default_nothing_of_it_exists(built, name):
    b = built[name]
    assert not [r.label for r in b.resources if r.type in HA_TYPES]
    assert "head_ha" not in b.outputs["rayfleet"]
    for r in b.of_type(policy.ROLE_POLICY):
        assert "secretsmanager" not in r.inputs["policy"], r.label


def test_the_store_is_encrypted_tls_only_and_behind_a_secret_token(built):
    b = built["ha"]
    (rg,) = b.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    i = rg.inputs
    assert (i["atRestEncryptionEnabled"], i["transitEncryptionEnabled"],
            i["transitEncryptionMode"]) == (True, True, "required")
    assert (i["nodeType"], int(i["port"])) == (GCS_STORE_NODE_TYPE, GCS_STORE_PORT)
    # Three private subnets in three AZs: a replica in another AZ, automatic failover.
    assert (int(i["numCacheClusters"]), i["automaticFailoverEnabled"], i["multiAzEnabled"]) \
        == (2, True, True)
    (version,) = b.of_type("aws:secretsmanager/secretVersion:SecretVersion")
    # The token is a Pulumi secret in both places, and the same value.
    assert SECRET_SIG in i["authToken"] and SECRET_SIG in version.inputs["secretString"]
    token = version.inputs["secretString"]["value"]
    assert i["authToken"]["value"] == token
    assert len(token) == 64 and int(token, 16) >= 0
    # AWS-managed keys: the stack's key may be used only through S3 (rule 29).
    (secret,) = b.of_type("aws:secretsmanager/secret:Secret")
    assert "kmsKeyId" not in secret.inputs and "kmsKeyId" not in i
    # Never in an output.
    assert token not in json.dumps(b.outputs)


def test_the_store_is_reachable_from_the_cluster_group_only(built):
    b = built["ha"]
    (rg,) = b.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    group = b.named(f"{D}-gcs-sg")
    assert rg.inputs["securityGroupIds"] == [group.outputs["id"]]
    subnets = b.named(f"{D}-gcs-subnets")
    assert subnets.inputs["subnetIds"] == b.outputs["rayfleet"]["private_subnet_ids"]
    rules = [p for p in policy.permissions(b.resources) if p.group == group.outputs["id"]]
    cluster = b.named(f"{D}-security-cluster").outputs["id"]
    assert [(p.direction, p.port_range, p.groups, p.cidrs) for p in rules] == [
        ("ingress", (GCS_STORE_PORT, GCS_STORE_PORT), (cluster,), ())]


def test_only_the_head_role_reads_the_token_and_only_that_secret(built):
    b = built["ha"]
    secret_arn = b.of_type("aws:secretsmanager/secret:Secret")[0].outputs["arn"]
    readers = [r for r in b.of_type(policy.ROLE_POLICY) if "secretsmanager" in r.inputs["policy"]]
    assert [r.name for r in readers] == [f"{D}-gcs-head-token"]
    (reader,) = readers
    head_role = next(r for r in b.of_type(policy.ROLE) if r.name == f"{D}-iam-head")
    assert reader.inputs["role"] == head_role.outputs["name"]
    statements = json.loads(reader.inputs["policy"])["Statement"]
    assert [(s["Action"], s["Resource"]) for s in statements] == [
        ("secretsmanager:GetSecretValue", secret_arn)]


def test_the_head_address_is_reserved_in_the_workers_subnet_and_rendered(built, tmp_path):
    b = built["ha"]
    out = b.outputs["rayfleet"]
    (reservation,) = b.of_type("aws:ec2/subnetCidrReservation:SubnetCidrReservation")
    assert reservation.inputs["reservationType"] == "explicit"
    assert reservation.inputs["subnetId"] == out["worker_subnet_id"]
    subnet = next(r for r in b.of_type(policy.SUBNET)
                  if r.outputs["id"] == out["worker_subnet_id"])
    ip = ipaddress.ip_address(out["head_ha"]["head_address"]["private_ip"])
    block = ipaddress.ip_network(reservation.inputs["cidrBlock"])
    net = ipaddress.ip_network(subnet.inputs["cidrBlock"])
    assert ip in block and block.subnet_of(net)
    # Not one of the five addresses AWS keeps in every subnet.
    assert net.network_address + 3 < ip < net.broadcast_address
    assert out["head_ha"]["head_address"]["subnet_id"] == out["worker_subnet_id"]
    assert out["head_ha"]["gcs_store"]["port"] == GCS_STORE_PORT
    # What render makes of the program's own export.
    o = contract.parse(json.dumps(b.outputs))
    assert o.head_ha.gcs_store.url.startswith("rediss://master.rayfleet-dev-gcs.")
    cfg = render.plain(render.build_config(o, str(tmp_path / "token")))
    head = cfg["available_node_types"]["ray.head.default"]["node_config"]
    assert (head["PrivateIpAddress"], head["SubnetIds"]) == (str(ip), [out["worker_subnet_id"]])


@pytest.mark.parametrize("cidr", ["10.42.0.0/19", "10.0.0.0/25", "172.16.32.0/21"])
def test_head_address_is_inside_the_subnet_clear_of_awss_addresses(cidr):
    block, ip = head_address(cidr)
    net = ipaddress.ip_network(cidr)
    assert ipaddress.ip_network(block).prefixlen == 28
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(block)
    # The last /28 (with the subnet's broadcast address AWS keeps) is left alone.
    assert ipaddress.ip_network(block).broadcast_address < net.broadcast_address - 1
