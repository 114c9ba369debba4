"""Bad input to `rayfleet logs` and to the log shipper agent: one line, exit 2, no AWS call;
what the agent may import; a training run named after its job. No cluster: the real thing
is tests/moto/test_logs.py."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from rayfleet.commands import cli, logs
from tests.conftest import REPO, free_port

AGENT = REPO / "rayfleet" / "agents" / "logship.py"


@pytest.fixture
def loopback_s3(monkeypatch):
    """Fake keys and an S3 endpoint on a closed loopback port: nothing can leave the box."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.mark.parametrize("argv,says", [
    (["logs"], "give a run (rayfleet logs CLUSTER_YAML RUN) or --cluster NAME"),
    (["logs", "r1", "--cluster", "dev-a", "--storage", "s3://b-1/p"], "not both"),
    (["logs", "--cluster", "dev-a"], "--storage: where to read from: pass the cluster YAML"),
    # One argument and no --storage: the YAML, unless it is neither a file nor a .yaml path.
    (["logs", "r1"], "CLUSTER_YAML: 'r1' is not a cluster YAML (no such file); where to read "
                     "from: rayfleet logs CLUSTER_YAML [RUN], or rayfleet logs --storage"),
    (["logs", "r1", "--cluster", "dev-a"], "'r1' is not a cluster YAML"),
    (["logs", "/nonexistent/dev.yaml", "r1"], "/nonexistent/dev.yaml: no such file"),
    (["logs", "/nonexistent/dev.yaml", "--cluster", "dev-a"], "no such file"),
    # A run before its YAML, or a YAML and --storage both: said which way to write it.
    (["logs", "r1", "{yaml}"], "the cluster YAML comes first: rayfleet logs {yaml} r1"),
    (["logs", "{yaml}", "r1", "--storage", "s3://b-1/p"],
     "the cluster YAML and --storage both say where to read from"),
    (["logs", "dev.yaml", "--storage", "s3://b-1/p"], "both say where to read from"),
    (["logs", "{yaml}", "r1", "--config", "{yaml}"], "with --config the one argument is the run"),
    (["logs", "{yaml}", "r1", "extra"], "unrecognized arguments: extra"),
    (["logs", "r1", "--storage", "s3://Bad_Bucket/p"], "is not s3://BUCKET/PREFIX"),
    (["logs", "r1", "--storage", "/tmp/runs"], "is not s3://BUCKET/PREFIX"),
    (["logs", "../up", "--storage", "s3://b-1/p"], "is not a run name"),
    (["logs", "r1", "--storage", "s3://b-1/p", "-o", "x"], "add --file NAME"),
    (["logs", "r1", "--storage", "s3://b-1/p", "--list", "--file", "a"], "one at a time"),
    (["logs", "--cluster", "Dev_1", "--storage", "s3://b-1/p"], "not a rayfleet cluster name"),
    (["logs", "--cluster", "dev-a", "--list", "--storage", "s3://b-1/p"], "are for a run"),
    (["logs", "r1", "--storage", "s3://b-1/p", "-o", "x", "--out", "y"], "give -o/--output only"),
    (["logs", "r1", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_and_no_aws_call(argv, says, capsys, aws_calls, loopback_s3,
                                               tmp_path):
    yaml_path = tmp_path / "dev.yaml"
    yaml_path.write_text("cluster_name: x\nprovider: {type: aws, region: us-east-1}\n")
    argv = [a.format(yaml=yaml_path) for a in argv]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("rayfleet: error: "), err
    assert says.format(yaml=yaml_path) in err, err
    assert aws_calls == []


def test_a_yaml_without_the_storage_header(tmp_path, capsys, aws_calls, loopback_s3):
    cfg = tmp_path / "ray.yaml"
    cfg.write_text("cluster_name: x\nprovider: {type: aws, region: us-east-1}\n")
    assert cli.main(["logs", str(cfg), "r1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfleet: error: CLUSTER_YAML: ") and err.count("\n") == 1, err
    assert "has no ray.rayfleet.json beside it and no '# Storage for jobs: s3://...' header" \
        in err
    assert aws_calls == []


def test_the_storage_is_renders_fact_beside_the_yaml(tmp_path, capsys, aws_calls, loopback_s3):
    """`rayfleet logs CLUSTER_YAML RUN` reads the stack's storage from the facts `rayfleet
    render` wrote beside the YAML; a YAML without them (an older kit's) from its header comment,
    saying once to re-render; a malformed facts file is one line, before any AWS call."""
    config = tmp_path / "dev.yaml"
    config.write_text(STORAGE_YAML)
    facts = tmp_path / "dev.rayfleet.json"
    facts.write_text(json.dumps({
        "schema_version": 1, "stack": "dev", "cluster_name": "x", "region": "us-east-1",
        "storage_uri": "s3://rayfleet-new/p/", "run_store": "s3://rayfleet-new/p/runs",
        "token_file": "/t"}))
    assert logs.storage_uri(None, str(config)) == "s3://rayfleet-new/p/"
    assert capsys.readouterr().err == ""
    facts.unlink()
    assert logs.storage_uri(None, str(config)) == "s3://rayfleet-logs/p/"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no dev.rayfleet.json beside it" in err, err
    facts.write_text("{")
    assert cli.main(["logs", str(config), "r1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rayfleet: error: ") and "not JSON" in err
    assert aws_calls == []


STORAGE_YAML = "# Storage for jobs: s3://rayfleet-logs/p/\ncluster_name: x\nprovider: {type: aws}\n"


@pytest.mark.parametrize("argv,run,config,storage,cluster", [
    (["{yaml}", "r1"], "r1", "{yaml}", None, None),
    (["{yaml}", "--cluster", "dev-a"], None, "{yaml}", None, "dev-a"),
    (["{yaml}", "r1", "--list"], "r1", "{yaml}", None, None),
    (["--storage", "s3://b-1/p", "r1"], "r1", None, "s3://b-1/p", None),
    (["r1", "--storage", "s3://b-1/p", "--list"], "r1", None, "s3://b-1/p", None),
    (["--storage", "s3://b-1/p", "--cluster", "dev-a"], None, None, "s3://b-1/p", "dev-a"),
    # The old spelling: the one argument is the run, the YAML follows --config.
    (["r1", "--config", "{yaml}"], "r1", "{yaml}", None, None),
    (["--cluster", "dev-a", "--config", "{yaml}"], None, "{yaml}", None, "dev-a"),
])
def test_the_arguments_read_as_yaml_then_run(argv, run, config, storage, cluster, tmp_path,
                                             monkeypatch, capsys):
    """`rayfleet logs CLUSTER_YAML [RUN]`, or `--storage s3://... [RUN]`; the old --config
    still works, after its one line."""
    yaml_path = tmp_path / "dev.yaml"
    yaml_path.write_text(STORAGE_YAML)
    seen = {}
    monkeypatch.setattr(logs, "main", lambda run, **kw: seen.update(run=run, **kw) or 0)
    assert cli.main(["logs", *(a.format(yaml=yaml_path) for a in argv)]) == 0
    config = config.format(yaml=yaml_path) if config else config
    assert (seen["run"], seen["config"], seen["storage"], seen["cluster"]) == \
        (run, config, storage, cluster)
    err = capsys.readouterr().err
    if "--config" in argv:
        assert err == "rayfleet: --config is deprecated: rayfleet logs CLUSTER_YAML [RUN]\n"
    else:
        assert err == ""


def test_out_still_writes_with_its_one_line(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(logs, "main", lambda run, **kw: seen.update(kw) or 0)
    assert cli.main(["logs", "--storage", "s3://b-1/p", "r1", "--file", "loss.png", "--out",
                     str(tmp_path / "loss.png")]) == 0
    assert seen["out_path"] == str(tmp_path / "loss.png")
    assert capsys.readouterr().err == ("rayfleet: --out is deprecated: rayfleet logs "
                                       "CLUSTER_YAML RUN --file NAME -o/--output PATH\n")
    assert cli.main(["logs", "--storage", "s3://b-1/p", "r1", "--file", "loss.png", "--output",
                     "a.png"]) == 0
    assert seen["out_path"] == "a.png" and capsys.readouterr().err == ""


def test_an_unreachable_endpoint_is_one_line(capsys, loopback_s3):
    assert cli.main(["logs", "r1", "--storage", "s3://rayfleet-logs/p"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfleet: error: cannot read s3://rayfleet-logs/p/: cannot "
                          "connect to http://127.0.0.1:") and err.count("\n") == 1, err


def test_no_credentials_is_one_line(capsys, monkeypatch, tmp_path, loopback_s3):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert cli.main(["logs", "r1", "--storage", "s3://rayfleet-logs/p"]) == 2
    err = capsys.readouterr().err
    assert "no AWS credentials found" in err and err.count("\n") == 1, err


def test_status_line_says_when_the_final_copy_is_missing():
    job = {"status": "RUNNING", "entrypoint": "python -m workloads.train", "start_time":
           1795452148170, "end_time": None, "final": False, "copied_at": "2026-11-23T16:00:00"}
    line = logs.status_line("r1", job)
    assert line.startswith("run r1: RUNNING  started 2026-11-23 ") and "ended -" in line
    assert "the cluster went before its final copy" in line


# ----------------------------------------------------------------------------- the agent

def _agent(*argv: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AGENT), *argv], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", **env})


def test_agent_imports_only_the_node_environment():
    # Nodes have ray and boto3 but not the kit, nor this folder as a package.
    tree = ast.parse(AGENT.read_text())
    roots = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in (n.names if isinstance(n, ast.Import) else [n])
             if not (isinstance(n, ast.ImportFrom) and n.level)}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
    assert roots - set(sys.stdlib_module_names) - {"__future__"} <= {"boto3", "botocore"}


def test_agent_help():
    proc = _agent("--help")
    assert proc.returncode == 0 and "--storage" in proc.stdout and "--every-s" in proc.stdout


@pytest.mark.parametrize("argv,env,says", [
    (["--address", "http://127.0.0.1:1"], {}, "the following arguments are required: --storage"),
    (["--storage", "gs://b/p", "--address", "http://127.0.0.1:1"], {}, "is not s3://"),
    (["--storage", "s3://Bad_B/p", "--address", "http://127.0.0.1:1"], {}, "is not s3://"),
    (["--storage", "s3://b-1/p", "--address", "127.0.0.1:1"], {}, "is not http://HOST:PORT"),
    (["--storage", "s3://b-1/p", "--address", "http://127.0.0.1:1", "--every-s", "0"], {},
     "--every-s must be more than 0"),
    (["--storage", "s3://b-1/p", "--address", "http://127.0.0.1:1"],
     {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/nonexistent/token"},
     "the token /nonexistent/token cannot be read"),
])
def test_agent_bad_args_are_one_line_exit_2(argv, env, says):
    proc = _agent(*argv, **env)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("logship: error: "), proc
    assert says in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- run names

@pytest.mark.parametrize("submission_id,name", [
    ("my-run", "my-run"),                           # chosen: the run is named after its job
    ("raysubmit_4LamXRuQpYdSMg7J", "smoke-ddp"),    # Ray's own id: the usual default
    ("a/b", "smoke-ddp"),                           # not a folder name
    (None, "smoke-ddp"),                            # not a Ray job
])
def test_a_job_submitted_with_an_id_names_its_run(submission_id, name, monkeypatch):
    from workloads.train import driver, options

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    if submission_id is not None:
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
            {"runtime_env": {}, "metadata": {"job_submission_id": submission_id,
                                             "job_name": submission_id}}))
    opts = options.TrainOptions.parse(["--smoke-test"])
    assert driver.run_name(opts, None) == name
    # --name always wins.
    assert driver.run_name(options.TrainOptions.parse(["--smoke-test", "--name", "x1"]),
                           None) == "x1"
