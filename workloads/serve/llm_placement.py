"""What the cluster can hold for an `llm` replica: the placement group one replica asks for, and
the nodes a rendered cluster YAML, or the running cluster, can provide for it."""

from __future__ import annotations

from pathlib import Path

from rayfleet import clusteryaml, facts
from rayfleet.clusteryaml import ClusterYaml, NodeType
from rayfleet.errors import ConfigError

BOOTSTRAP = facts.BOOTSTRAP_CONFIG


def _cluster(path: str) -> ClusterYaml:
    try:
        cfg, _ = clusteryaml.read(path)
    except clusteryaml.Unloadable as e:
        said = {clusteryaml.MISSING: f"{path} does not exist",
                clusteryaml.NOT_YAML: f"{path} is not valid YAML"}
        raise ConfigError("--cluster-config", said.get(e.kind, str(e))) from None
    types = (cfg or {}).get("available_node_types") if isinstance(cfg, dict) else None
    if not isinstance(types, dict):
        raise ConfigError("--cluster-config", f"{path} has no available_node_types")
    return ClusterYaml(cfg)


def _gpus(t: NodeType) -> int:
    return int(t.resources.get("GPU", 0))


def _largest(t: NodeType) -> tuple[float, ...]:
    """Sorts the node types with the most GPUs, then CPUs, then memory first."""
    have = t.numbers()
    return tuple(-have.get(k, 0) for k in ("GPU", "CPU", "memory"))


def gpu_capacity(path: str) -> tuple[int, int]:
    """(largest GPU count on one node of a cluster YAML, GPUs of all its workers at once): the
    workers as ClusterYaml.capacity counts them, the types with the most GPUs first."""
    cluster = _cluster(path)
    per_node = max((_gpus(t) for t in cluster.node_types()), default=0)
    return per_node, sum(_gpus(t) * n for t, n in cluster.capacity(key=_largest))


def node_capacity(path: str) -> list[dict]:
    """Each node a cluster YAML can have at once, as its node type's resources: the head, and
    the workers as ClusterYaml.capacity counts them (within the cluster's max_workers), the
    largest first."""
    return [t.numbers() for t, n in _cluster(path).capacity(key=_largest, head=True)
            for _ in range(n)]


def device_of(llm: dict) -> str:
    """cpu for a config whose bundles ask for no GPU and that names no accelerator."""
    pg = llm.get("placement_group_config") or {}
    bundles = pg.get("bundles") or [pg.get("bundle_per_worker") or {"GPU": 1}]
    gpu = llm.get("accelerator_type") or any(b.get("GPU") for b in bundles)
    return "gpu" if gpu else "cpu"


def replica_bundles(llm: dict) -> tuple[list[dict], str]:
    """The placement group one replica asks for, as Ray 2.60 builds it: a bundle per vLLM
    worker (tensor x pipeline), the replica actor's own resources added to the first
    (ray.llm's _merge_replica_actor_and_child_actor_bundles), and the strategy."""
    engine = llm.get("engine_kwargs") or {}
    workers = int(engine.get("tensor_parallel_size", 1)) * int(
        engine.get("pipeline_parallel_size", 1))
    pg = llm.get("placement_group_config") or {}
    bundles = [dict(b) for b in pg.get("bundles") or
               [dict(pg.get("bundle_per_worker") or {"GPU": 1})] * workers]
    actor = ((llm.get("deployment_config") or {}).get("ray_actor_options") or {})
    first = dict(bundles[0])
    first["CPU"] = first.get("CPU", 0) + actor.get("num_cpus", 1)
    first["GPU"] = first.get("GPU", 0) + actor.get("num_gpus", 0)
    bundles[0] = {k: v for k, v in first.items() if v}
    return bundles, pg.get("strategy", "PACK")


def _fits(node: dict, ask: dict) -> bool:
    return all(node.get(k, 0) >= v for k, v in ask.items())


def _say(ask: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(ask.items()))


def check_placement(llms: list[dict], nodes: list[dict], where: str) -> None:
    """Refuse, in one line, a replica no node set of `nodes` (each node's resources) can
    hold: Ray would leave its placement group pending forever and Serve would say nothing.
    STRICT_PACK needs one node with the sum of the bundles; otherwise each bundle must fit a
    node and the sum the cluster."""
    for llm in llms:
        bundles, strategy = replica_bundles(llm)
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        model = (llm.get("model_loading_config") or {}).get("model_id", "model")
        biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
        if strategy == "STRICT_PACK" and not any(_fits(n, need) for n in nodes):
            raise ConfigError("placement", f"a {model} replica needs {_say(need)} on one node "
                              f"(STRICT_PACK); the largest node of {where} has "
                              f"{_say({k: biggest.get(k, 0) for k in need})}: lower "
                              "--cpus-per-worker / --tensor-parallel-size or add a bigger node")
        total = {k: sum(n.get(k, 0) for n in nodes) for k in need}
        if any(not any(_fits(n, b) for n in nodes) for b in bundles) or not _fits(total, need):
            raise ConfigError("placement", f"a {model} replica needs {_say(need)}; {where} has "
                              f"{_say(total)} in all")
        _check_kv_cache(llm, model, nodes, where)


def _check_kv_cache(llm: dict, model: str, nodes: list[dict], where: str) -> None:
    # On CPU the KV cache lives in the node's RAM (Ray's `memory` resource, where the
    # nodes report it): a cache no node can hold fails vLLM's start on every try.
    kv = (llm.get("engine_kwargs") or {}).get("kv_cache_memory_bytes")
    memories = [n["memory"] for n in nodes if n.get("memory")]
    if device_of(llm) == "cpu" and kv and memories and int(kv) > max(memories):
        raise ConfigError("placement", f"a {model} replica's KV cache is "
                          f"{int(kv) / (1 << 30):.1f} GiB; the largest node of {where} has "
                          f"{max(memories) / (1 << 30):.1f} GiB for Ray: lower "
                          "--kv-cache-gib")


def cluster_nodes() -> tuple[list[dict], str]:
    """(each node the cluster this process runs in can have, what that was read from): on a
    cluster-launcher head, every node its autoscaler may start (GPU workers usually do not
    exist yet when an app is deployed); elsewhere (local, on-prem: no autoscaler) the alive
    nodes."""
    import ray

    bootstrap = Path(BOOTSTRAP).expanduser()
    if bootstrap.is_file():
        return node_capacity(str(bootstrap)), "this cluster's node types"
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")], "this cluster"


def live_check(llm: dict) -> None:
    """Where a client environment names a running cluster (RAY_ADDRESS, as `rayfleet local
    env` exports it), check the replica fits it before anything is deployed."""
    import os

    address = os.environ.get("RAY_ADDRESS")
    if not address or address.startswith(("http://", "https://")):
        return   # none, or the Jobs API's address (a tunnel to a remote cluster): no GCS here
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # a cluster that is not there, or refuses the token
        raise ConfigError("RAY_ADDRESS", f"cannot reach the cluster at {address} to check "
                          f"the replica fits ({str(e).splitlines()[0][:160]}); unset it to "
                          "skip the check") from None
    try:
        nodes, where = cluster_nodes()
    finally:
        ray.shutdown()
    check_placement([llm], nodes, f"{where} ({address})")
