"""The one way the kit's command lines fail (rayfleet.entrypoint), as each CLI uses it."""

from __future__ import annotations

import pytest

from rayfleet.entrypoint import ArgumentParser, UsageError, run_main
from rayfleet.errors import ConfigError


def test_a_bad_flag_is_one_line_with_the_subcommands_own_help_hint(capsys):
    parser = ArgumentParser(prog="tool", help_hint=True)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("go").add_argument("--n", type=int)
    with pytest.raises(UsageError, match=r"invalid int value: 'x' \(see tool go --help\)$"):
        parser.parse_args(["go", "--n", "x"])
    assert capsys.readouterr().err == ""   # no usage block


def test_run_main_turns_expected_failures_into_one_line_and_exit_2(capsys):
    def refuse(argv):
        ArgumentParser(prog="job").parse_args(argv)
        raise ConfigError("--lr", "must be positive")

    assert run_main(refuse, ["--nope"], "job") == 2
    assert capsys.readouterr().err == "job: error: unrecognized arguments: --nope\n"
    assert run_main(refuse, [], "job") == 2
    assert capsys.readouterr().err == "job: error: --lr: must be positive\n"
    assert run_main(lambda argv: None, [], "job") == 0


def test_run_main_lets_unexpected_errors_through():
    def crash(argv):
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_main(crash, [], "job")
