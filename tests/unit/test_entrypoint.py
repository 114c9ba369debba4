"""The one way the kit's command lines fail (rayfleet.entrypoint), as each CLI uses it."""

from __future__ import annotations

import pytest

from rayfleet.entrypoint import ArgumentParser, UsageError, at_least, bounded, run_main, tcp_port
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


@pytest.mark.parametrize("kind, text, says", [
    (at_least(1, unit="minute"), "0", "argument --n: must be at least 1 minute, got 0"),
    (at_least(0.5, float), "nan", "argument --n: must be at least 0.5, got nan"),
    (at_least(1), "two", "argument --n: expected a number, got 'two'"),
    (tcp_port, "65536", "argument --n: must be a TCP port between 1 and 65535, got 65536"),
    (bounded(float, lambda v: 0 < v <= 744, "between 0 and 744"), "0",
     "argument --n: must be between 0 and 744, got 0"),
])
def test_numeric_bounds_are_argparse_types_with_one_line(kind, text, says):
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--n", type=kind)
    with pytest.raises(UsageError) as refused:
        parser.parse_args(["--n", text])
    assert str(refused.value) == says


def test_numbers_within_their_bounds_pass():
    assert at_least(1)("3") == 3 and at_least(0, float)("0") == 0.0
    assert tcp_port("1") == 1 and tcp_port("65535") == 65535


def test_a_driver_leaves_ray_before_its_line_so_nothing_of_ray_follows_it(capsys, monkeypatch):
    """A connected driver disconnects from Ray (which stops Ray forwarding its actors' output)
    before the kit prints its one line; one that never started Ray is left alone."""
    import sys
    import types

    said = []
    ray = types.SimpleNamespace(is_initialized=lambda: True,
                                shutdown=lambda: said.append(("shutdown", capsys.readouterr())))
    monkeypatch.setitem(sys.modules, "ray", ray)

    def fail(argv):
        raise ConfigError("--storage-path", "storage failed")

    assert run_main(fail, [], "job") == 2
    assert [what for what, _ in said] == ["shutdown"] and said[0][1].err == ""
    assert capsys.readouterr().err == "job: error: --storage-path: storage failed\n"
    ray.is_initialized = lambda: False
    assert run_main(fail, [], "job") == 2 and len(said) == 1
