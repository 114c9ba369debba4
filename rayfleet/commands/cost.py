"""`rayfleet cost CLUSTER_YAML`: what a cluster YAML costs per hour and per month; exit 1 when
a total compared with the budget is over it.

Prices come from the instance catalog (``rayfleet/catalog.py``), a dated table shipped with
the kit: EC2 prices cannot be fetched offline (the Pricing API needs credentials and the
network), so the table says when it was taken and every report repeats that date; a type
whose price could not be confirmed has none, and the report says so rather than guess. Per node
type: on-demand, and spot where the node type is a spot one. Head + min workers is the floor
(an idle cluster), head + max workers the ceiling. With several worker types the ceiling is
given per type (every worker of that type, the cluster's max_workers bounding them all), the
preferred (first) type's first; that one is compared with the stack's budget.

Reserved capacity: a node type that targets an On-Demand Capacity Reservation is priced at its
type's on-demand rate, which the reservation bills for every reserved instance whether a
worker runs in it or not (the idle ones are not in these totals; `rayfleet preflight` shows
how many it holds). A node type in a Capacity Block adds no hourly compute: the block was paid
for in full when bought, and its fee is not in the catalog, so it is named, never guessed.
A ceiling fills the dearest node types first, so prepaid capacity never lowers it.

A fallback AZ's node types (rayfleet:workerFallbackAzs) are priced as their type and market;
they are more rows of the same type, and a ceiling still counts at most the cluster's
max_workers workers across every row, so no worker is counted once per AZ.
"""

from __future__ import annotations

import sys
from typing import Any

from rayfleet import catalog
from rayfleet.clusteryaml import ClusterYaml, NodeType, at_once, load
from rayfleet.config import load_stack_file
from rayfleet.errors import ConfigError, RayfleetError, did_you_mean
from rayfleet.facts import CAPACITY_BLOCK_MARKET_TYPE, GCS_STORE_NODE_TYPE
from rayfleet.raystart import REDIS_ADDRESS_ENV

# Always on: 365 days x 24 hours / 12 months. A month has at most 31 x 24 hours.
HOURS_PER_MONTH = 730.0
MAX_HOURS_PER_MONTH = 744

def load_prices() -> dict[str, Any]:
    return catalog.prices()


def hourly(instance_type: str, market: str, prices: dict[str, Any]) -> float | None:
    """$/hour of one instance; ``market`` is ``on_demand`` or ``spot``. None for a GPU type
    the catalog knows but has no confirmed price for (its ``source`` says why)."""
    if instance_type in prices["gpu"]:
        return prices["gpu"][instance_type][market]
    family, _, size = instance_type.partition(".")
    per_vcpu = prices["cpu_per_vcpu_hour"].get(family)
    heads = catalog.head_types()
    if per_vcpu is None or instance_type not in heads:
        known = list(prices["gpu"]) + list(heads)
        raise ConfigError("InstanceType", f"{instance_type!r} is not in the price table of "
                                          f"{prices['as_of']}{did_you_mean(instance_type, known)}")
    return round(per_vcpu[market] * heads[instance_type].vcpus, 4)


def _sum(pairs: list[tuple[float | None, int]]) -> float | None:
    """Sum of price x count; None if a counted price is unknown."""
    if any(p is None and n for p, n in pairs):
        return None
    return round(sum((p or 0) * n for p, n in pairs), 2)


def estimate(cfg: dict[str, Any], prices: dict[str, Any] | None = None,
             hours_per_month: float = HOURS_PER_MONTH) -> dict[str, Any]:
    """Floor (head + min workers) and ceilings (head + max workers). With several worker
    types, the ceiling is given per instance type, as if every worker were of that type (the
    autoscaler's max_workers bounds all types together); ``hourly.max`` assumes the first
    worker type of the YAML, the stack's preferred one (``assumes``). A price the catalog has
    not confirmed makes the totals that need it None."""
    prices = prices or load_prices()
    provider = cfg.get("provider") or {}
    if provider.get("type") != "aws":
        raise RayfleetError(f"cost covers AWS clusters only; provider.type is "
                            f"{provider.get('type')!r}")
    region = provider.get("region")
    if region not in prices["regions"]:
        raise ConfigError("provider.region", f"{region!r} is not in the price table of "
                                             f"{prices['as_of']} (it covers "
                                             f"{', '.join(prices['regions'])})")
    cluster = ClusterYaml(cfg)
    if cluster.head() is None:
        raise RayfleetError("head_node_type is missing or not one of available_node_types")
    rows = [_row(t, cluster, prices) for t in cluster.node_types()]
    head_row = next(r for r in rows if r["head"])
    workers = [r for r in rows if not r["head"]]
    # The autoscaler never runs more workers than the global max_workers.
    cap = cluster.max_workers
    cap = cap if cap is not None else sum(r["max"] for r in workers)
    order = list(dict.fromkeys(r["instance_type"] for r in workers))
    by_type = {t: {"max": _ceiling(head_row, workers, t, cap, False),
                   "max_all_on_demand": _ceiling(head_row, workers, t, cap, True)}
               for t in order}
    assumes = order[0] if order else None
    out = {
        "as_of": prices["as_of"],
        "region": region,
        "rows": rows,
        "assumes": assumes,
        "by_type": by_type,
        "hourly": {
            "min": _sum([(r["price"], r["min"]) for r in rows]),
            "max": by_type[assumes]["max"] if assumes else head_row["price"],
            "max_all_on_demand": (by_type[assumes]["max_all_on_demand"] if assumes
                                  else head_row["price"]),
        },
        "hours_per_month": hours_per_month,
        "max_workers": min(cap, sum(r["max"] for r in workers)),
        "unpriced": [t for t in order if prices["gpu"].get(t, {}).get("on_demand") is None
                     or prices["gpu"].get(t, {}).get("spot") is None],
    }
    out["monthly"] = {k: None if v is None else round(v * hours_per_month, 2)
                      for k, v in out["hourly"].items()}
    return out


def _row(t: NodeType, cluster: ClusterYaml, prices: dict[str, Any]) -> dict[str, Any]:
    """One node type's row: its instance type, market, price and worker bounds."""
    itype = t.node_config.get("InstanceType")
    if not itype:
        raise ConfigError(f"available_node_types.{t.name}.node_config.InstanceType",
                          "missing; cost needs an instance type per node type")
    spot = t.market == "spot"
    block = t.market == CAPACITY_BLOCK_MARKET_TYPE
    reserved = not (spot or block) and bool(
        (t.node_config.get("CapacityReservationSpecification") or {}).get(
            "CapacityReservationTarget"))
    # A worker type without max_workers may grow to the cluster's, as Ray fills it in.
    most = t.max_workers if t.max_workers is not None else cluster.max_workers or 0
    lo, hi = (1, 1) if t.head else (t.min_workers, most)
    if lo > hi:
        raise ConfigError(f"available_node_types.{t.name}", f"min_workers {lo} > "
                                                            f"max_workers {hi}")
    od = hourly(itype, "on_demand", prices)
    # A Capacity Block's instances were paid for with the block: no hourly compute.
    price = hourly(itype, "spot", prices) if spot else 0.0 if block else od
    market = "spot" if spot else "block" if block else "reserved" if reserved else "on-demand"
    return {"node_type": t.name, "instance_type": itype, "head": t.head, "market": market,
            "price": price, "on_demand_price": 0.0 if block else od, "min": lo, "max": hi}


def _ceiling(head_row: dict, workers: list[dict], itype: str, cap: int,
             all_on_demand: bool) -> float | None:
    """$/hour of the head and every worker of ``itype`` the cap allows, the dearest rows
    first: on-demand and reserved (always launchable, at the on-demand rate), then spot,
    then a prepaid Capacity Block."""
    dearest = ("on-demand", "reserved", "spot", "block")
    rows = sorted((r for r in workers if r["instance_type"] == itype),
                  key=lambda r: dearest.index(r["market"]))
    return _sum([(head_row["price"], 1)]
                + [(r["on_demand_price"] if all_on_demand else r["price"], n)
                   for r, n in at_once([(r, r["max"]) for r in rows], cap)])


def _money(hourly_usd: float | None, monthly_usd: float | None, hrs: float) -> str:
    if hourly_usd is None or monthly_usd is None:
        return "no confirmed price"
    return f"${hourly_usd:.2f}/h  ${monthly_usd:,.0f}/month ({hrs:g} h)"


def main(path: str, stack_file: str | None = None, budget_usd: float | None = None,
         hours_per_month: float = HOURS_PER_MONTH, out=None) -> int:
    out = out or sys.stdout
    if budget_usd is None and stack_file:
        budget_usd = float(load_stack_file(stack_file).budget.monthly_usd) or None
    cfg, _ = load(path)
    e = estimate(cfg, hours_per_month=hours_per_month)
    print(f"Prices: rayfleet's catalog as of {e['as_of']} ({e['region']}); they cannot be "
          "fetched offline - check https://aws.amazon.com/ec2/pricing/ before budgeting. "
          "EBS, NAT, transfer and S3 not included.", file=out)
    if REDIS_ADDRESS_ENV in "\n".join(str(c) for c in cfg.get("head_start_ray_commands") or []):
        # rayfleet:headHa: the catalog has no confirmed ElastiCache price, so none is guessed.
        print(f"The head's GCS store (rayfleet:headHa: ElastiCache Redis, {GCS_STORE_NODE_TYPE} "
              "nodes, a replica in a second AZ) bills by the hour, running or not, and is not "
              "in these totals: check https://aws.amazon.com/elasticache/pricing/.", file=out)
    if e["unpriced"]:
        print(f"No confirmed price in the catalog for {', '.join(e['unpriced'])}: their rows "
              "and the totals that need them say so instead of guessing.", file=out)
    print(f"{'node type':34} {'instance':16} {'market':10} {'$/h each':>9} {'min':>4} "
          f"{'max':>4}", file=out)
    for r in e["rows"]:
        price = ("n/a" if r["price"] is None else "prepaid" if r["market"] == "block"
                 else f"{r['price']:.2f}")
        print(f"{r['node_type']:34} {r['instance_type']:16} {r['market']:10} "
              f"{price:>9} {r['min']:4d} {r['max']:4d}", file=out)
    for r in e["rows"]:
        if r["market"] == "reserved":
            print(f"{r['node_type']} targets an On-Demand Capacity Reservation: it bills the "
                  f"on-demand rate for every reserved {r['instance_type']} whether a worker "
                  "runs in it or not; only running workers are in the totals below",
                  file=out)
        elif r["market"] == "block":
            print(f"{r['node_type']} runs in a Capacity Block: paid in full when bought (its "
                  "fee is not in the catalog and is not guessed here); its workers add no "
                  "hourly compute", file=out)
    h, m = e["hourly"], e["monthly"]
    hrs = e["hours_per_month"]
    assumes = f", all {e['assumes']} (the preferred type)" if e["assumes"] else ""
    print(f"head + min workers: {_money(h['min'], m['min'], hrs)}", file=out)
    print(f"head + max workers{assumes}: {_money(h['max'], m['max'], hrs)} (spot where the "
          f"node type is spot)", file=out)
    print(f"head + max workers{assumes}, all on-demand (no spot capacity): "
          f"{_money(h['max_all_on_demand'], m['max_all_on_demand'], hrs)}", file=out)
    for itype, c in list(e["by_type"].items())[1:]:
        od = c["max_all_on_demand"]
        print(f"head + max workers, all {itype} (if the autoscaler falls back to it): "
              f"{_money(c['max'], None if c['max'] is None else c['max'] * hrs, hrs)}; all "
              f"on-demand {_money(od, None if od is None else od * hrs, hrs)}", file=out)
    if not budget_usd:
        print("no budget given (--budget-usd or --stack-file Pulumi.<stack>.yaml)", file=out)
        return 0
    return 1 if _budget(e, budget_usd, assumes, out) else 0


def _budget(e: dict[str, Any], budget_usd: float, assumes: str, out) -> bool:
    """The idle floor and the busy ceiling against the monthly budget; True if one is over."""
    h, m = e["hourly"], e["monthly"]
    over = False
    for label, key in (("idle (min)", "min"), (f"busy (max{assumes})", "max")):
        if m[key] is None:
            print(f"budget ${budget_usd:,.0f}/month: {label} has no confirmed price", file=out)
            continue
        share = m[key] / budget_usd * 100
        verdict = "within" if m[key] <= budget_usd else "OVER"
        over = over or verdict == "OVER"
        print(f"budget ${budget_usd:,.0f}/month: {label} is {share:.0f}% - {verdict}", file=out)
    # Hours of full-size use the budget buys after the idle floor.
    if m["min"] is not None and h["max"] is not None:
        spare = budget_usd - m["min"]
        extra = h["max"] - h["min"]
        if spare > 0 and extra > 0:
            print(f"  the budget covers about {spare / extra:,.0f} h/month at max workers "
                  "above the idle floor", file=out)
    return over
