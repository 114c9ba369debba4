"""One home per fact: tag keys, ports, the IMDS hop limits, the bucket-name rule and the secret
patterns live in rayfleet/facts.py, instance and GPU facts in rayfleet/catalog.py (its
catalog.json). A second copy written anywhere else in the kit fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rayfleet import catalog, config, facts
from rayfleet.commands import cost, lint

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "infra" / "ansible" / "roles" / "ray_node"
# The kit's own code and configuration; tests may spell a fact out to pin what users see.
SOURCES = [p for folder in ("rayfleet", "infra", "workloads", "bench", "scripts")
           for p in sorted((REPO / folder).rglob("*"))
           if p.is_file() and p.suffix in (".py", ".yml", ".yaml", ".j2", ".sh", ".json")
           and "__pycache__" not in p.parts]


def _hits(pattern: str, *homes: Path) -> list[str]:
    rx = re.compile(pattern)
    out = []
    for path in SOURCES:
        if path in homes:
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if rx.search(line):
                out.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    return out


FACTS = REPO / "rayfleet" / "facts.py"
CATALOG = [REPO / "rayfleet" / "catalog.py", REPO / "rayfleet" / "catalog.json"]
LOGSHIP = REPO / "rayfleet" / "agents" / "logship.py"


# ----------------------------------------------------------------------------- tags, patterns

def test_rayfleet_tag_keys_are_written_only_in_facts():
    # A quoted "rayfleet:<lowercase-key>" is a tag key (config keys are camelCase and Pulumi
    # type tokens have a second colon).
    assert _hits(r"""["']rayfleet:[a-z]+(-[a-z]+)*["']""", FACTS) == []
    for key in facts.TAG_KEYS:
        assert _hits(f"[\"']{re.escape(key)}[\"']", FACTS) == [], key


def test_secret_patterns_are_one_list_for_lint_and_the_policy_pack():
    from infra.policy_pack import compute as checks

    assert lint.SECRET_PATTERNS is facts.SECRET_PATTERNS
    assert checks.SECRET_PATTERNS is facts.SECRET_PATTERNS
    assert _hits(r"AKIA\|ASIA|PRIVATE KEY-----", FACTS) == []


@pytest.mark.parametrize("text", [
    "export RAY_AUTH_TOKEN=abc", "RAY_AUTH_TOKEN=0123456789abcdef0123 ray start",
    "aws configure set aws_access_key_id AKIAABCDEFGHIJKLMNOP", "DB_PASSWORD=hunter2hunter2",
    "wandb_api_key: 0123456789", "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123456789",
    "-----BEGIN OPENSSH PRIVATE KEY-----", "aws_secret_access_key = wJalrXUtnFEMI",
])
def test_a_secret_is_one_to_lint_and_to_the_policy_pack(text):
    assert any(p.search(text) for p, _ in facts.SECRET_PATTERNS)


@pytest.mark.parametrize("text", [
    "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.rayfleet/auth_token",
    "  ~/.rayfleet/auth_token: /tmp/pytest-of-me/pytest-1/test0/token",
    "RAY_AUTH_TOKEN=$(cat ~/.rayfleet/auth_token)", "token_file: ~/.rayfleet/token",
])
def test_references_to_secrets_are_not_secrets(text):
    assert not any(p.search(text) for p, _ in facts.SECRET_PATTERNS)


def test_bucket_and_cluster_name_rules_live_in_facts():
    # The log shipper's copy (a node agent cannot import the kit) is held equal just below.
    assert _hits(r"\{1,61\}|\{1,30\}", FACTS, LOGSHIP) == []
    for good in ("rayfleet-data-0001", "a.b-c", "abc"):
        assert facts.is_bucket_name(good), good
    for bad in ("My_Bucket", "ab", "a..b", "-abc", "abc-", "a" * 64):
        assert not facts.is_bucket_name(bad), bad


def test_the_log_shipper_refuses_what_facts_refuses():
    from rayfleet.agents import logship

    assert logship.S3_BUCKET_NAME.pattern == facts.S3_BUCKET_NAME.pattern
    for bad in ("My_Bucket", "ab", "a..b", "-abc", "abc-", "a" * 64):
        with pytest.raises(logship.BadArgs, match="is not s3://BUCKET/PREFIX"):
            logship.parse_args(["--storage", f"s3://{bad}/p", "--address", "http://h:1"])
    args = logship.parse_args(["--storage", "s3://a.b-c/p/", "--address", "http://h:1"])
    assert (args.bucket, args.prefix) == ("a.b-c", "p")


def test_ports_and_hop_limits_are_not_respelled():
    # A port number or hop limit as a value in code (an assignment, a keyword, a tuple):
    # outside facts, only the Ansible role's defaults, which `make regen` writes from RAY_PORTS
    # (tests/unit/test_regen.py).
    # (ssh's 22 is also a rule number; Serve's ports are the Serve configs' to set.)
    numbers = "|".join(sorted({str(n) for p in facts.RAY_PORTS for n in (p.from_port, p.to_port)
                               if p.flag.startswith("--")}))
    code = rf"=\s*({numbers})\s*[,)]|\(\s*({numbers})\s*,|,\s*({numbers})\s*\)|=\s*({numbers})$"
    assert _hits(code + r"|OPERATOR_PORTS\s*=\s*\(|RayPort\(|hop_limit\s*=\s*\d", FACTS,
                 ROLE / "defaults" / "main.yml", ROLE / "meta" / "argument_specs.yml") == []
    assert {name for name, _ in facts.OPERATOR_PORTS} <= set(facts.RAY_PORTS_BY_NAME)
    assert set(facts.WORLD_FORBIDDEN) <= set(facts.RAY_PORTS_BY_NAME)


# Ports the kit's code spells out inside a string, waiting for a change outside these tests:
# path -> the one line allowed.
SPELLED_IN_STRINGS: dict[str, str] = {}


def test_ports_are_not_spelled_inside_strings_either():
    # A port number anywhere in a line: a URL's ("http://127.0.0.1:8265"), a host:port, a
    # default or a help text. Outside facts, only the Ansible role's pinned defaults (make regen).
    numbers = sorted({str(n) for p in facts.RAY_PORTS for n in (p.from_port, p.to_port)
                      if p.flag.startswith("--")})
    hits = _hits(rf"(?<![\w.])({'|'.join(numbers)})(?![\w])", FACTS,
                 ROLE / "defaults" / "main.yml", ROLE / "meta" / "argument_specs.yml")
    allowed = [f"{path}:" for path in SPELLED_IN_STRINGS]
    left = [h for h in hits if not any(h.startswith(a) and h.endswith(SPELLED_IN_STRINGS[
        a[:-1]]) for a in allowed)]
    assert left == [], left
    # The regex finds what it is for (a URL's port, a host:port, a quoted one).
    rx = re.compile(rf"(?<![\w.])({'|'.join(numbers)})(?![\w])")
    for text in ('default="http://127.0.0.1:8265"', "10.0.0.10:6379", '"--port", "6379"',
                 "dashboard (8265)", "--min-worker-port=10002"):
        assert rx.search(text), text
    for text in ("10.0.82.65", "v2.6379", "ray_node_gcs_port", "86379", "port6379"):
        assert not rx.search(text), text


# ----------------------------------------------------------------------------- instance catalog

def test_config_render_and_cost_read_the_catalog():
    assert config.WORKER_INSTANCE_TYPES is catalog.worker_types()
    assert config.HEAD_INSTANCE_TYPES is catalog.head_types()
    assert config.WORKER_REGIONS is catalog.worker_regions()
    assert cost.load_prices()["gpu"].keys() == catalog.worker_types().keys()
    assert not (REPO / "rayfleet" / "prices.json").exists()


def test_instance_facts_are_not_respelled():
    # GPU-type regexes, FLOP/s figures, per-type memory tables, instance specs.
    assert _hits(r"""r["']\^?\(?p\\d|g\\d\+|\d{3}e12\b|"A100-80G":\s*\d|InstanceSpec\(["']""",
                 *CATALOG) == []


@pytest.mark.parametrize("itype,gpu,quota", [
    ("p4d.24xlarge", True, "P"), ("p5en.48xlarge", True, "P"), ("p3dn.24xlarge", True, "P"),
    ("g5g.xlarge", True, "G"), ("g4ad.xlarge", True, "G"), ("gr6.4xlarge", True, "G"),
    ("trn1.32xlarge", False, None), ("inf2.xlarge", False, None), ("m6i.2xlarge", False, None),
    ("u-6tb1.metal", False, None), ("p4d", False, None),
])
def test_gpu_types_and_their_quota_group(itype, gpu, quota):
    assert catalog.is_gpu_type(itype) is gpu
    assert catalog.quota_group(itype) == quota


def test_gpu_memory_and_peak_flops():
    assert catalog.gpu_memory_gib("A100-80G") == 80 and catalog.gpu_memory_gib("A100") == 40
    assert catalog.gpu_memory_gib("no-such-gpu") == 0
    assert catalog.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert catalog.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert catalog.peak_bf16_flops("NVIDIA A10G") is None
    for t in catalog.worker_types().values():
        assert t.gpus and t.gpu_memory_gib and t.efa_interfaces
