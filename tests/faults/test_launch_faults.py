"""Fault 6 (docs/faults.md): a launch interrupted half-way leaves nothing
`rayfleet sweep` misses.

The example stack is built in moto by infra/ itself (tests/moto/pulumi_moto.py) and rendered.
Ray's own AWS node provider launches the head; then EC2 answers the A100 worker's
RunInstances with InsufficientInstanceCapacity, the everyday p4d failure. The error is
injected in the client, not on the wire: a botocore ``before-send`` hook on the very EC2
client Ray launches with returns EC2's own error document, so botocore parses it and Ray
handles it exactly as it would a real one. Then `rayfleet sweep` lists the head and its
volume, `--delete` removes them, and a second sweep finds nothing tagged with the cluster.
"""

from __future__ import annotations

import copy

import pytest

from rayfleet.commands import cli, sweep
from tests.moto import pulumi_moto
from tests.moto.pulumi_moto import cluster_instances, ray_launch_config

pytestmark = [pytest.mark.faults, pytest.mark.moto]

# The moto fixtures of tests/moto, visible here: pytest finds fixtures among module attributes.
moto_account = pulumi_moto.moto_account
infra_stack = pulumi_moto.infra_stack

# EC2's error document for a capacity shortfall, as the Query API returns it (HTTP 500).
CAPACITY_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
    "<Code>InsufficientInstanceCapacity</Code><Message>We currently do not have sufficient "
    "{itype} capacity in the Availability Zone you requested ({az}). Our system will be working "
    "on provisioning additional capacity.</Message></Error></Errors>"
    "<RequestID>4b5c2c70-0000-4000-8000-000000000006</RequestID></Response>"
)


class _Body:
    """The raw body botocore reads an injected response from."""

    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def no_capacity_for(instance_type: str, az: str, attempts: list[str]):
    """A before-send hook: RunInstances for ``instance_type`` gets EC2's capacity error,
    every other call goes to moto."""
    from botocore.awsrequest import AWSResponse

    def hook(request, **_):
        body = request.body if isinstance(request.body, bytes) else \
            str(request.body or "").encode()
        if f"InstanceType={instance_type}".encode() not in body:
            return None
        attempts.append(instance_type)
        xml = CAPACITY_ERROR.format(itype=instance_type, az=az).encode()
        return AWSResponse(request.url, 500, {"Content-Type": "text/xml"}, _Body(xml))

    return hook


def test_launch_interrupted_by_capacity_error_is_swept_clean(infra_stack, moto_account,
                                                             tmp_path, capsys):
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.node_launch_exception import NodeLaunchException
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    o = infra_stack.outputs
    c = o["cluster_name"]
    ec2 = moto_account.client("ec2")
    rendered = tmp_path / "cluster.yaml"
    assert cli.main(["render", str(infra_stack.path), "--output", str(rendered),
                     "--token-file", str(tmp_path / "token")]) == 0
    cfg = ray_launch_config(rendered)
    provider = AWSNodeProvider(cfg["provider"], cfg["cluster_name"])
    # The preferred type's on-demand node type (p4d): EC2 has none of it in the workers' AZ.
    preferred = o["node_types"]["workers"][1]
    worker_type = preferred["instance_type"]
    attempts: list[str] = []
    # Ray launches through its fail-fast client (no botocore retries); the hook sits on it.
    provider.ec2_fail_fast.meta.client.meta.events.register(
        "before-send.ec2.RunInstances",
        no_capacity_for(worker_type, o["worker_availability_zone"], attempts))

    def launch(node_type: str, kind: str):
        node_config = copy.deepcopy(cfg["available_node_types"][node_type]["node_config"])
        return provider.create_node(node_config, {TAG_RAY_NODE_KIND: kind,
                                                  TAG_RAY_USER_NODE_TYPE: node_type}, 1)

    (head_id,) = launch("ray.head.default", "head")
    with pytest.raises(NodeLaunchException) as err:
        launch(f"ray.worker.{worker_type}.{preferred['market']}", "worker")
    # What the user (or the autoscaler's log) sees: EC2's code and message, not a traceback.
    assert err.value.category == "InsufficientInstanceCapacity"
    assert f"sufficient {worker_type} capacity" in err.value.description
    assert attempts and set(attempts) == {worker_type}
    seen = capsys.readouterr()
    assert "Failed to launch instances" in seen.out + seen.err
    # Half-way: the head runs, no worker exists.
    assert [i["InstanceId"] for i in cluster_instances(ec2, c)] == [head_id]

    # The sweep lists the head and the volume it was launched with, and deletes nothing.
    head = cluster_instances(ec2, c)[0]
    head_volumes = {b["Ebs"]["VolumeId"] for b in head["BlockDeviceMappings"]}
    assert cli.main(["sweep", "--cluster-name", c, "--region", o["region"]]) == 1
    listed = capsys.readouterr().out
    assert head_id in listed and all(v in listed for v in head_volumes), listed
    assert {x.id for x in sweep.find(ec2, c)} >= {head_id, *head_volumes}
    assert cluster_instances(ec2, c), "a sweep without --delete removed something"
    present = {v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]}
    assert head_volumes <= present, "a sweep without --delete removed a volume"

    assert cli.main(["sweep", "--cluster-name", c, "--region", o["region"], "--delete"]) == 0
    assert cluster_instances(ec2, c) == []
    assert cli.main(["sweep", "--cluster-name", c, "--region", o["region"]]) == 0
    assert f"nothing tagged ray-cluster-name={c} is left" in capsys.readouterr().out
    # The stack itself is untouched: its groups and templates stay for `pulumi destroy`.
    assert o["cluster_security_group_id"] in {
        g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]}
