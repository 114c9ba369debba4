"""Auto-stop's teardown against moto, in the account the Pulumi program built: the cluster's
workers go first, then its head, nothing of another cluster is touched, every EC2 call is one
the head role grants, and the decision is logged where `rayfleet logs --cluster` reads it. (The
idleness decision runs against a real cluster in tests/cluster/test_autostop.py; the whole
thing, head terminating itself, in the fake-cloud rehearsal.)"""

from __future__ import annotations

import fnmatch

import pytest

from .pulumi_moto import cluster_instances, load_agent, role_actions

pytestmark = pytest.mark.moto


def _launch(ec2, ami: str, cluster: str, kind: str) -> str:
    tags = [{"Key": "ray-cluster-name", "Value": cluster}, {"Key": "ray-node-type", "Value": kind}]
    return ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": tags}])["Instances"][0]["InstanceId"]


def test_teardown_terminates_workers_then_head_with_the_head_roles_calls(infra_stack,
                                                                        moto_account):
    autostop = load_agent("autostop")
    o = infra_stack.outputs
    c = o["cluster_name"]
    ec2 = moto_account.client("ec2")
    head = _launch(ec2, infra_stack.ami_id, c, "head")
    workers = {_launch(ec2, infra_stack.ami_id, c, "worker") for _ in range(2)}
    other = _launch(ec2, infra_stack.ami_id, f"{c}-other", "head")   # another cluster's

    calls: list[tuple[str, tuple[str, ...]]] = []
    ec2.meta.events.register("before-parameter-build.ec2", lambda model, params, **_: calls.append(
        (f"ec2:{model.name}", tuple(params.get("InstanceIds", ())))))
    gone = autostop.teardown(ec2, c, wait_s=30, poll_s=0.2)

    assert set(gone[:2]) == workers and gone[2:] == [head], gone
    terminations = [ids for name, ids in calls if name == "ec2:TerminateInstances"]
    assert [set(t) for t in terminations] == [workers, {head}], calls   # workers, then head
    assert cluster_instances(ec2, c) == []
    states = {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances(
        InstanceIds=[other, head, *workers])["Reservations"] for i in r["Instances"]}
    assert states[other] == "running", states
    # What it called is what the head role already grants Ray's autoscaler; the role's tag
    # condition (ray-cluster-name = this cluster) holds for every instance it terminated.
    granted = role_actions(moto_account.client("iam"), o["roles"]["head"]["arn"])
    assert {name for name, _ in calls} == {"ec2:DescribeInstances", "ec2:TerminateInstances"}
    assert all(any(fnmatch.fnmatchcase(name, g) for g in granted) for name, _ in calls), granted
    tagged = {i["InstanceId"] for r in ec2.describe_instances(Filters=[
        {"Name": "tag:ray-cluster-name", "Values": [c]}])["Reservations"] for i in r["Instances"]}
    assert set(gone) <= tagged

    # The decision, appended line by line under the stack's storage prefix (the head role may
    # write there), where `rayfleet logs --cluster` reads it.
    s3 = moto_account.client("s3")
    log = autostop.ClusterLog(o["storage_uri"], c, s3)
    log.write("armed")
    log.write("tearing down: idle")
    bucket, _, prefix = o["storage_uri"].removeprefix("s3://").partition("/")
    body = s3.get_object(Bucket=bucket, Key=f"{prefix.strip('/')}/clusters/{c}/autostop.log")[
        "Body"].read().decode()
    assert [ln.split(" ", 1)[1] for ln in body.splitlines()] == ["armed", "tearing down: idle"]


def test_workers_launched_during_the_teardown_go_too(infra_stack, moto_account):
    """An autoscaler that could not be paused (minWorkers 1) launches a worker for each one
    terminated: the teardown terminates until none of the cluster's is left."""
    autostop = load_agent("autostop")
    c = infra_stack.outputs["cluster_name"]
    ec2 = moto_account.client("ec2")
    head = _launch(ec2, infra_stack.ami_id, c, "head")
    first = _launch(ec2, infra_stack.ami_id, c, "worker")
    relaunched: list[str] = []

    def autoscaler(**kwargs):   # after the teardown's first TerminateInstances: a new worker
        if kwargs["model"].name == "TerminateInstances" and not relaunched:
            relaunched.append(_launch(ec2, infra_stack.ami_id, c, "worker"))

    ec2.meta.events.register("after-call.ec2", autoscaler)
    gone = autostop.teardown(ec2, c, wait_s=30, poll_s=0.2)
    assert len(relaunched) == 1 and gone == [first, *relaunched, head], (gone, relaunched)
    assert cluster_instances(ec2, c) == []   # what `rayfleet sweep` would find: nothing
