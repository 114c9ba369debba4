"""`rayfleet preflight` on moto: the rendered example stack passes; each missing piece fails
with its fix; bad input stops before any AWS call."""

from __future__ import annotations

import json

import pytest
import yaml

from rayfleet.commands import cli, preflight

pytestmark = pytest.mark.moto


def _run(path, capsys, *extra) -> tuple[int, str]:
    rc = cli.main(["preflight", str(path), *extra])
    return rc, capsys.readouterr().out


def test_rendered_stack_passes(rendered, capsys):
    rc, out = _run(rendered, capsys, "--num-gpus", "8")
    assert rc == 0, out
    assert "0 failed" in out
    # Each allowed worker type is checked in the workers' AZ on its own (p4d, then p4de).
    for name in ("token", "8 GPUs", "subnets", "p4d.24xlarge offered", "p4de.24xlarge offered",
                 "security groups", "AMIs", "key pairs", "instance profile", "bucket"):
        assert name in out, name
    # moto has no Service Quotas: reported as unknown, not a crash.
    assert "UNKNOWN  quota" in out


def test_deleted_security_group_fails_with_fix(rendered, stack, ec2, capsys):
    cfg = yaml.safe_load(rendered.read_text())
    cfg["available_node_types"]["ray.head.default"]["node_config"]["SecurityGroupIds"] = [
        "sg-0123456789abcdef0"]
    rendered.write_text(yaml.safe_dump(cfg))
    rc, out = _run(rendered, capsys, "--bucket", "s3://" + stack["outputs"]["bucket"] + "/x/")
    assert rc == 1
    assert any(ln.startswith("FAIL") and "security groups" in ln and "pulumi up" in ln
               for ln in out.splitlines()), out


def test_missing_key_pair_bucket_and_token(rendered, tmp_path, ec2, capsys):
    ec2.delete_key_pair(KeyName="rayfleet-dev-operator")
    (tmp_path / "token").unlink()
    rc, out = _run(rendered, capsys, "--bucket", "s3://no-such-bucket-rayfleet/x/")
    assert rc == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert any("key pairs" in ln and "rayfleet keypair CLUSTER_YAML" in ln for ln in fails)
    assert any("bucket" in ln for ln in fails)
    assert any("token" in ln and "rayfleet render" in ln for ln in fails)


def test_instance_type_not_offered_in_the_az(rendered, capsys):
    cfg = yaml.safe_load(rendered.read_text())
    cfg["available_node_types"]["ray.head.default"]["node_config"]["InstanceType"] = "p4d.48xlarge"
    rendered.write_text(yaml.safe_dump(cfg))
    rc, out = _run(rendered, capsys)
    assert rc == 1 and "p4d.48xlarge offered" in out, out


def test_quota_below_max_workers_vcpus_fails(rendered, capsys):
    """A new account's P quota (often 0, or 48 vCPUs) cannot hold one p4d (96 vCPUs). The
    example allows p4d and p4de, one spot worker each, two workers in all: 192 spot vCPUs."""
    import io

    import boto3

    class Quotas:
        def get_service_quota(self, ServiceCode, QuotaCode):  # noqa: N803 (boto3's names)
            return {"Quota": {"Value": 48.0 if QuotaCode == "L-7212CCBC" else 192.0}}

    session = boto3.session.Session(region_name="us-east-1")
    real = session.client
    session.client = lambda name, **kw: Quotas() if name == "service-quotas" else real(name, **kw)
    out = io.StringIO()
    assert preflight.main(str(rendered), session=session, out=out) == 1
    lines = out.getvalue().splitlines()
    assert any(ln.startswith("FAIL") and "Spot" in ln and "need 192" in ln
               and "L-7212CCBC" in ln for ln in lines), lines
    assert any(ln.startswith("PASS") and "On-Demand P" in ln for ln in lines)


@pytest.mark.parametrize("types,cap,need", [
    ([(96, 2), (192, 2)], 2, 384),     # [p4d, p5], 2 workers at most: two p5s at worst
    ([(96, 2), (192, 2)], 3, 480),     # three: two p5s and a p4d
    ([(96, 1), (96, 1)], 2, 192),      # the example: one spot worker of each A100 type
    ([(96, 0), (192, 0)], 2, 0),       # no spot at all (onDemandWorkers = maxWorkers)
])
def test_quota_need_is_what_the_types_can_run_together(types, cap, need):
    assert preflight.quota_need(types, cap) == need


@pytest.mark.parametrize("mutate,argv,expected", [
    (None, ["--num-gpus", "16"], "no node type offers 16 GPUs (the most is 8)"),
    (lambda c: c["provider"].update(region="us-east1"), [], 'did you mean "us-east-1"'),
    (lambda c: c.update(provider={"type": "local", "head_ip": "1.2.3.4"}), [],
     "preflight checks AWS clusters"),
])
def test_bad_input_one_line_no_aws_call(mutate, argv, expected, rendered, aws_calls, capsys):
    cfg = yaml.safe_load(rendered.read_text())
    if mutate:
        mutate(cfg)
    rendered.write_text(yaml.safe_dump(cfg))
    aws_calls.clear()
    assert cli.main(["preflight", str(rendered), *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1
    assert aws_calls == []


def test_no_credentials_is_one_line_not_a_table_of_failures(rendered, aws_calls, capsys,
                                                             monkeypatch, tmp_path):
    # Without credentials every AWS row would FAIL, each with a misleading fix. (The
    # instance-metadata provider is switched off: nothing may leave this machine.)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    aws_calls.clear()
    assert cli.main(["preflight", str(rendered)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        "rayfleet: error: no AWS credentials found (environment, AWS_PROFILE, ~/.aws, SSO or an "
        "instance role): set them (e.g. `export AWS_PROFILE=...`), then run preflight again"]
    assert aws_calls == []


def test_the_bucket_is_renders_fact_beside_the_yaml(rendered, stack, aws_calls, capsys):
    """--bucket's default: the storage `rayfleet render` wrote beside the YAML; an older kit's
    YAML (none beside it) still gets its header comment's, with one line saying to re-render;
    a malformed facts file is one line, before any AWS call."""
    facts = rendered.with_name("cluster.rayfleet.json")
    storage = stack["outputs"]["storage_uri"]
    assert json.loads(facts.read_text())["storage_uri"] == storage
    bucket_row = "PASS     bucket"
    assert cli.main(["preflight", str(rendered)]) == 0
    out, err = capsys.readouterr()
    assert any(ln.startswith(bucket_row) and storage.rstrip("/") in ln
               for ln in out.splitlines()), out
    assert err == ""
    facts.unlink()
    assert cli.main(["preflight", str(rendered)]) == 0
    out, err = capsys.readouterr()
    assert any(ln.startswith(bucket_row) for ln in out.splitlines()), out
    assert err.count("\n") == 1 and "no cluster.rayfleet.json beside it" in err, err
    facts.write_text(json.dumps({"schema_version": 9}))
    aws_calls.clear()
    assert cli.main(["preflight", str(rendered)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "schema_version 9 is newer" in err, err
    assert aws_calls == []
