"""Run the real Pulumi program under ``pulumi.runtime.set_mocks`` and capture its resources.

No engine runs: Pulumi's mock monitor hands every resource registration and every invoke
(get_ami, get_availability_zones, get_caller_identity) to :class:`CaptureMocks`, which answers
with plausible ids/ARNs and records what the program asked for. What comes back is the
resource graph the policy pack (infra/policy_pack) checks and the stack outputs the program
exported. This
proves what the program *requests*; it does not prove AWS accepts it (see docs/testing.md).
"""

from __future__ import annotations

import asyncio
import importlib
import runpy
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pulumi
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import settings as pulumi_settings

from pulumi_policy import PolicyResource, PolicyResourceOptions
from pulumi_policy.proxy import unknown_checking_proxy

from infra.policy_pack.checks import Resource

# pulumi_aws warns about its own deprecated classes (BucketV2...) when its modules load; the
# program uses none of them, so load the modules it does use quietly, once.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for _module, _cls in (("s3", "Bucket"), ("ec2", "Vpc"), ("vpc", "SecurityGroupIngressRule"),
                          ("iam", "Role"), ("cloudwatch", "LogGroup"), ("kms", "Key"),
                          ("budgets", "Budget")):
        # pulumi_aws loads submodules lazily: touching a class is what imports them.
        getattr(importlib.import_module(f"pulumi_aws.{_module}"), _cls)

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "infra" / "__main__.py"
ACCOUNT = "123456789012"
AMI_ID = "ami-0123456789abcdef0"

# Id prefixes, so that a violation message reads like the console ("sg-...", "subnet-...").
_ID_PREFIX = {
    "aws:ec2/vpc:Vpc": "vpc", "aws:ec2/subnet:Subnet": "subnet",
    "aws:ec2/securityGroup:SecurityGroup": "sg", "aws:ec2/defaultSecurityGroup:"
    "DefaultSecurityGroup": "sg", "aws:ec2/internetGateway:InternetGateway": "igw",
    "aws:ec2/natGateway:NatGateway": "nat", "aws:ec2/eip:Eip": "eipalloc",
    "aws:ec2/routeTable:RouteTable": "rtb", "aws:ec2/vpcEndpoint:VpcEndpoint": "vpce",
    "aws:ec2/flowLog:FlowLog": "fl", "aws:ec2/launchTemplate:LaunchTemplate": "lt",
    "aws:ec2/placementGroup:PlacementGroup": "pg",
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": "sgr",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": "sgr",
}


class CaptureMocks(pulumi.runtime.Mocks):
    """Answers like AWS would, closely enough for the program's wiring, and records inputs."""

    def __init__(self, region: str, zones: int = 6):
        self.region = region
        self.zones = [f"{region}{letter}" for letter in "abcdef"[:zones]]
        self.inputs: dict[tuple[str, str], tuple[dict, dict, str]] = {}
        self.calls: list[pulumi.runtime.MockCallArgs] = []
        self._lock = threading.Lock()

    def call(self, args: pulumi.runtime.MockCallArgs):
        with self._lock:
            self.calls.append(args)
        token = args.token
        if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            return {"names": self.zones, "zoneIds": [f"use1-az{i}" for i in
                                                     range(len(self.zones))],
                    "id": self.region}
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": ACCOUNT, "arn": f"arn:aws:iam::{ACCOUNT}:user/ci",
                    "userId": "AIDAEXAMPLE", "id": ACCOUNT}
        if token == "aws:ec2/getAmi:getAmi":
            return {"id": AMI_ID, "imageId": AMI_ID, "architecture": "x86_64",
                    "rootDeviceName": "/dev/sda1",
                    "name": "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) "
                            "20250601"}
        raise NotImplementedError(f"the mocks do not answer invoke {token}")

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        typ, name, inputs = args.typ, args.name, dict(args.inputs)
        state = dict(inputs)
        rid = f"{_ID_PREFIX.get(typ, typ.split(':')[-1].lower())}-{name}"
        auto = f"{name}-1a2b3c4"  # Pulumi's auto-name: logical name + random suffix
        arn_base = f"arn:aws:{typ.split(':')[1].split('/')[0]}:{self.region}:{ACCOUNT}"
        if typ == "aws:s3/bucket:Bucket":
            bucket = inputs.get("bucket") or (inputs["bucketPrefix"] + "20250601000000000001"
                                              if inputs.get("bucketPrefix") else auto)
            rid, state["bucket"], state["arn"] = bucket, bucket, f"arn:aws:s3:::{bucket}"
        elif typ in ("aws:iam/role:Role", "aws:iam/instanceProfile:InstanceProfile"):
            kind = "role" if typ.endswith("Role") else "instance-profile"
            rid = state["name"] = inputs.get("name") or auto
            state["arn"] = f"arn:aws:iam::{ACCOUNT}:{kind}/{rid}"
        elif typ == "aws:kms/key:Key":
            rid = state["keyId"] = "0a1b2c3d-0000-4000-8000-" + name[-12:].rjust(12, "0")
            state["arn"] = f"{arn_base}:key/{rid}"
        elif typ == "aws:cloudwatch/logGroup:LogGroup":
            rid = state["name"] = inputs.get("name") or inputs.get("namePrefix", "") + "0001"
            state["arn"] = f"arn:aws:logs:{self.region}:{ACCOUNT}:log-group:{rid}"
        elif typ == "aws:ec2/eip:Eip":
            state["allocationId"] = rid
        elif typ in ("aws:ec2/launchTemplate:LaunchTemplate",
                     "aws:ec2/placementGroup:PlacementGroup", "aws:iam/rolePolicy:RolePolicy",
                     "aws:ec2/securityGroup:SecurityGroup"):
            state["name"] = inputs.get("name") or auto
        elif typ == "aws:elasticache/replicationGroup:ReplicationGroup":
            # ElastiCache's primary endpoint: a DNS name under the group's id.
            state["primaryEndpointAddress"] = (f"master.{inputs.get('replicationGroupId', rid)}"
                                               f".abc123.use1.cache.amazonaws.com")
        elif typ == "aws:secretsmanager/secret:Secret":
            state["arn"] = f"arn:aws:secretsmanager:{self.region}:{ACCOUNT}:secret:{auto}"
        elif typ == "aws:budgets/budget:Budget":
            state["name"] = inputs.get("name") or inputs.get("namePrefix", "") + "0001"
        if typ.startswith("aws:") and "arn" not in state:
            state["arn"] = f"{arn_base}:{typ.split(':')[-1].lower()}/{rid}"
        with self._lock:
            if (typ, name) in self.inputs:
                raise AssertionError(f"two resources named {typ} {name!r}")
            self.inputs[(typ, name)] = (inputs, state, rid)
        return rid, state


class CaptureMonitor(pulumi_mocks.MockMonitor):
    """The mock monitor, also keeping each registration's parent and provider."""

    def __init__(self, mocks: CaptureMocks):
        super().__init__(mocks)
        self.registrations: list[dict] = []
        self._lock = threading.Lock()

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            with self._lock:
                self.registrations.append({
                    "type": request.type, "name": request.name, "urn": response.urn,
                    "parent": request.parent, "provider": request.provider,
                    "custom": request.custom,
                    "deps": {k: tuple(v.urns) for k, v in
                             request.propertyDependencies.items()},
                })
        return response


@dataclass
class Built:
    """One program run: the resource graph, the exported outputs, what the mocks saw."""

    resources: list[Resource]
    outputs: dict[str, Any]
    registrations: list[dict]
    calls: list[pulumi.runtime.MockCallArgs]

    def of_type(self, typ: str) -> list[Resource]:
        return [r for r in self.resources if r.type == typ]

    def named(self, name: str) -> Resource:
        (found,) = [r for r in self.resources if r.name == name]
        return found


def execute(mocks: pulumi.runtime.Mocks, config: dict[str, Any], *, stack: str = "dev",
            monitor: Any = None, extra: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run infra/__main__.py with ``config`` ({"rayfleet:key": value}) under ``mocks``;
    return the stack outputs it exported (resolved)."""
    # Each run starts from a clean slate: a new root stack, no leftover config or outputs.
    pulumi_settings.ROOT.set(None)
    # pulumi.runtime.test runs on the thread's current event loop, and an asyncio.run()
    # anywhere earlier in the process (another tier's test) leaves none set.
    try:
        asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        asyncio.set_event_loop(asyncio.new_event_loop())
    pulumi.runtime.set_mocks(mocks, project="rayfleet", stack=stack, preview=False,
                             monitor=monitor)
    pulumi.runtime.set_all_config({k: _pulumi_string(v) for k, v in config.items()})
    exported: dict[str, Any] = {}
    resolved: dict[str, Any] = {}

    def record(name: str, value: Any) -> None:
        exported[name] = value

    @pulumi.runtime.test
    def program():
        with mock.patch.object(pulumi, "export", record):
            runpy.run_path(str(MAIN), run_name="__main__")
        if extra is not None:
            extra()
        return pulumi.Output.from_input(exported).apply(resolved.update)

    program()
    return resolved


def run_program(config: dict[str, Any], *, stack: str = "dev",
                extra: Callable[[], None] | None = None, zones: int = 6) -> Built:
    """Run infra/__main__.py with ``config`` ({"rayfleet:key": value}) under fresh mocks.

    ``extra`` runs inside the same program after __main__, for mutation tests that add a
    resource the way a careless change to the program would.
    """
    region = str(config.get("rayfleet:region", "us-east-1"))
    mocks = CaptureMocks(region, zones=zones)
    monitor = CaptureMonitor(mocks)
    try:
        resolved = execute(mocks, config, stack=stack, monitor=monitor, extra=extra)
    except Exception as err:
        # Let a test see what had been registered when the program stopped.
        err.registrations = list(monitor.registrations)  # type: ignore[attr-defined]
        raise
    resources = []
    for reg in monitor.registrations:
        inputs, state, rid = mocks.inputs[(reg["type"], reg["name"])]
        # What the resource came back with beyond its inputs (ids, ARNs, auto-names): a
        # mutation that removes an input must not find it again among the outputs.
        outputs = {k: v for k, v in state.items() if k not in inputs or v != inputs[k]}
        resources.append(Resource(type=reg["type"], name=reg["name"], inputs=inputs,
                                  outputs={**outputs, "id": rid}, urn=reg["urn"],
                                  parent=reg["parent"], provider=reg["provider"],
                                  deps=reg["deps"]))
    return Built(resources=resources, outputs=resolved, registrations=monitor.registrations,
                 calls=list(mocks.calls))


def _pulumi_string(value: Any) -> str:
    """Config values as the engine hands them to a program: strings, arrays as JSON."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def policy_resources(resources: list[Resource]) -> list[PolicyResource]:
    """The graph as the engine hands it to a policy pack's stack policies: each resource's
    properties (inputs, plus the ids and ARNs it came back with) behind CrossGuard's
    unknown-checking proxy, and its property dependencies as resource objects."""
    out = [PolicyResource(r.type, unknown_checking_proxy({**r.outputs, **r.inputs}), r.urn,
                          r.name, PolicyResourceOptions(False, [], False, [], None, []), None,
                          None, [], {}) for r in resources]
    by_urn = {p.urn: p for p in out}
    for r, p in zip(resources, out, strict=True):
        p.parent = by_urn.get(r.parent)
        p.property_dependencies = {k: [by_urn[u] for u in urns if u in by_urn]
                                   for k, urns in r.deps.items()}
    return out
