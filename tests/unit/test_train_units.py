"""The training loop and driver logic without a cluster: model, schedule, the fail-fast
resource check, the memory estimate, checkpoint validation, and the loop itself in one
process (the same code Ray Train and torchrun run)."""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from rayfleet.errors import CheckpointError, ClusterError, ConfigError, RayfleetError
from workloads.common import runs as ckpt
from workloads.train.context import TorchrunContext
from workloads.train.loop import LoopConfig, lr_at, train_loop
from workloads.train.options import TrainOptions, check_options
from workloads.train.placement import check_memory, check_resources, memory_estimate_bytes
from workloads.common.model import GPT, PRESETS


def args_of(*argv):
    opts = TrainOptions.parse(list(argv))
    return opts, check_options(opts)


def test_parameter_count_formula_matches_the_module():
    for name in ("tiny", "small", "125m"):
        cfg = PRESETS[name]
        assert cfg.num_params() == sum(p.numel() for p in GPT(cfg).parameters())
    assert 80e6 < PRESETS["125m"].num_params() < 130e6
    assert 1.0e9 < PRESETS["1b"].num_params() < 1.4e9


def test_lr_warms_up_then_decays():
    cfg = LoopConfig(lr=1.0, warmup_steps=10, max_steps=100)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) < 0.2
    assert lr_at(50, cfg) < lr_at(20, cfg)


@pytest.mark.parametrize("argv,key,needle", [
    (["--strategy", "dpp"], "--strategy", 'did you mean "ddp"'),
    (["--num-workers", "0"], "--num-workers", "at least 1"),
    (["--model", "125M"], "--model", 'did you mean "125m"'),
    (["--zero-stage", "1"], "--zero-stage", "2 or 3"),
    (["--resources-per-worker", "[1]"], "--resources-per-worker", "JSON object"),
    (["--strategy", "deepspeed", "--compile"], "--compile", "ddp or fsdp"),
])
def test_bad_flags_name_the_key(argv, key, needle):
    with pytest.raises(ConfigError) as e:
        args_of(*argv)
    assert key in str(e.value) and needle in str(e.value)


def test_smoke_defaults_yield_to_explicit_flags():
    args, model = args_of("--smoke-test", "--max-steps", "3")
    assert args.max_steps == 3 and args.num_workers == 2 and model == PRESETS["tiny"]


CPU_NODE = {"Alive": True, "Resources": {"CPU": 4.0, "memory": 8e9}}
GPU_NODE = {"Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0, "memory": 1e12,
                                         "accelerator_type:A100": 1.0}}


def test_gpus_on_a_cpu_cluster_fail_fast_naming_gpu():
    args, _ = args_of("--use-gpu", "--num-workers", "2")
    with pytest.raises(ClusterError, match="no GPU at all"):
        check_resources(args, [CPU_NODE], {"CPU": 4.0})


def test_more_workers_than_fit_names_the_numbers():
    args, _ = args_of("--num-workers", "9", "--use-gpu")
    with pytest.raises(ClusterError, match="fits only 8"):
        check_resources(args, [GPU_NODE, {**CPU_NODE, "Alive": False}], {"CPU": 96, "GPU": 8})
    args, _ = args_of("--num-workers", "16", "--use-gpu")
    check_resources(args, [GPU_NODE, GPU_NODE], {"CPU": 192, "GPU": 16})  # fits: no error


def test_custom_resource_nobody_has():
    args, _ = args_of("--resources-per-worker", '{"accelerator_type:H100": 0.01}')
    with pytest.raises(ClusterError, match="accelerator_type:H100"):
        check_resources(args, [GPU_NODE], {"CPU": 96, "GPU": 8, "accelerator_type:A100": 1})


def test_a_resource_only_the_autoscaler_can_add_waits_for_it(tmp_path):
    """On a `ray up` cluster the head's autoscaling config names the worker types: a job asking
    for what only they have must wait for a launch, not fail fast (the rendered YAML's A100
    types, read the way the driver reads them on the head)."""
    import shutil

    from workloads.train.placement import (
        autoscaler_config,
        fitting_types,
        launchable_nodes,
        worker_types,
    )

    cfg = tmp_path / "ray_bootstrap_config.yaml"
    shutil.copy(REPO / "cluster-configs" / "aws-a100.example.yaml", cfg)
    autoscaling = autoscaler_config(str(cfg))
    extra = launchable_nodes(autoscaling)
    # max_workers (2) is spent on the preferred type's two node types...
    assert sorted(n["Launchable"] for n in extra) == ["ray.worker.p4d.24xlarge.ondemand",
                                                      "ray.worker.p4d.24xlarge.spot"]
    args, _ = args_of("--resources-per-worker", '{"accelerator_type:A100": 0.5}')
    check_resources(args, [CPU_NODE] + extra, {"CPU": 4.0 + 192, "accelerator_type:A100": 2})
    # ...but every A100 type may still launch in their place when EC2 refuses p4d: all of them
    # are what the run waits on (a rehearsal run failed fast while p4de was starting, when
    # these were taken from the capped list).
    assert fitting_types(args, worker_types(autoscaling)) == [
        "ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand",
        "ray.worker.p4de.24xlarge.spot", "ray.worker.p4de.24xlarge.ondemand"]
    with pytest.raises(ClusterError, match="accelerator_type:A100"):
        check_resources(args, [CPU_NODE] + launchable_nodes(
            autoscaler_config(str(tmp_path / "none.yaml"))), {"CPU": 4.0})


def test_memory_estimate_shrinks_with_sharding():
    est = {}
    for strat in (["--strategy", "ddp"], ["--strategy", "fsdp"],
                  ["--strategy", "deepspeed", "--zero-stage", "2"],
                  ["--strategy", "deepspeed", "--zero-stage", "3"],
                  ["--strategy", "deepspeed", "--zero-stage", "3", "--offload"]):
        args, model = args_of("--model", "1b", "--num-workers", "8", "--use-gpu", *strat)
        est[" ".join(strat)] = memory_estimate_bytes(model, args)["total"]
    vals = list(est.values())
    assert vals[0] > vals[2] > vals[3] > vals[4]
    assert vals[1] == pytest.approx(vals[3])  # FSDP full-shard == ZeRO-3


def test_oom_warning_for_1b_ddp_on_a100_40g_but_not_with_zero3():
    args, model = args_of("--model", "1b", "--num-workers", "8", "--use-gpu")
    warning = check_memory(model, args, [GPU_NODE])
    assert warning and "expect OOM" in warning and "40.0 GiB" in warning
    args, model = args_of("--model", "1b", "--num-workers", "8", "--use-gpu", "--batch-size", "1",
                          "--strategy", "deepspeed", "--zero-stage", "3")
    assert check_memory(model, args, [GPU_NODE]) is None


def _run_loop(root: Path, max_steps: int, strategy: str = "ddp",
              compile: bool = False) -> tuple[TorchrunContext, dict]:
    cfg = LoopConfig(model=PRESETS["tiny"].to_dict(), strategy=strategy, batch_size=8,
                     lr=3e-3, warmup_steps=3, max_steps=max_steps, checkpoint_every=5,
                     log_every=5, corpus_bytes=64 << 10, num_workers=0, compile=compile)
    ctx = TorchrunContext(root, keep=2)
    return ctx, train_loop(cfg, ctx)


def test_loop_learns_and_resumes_where_it_stopped(tmp_path):
    ctx, first = _run_loop(tmp_path, 10)
    assert first["step"] == 10
    assert first["compute_dtype"] == "float32"  # no autocast on CPU
    assert ctx.reports[-1]["loss"] < ctx.reports[0]["loss"] < 6.0
    latest = sorted(tmp_path.glob("checkpoint_*"))[-1]
    marker = ckpt.validate(latest)
    assert marker["step"] == 10 and marker["final"] is True
    assert {"model.pt", "optim.pt", "trainer_state.json", "rng_rank0.pt",
            "metrics.csv"} <= set(marker["files"])
    ctx2, second = _run_loop(tmp_path, 15)
    assert second["step"] == 15
    assert [r["step"] for r in ctx2.reports] == [15]  # continued at 11, did not restart at 1
    state = json.loads((sorted(tmp_path.glob("checkpoint_*"))[-1] / "trainer_state.json")
                       .read_text())
    assert state["step"] == 15


@pytest.mark.slow  # inductor compiles the tiny model's forward and backward (~25 s on 2 cores)
def test_compiled_loop_matches_eager_and_shares_its_checkpoints(tmp_path):
    try:
        _, eager = _run_loop(tmp_path / "eager", 5)
        _, compiled = _run_loop(tmp_path / "compiled", 5, compile=True)
        # The same seed and data: torch.compile changes kernels, not the arithmetic.
        assert compiled["loss"] == pytest.approx(eager["loss"], abs=1e-3)
        # Compiled in place: state_dict keys as in eager (no `_orig_mod.` prefix), so an
        # eager run resumes from a compiled run's checkpoint and the other way round.
        latest = sorted((tmp_path / "compiled").glob("checkpoint_*"))[-1]
        keys = torch.load(latest / "model.pt", weights_only=True).keys()
        assert keys == GPT(PRESETS["tiny"]).state_dict().keys()
        ctx, resumed = _run_loop(tmp_path / "compiled", 10)  # eager, from the compiled one
        assert [r["step"] for r in ctx.reports] == [10] and resumed["step"] == 10
    finally:
        torch._dynamo.reset()


def test_truncated_checkpoint_is_refused(tmp_path):
    _run_loop(tmp_path, 5)
    latest = sorted(tmp_path.glob("checkpoint_*"))[-1]
    model = latest / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt: model.pt is 100 bytes"):
        ckpt.validate(latest)
    with pytest.raises(CheckpointError, match="corrupt"):
        _run_loop(tmp_path, 10)


def test_checkpoint_without_marker_is_never_used(tmp_path):
    _run_loop(tmp_path, 5)
    latest = sorted(tmp_path.glob("checkpoint_*"))[-1]
    (latest / ckpt.MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.validate(latest)


def test_fsdp_checkpoint_missing_a_rank_shard_is_incomplete():
    marker = {"strategy": "fsdp", "world_size": 2, "files": {}}
    listing = {"dcp/.metadata": 10, "dcp/__0_0.distcp": 100}
    with pytest.raises(CheckpointError, match=r"ranks \[1\]"):
        ckpt.check_listing("x", marker, listing)


def test_full_weights_load_into_a_fresh_model(tmp_path):
    _run_loop(tmp_path, 5)
    cfg, state = ckpt.load_full_weights(sorted(tmp_path.glob("checkpoint_*"))[-1])
    from workloads.common.model import GPTConfig

    model = GPT(GPTConfig.from_dict(cfg))
    model.load_state_dict(state)
    out = model.generate(torch.tensor([[ord("d")]]), max_new_tokens=5, temperature=0)
    assert out.shape == (1, 6)


def test_workload_import_has_no_side_effects(capsys):
    import importlib

    for mod in ("workloads.train.driver", "workloads.train.loop", "workloads.common.storage"):
        importlib.reload(importlib.import_module(mod))
    assert capsys.readouterr().out == ""
    assert isinstance(RayfleetError("a\nb").args[0], str) and "\n" not in str(RayfleetError("a\nb"))


def test_resources_per_worker_is_validated_also_under_python_O(tmp_path):
    # `python -O` strips asserts: validation must not be one.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-O", "-m", "workloads.train", "--storage-path",
                           str(tmp_path), "--resources-per-worker", "[1]"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        'workloads.train: error: --resources-per-worker: must be a JSON object of numbers, e.g. '
        '{"memory": 4e9}']
    assert list(tmp_path.iterdir()) == []


def test_the_training_corpus_is_the_sorted_standard_library_without_tests():
    """The loop's corpus is read lazily (it needs a few dozen files, not a walk of the whole
    standard library first), but it stays the same bytes in the same order: every run, and a
    resumed one, trains on the same data."""
    import sysconfig

    from workloads.common.corpus import stdlib_corpus, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    expected = sorted(p for p in root.rglob("*.py")
                      if not skip.intersection(p.relative_to(root).parts))
    assert stdlib_files() == expected
    corpus = stdlib_corpus(1 << 20)
    assert len(corpus) == 1 << 20
    assert corpus.startswith(expected[0].read_bytes()[:4096])
    assert stdlib_corpus(1 << 16) == corpus[:1 << 16]


def test_training_options_are_parsed_once_and_frozen():
    import dataclasses

    opts, _ = args_of("--smoke-test", "--num-workers", "8", "--env", "A=1")
    assert opts.num_workers == 2 and opts.batch_size == 8 and opts.env == ("A=1",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.num_workers = 4


def test_the_runs_actors_are_given_the_clusters_address():
    """Ray Train's PlacementGroupCleaner finds the cluster through RAY_ADDRESS (else it guesses
    from `ps` and /tmp/ray, and fails with a traceback when there is a second or a stale Ray
    instance): the driver hands its own address to the job's actors."""
    from workloads.train.driver import cluster_address_env

    assert cluster_address_env({"RAY_ADDRESS": "10.0.1.5:6379"}) == {
        "env_vars": {"RAY_ADDRESS": "10.0.1.5:6379"}}
    for address in ("", "auto", "ray://10.0.1.5:10001", "http://127.0.0.1:8265"):
        assert cluster_address_env({"RAY_ADDRESS": address}) is None, address
    assert cluster_address_env({}) is None
    # A job that set RAY_ADDRESS in its own runtime env keeps it (Ray refuses two values).
    job = json.dumps({"runtime_env": {"env_vars": {"RAY_ADDRESS": "10.0.1.5:6379"}}})
    assert cluster_address_env({"RAY_ADDRESS": "10.0.1.5:6379",
                                "RAY_JOB_CONFIG_JSON_ENV_VAR": job}) is None
    job = json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}})
    assert cluster_address_env({"RAY_ADDRESS": "127.0.0.1:6379",
                                "RAY_JOB_CONFIG_JSON_ENV_VAR": job}) == {
        "env_vars": {"RAY_ADDRESS": "127.0.0.1:6379"}}


@pytest.mark.slow
def test_deepspeed_on_one_rank_trains(tmp_path):
    """A one-GPU run (`torchrun --nproc-per-node 1`, bench.gpu, a one-GPU node): DeepSpeed
    needs a process group even there. On an H100 it failed in deepspeed.initialize
    ("Distributed backend is not initialized") before the loop made a one-rank group."""
    from tests.conftest import BIN, run, summary_of

    proc = run([str(BIN / "torchrun"), "--nproc-per-node", "1", "-m", "workloads.train.torchrun",
                "--smoke-test", "--strategy", "deepspeed", "--max-steps", "2",
                "--output", str(tmp_path / "out")],
               env={"PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                    "TMPDIR": os.environ["TMPDIR"],   # the run's folder (tests/scratch.py)
                    "HOME": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = summary_of(proc.stdout)
    assert summary["world_size"] == 1 and summary["history"][-1]["step"] == 2


@pytest.fixture
def head_home(tmp_path, monkeypatch):
    """The driver's node: HOME here (where the head keeps its autoscaling config), no run store
    in the environment unless a test sets one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAYFLEET_STORAGE", "RAYFLEET_STORAGE_PREFIX", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _bootstrap(home: Path, edit=None) -> None:
    """The head's copy of the cluster YAML (`ray up` puts it at ~/ray_bootstrap_config.yaml):
    the rendered example (an AWS cluster whose worker types may launch), edited."""
    import yaml

    cfg = yaml.safe_load((REPO / "cluster-configs" / "aws-a100.example.yaml").read_text())
    if edit:
        edit(cfg)
    (home / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(cfg))


STORE = {"RAYFLEET_STORAGE": "s3://rayfleet-b/rayfleet/runs",
         "RAYFLEET_STORAGE_PREFIX": "s3://rayfleet-b/rayfleet/"}


@pytest.mark.parametrize("argv,env,says", [
    # The default ~/rayfleet-runs of a cluster an older kit rendered: the head's disk.
    ([], {}, "{home}/rayfleet-runs is a folder on one node, and this cloud cluster can have "
             "more than one"),
    (["--storage-path", "/data/runs"], STORE,
     "leave --storage-path out, for the run store s3://rayfleet-b/rayfleet/runs"),
    (["--storage-path", "s3://rayfleet-other/runs"], STORE,
     "s3://rayfleet-other/runs is outside s3://rayfleet-b/rayfleet/, the only prefix"),
    (["--storage-path", "s3://rayfleet-b/rayfleetx/runs"], STORE, "is outside"),
])
def test_storage_a_cloud_cluster_cannot_keep_is_refused_before_ray(head_home, monkeypatch,
                                                                   capsys, argv, env, says):
    """A node's folder on a multi-node cloud cluster (the workers' checkpoints on their own
    disks, gone at `ray down`), or a bucket path the roles may not write: one line, exit 2,
    before Ray or any worker starts and before anything is created."""
    import sys

    from workloads.train import driver

    _bootstrap(head_home)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "ray", None)   # the refusal comes before Ray is imported
    assert driver.main(["--smoke-test", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("workloads.train: error: --storage-path: ") and \
        says.format(home=head_home) in err, err
    assert sorted(p.name for p in head_home.iterdir()) == ["ray_bootstrap_config.yaml"]


def _no_workers(cfg: dict) -> None:
    for name, nt in cfg["available_node_types"].items():
        if name != cfg["head_node_type"]:
            nt["max_workers"] = nt["min_workers"] = 0


@pytest.mark.parametrize("bootstrap,env,storage", [
    (None, {}, "/data/runs"),                                         # off a cluster
    (lambda c: c["provider"].update(type="local"), {}, "/data/runs"),  # a local cluster
    (_no_workers, {}, "/data/runs"),                                  # the head alone
    (None, STORE, "s3://rayfleet-b/rayfleet/runs"),
    (None, STORE, "s3://rayfleet-b/rayfleet/elsewhere"),
])
def test_storage_every_node_can_reach_is_taken(head_home, monkeypatch, bootstrap, env, storage):
    from workloads.train import driver

    if bootstrap is not None or env:
        _bootstrap(head_home, bootstrap)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    opts, _, _ = driver._options(["--smoke-test", "--storage-path", storage])
    assert opts.storage_path == storage


def test_the_run_store_is_the_default_storage(head_home, monkeypatch):
    from workloads.train import driver

    _bootstrap(head_home)
    for k, v in STORE.items():
        monkeypatch.setenv(k, v)
    opts, _, _ = driver._options(["--smoke-test"])
    assert opts.storage_path == STORE["RAYFLEET_STORAGE"]
