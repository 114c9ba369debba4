"""The `rayfleet` CLI's one convention (docs/cli.md): the cluster YAML first, as CLUSTER_YAML;
-o/--output for a file written; the old spellings still run, each after its one line."""

from __future__ import annotations

import pytest

from rayfleet.commands import cli, serve_config, status
from tests.conftest import REPO

EXAMPLE = REPO / "cluster-configs" / "aws-a100.example.yaml"


@pytest.mark.parametrize("command", ["lint", "cost", "preflight", "status", "logs", "sweep",
                                     "keypair"])
def test_every_command_that_reads_a_cluster_yaml_names_it_cluster_yaml(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    usage = text.split("\n\n", 1)[0]
    assert "CLUSTER_YAML" in usage and "--config" not in text, text
    assert "\n  CLUSTER_YAML " in text   # a positional argument, described under its name


@pytest.mark.parametrize("command", ["render", "serve-config", "logs"])
def test_a_file_written_is_dash_o_output(command, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "-o PATH, --output PATH" in text and "--out " not in text, text


def test_status_config_still_works_with_its_one_line(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(status, "main", lambda address, config: seen.append(config) or 0)
    assert cli.main(["status", "--config", str(EXAMPLE)]) == 0
    assert capsys.readouterr().err == \
        "rayfleet: --config is deprecated: rayfleet status CLUSTER_YAML\n"
    assert cli.main(["status", str(EXAMPLE)]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["status"]) == 0   # no YAML: the dashboard's order, RAY_AUTH_TOKEN_PATH
    assert seen == [str(EXAMPLE), str(EXAMPLE), None]
    assert cli.main(["status", str(EXAMPLE), "--config", str(EXAMPLE)]) == 2
    assert capsys.readouterr().err == (
        "rayfleet: error: the cluster YAML is given twice (CLUSTER_YAML and --config): "
        "rayfleet status CLUSTER_YAML\n")


def test_render_out_still_writes_with_its_one_line(tmp_path, capsys):
    outputs = REPO / "cluster-configs" / "examples" / "dev-outputs.json"
    token = ["--token-file", str(tmp_path / "home" / "auth_token")]
    assert cli.main(["render", str(outputs), "--out", str(tmp_path / "a.yaml"), *token]) == 0
    out, err = capsys.readouterr()
    assert err == "rayfleet: --out is deprecated: rayfleet render OUTPUTS -o/--output PATH\n"
    assert out == f"wrote {tmp_path / 'a.yaml'}\n"
    assert cli.main(["render", str(outputs), "--output", str(tmp_path / "b.yaml"), *token]) == 0
    assert capsys.readouterr().err == ""
    # The same YAML, whichever spelling wrote it.
    assert (tmp_path / "a.yaml").read_text() == (tmp_path / "b.yaml").read_text()
    assert cli.main(["render", str(outputs), "-o", "x.yaml", "--out", "y.yaml", *token]) == 2
    assert "give -o/--output only" in capsys.readouterr().err


def test_serve_config_out_still_writes_with_its_one_line(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(serve_config, "checked_config",
                        lambda config, arg_pairs, out: seen.append(out) or out)
    assert cli.main(["serve-config", "lm.yaml", "--out", "a.yaml"]) == 0
    assert capsys.readouterr().err == ("rayfleet: --out is deprecated: rayfleet serve-config "
                                       "lm.yaml -o/--output PATH\n")
    assert cli.main(["serve-config", "lm.yaml", "-o", "b.yaml"]) == 0
    assert capsys.readouterr().err == ""
    assert seen == ["a.yaml", "b.yaml"]


def test_render_errors_name_the_new_spelling(tmp_path, capsys):
    outputs = REPO / "cluster-configs" / "examples" / "dev-outputs.json"
    assert cli.main(["render", str(outputs), "-o", str(tmp_path), "--token-file",
                     str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err == (f"rayfleet: error: --output {tmp_path}: is a folder; "
                                       "name the YAML file to write\n")


@pytest.mark.parametrize("argv", [["sweep"], ["preflight"], ["logs", "a-run"], ["keypair"]])
def test_an_aws_profile_that_does_not_exist_is_one_line(argv, tmp_path, monkeypatch, capsys):
    """Bad input in the caller's AWS set-up (here AWS_PROFILE) is one line and exit 2, never
    botocore's traceback, in every command that calls AWS."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    cluster = tmp_path / "dev.yaml"
    assert cli.main(["render", str(REPO / "cluster-configs" / "examples" / "dev-outputs.json"),
                     "-o", str(cluster)]) == 0
    capsys.readouterr()
    assert cli.main([argv[0], str(cluster), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfleet: error: ") and len(err.strip().splitlines()) == 1, err
    assert "no-such-profile" in err and "Traceback" not in err, err
