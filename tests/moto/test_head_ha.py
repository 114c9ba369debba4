"""rayfleet:headHa in moto, built by the Pulumi program itself (pulumi_moto.py): the GCS store
exists as the program asked (TLS, at-rest encryption, auth token, its own group), only the
head role may read its token, the head's token command fetches it with the head's client
environment into a 0600 file, and Ray's own bootstrap and node provider launch the head at
its fixed address. (A replacement head at that address, on a cluster that lost its head, is
fault 10: tests/fakecloud/test_head_loss.py.)"""

from __future__ import annotations

import copy
import json
import os
import shlex
import stat
import subprocess
import sys

import pytest

from rayfleet.commands import cli, render
from rayfleet.stack import parse

from .pulumi_moto import build_stack, cluster_instances, ray_launch_config, role_actions

pytestmark = pytest.mark.moto


def test_ha_stack_store_token_and_head_address_in_moto(moto_account, tmp_path):
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    stack = build_stack(moto_account, tmp_path, {"rayfleet:headHa": True})
    o = stack.outputs
    ha = o["head_ha"]
    # The store as moto holds it.
    (rg,) = moto_account.client("elasticache").describe_replication_groups(
        ReplicationGroupId=f"{o['cluster_name']}-gcs")["ReplicationGroups"]
    assert rg["TransitEncryptionEnabled"] and rg["AtRestEncryptionEnabled"]
    assert rg["AuthTokenEnabled"]
    sm = moto_account.client("secretsmanager")
    token = sm.get_secret_value(SecretId=ha["gcs_store"]["auth_secret_arn"])["SecretString"]
    assert len(token) == 64 and token not in stack.path.read_text()

    # Only the head role's policies name Secrets Manager, and only this secret.
    iam = moto_account.client("iam")
    assert not [a for a in role_actions(iam, o["roles"]["worker"]["arn"])
                if a.startswith("secretsmanager:")]
    head = o["roles"]["head"]["arn"].rsplit("/", 1)[-1]
    reads = [st for p in iam.list_role_policies(RoleName=head)["PolicyNames"]
             for st in iam.get_role_policy(RoleName=head, PolicyName=p)["PolicyDocument"][
                 "Statement"] if "secretsmanager" in json.dumps(st["Action"])]
    assert [(st["Action"], st["Resource"]) for st in reads] == [
        ("secretsmanager:GetSecretValue", ha["gcs_store"]["auth_secret_arn"])]

    # The head's token command, with the client environment the head would have (moto's
    # endpoint stands in for the instance role), into a 0600 file; nothing printed.
    command = render.gcs_store_token_command(parse(stack.path.read_text()))
    argv = shlex.split(command.split(" && ")[-1])
    target = tmp_path / "gcs_store_token"
    proc = subprocess.run([sys.executable, "-c", argv[2], argv[3], argv[4], str(target)],
                          env=dict(os.environ), capture_output=True, text=True, check=True)
    assert (proc.stdout, proc.stderr) == ("", "")
    assert target.read_text() == token and stat.S_IMODE(target.stat().st_mode) == 0o600

    # `ray up`'s bootstrap and Ray's node provider launch the head at the fixed address.
    rendered = tmp_path / "cluster.yaml"
    assert cli.main(["render", str(stack.path), "--output", str(rendered),
                     "--token-file", str(tmp_path / "token")]) == 0
    assert cli.main(["preflight", str(rendered), "--num-gpus", "8"]) == 0
    cfg = ray_launch_config(rendered)
    head_type = cfg["head_node_type"]
    ec2 = moto_account.client("ec2")
    provider = AWSNodeProvider(cfg["provider"], cfg["cluster_name"])
    provider.create_node(copy.deepcopy(cfg["available_node_types"][head_type]["node_config"]),
                         {TAG_RAY_NODE_KIND: "head", TAG_RAY_USER_NODE_TYPE: head_type}, 1)
    (i,) = cluster_instances(ec2, o["cluster_name"])
    fixed = (ha["head_address"]["private_ip"], ha["head_address"]["subnet_id"])
    assert (i["PrivateIpAddress"], i["SubnetId"]) == fixed
    assert not i.get("PublicIpAddress")
    assert {g["GroupId"] for g in i["SecurityGroups"]} == {o["cluster_security_group_id"]}
    # The address sits in the stack's explicit reservation of that subnet.
    (res,) = ec2.get_subnet_cidr_reservations(SubnetId=fixed[1])[
        "SubnetIpv4CidrReservations"]
    assert res["ReservationType"] == "explicit"
