"""`rayfleet cost`: $/hour and $/month from the dated price table, against the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayfleet.commands import cli, cost

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "cluster-configs" / "aws-a100.example.yaml"


def test_example_floor_and_ceiling():
    p = cost.load_prices()
    e = cost.estimate(yaml.safe_load(EXAMPLE.read_text()))
    head = cost.hourly("m6i.2xlarge", "on_demand", p)
    spot = p["gpu"]["p4d.24xlarge"]["spot"]
    od = p["gpu"]["p4d.24xlarge"]["on_demand"]
    assert head == pytest.approx(0.384)
    assert e["hourly"]["min"] == pytest.approx(head, abs=0.01)  # min_workers 0: head only
    assert e["hourly"]["max"] == pytest.approx(head + spot + od, abs=0.01)
    assert e["hourly"]["max_all_on_demand"] == pytest.approx(head + 2 * od, abs=0.01)
    assert e["monthly"]["max"] == pytest.approx(e["hourly"]["max"] * 730, abs=1)
    assert e["as_of"] == p["as_of"]


def test_cli_reports_date_offline_note_and_budget(capsys):
    # Over the budget is a finding: exit 1 (docs/cli.md), the report printed all the same.
    assert cli.main(["cost", str(EXAMPLE), "--stack-file", str(REPO / "Pulumi.dev.yaml")]) == 1
    out = capsys.readouterr().out
    assert cost.load_prices()["as_of"] in out and "cannot be fetched offline" in out
    assert "budget $5,000/month" in out and "OVER" in out and "within" in out


@pytest.mark.parametrize("budget,code,verdicts", [
    ("1000000", 0, ["within", "within"]),    # idle floor and busy ceiling both within
    ("5000", 1, ["within", "OVER"]),         # the ceiling over: a finding
    ("100", 1, ["OVER", "OVER"]),            # even idle, over
])
def test_over_budget_exits_1(budget, code, verdicts, capsys):
    assert cli.main(["cost", str(EXAMPLE), "--budget-usd", budget]) == code
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("budget $")]
    assert [ln.rsplit(" - ", 1)[1] for ln in lines] == verdicts


def test_no_budget_and_no_confirmed_price_are_not_findings(tmp_path, capsys):
    assert cli.main(["cost", str(EXAMPLE)]) == 0
    assert "no budget given" in capsys.readouterr().out
    # The ceiling has no confirmed price (p5 first): nothing over, exit 0.
    cfg = _two_types()
    types = cfg["available_node_types"]
    cfg["available_node_types"] = dict(sorted(types.items(), key=lambda kv: "p5" not in
                                              kv[1]["node_config"]["InstanceType"]))
    path = tmp_path / "p5-first.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))   # the YAML's order is the preference
    assert cli.main(["cost", str(path), "--budget-usd", "1000000"]) == 0
    assert "busy (max, all p5.48xlarge (the preferred type)) has no confirmed price" in \
        capsys.readouterr().out


def test_price_table_is_dated_and_covers_every_worker_type():
    from rayfleet.configkeys import WORKER_INSTANCE_TYPES

    p = cost.load_prices()
    assert p["as_of"] and "offline" in p["source"]
    assert set(WORKER_INSTANCE_TYPES) <= set(p["gpu"])
    for name, t in p["gpu"].items():
        if t["on_demand"] is None or t["spot"] is None:
            # Unconfirmed: both left out, and the source note names the type's family.
            assert t["on_demand"] is None and t["spot"] is None, name
            assert name.split(".")[0] in p["source"] and "could be confirmed" in p["source"]
            continue
        assert t["spot"] < t["on_demand"]


def _two_types() -> dict:
    """The example YAML with its second type (p4de) swapped for p5, unpriced."""
    text = EXAMPLE.read_text().replace("p4de.24xlarge", "p5.48xlarge")
    return yaml.safe_load(text)


def test_several_types_ceiling_per_type_the_preferred_first():
    p = cost.load_prices()
    e = cost.estimate(yaml.safe_load(EXAMPLE.read_text()))
    head = cost.hourly("m6i.2xlarge", "on_demand", p)
    assert e["assumes"] == "p4d.24xlarge"
    p4de = p["gpu"]["p4de.24xlarge"]
    # Every worker p4de: its on-demand one and its spot one, the cluster's max_workers (2).
    assert e["by_type"]["p4de.24xlarge"]["max"] == pytest.approx(
        head + p4de["spot"] + p4de["on_demand"], abs=0.01)
    assert e["max_workers"] == 2


def test_an_unpriced_type_says_so_instead_of_guessing(tmp_path, capsys):
    e = cost.estimate(_two_types())
    assert e["unpriced"] == ["p5.48xlarge"]
    assert e["by_type"]["p5.48xlarge"] == {"max": None, "max_all_on_demand": None}
    assert e["hourly"]["max"] is not None   # the preferred p4d has prices
    assert cli.main(["cost", _write(tmp_path, _two_types())]) == 0
    out = capsys.readouterr().out
    assert "No confirmed price in the catalog for p5.48xlarge" in out
    assert "all p5.48xlarge (if the autoscaler falls back to it): no confirmed price" in out
    assert "all p4d.24xlarge (the preferred type): $" in out


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("mutate,expected", [
    (lambda c: c["available_node_types"]["ray.worker.p4d.24xlarge.spot"]["node_config"].update(
        InstanceType="p4d.24xlage"), 'did you mean "p4d.24xlarge"'),
    (lambda c: c["provider"].update(region="ap-south-1"), "not in the price table"),
    (lambda c: c["available_node_types"]["ray.worker.p4d.24xlarge.spot"].update(min_workers=5),
     "min_workers 5 > max_workers 1"),
])
def test_bad_input_one_line(mutate, expected, tmp_path, capsys):
    cfg = yaml.safe_load(EXAMPLE.read_text())
    mutate(cfg)
    assert cli.main(["cost", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_reserved_capacity_is_priced_honestly(tmp_path):
    """An ODCR's workers at the on-demand rate it bills anyway; a Capacity Block's at nothing
    more per hour (prepaid; its fee is not in the catalog, so it is named, not guessed); the
    ceiling fills the dearest node types first, so prepaid capacity never lowers it."""
    import io
    import json

    from rayfleet import stack
    from rayfleet.commands import render
    from tests.reservations import BLOCK_NAME, RESERVED_NAME, with_reservations

    o = json.loads((REPO / "cluster-configs/examples/dev-outputs.json").read_text())["rayfleet"]
    cfg = render.plain(render.build_config(stack.parse(json.dumps(with_reservations(o))), "t"))
    p = cost.load_prices()
    e = cost.estimate(cfg)
    rows = {r["node_type"]: r for r in e["rows"]}
    od = p["gpu"]["p4de.24xlarge"]["on_demand"]
    assert (rows[BLOCK_NAME]["market"], rows[BLOCK_NAME]["price"]) == ("block", 0.0)
    assert (rows[RESERVED_NAME]["market"], rows[RESERVED_NAME]["price"]) == ("reserved", od)
    plain_e = cost.estimate(yaml.safe_load(EXAMPLE.read_text()))
    # p4d: the block only adds free capacity; the ceiling is the example's.
    assert e["by_type"]["p4d.24xlarge"] == plain_e["by_type"]["p4d.24xlarge"]
    # p4de: its two workers may both run on-demand-priced (its on-demand and its ODCR).
    head = cost.hourly("m6i.2xlarge", "on_demand", p)
    assert e["by_type"]["p4de.24xlarge"]["max"] == pytest.approx(head + 2 * od, abs=0.01)
    out = io.StringIO()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cost.main(str(path), out=out) == 0
    report = out.getvalue()
    assert f"{BLOCK_NAME} runs in a Capacity Block: paid in full when bought (its fee is not " \
        "in the catalog" in report
    assert f"{RESERVED_NAME} targets an On-Demand Capacity Reservation: it bills the " \
        "on-demand rate for every reserved p4de.24xlarge whether a worker runs in it or not" \
        in report
    assert any(ln.startswith(BLOCK_NAME) and "prepaid" in ln for ln in report.splitlines())


def test_a_fallback_az_is_priced_as_its_type_and_market_never_counted_twice():
    """Each fallback node type at its type's and market's rate; a ceiling holds the cluster's
    max_workers workers across both AZs (the dearest first), not one per node type."""
    import json

    from rayfleet import stack
    from rayfleet.commands import render
    from tests.fallback_azs import FALLBACK_AZ, with_fallback_az

    o = json.loads((REPO / "cluster-configs/examples/dev-outputs.json").read_text())["rayfleet"]
    cfg = render.plain(render.build_config(stack.parse(json.dumps(with_fallback_az(o))), "t"))
    e = cost.estimate(cfg)
    rows = {r["node_type"]: r for r in e["rows"]}
    for name, r in rows.items():
        if name.endswith(f".{FALLBACK_AZ}"):
            twin = rows[name.removesuffix(f".{FALLBACK_AZ}")]
            assert (r["market"], r["price"], r["max"]) == \
                (twin["market"], twin["price"], twin["max"]), name
            assert r["min"] == 0
    p = cost.load_prices()
    head = cost.hourly("m6i.2xlarge", "on_demand", p)
    assert e["max_workers"] == o["max_workers"] == 2
    # onDemandWorkers (1) bounds each on-demand node type: at worst one on-demand p4d in each
    # AZ, and still two workers in all.
    assert e["by_type"]["p4d.24xlarge"]["max"] == pytest.approx(
        head + 2 * p["gpu"]["p4d.24xlarge"]["on_demand"], abs=0.01)
    assert e["by_type"]["p4d.24xlarge"]["max_all_on_demand"] == \
        e["by_type"]["p4d.24xlarge"]["max"]
    # The floor is the example's: the minimum stays in the workers' AZ.
    assert e["hourly"]["min"] == cost.estimate(yaml.safe_load(EXAMPLE.read_text()))["hourly"][
        "min"]
