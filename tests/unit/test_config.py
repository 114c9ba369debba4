"""rayfleet.config: every bad stack setting fails early, on one line, naming the key."""

from __future__ import annotations

import dataclasses
import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayfleet import config, configcheck, configkeys, configvalues
from rayfleet.config import StackConfig, load_stack_file
from rayfleet.configkeys import JOINT_CHECKS, SCHEMA, SCHEMA_BY_NAME, WORKER_REGIONS
from rayfleet.errors import ConfigError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def cfg(**values) -> StackConfig:
    return StackConfig.from_mapping({f"rayfleet:{k}": v for k, v in values.items()})


def error_for(mapping: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        StackConfig.from_mapping(mapping)
    return info.value


# ----------------------------------------------------------------------------- good configs

def test_defaults_are_a_complete_secure_stack():
    c = StackConfig.from_mapping({})
    assert c.region == "us-east-1" and c.network.az_count == 3
    assert c.access.operator_cidrs == () and c.access.mode == "ssm"
    assert c.nodes.worker_instance_types == ("p4d.24xlarge",)
    assert c.nodes.imds_hop_limit == 1
    assert c.storage.encryption == "kms"
    assert not c.budget.enabled


def test_example_stack_file_loads():
    c = load_stack_file(ROOT / "Pulumi.dev.yaml")
    assert c.cluster_name == "rayfleet-dev"
    assert c.network.worker_az == "us-east-1b"
    assert c.budget.enabled and c.budget.emails == ("ml-platform@example.com",)


def test_pulumi_string_forms_are_accepted():
    # What the engine hands a program: every value a string, arrays as JSON.
    c = StackConfig.from_mapping({
        "rayfleet:azCount": "4", "rayfleet:rayInDocker": "true",
        "rayfleet:operatorCidrs": '["10.8.0.0/16"]', "rayfleet:budgetMonthlyUsd": "100",
        "rayfleet:budgetEmails": '["a@example.com"]',
    })
    assert c.network.az_count == 4 and c.nodes.ray_in_docker
    assert c.access.operator_cidrs == ("10.8.0.0/16",) and c.access.mode == "ssm+cidr"
    assert c.nodes.imds_hop_limit == 2


def test_bare_and_namespaced_keys_mean_the_same():
    assert StackConfig.from_mapping({"azCount": 5}) == StackConfig.from_mapping(
        {"rayfleet:azCount": 5})


def test_round_trip_through_to_mapping():
    c = load_stack_file(ROOT / "Pulumi.dev.yaml")
    assert StackConfig.from_mapping(c.to_mapping()) == c


def test_aws_region_equal_to_ours_is_fine():
    assert cfg(region="us-west-2").region == StackConfig.from_mapping(
        {"rayfleet:region": "us-west-2", "aws:region": "us-west-2"}).region


def test_other_packages_config_is_ignored():
    assert StackConfig.from_mapping({"other:thing": "x"}) == StackConfig.from_mapping({})


@pytest.mark.parametrize("on_demand,min_w,max_w,expected", [
    (0, 0, 2, (0, 0, 0, 2)),
    (1, 0, 2, (0, 1, 0, 1)),
    (1, 2, 4, (1, 1, 1, 3)),
    (4, 2, 4, (2, 4, 0, 0)),
])
def test_worker_counts_split_into_on_demand_then_spot(on_demand, min_w, max_w, expected):
    n = cfg(onDemandWorkers=on_demand, minWorkers=min_w, maxWorkers=max_w).nodes
    assert (n.on_demand_min, n.on_demand_max, n.spot_min, n.spot_max) == expected
    assert n.on_demand_min + n.spot_min == min_w
    assert n.on_demand_max + n.spot_max == max_w


@pytest.mark.parametrize("vpc,azs", [("10.42.0.0/16", 3), ("10.0.0.0/22", 6),
                                     ("172.20.0.0/18", 4)])
def test_subnets_fit_the_vpc_and_never_overlap(vpc, azs):
    private, public = cfg(vpcCidr=vpc, azCount=azs).network.subnet_cidrs()
    nets = [ipaddress.ip_network(n) for n in private + public]
    assert len(private) == len(public) == azs
    assert all(n.subnet_of(ipaddress.ip_network(vpc)) for n in nets)
    assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])
    assert all(n.prefixlen <= 28 for n in nets)  # AWS's smallest subnet


def test_worker_types_keep_the_stacks_order_and_split_per_type_and_market():
    n = cfg(workerInstanceTypes=["p5.48xlarge", "p4d.24xlarge"], minWorkers=2, maxWorkers=4,
            onDemandWorkers=1).nodes
    assert [w.name for w in n.workers] == ["p5.48xlarge", "p4d.24xlarge"]
    # The preferred type keeps the minimum (on-demand first); every type may grow to the
    # split's maxima; the cluster's max_workers (maxWorkers) bounds them together.
    assert [(w.spec.name, w.market, w.min_workers, w.max_workers)
            for w in n.worker_splits()] == [
        ("p5.48xlarge", "spot", 1, 3), ("p5.48xlarge", "ondemand", 1, 1),
        ("p4d.24xlarge", "spot", 0, 3), ("p4d.24xlarge", "ondemand", 0, 1)]


def test_a_bare_string_is_a_one_type_list_as_pulumi_config_set_stores_it():
    assert cfg(workerInstanceTypes="p4de.24xlarge").nodes.worker_instance_types == \
        ("p4de.24xlarge",)
    assert cfg(workerInstanceTypes='["p5.48xlarge","p4d.24xlarge"]').nodes \
        .worker_instance_types == ("p5.48xlarge", "p4d.24xlarge")


def test_p4de_regions_are_a_subset_of_p4d_regions():
    assert set(WORKER_REGIONS["p4de.24xlarge"]) <= set(WORKER_REGIONS["p4d.24xlarge"])


def test_config_import_stays_light_for_the_cli():
    # render/preflight/cost import rayfleet.config on every invocation: no Pulumi, no boto3.
    code = "import sys, rayfleet.config; print(sorted({'pulumi', 'boto3'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]"


# ----------------------------------------------------------------------------- Pulumi.yaml

def test_pulumi_yaml_follows_the_project_file_rules():
    # The checks `pulumi` applies to a project's config block (sdk/go/common/workspace/
    # project.go, Project.Validate): typed keys belong to the project's namespace, arrays
    # name their item type, defaults match the type.
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    assert project["name"] == "rayfleet"
    assert project["runtime"]["name"] == "python"
    assert project["runtime"]["options"]["virtualenv"] == ".venv"
    assert project["main"] == "infra/"
    python_types = {"string": str, "integer": int, "boolean": bool, "array": list}
    for key, entry in project["config"].items():
        assert key.startswith("rayfleet:"), key
        assert {"default", "description"} <= set(entry), key
        assert "value" not in entry, key
        assert type(entry["default"]) is python_types[entry.get("type", "array")], key
        if "type" not in entry:
            continue  # untyped: a list of objects, no items type to name
        if entry["type"] == "array":
            assert entry["items"] == {"type": "string"}, key
        assert entry["description"].strip(), key


def test_pulumi_yaml_defaults_build_the_default_config():
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    defaults = {k: v["default"] for k, v in project["config"].items()}
    assert StackConfig.from_mapping(defaults) == StackConfig.from_mapping({})


# ----------------------------------------------------------------------------- reservations

ODCR = {"instanceType": "p4d.24xlarge", "availabilityZone": "us-east-1b",
        "id": "cr-0123456789abcdef0"}
BLOCK = {"instanceType": "p4d.24xlarge", "availabilityZone": "us-east-1c",
         "id": "cr-0fedcba9876543210", "capacityBlock": True}
GROUP = "arn:aws:resource-groups:us-east-1:123456789012:group/p4de-odcrs"


def test_reservations_come_first_in_their_types_order_block_before_odcr():
    n = cfg(workerInstanceTypes=["p4d.24xlarge", "p4de.24xlarge"], minWorkers=1, maxWorkers=4,
            onDemandWorkers=1,
            capacityReservations=[ODCR, {"instanceType": "p4de.24xlarge",
                                         "availabilityZone": "us-east-1b",
                                         "resourceGroupArn": GROUP}, BLOCK]).nodes
    # Prepaid capacity first, per type in the stack's order; reservations keep no minimum and
    # may grow to maxWorkers (AWS, not the config, knows how many instances they hold).
    assert [(w.spec.name, w.market, w.min_workers, w.max_workers,
             w.reservation.target if w.reservation else None)
            for w in n.worker_splits()] == [
        ("p4d.24xlarge", "block", 0, 4, BLOCK["id"]),
        ("p4d.24xlarge", "reserved", 0, 4, ODCR["id"]),
        ("p4d.24xlarge", "spot", 0, 3, None), ("p4d.24xlarge", "ondemand", 1, 1, None),
        ("p4de.24xlarge", "reserved", 0, 4, GROUP),
        ("p4de.24xlarge", "spot", 0, 3, None), ("p4de.24xlarge", "ondemand", 0, 1, None)]
    assert n.reserved_azs == ("us-east-1b", "us-east-1c")


def test_fallback_azs_follow_each_type_in_the_workers_az_type_major():
    n = cfg(workerInstanceTypes=["p4d.24xlarge", "p4de.24xlarge"], workerAz="us-east-1b",
            workerFallbackAzs=["us-east-1c", "us-east-1a"], minWorkers=1, maxWorkers=4,
            onDemandWorkers=1, capacityReservations=[BLOCK]).nodes
    assert n.worker_fallback_azs == ("us-east-1c", "us-east-1a")
    # A type's reservations, spot and on-demand in the workers' AZ, then its spot and
    # on-demand in each fallback AZ in order, then the next type. The minimum stays in the
    # workers' AZ; a fallback entry has its market's maximum (maxWorkers bounds them all).
    assert [(w.spec.name, w.market, w.fallback_az, w.min_workers, w.max_workers)
            for w in n.worker_splits()] == [
        ("p4d.24xlarge", "block", None, 0, 4),
        ("p4d.24xlarge", "spot", None, 0, 3), ("p4d.24xlarge", "ondemand", None, 1, 1),
        ("p4d.24xlarge", "spot", "us-east-1c", 0, 3),
        ("p4d.24xlarge", "ondemand", "us-east-1c", 0, 1),
        ("p4d.24xlarge", "spot", "us-east-1a", 0, 3),
        ("p4d.24xlarge", "ondemand", "us-east-1a", 0, 1),
        ("p4de.24xlarge", "spot", None, 0, 3), ("p4de.24xlarge", "ondemand", None, 0, 1),
        ("p4de.24xlarge", "spot", "us-east-1c", 0, 3),
        ("p4de.24xlarge", "ondemand", "us-east-1c", 0, 1),
        ("p4de.24xlarge", "spot", "us-east-1a", 0, 3),
        ("p4de.24xlarge", "ondemand", "us-east-1a", 0, 1)]
    # As `pulumi config set --path` hands a list over; empty by default.
    assert cfg(workerFallbackAzs='["us-east-1c"]').nodes.worker_fallback_azs == ("us-east-1c",)
    assert cfg().nodes.worker_fallback_azs == ()


def test_reservations_as_pulumi_config_hands_them_over():
    # `pulumi config set --path` stores a structured value; the program gets it as JSON text.
    import json

    n = cfg(capacityReservations=json.dumps([BLOCK])).nodes
    assert n.capacity_reservations[0].capacity_block and n.capacity_reservations[0].market == \
        "block"
    assert cfg(capacityReservations="").nodes.capacity_reservations == ()
    assert cfg().nodes.capacity_reservations == ()


# ----------------------------------------------------------------------------- bad configs

BAD = [
    # (mapping, key named, fragments the line must hold)
    ({"rayfleet:azcount": 3}, "rayfleet:azcount", ['did you mean "rayfleet:azCount"']),
    ({"rayfleet:clusterName": "My_Cluster"}, "rayfleet:clusterName",
     ['did you mean "my-cluster"']),
    ({"rayfleet:clusterName": "a"}, "rayfleet:clusterName", ["3-32"]),
    ({"rayfleet:region": "us-east1"}, "rayfleet:region", ['did you mean "us-east-1"']),
    ({"rayfleet:region": "us-west-1"}, "rayfleet:workerInstanceTypes",
     ["p4d.24xlarge is not offered in rayfleet:region us-west-1", "us-east-1",
      'did you mean "us-west-2"']),
    ({"rayfleet:region": "eu-central-1",
      "rayfleet:workerInstanceTypes": ["p4d.24xlarge", "p4de.24xlarge"]},
     "rayfleet:workerInstanceTypes", ["p4de.24xlarge is not offered",
                                      "allowed: us-east-1, us-west-2"]),
    ({"rayfleet:region": "us-east-1", "rayfleet:workerInstanceTypes": ["p5en.48xlarge"]},
     "rayfleet:workerInstanceTypes", ["p5en.48xlarge is not offered in rayfleet:region "
                                      "us-east-1"]),
    ({"rayfleet:azCount": 2}, "rayfleet:azCount", ["between 3 and 6"]),
    ({"rayfleet:azCount": "three"}, "rayfleet:azCount", ["expected an integer"]),
    ({"rayfleet:workerAz": "us-east-1"}, "rayfleet:workerAz", ["not an availability zone"]),
    ({"rayfleet:workerAz": "us-west-2b"}, "rayfleet:workerAz", ['did you mean "us-east-1b"']),
    ({"rayfleet:vpcCidr": "10.0.0.0/8"}, "rayfleet:vpcCidr", ["/16 to /22"]),
    ({"rayfleet:vpcCidr": "10.42.1.0/16"}, "rayfleet:vpcCidr",
     ['host bits', 'did you mean "10.42.0.0/16"']),
    ({"rayfleet:vpcCidr": "8.8.0.0/16"}, "rayfleet:vpcCidr", ["private range", "10.0.0.0/8"]),
    ({"rayfleet:vpcCidr": "banana"}, "rayfleet:vpcCidr", ["not a CIDR"]),
    ({"rayfleet:natGateways": "per_az"}, "rayfleet:natGateways",
     ["allowed: single, per-az", 'did you mean "per-az"']),
    ({"rayfleet:flowLogRetentionDays": 0}, "rayfleet:flowLogRetentionDays",
     ['did you mean "1"']),
    ({"rayfleet:flowLogRetentionDays": 91}, "rayfleet:flowLogRetentionDays",
     ['did you mean "90"']),
    ({"rayfleet:operatorCidrs": ["0.0.0.0/0"]}, "rayfleet:operatorCidrs",
     ["whole internet", "SSM"]),
    ({"rayfleet:operatorCidrs": ["::/0"]}, "rayfleet:operatorCidrs", ["whole internet"]),
    ({"rayfleet:operatorCidrs": ["0.0.0.0/1"]}, "rayfleet:operatorCidrs", ["broader than /8"]),
    ({"rayfleet:operatorCidrs": ["10.0.0.1/8"]}, "rayfleet:operatorCidrs",
     ['did you mean "10.0.0.0/8"']),
    ({"rayfleet:operatorCidrs": ["10.0.0.300/24"]}, "rayfleet:operatorCidrs", ["not a CIDR"]),
    ({"rayfleet:operatorCidrs": "not json ["}, "rayfleet:operatorCidrs", ["not a CIDR"]),
    ({"rayfleet:operatorCidrs": [1, 2]}, "rayfleet:operatorCidrs", ["list of strings"]),
    ({"rayfleet:headInstanceType": "m6i.2xlarg"}, "rayfleet:headInstanceType",
     ['did you mean "m6i.2xlarge"']),
    ({"rayfleet:headInstanceType": "p4d.24xlarge"}, "rayfleet:headInstanceType",
     ["GPU type", "CPU"]),
    ({"rayfleet:workerInstanceType": "p5.48xlarge"}, "rayfleet:workerInstanceType",
     ["replaced by rayfleet:workerInstanceTypes",
      "set rayfleet:workerInstanceTypes: [p5.48xlarge]"]),
    ({"rayfleet:workerInstanceTypes": ["p4d.24xl"]}, "rayfleet:workerInstanceTypes",
     ["not a GPU worker type", "allowed: p4d.24xlarge, p4de.24xlarge, p5.48xlarge",
      'did you mean "p4d.24xlarge"']),
    ({"rayfleet:workerInstanceTypes": ["p5.48xlarge", "p4d.24xlarge", "p5.48xlarge"]},
     "rayfleet:workerInstanceTypes", ["lists p5.48xlarge twice"]),
    ({"rayfleet:workerInstanceTypes": []}, "rayfleet:workerInstanceTypes",
     ["is empty", "p4d.24xlarge, p4de.24xlarge, p5.48xlarge, p5e.48xlarge, p5en.48xlarge"]),
    ({"rayfleet:workerInstanceTypes": ""}, "rayfleet:workerInstanceTypes", ["is empty"]),
    ({"rayfleet:workerInstanceTypes": ["m6i.2xlarge"]}, "rayfleet:workerInstanceTypes",
     ["not a GPU worker type"]),
    ({"rayfleet:minWorkers": 3, "rayfleet:maxWorkers": 2}, "rayfleet:minWorkers",
     ["must be <= maxWorkers", "rayfleet:maxWorkers is 2"]),
    ({"rayfleet:maxWorkers": 0}, "rayfleet:maxWorkers", ["between 1 and 64"]),
    ({"rayfleet:minWorkers": -1}, "rayfleet:minWorkers", ["between 0 and 64"]),
    ({"rayfleet:onDemandWorkers": 3}, "rayfleet:onDemandWorkers", ["rayfleet:maxWorkers (2)"]),
    ({"rayfleet:headRootVolumeGb": 8}, "rayfleet:headRootVolumeGb", ["between 100"]),
    ({"rayfleet:workerRootVolumeGb": 100}, "rayfleet:workerRootVolumeGb", ["between 200"]),
    ({"rayfleet:amiId": "ami-123"}, "rayfleet:amiId", ["not an AMI id"]),
    ({"rayfleet:rayInDocker": "yes"}, "rayfleet:rayInDocker", ["true or false"]),
    ({"rayfleet:headHa": "on"}, "rayfleet:headHa", ["true or false", "'on'"]),
    ({"rayfleet:headHa": 1}, "rayfleet:headHa", ["true or false"]),
    ({"rayfleet:bucketPrefix": "My_Bucket"}, "rayfleet:bucketPrefix",
     ['did you mean "my-bucket"']),
    ({"rayfleet:bucketPrefix": "data.bucket"}, "rayfleet:bucketPrefix",
     ['did you mean "data-bucket"']),
    ({"rayfleet:bucketPrefix": "x" * 38}, "rayfleet:bucketPrefix", ["3-37 characters"]),
    ({"rayfleet:bucketPrefix": "xn--bucket"}, "rayfleet:bucketPrefix", ["reserves"]),
    ({"rayfleet:bucketKeyPrefix": "/data"}, "rayfleet:bucketKeyPrefix",
     ['did you mean "data/"']),
    ({"rayfleet:bucketKeyPrefix": "data"}, "rayfleet:bucketKeyPrefix",
     ['did you mean "data/"']),
    ({"rayfleet:bucketKeyPrefix": ""}, "rayfleet:bucketKeyPrefix", ["ending with /"]),
    ({"rayfleet:bucketEncryption": "sse-kms"}, "rayfleet:bucketEncryption",
     ["allowed: kms, s3"]),
    ({"rayfleet:noncurrentVersionDays": 0}, "rayfleet:noncurrentVersionDays", ["between 1"]),
    ({"rayfleet:abortMultipartDays": 0}, "rayfleet:abortMultipartDays", ["between 1"]),
    ({"rayfleet:budgetMonthlyUsd": 100}, "rayfleet:budgetEmails", ["at least one address"]),
    ({"rayfleet:budgetEmails": ["a@example.com"]}, "rayfleet:budgetMonthlyUsd",
     ["set a monthly limit"]),
    ({"rayfleet:budgetMonthlyUsd": 100, "rayfleet:budgetEmails": ["not-an-email"]},
     "rayfleet:budgetEmails", ["not an email address"]),
    ({"rayfleet:budgetMonthlyUsd": -5}, "rayfleet:budgetMonthlyUsd", ["0 (no budget) or more"]),
    ({"rayfleet:autostopMinutes": -1}, "rayfleet:autostopMinutes", ["between 0 and 10080"]),
    ({"rayfleet:vllm": "gpu"}, "rayfleet:vllm", ["allowed: cuda, cpu, none"]),
    ({"rayfleet:budgetMonthlyUsd": 1, "rayfleet:budgetEmails": [f"a{i}@x.io" for i in range(11)]},
     "rayfleet:budgetEmails", ["at most 10"]),
    ({"rayfleet:region": {"secure": "AAAbase64"}}, "rayfleet:region", ["not a secret"]),
    ({"aws:region": "eu-west-1"}, "aws:region", ["rayfleet:region (us-east-1)"]),
    ({"aws:profile": "prod"}, "aws:profile", ["AWS_PROFILE"]),
    # rayfleet:workerFallbackAzs: AZs of the region, each once, none the workers' own.
    ({"rayfleet:workerFallbackAzs": ["us-east1c"]}, "rayfleet:workerFallbackAzs",
     ['did you mean "us-east-1c"', "expected a list such as [us-east-1c]"]),
    ({"rayfleet:workerFallbackAzs": ["eu-west-1c"]}, "rayfleet:workerFallbackAzs",
     ["rayfleet:region us-east-1", 'did you mean "us-east-1c"']),
    ({"rayfleet:workerAz": "us-east-1b", "rayfleet:workerFallbackAzs": ["us-east-1b"]},
     "rayfleet:workerFallbackAzs", ["us-east-1b, which is rayfleet:workerAz"]),
    ({"rayfleet:workerFallbackAzs": ["us-east-1c", "us-east-1c"]},
     "rayfleet:workerFallbackAzs", ["lists us-east-1c twice"]),
    ({"rayfleet:workerFallbackAzs": [3]}, "rayfleet:workerFallbackAzs",
     ["expected a list of strings"]),
    ({"rayfleet:workerFallbackAZs": ["us-east-1c"]}, "rayfleet:workerFallbackAZs",
     ['did you mean "rayfleet:workerFallbackAzs"']),
    # rayfleet:capacityReservations: each mistake names the entry's key.
    ({"rayfleet:capacityReservations": "cr-0123456789abcdef0"}, "rayfleet:capacityReservations",
     ["expected a list of objects"]),
    ({"rayfleet:capacityReservations": [{**ODCR, "instanceType": "p4de.24xlarge"}]},
     "rayfleet:capacityReservations[0].instanceType",
     ["not one of rayfleet:workerInstanceTypes", "allowed: p4d.24xlarge"]),
    ({"rayfleet:capacityReservations": [{**ODCR, "availabilityZone": "us-east1b"}]},
     "rayfleet:capacityReservations[0].availabilityZone", ['did you mean "us-east-1b"']),
    ({"rayfleet:capacityReservations": [{**ODCR, "availabilityZone": "eu-west-1a"}]},
     "rayfleet:capacityReservations[0].availabilityZone", ["rayfleet:region us-east-1"]),
    ({"rayfleet:capacityReservations": [{**ODCR, "id": "cr-0123456789ABCDEF0"}]},
     "rayfleet:capacityReservations[0].id", ['did you mean "cr-0123456789abcdef0"']),
    ({"rayfleet:capacityReservations": [{**ODCR, "resourceGroupArn": GROUP}]},
     "rayfleet:capacityReservations[0]", ["exactly one of id", "got both"]),
    ({"rayfleet:capacityReservations": [{"instanceType": "p4d.24xlarge",
                                         "availabilityZone": "us-east-1b"}]},
     "rayfleet:capacityReservations[0]", ["exactly one of id", "got neither"]),
    ({"rayfleet:capacityReservations": [{**ODCR, "capacityblock": True}]},
     "rayfleet:capacityReservations[0].capacityblock", ['did you mean "capacityBlock"']),
    ({"rayfleet:capacityReservations": [{**ODCR, "capacityBlock": "yes"}]},
     "rayfleet:capacityReservations[0].capacityBlock", ["expected true or false"]),
    ({"rayfleet:capacityReservations": [{"instanceType": "p4d.24xlarge", "capacityBlock": True,
                                         "availabilityZone": "us-east-1b",
                                         "resourceGroupArn": GROUP}]},
     "rayfleet:capacityReservations[0].resourceGroupArn", ["set id: cr-... instead"]),
    ({"rayfleet:capacityReservations": [{"instanceType": "p4d.24xlarge",
                                         "availabilityZone": "us-east-1b",
                                         "resourceGroupArn": GROUP.replace("us-east-1",
                                                                           "us-west-2")}]},
     "rayfleet:capacityReservations[0].resourceGroupArn", ["of rayfleet:region us-east-1"]),
    ({"rayfleet:capacityReservations": [ODCR, {**ODCR, "id": "cr-0123456789abcdef1"}]},
     "rayfleet:capacityReservations[1]", ["second On-Demand Capacity Reservation for "
                                          "p4d.24xlarge", "resource group"]),
    ({"rayfleet:capacityReservations": [ODCR, {**ODCR, "capacityBlock": True}]},
     "rayfleet:capacityReservations[1]", ["lists cr-0123456789abcdef0 twice"]),
]


@pytest.mark.parametrize("mapping,key,fragments", BAD,
                         ids=[f"{i}-{k}" for i, (_, k, _) in enumerate(BAD)])
def test_bad_setting_fails_on_one_line_naming_the_key(mapping, key, fragments):
    err = error_for(mapping)
    line = str(err)
    assert "\n" not in line
    assert line.startswith(f"{key}: "), line
    assert err.key == key
    for fragment in fragments:
        assert fragment in line, line


def test_every_key_has_a_bad_value_test():
    named = {key for _, key, _ in BAD}
    assert {k.qualified for k in SCHEMA} <= named


# ----------------------------------------------------------------------------- declared checks

def test_every_key_carries_its_own_check_or_names_its_joint_check():
    for key in SCHEMA:
        own, joint = key.check is not None, key.checked_with in JOINT_CHECKS
        assert own != joint, f"{key.name}: a check of its own, or checked_with a joint check"


@pytest.mark.parametrize("name,bad", [
    ("clusterName", "My_Cluster"), ("region", "us-east1"), ("azCount", 7),
    ("natGateways", "per_az"), ("flowLogRetentionDays", 91), ("operatorCidrs", ["0.0.0.0/0"]),
    ("bucketKeyPrefix", "/data"), ("autostopMinutes", 10081),
])
def test_a_bad_value_is_refused_by_its_keys_declared_check(name, bad):
    with pytest.raises(ConfigError) as declared:
        SCHEMA_BY_NAME[name].checked(bad)
    assert str(error_for({f"rayfleet:{name}": bad})) == str(declared.value)


def test_from_mapping_runs_the_check_the_schema_declares(monkeypatch):
    stricter = dataclasses.replace(SCHEMA_BY_NAME["azCount"], check=configvalues.between(3, 4))
    monkeypatch.setattr(config, "SCHEMA",
                        tuple(stricter if k.name == "azCount" else k for k in SCHEMA))
    assert str(error_for({"rayfleet:azCount": 5})) == \
        "rayfleet:azCount: must be between 3 and 4, got 5"


def test_the_moved_checks_and_tables_keep_their_old_import_paths():
    assert configkeys.AWS_REGIONS is configvalues.AWS_REGIONS
    assert configkeys.LOG_RETENTION_DAYS is configvalues.LOG_RETENTION_DAYS
    for name in ("qualified", "suggest", "choice", "int_range", "cluster_name", "region",
                 "vpc_cidr", "operator_cidrs", "bucket_prefix", "key_prefix", "budget"):
        assert getattr(configcheck, name) is getattr(configvalues, name), name


def test_stack_file_problems_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the stack file"):
        load_stack_file(tmp_path / "Pulumi.missing.yaml")
    bad_yaml = tmp_path / "Pulumi.bad.yaml"
    bad_yaml.write_text("config: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_stack_file(bad_yaml)
    typo = tmp_path / "Pulumi.typo.yaml"
    typo.write_text("config:\n  rayfleet:maxWorker: 4\n")
    with pytest.raises(ConfigError, match='did you mean "rayfleet:maxWorkers"'):
        load_stack_file(typo)


def test_head_ha_is_off_unless_the_stack_says_true():
    assert StackConfig.from_mapping({}).head_ha is False
    assert load_stack_file(ROOT / "Pulumi.dev.yaml").head_ha is False
    assert StackConfig.from_mapping({"rayfleet:headHa": "true"}).head_ha is True
    assert StackConfig.from_mapping({"headHa": True}).head_ha is True
