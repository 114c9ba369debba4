"""`rayfleet sweep CLUSTER_YAML [--delete]`: what a Ray cluster left behind.

After `ray down` (or an interrupted `ray up`) these can outlive the cluster and keep billing
or keep a door open: instances (stopped ones too: their EBS still bills), volumes, network
interfaces, the ``ray-autoscaler-<cluster>`` security group Ray creates, and key pairs. Found
by the ``ray-cluster-name`` tag Ray puts on everything it launches (and, for Ray's security
group, by its name). Anything tagged ``rayfleet:managed-by=pulumi`` belongs to the stack and is
never touched: `pulumi destroy` removes it. Listed by default; removed only with ``--delete``.
The cluster's name and region come from its YAML (or from --cluster-name and --region, both
given: a region guessed from the AWS profile would search the wrong one and find nothing).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from rayfleet.clusteryaml import load
from rayfleet.configkeys import AWS_REGIONS
from rayfleet.errors import ConfigError, RayfleetError, did_you_mean
from rayfleet.facts import MANAGED_BY_PULUMI, RAY_CLUSTER_TAG, TAG_MANAGED_BY

LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


@dataclass(frozen=True)
class Leftover:
    kind: str  # instance | volume | network-interface | security-group | key-pair
    id: str
    detail: str


def _tags(resource: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags") or []}


def _ours(resource: dict) -> bool:
    return _tags(resource).get(TAG_MANAGED_BY) == MANAGED_BY_PULUMI


def check_cluster_name(name: str, key: str = "--cluster-name") -> str:
    # Ray accepts more, but every cluster rayfleet renders has a config-valid name; anything
    # else (a typo with capitals, a glob) would only ever match nothing.
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name):
        raise ConfigError(key, f"{name!r} is not a Ray cluster name (letters, digits, - _ .)")
    return name


def check_region(region: str, key: str = "--region") -> str:
    if region not in AWS_REGIONS:
        raise ConfigError(key, f"{region!r} is not an AWS region"
                               f"{did_you_mean(region, AWS_REGIONS)}")
    return region


def aws_region(cfg: dict, path: str, does: str, there: str) -> str:
    """A cluster YAML's provider.region, checked, for a command that ``does`` something on AWS
    (refused for another provider) ``there`` (what the region is for, when it is missing)."""
    provider = cfg["provider"]
    if provider.get("type") != "aws":
        raise RayfleetError(f"{path}: {does} (provider.type: aws), not "
                            f"{provider.get('type')!r}")
    if "region" not in provider:
        raise ConfigError("provider.region", f"{path} has none; {there}")
    return check_region(provider["region"], "provider.region")


def of_yaml(path: str) -> tuple[str, str]:
    """(cluster_name, provider.region) of a cluster YAML, both checked."""
    cfg, _ = load(path)
    region = aws_region(cfg, path, "sweep looks for what a cluster left on AWS",
                        "sweep looks in that region")
    if "cluster_name" not in cfg:
        raise ConfigError("cluster_name", f"{path} has none; sweep finds a cluster by it")
    return check_cluster_name(cfg["cluster_name"], "cluster_name"), region


def target(cluster_yaml: str | None, cluster_name: str | None,
           region: str | None) -> tuple[str, str]:
    """(cluster name, region) from the YAML, or from --cluster-name and --region, both given."""
    if cluster_yaml is not None:
        if cluster_name is not None or region is not None:
            raise ConfigError("CLUSTER_YAML", "the YAML names the cluster and its region: "
                                              "drop --cluster-name and --region")
        return of_yaml(cluster_yaml)
    if cluster_name is None:
        raise ConfigError("CLUSTER_YAML", "which cluster: rayfleet sweep CLUSTER_YAML (or "
                                          "--cluster-name NAME --region REGION)")
    if region is None:
        raise ConfigError("--region", "required with --cluster-name (the AWS profile's region "
                                      "may not be the cluster's); or give the YAML: rayfleet "
                                      "sweep CLUSTER_YAML")
    return check_cluster_name(cluster_name), check_region(region)


def find(ec2, cluster: str) -> list[Leftover]:
    tag = [{"Name": f"tag:{RAY_CLUSTER_TAG}", "Values": [cluster]}]
    out: list[Leftover] = []
    for page in ec2.get_paginator("describe_instances").paginate(
            Filters=tag + [{"Name": "instance-state-name", "Values": LIVE_STATES}]):
        for r in page["Reservations"]:
            for i in r["Instances"]:
                if not _ours(i):
                    out.append(Leftover("instance", i["InstanceId"],
                                        f"{i['InstanceType']} {i['State']['Name']}"))
    for page in ec2.get_paginator("describe_volumes").paginate(Filters=tag):
        for v in page["Volumes"]:
            if not _ours(v):
                out.append(Leftover("volume", v["VolumeId"], f"{v['Size']} GiB {v['State']}"))
    for page in ec2.get_paginator("describe_network_interfaces").paginate(Filters=tag):
        for n in page["NetworkInterfaces"]:
            if not _ours(n):
                out.append(Leftover("network-interface", n["NetworkInterfaceId"], n["Status"]))
    groups: dict[str, dict] = {}
    for filters in (tag, [{"Name": "group-name", "Values": [f"ray-autoscaler-{cluster}"]}]):
        for page in ec2.get_paginator("describe_security_groups").paginate(Filters=filters):
            for g in page["SecurityGroups"]:
                groups[g["GroupId"]] = g
    for g in groups.values():
        if not _ours(g):
            out.append(Leftover("security-group", g["GroupId"], g["GroupName"]))
    for k in ec2.describe_key_pairs(Filters=tag).get("KeyPairs", []):
        if not _ours(k):
            out.append(Leftover("key-pair", k["KeyName"], k.get("KeyPairId", "")))
    return out


def delete(ec2, leftovers: list[Leftover]) -> list[str]:
    """Remove in dependency order; returns one line per failure (the rest still go: an
    instance EC2 will not terminate, or a wait that runs out, stops nothing after it)."""
    from botocore.exceptions import BotoCoreError, ClientError

    def why(e: Exception) -> str:
        if isinstance(e, ClientError):
            return e.response.get("Error", {}).get("Code", "") or str(e)
        return f"{type(e).__name__}: {e}"

    failures: list[str] = []
    by_kind: dict[str, list[str]] = {}
    for x in leftovers:
        by_kind.setdefault(x.kind, []).append(x.id)
    terminating = []
    for iid in by_kind.get("instance", []):   # one by one: a protected one stops no other
        try:
            ec2.terminate_instances(InstanceIds=[iid])
            terminating.append(iid)
        except (BotoCoreError, ClientError) as e:
            failures.append(f"instance {iid}: {why(e)}")
    if terminating:
        try:
            ec2.get_waiter("instance_terminated").wait(
                InstanceIds=terminating, WaiterConfig={"Delay": 5, "MaxAttempts": 120})
        except (BotoCoreError, ClientError) as e:   # WaiterError is a BotoCoreError
            failures.append(f"instances {' '.join(terminating)} not yet terminated: {why(e)}")
    calls = (("network-interface", lambda i: ec2.delete_network_interface(NetworkInterfaceId=i)),
             ("volume", lambda i: ec2.delete_volume(VolumeId=i)),
             ("security-group", lambda i: ec2.delete_security_group(GroupId=i)),
             ("key-pair", lambda i: ec2.delete_key_pair(KeyName=i)))
    for kind, call in calls:
        for rid in by_kind.get(kind, []):
            try:
                call(rid)
            except (BotoCoreError, ClientError) as e:
                if why(e).endswith("NotFound"):
                    continue  # went with its instance
                failures.append(f"{kind} {rid}: {why(e)}")
    return failures


def client(region: str):
    import boto3

    return boto3.client("ec2", region_name=region)


def main(cluster_name: str | None = None, region: str | None = None, delete_: bool = False,
         out=None, ec2: Any = None, cluster_yaml: str | None = None) -> int:
    out = out or sys.stdout
    cluster_name, region = target(cluster_yaml, cluster_name, region)
    ec2 = ec2 or client(region)
    try:
        found = find(ec2, cluster_name)
    except Exception as e:  # credentials / endpoint: say so in one line
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(e, (BotoCoreError, ClientError)):
            raise RayfleetError(f"cannot list EC2 resources: {e}") from None
        raise
    if not found:
        print(f"nothing tagged {RAY_CLUSTER_TAG}={cluster_name} is left in {region}", file=out)
        return 0
    for x in found:
        print(f"{x.kind:18} {x.id:24} {x.detail}", file=out)
    if not delete_:
        print(f"{len(found)} leftover(s) of {cluster_name} in {region}; run again with --delete "
              "to remove them", file=out)
        return 1
    failures = delete(ec2, found)
    for f in failures:
        print(f"could not delete {f}", file=sys.stderr)
    print(f"deleted {len(found) - len(failures)} of {len(found)}", file=out)
    return 1 if failures else 0
