"""The head's scorer (rayfleet/agents/fallover.py) inside Ray's own node-type choice.

Ray 2.60's `get_nodes_for` (what the autoscaler runs each update to pick node types for pending
work) is called here as the autoscaler calls it, with Ray's own availability tracker fed EC2's
capacity error as Ray's AWS provider raises it (NodeLaunchException). The scorer is loaded the
way the head loads it: by name, from the folder render copies it to, through Ray's loader.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import yaml

from rayfleet.agents import fallover
from rayfleet.commands import render
from rayfleet.launcher.agents import SCORER_ALSO
from tests.conftest import REPO
from tests.fallback_azs import FALLBACK_AZ, with_fallback_az

ORDER = ["ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
         "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand"]
A100 = {"CPU": 96, "GPU": 8, "accelerator_type:A100": 1}
NODE_TYPES = {
    "ray.head.default": {"resources": {"CPU": 8, "GPU": 0}, "max_workers": 0},
    **{name: {"resources": dict(A100), "max_workers": 1} for name in ORDER},
}
# A Train worker asking for half an A100 node's accelerator resource, as the rehearsal's jobs do.
DEMAND = [{"CPU": 1, "accelerator_type:A100": 0.5}]
CAPACITY = ("InsufficientInstanceCapacity", "We currently do not have sufficient {} capacity in "
            "the Availability Zone you requested (us-east-1b).")


def _pick(scorer, tracker, node_types: dict | None = None) -> str:
    from ray.autoscaler._private.resource_demand_scheduler import get_nodes_for

    added, left = get_nodes_for(
        node_types or NODE_TYPES, {"ray.head.default": 1}, "ray.head.default", 1, DEMAND,
        utilization_scorer=functools.partial(scorer,
                                             node_availability_summary=tracker.summary()))
    assert not left and sum(added.values()) == 1, (added, left)
    (name,) = added
    return name


_CLOCK = iter(range(1_700_000_000, 1_700_001_000))


def _fail(tracker, node_type: str) -> None:
    """EC2 refuses the type now (each call a second later than the last)."""
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    code, message = CAPACITY
    itype = node_type.split(".", 2)[2].rsplit(".", 1)[0]
    tracker.update_node_availability(node_type, next(_CLOCK),
                                     NodeLaunchException(code, message.format(itype), None))


@pytest.fixture
def tracker():
    from ray.autoscaler._private.node_provider_availability_tracker import (
        NodeProviderAvailabilityTracker,
    )

    # A clock that stands still: Ray forgets a failure after 30 min, not during a test.
    return NodeProviderAvailabilityTracker(timer=lambda: 1_700_000_500)


def test_rays_own_choice_ignores_the_stacks_order_and_the_failures(tracker):
    """What the scorer is for: Ray breaks the tie between identical types by name, largest
    first, so p4de's spot type comes before the stack's preferred p4d, and again after a p4de
    failure (Ray's default scorer ignores the availability it is given). If Ray changes this,
    the scorer's reason to exist changes with it."""
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer

    assert _pick(_default_utilization_scorer, tracker) == "ray.worker.p4de.24xlarge.spot"
    _fail(tracker, "ray.worker.p4de.24xlarge.spot")
    assert _pick(_default_utilization_scorer, tracker) == "ray.worker.p4de.24xlarge.spot"


def test_the_stacks_order_then_the_next_type_with_capacity(tracker, monkeypatch):
    monkeypatch.setenv(fallover.ORDER_ENV, ",".join(ORDER))
    picks = []
    for _ in ORDER:
        picks.append(_pick(fallover.score, tracker))
        _fail(tracker, picks[-1])
    # p4d spot, p4d on-demand, then p4de: each EC2 refusal moves the launch to the next type.
    assert picks == ORDER
    # Every type failing: the autoscaler goes round them, the one refused longest ago first,
    # in the stack's order, instead of asking for the first type forever.
    again = []
    for _ in ORDER:
        again.append(_pick(fallover.score, tracker))
        _fail(tracker, again[-1])
    assert again == ORDER
    # A type whose launch succeeds again is preferred over the failing ones.
    tracker.update_node_availability(ORDER[3], next(_CLOCK), None)
    assert _pick(fallover.score, tracker) == ORDER[3]


def test_cpu_work_still_never_starts_a_gpu_node(tracker, monkeypatch):
    from ray.autoscaler._private.resource_demand_scheduler import get_nodes_for

    monkeypatch.setenv(fallover.ORDER_ENV, ",".join(ORDER))
    types = {**NODE_TYPES, "ray.worker.cpu": {"resources": {"CPU": 16}, "max_workers": 1}}
    added, _ = get_nodes_for(types, {"ray.head.default": 1}, "ray.head.default", 1, [{"CPU": 1}],
                             utilization_scorer=functools.partial(
                                 fallover.score, node_availability_summary=tracker.summary()))
    assert dict(added) == {"ray.worker.cpu": 1}


def test_cpu_only_work_never_starts_an_a100_worker(tracker, monkeypatch):
    """A queued CPU task (a Ray Data job's, on the fake cloud) made Ray's own choice start an
    A100 worker: with only GPU worker types, Ray's GPU guard is a mere preference. The scorer
    refuses; work asking for an accelerator still gets one, CPU bundles riding along."""
    from ray.autoscaler._private.resource_demand_scheduler import (
        _default_utilization_scorer,
        get_nodes_for,
    )

    monkeypatch.setenv(fallover.ORDER_ENV, ",".join(ORDER))

    def added(scorer, demand):
        return dict(get_nodes_for(NODE_TYPES, {"ray.head.default": 1}, "ray.head.default", 1,
                                  demand, utilization_scorer=functools.partial(
                                      scorer, node_availability_summary=tracker.summary()))[0])

    assert sum(added(_default_utilization_scorer, [{"CPU": 1}]).values()) == 1
    assert added(fallover.score, [{"CPU": 1}]) == {}
    assert added(fallover.score, [{"CPU": 1}, *DEMAND]) == {ORDER[0]: 1}
    assert added(fallover.score, [{"CPU": 1, "GPU": 1}]) == {ORDER[0]: 1}


def test_the_head_loads_the_copy_render_ships(tmp_path):
    """Through Ray's own loader, with only what render's head `ray start` line sets: the
    folder render copies the agents to, its scorer folder on PYTHONPATH, and Ray's variable."""
    folder = render.copy_agents(str(tmp_path / "agents"))
    scorer_dir = folder / "autoscaler"
    assert sorted(p.name for p in scorer_dir.iterdir()) == sorted(
        [f"{fallover.MODULE}.py", *(f"{n}.py" for n in SCORER_ALSO)])
    probe = (
        "import sys; sys.modules['rayfleet'] = None\n"   # the head has no kit installed
        "from ray.autoscaler._private.resource_demand_scheduler import "
        "ResourceDemandScheduler as R\n"
        "s = R(None, {}, 0, 'head', 1.0).utilization_scorer\n"
        "print(s.__module__, s.__name__)\n"
        "print(sys.modules[s.__module__].gpugate.__file__)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(scorer_dir),
                               fallover.SCORER_ENV: fallover.SCORER})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [fallover.MODULE, "score", str(scorer_dir / "gpugate.py")]


def example_outputs(fallback_az: str | None = None) -> dict:
    """The example stack's output; with ``fallback_az``, as that stack with
    rayfleet:workerFallbackAzs: [fallback_az] exports it."""
    o = json.loads((REPO / "cluster-configs" / "examples" / "dev-outputs.json").read_text())
    return {"rayfleet": with_fallback_az(o["rayfleet"], fallback_az)} if fallback_az else o


# Type-major: p4d in the workers' AZ, p4d in the fallback AZ, then p4de.
FALLBACK_ORDER = [
    "ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
    "ray.worker.p4d.24xlarge.spot.us-east-1c", "ray.worker.p4d.24xlarge.ondemand.us-east-1c",
    "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand",
    "ray.worker.p4de.24xlarge.spot.us-east-1c", "ray.worker.p4de.24xlarge.ondemand.us-east-1c"]


@pytest.mark.parametrize("fallback_az,order", [(None, ORDER), (FALLBACK_AZ, FALLBACK_ORDER)],
                         ids=["one-az", "fallback-az"])
def test_render_puts_the_scorer_and_the_stacks_order_on_the_heads_start_line(fallback_az,
                                                                             order):
    from rayfleet.stack import parse

    outputs = parse(json.dumps(example_outputs(fallback_az)))
    cfg = render.plain(render.build_config(outputs, "~/.rayfleet/token"))
    workers = [t for t in cfg["available_node_types"] if t != cfg["head_node_type"]]
    (start,) = [c for c in cfg["head_start_ray_commands"] if " start --head" in c]
    env = dict(w.split("=", 1) for w in start.split("; ")[-1].split(" ray")[0].split()
               if "=" in w)
    assert env[fallover.SCORER_ENV] == fallover.SCORER
    assert env["PYTHONPATH"] == "$HOME/rayfleet-agents/autoscaler"
    # The stack's order, which render keeps for the YAML's node types too.
    assert env[fallover.ORDER_ENV].split(",") == workers
    # Type-major: p4d in the workers' AZ, p4d in the fallback AZ, then p4de.
    assert workers == order
    # Ray's v1 autoscaler, the one that loads scorers, on every node (`ray up` exports v2's
    # switch on before these lines); workers start Ray without the scorer.
    assert env[fallover.AUTOSCALER_V2_ENV] == "0"
    (worker,) = [c for c in cfg["worker_start_ray_commands"] if " start --address" in c]
    assert f" {fallover.AUTOSCALER_V2_ENV}=0 " in worker
    assert fallover.SCORER_ENV not in worker
    json.dumps(yaml.safe_load(yaml.safe_dump(cfg)))


def test_with_a_fallback_az_a_type_is_tried_in_every_az_before_the_next(tracker, monkeypatch):
    """The rendered fallback stack's node types through Ray's own choice and the scorer: each
    EC2 refusal moves the launch on in the stack's order, so p4d is tried in us-east-1c before
    any p4de."""
    from rayfleet.stack import parse

    cfg = render.plain(render.build_config(parse(json.dumps(example_outputs(FALLBACK_AZ))),
                                           "t"))
    monkeypatch.setenv(fallover.ORDER_ENV, ",".join(FALLBACK_ORDER))
    types = {"ray.head.default": NODE_TYPES["ray.head.default"],
             **{n: {"resources": t["resources"], "max_workers": t["max_workers"]}
                for n, t in cfg["available_node_types"].items() if n != "ray.head.default"}}
    picks = []
    for _ in FALLBACK_ORDER:
        picks.append(_pick(fallover.score, tracker, types))
        _fail(tracker, picks[-1])
    assert picks == FALLBACK_ORDER


def test_a_type_the_gpu_gate_keeps_refusing_is_launched_no_more(tracker, monkeypatch, capsys):
    """The cap, inside Ray's own choice: the stack's first type's nodes refused by the GPU
    health gate CAP times within the window, and the scorer moves on to the next type, saying
    why once on the autoscaler's stderr; under the cap, or with the refusals older than the
    window, the first type again. The records are read from the stack's storage
    (gpugate.read_records on moto: tests/moto/test_health.py)."""
    import time

    from rayfleet.agents import gpugate

    now = time.time()
    records = [{"node_type": ORDER[0], "ok": False, "time": now - 10 * i,
                "line": "refused: xid: Xid 79 (GPU has fallen off the bus) on PCI:0000:10:1c"}
               for i in range(gpugate.CAP)]
    reads = []
    monkeypatch.setattr(gpugate, "read_records",
                        lambda s3, storage, since: reads.append((storage, since)) or records)
    monkeypatch.setattr(gpugate, "s3_client", lambda *timeouts: None)
    monkeypatch.setattr(fallover, "_health", {"at": None, "records": [], "said": set()})
    monkeypatch.setenv(fallover.ORDER_ENV, ",".join(ORDER))
    monkeypatch.setenv(fallover.HEALTH_ENV, "s3://b/p")
    assert _pick(fallover.score, tracker) == ORDER[1]
    assert _pick(fallover.score, tracker) == ORDER[1]
    assert len(reads) == 1 and reads[0][0] == "s3://b/p"     # read again only after REREAD_S
    assert capsys.readouterr().err.splitlines() == [
        f"rayfleet scorer: {ORDER[0]}: no more launches: {gpugate.CAP} nodes refused by the "
        f"GPU health gate within {gpugate.CAP_WINDOW_S // 60} min (last: {records[0]['line']})"]
    del records[0]
    fallover._health["at"] = None
    assert _pick(fallover.score, tracker) == ORDER[0]
