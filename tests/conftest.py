"""Shared fixtures: one real local Ray cluster per test session (token auth on, its own
ports and state folder, so it runs beside a user's cluster), and a real moto S3 server.

Markers: unit (default), ray, moto, slow, faults, gpu, aws_live.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from rayfleet.commands.host import free_port  # noqa: F401  (the tests' one picker)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Every temporary file of this run, its children's included, under one folder of its own
# (tests/scratch.py): before anything asks tempfile where /tmp is. An earlier run's folder,
# left by a kill, goes first.
from tests import cpuclock, scratch  # noqa: E402

SWEPT = [] if os.environ.get(scratch.ENV) else scratch.sweep(Path(tempfile.gettempdir()))
SCRATCH = scratch.enter()




def run(cmd: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = REPO,
        check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def wait_until(what: str, predicate, timeout: float = 60, interval: float = 0.3,
               detail=lambda: ""):
    """``predicate()``'s first truthy value, polled every ``interval`` s; fails naming
    ``what`` (and ``detail()``, e.g. a log) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{detail()}")


# Ray streams its actors' logs to a driver's terminal, each line tagged "(Name pid=N)"; Ray
# Train's controller logs its retries there, with tracebacks. Ray's own processes' lines come
# tagged too: "(raylet)" warns there every 10 s while the disk is over 95% full, as it was on
# a CI machine shared with others. What the kit itself printed is every other line.
_RAY_LOG_LINE = re.compile(
    r"^(\x1b\[\d+m)?\((\w+ pid=\d+|raylet|gcs_server|autoscaler|monitor)\b")


def kit_lines(text: str) -> list[str]:
    """The non-blank lines of a driver's output that are not Ray's forwarded logs."""
    return [ln for ln in text.splitlines() if ln.strip() and not _RAY_LOG_LINE.match(ln)]


def ray_logged_at(logs, text: str, after: float = 0.0) -> float | None:
    """When a line holding ``text`` was first written to one of Ray's ``logs`` after ``after``
    (its `[YYYY-mm-dd HH:MM:SS,mmm` stamp, the machine's local time), or None."""
    import datetime

    for log in logs:
        try:
            lines = Path(log).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if text in line:
                at = datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if at > after:
                    return at
    return None


def summary_of(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RAYFLEET_SUMMARY ")]
    assert lines, f"no summary line in output:\n{stdout[-3000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def ensure_redis_server() -> None:
    """Debian's redis-server, installed with apt-get when missing (CI and this suite run as
    root); a machine that cannot install it fails the test, never skips it."""
    from rayfleet import gcsft

    if gcsft.redis_binary():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if Path("/run/systemd/system").is_dir():
        # The package's service would start a second Redis, on 6379.
        subprocess.run(["systemctl", "mask", "redis-server.service"], capture_output=True)
    install = ["apt-get", "-q", "-y", "install", "--no-install-recommends", "redis-server"]
    proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        subprocess.run(["apt-get", "-q", "update"], env=env, capture_output=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if not gcsft.redis_binary():
        pytest.fail(f"redis-server is missing and `{gcsft.INSTALL_HINT}` failed: "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}", pytrace=False)


def pytest_collection_finish(session):
    # The fake cloud's wheelhouse (tests/fakecloud/test_ray_up.py) is built in the background
    # from now on; not for `--collect-only`, which runs nothing (and took a 1.2 GB build).
    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith("tests/fakecloud/") for item in session.items):
        from tests.fakecloud import test_ray_up

        test_ray_up.start_prebuild()


# `make test` runs two pytest-xdist workers (`-n 2 --dist loadscope`) with the scheduler below:
# each group runs whole on one worker, and groups are handed out in this order.
FIRST_GROUPS = ("fakecloud", "cluster", "tests/cluster/test_ansible.py")
GROUPS_ENV = "RAYFLEET_XDIST_GROUPS"  # where workers write {node id: group} for the scheduler


def xdist_group(module: str, uses_cluster: bool) -> str:
    """The rehearsal alone ("fakecloud"), every test that uses the session's Ray cluster
    together ("cluster": one worker, one cluster), the other tests by module (its module
    fixtures made once). A module's tests that need no cluster stay off the cluster's worker
    (the bad-input suite's ~100 in-process cases once rode there behind its one cluster test,
    on the run's critical path)."""
    if module.startswith("tests/fakecloud/"):
        return "fakecloud"
    return "cluster" if uses_cluster else module


def group_for_xdist(items) -> dict[str, str]:
    """Each item's group, with the items ordered so that the longest groups start first, side
    by side: the rehearsal (the longest test) on one worker while the other works through the
    cluster's tests; the rest fill in after."""
    groups = {item.nodeid: xdist_group(item.nodeid.split("::")[0],
                                       "ray_cluster" in item.fixturenames) for item in items}
    first = {g: i for i, g in enumerate(FIRST_GROUPS)}
    items.sort(key=lambda it: first.get(groups[it.nodeid], len(first)))  # stable
    return groups


def read_groups(groups_file: Path) -> dict[str, str]:
    """Every worker's {node id: group}, as pytest_collection_modifyitems wrote them."""
    written = sorted(groups_file.parent.glob(f"{groups_file.name}.*"))
    if not written:
        raise RuntimeError("no worker wrote its test groups (tests/conftest.py)")
    groups: dict[str, str] = {}
    for path in written:
        groups.update(json.loads(path.read_text()))
    return groups


def scope_of(groups: dict[str, str], nodeid: str) -> str:
    """A test's xdist scope: its group. A test no worker grouped is an error, not a scope of
    its own: that is how two session clusters once started side by side."""
    try:
        return groups[nodeid]
    except KeyError:
        raise RuntimeError(f"{nodeid}: in no test group that the workers wrote (tests/"
                           f"conftest.py, pytest_collection_modifyitems); it would run "
                           f"outside its group, on any worker") from None


def pytest_report_header(config):
    """One line before the first test on what would skew this run (tests/machine.py), and
    the earlier runs' temporary folders removed."""
    from tests.machine import observe, report

    lines = [report(observe())]
    if SWEPT:
        lines.append(f"removed {len(SWEPT)} temporary folder(s) that earlier runs left: "
                     f"{', '.join(map(str, SWEPT[:3]))}{'…' if len(SWEPT) > 3 else ''}")
    return lines


_OUTCOME: dict = {}
_SHM_BEFORE: set[str] = set()   # /dev/shm's names at the start (the controller's)
# Each test's CPU (tests/cpuclock.py): this process's clock, its last reading, and the CPU and
# wall seconds per test of the reports this process logged (the workers' too, in the controller).
CLOCK = cpuclock.Clock()
_LAST: list[float | None] = [None]
_CPU: dict[str, float] = {}
_WALL: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    now = CLOCK.seconds()
    if now is not None and _LAST[0] is not None:
        outcome.get_result().user_properties.append(("cpu_s", now - _LAST[0]))
    _LAST[0] = now


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_s":
            _CPU[report.nodeid] = _CPU.get(report.nodeid, 0.0) + value
    _WALL[report.nodeid] = _WALL.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = cpuclock.table(_CPU, _WALL) or [
        f"CPU per test: not measured ({CLOCK.why or 'no worker could make a cgroup'})"]
    for line in lines:
        terminalreporter.write_line(line)
    if _SHM_BEFORE:   # the controller, once every worker and its clusters are done
        from tests.machine import leftover_segments

        gone, size = [], 0
        for p in leftover_segments(_SHM_BEFORE):
            try:
                size += p.stat().st_size
                p.unlink()
            except OSError:   # its owner's own cleanup came first
                continue
            gone.append(p)
        if gone:
            terminalreporter.write_line(
                f"removed {len(gone)} shared memory segment(s) this run's killed processes "
                f"left in /dev/shm ({size / 2**20:.0f} MiB; vLLM's engine makes them): "
                f"{', '.join(p.name for p in gone[:4])}{'…' if len(gone) > 4 else ''}")
    _OUTCOME["passed"] = exitstatus == 0
    if not _OUTCOME["passed"] and scratch.made_here(SCRATCH):
        terminalreporter.write_line(scratch.leave(SCRATCH, passed=False))


def pytest_unconfigure(config):
    # Last of all: every fixture, cluster and fake cloud is down by now.
    CLOCK.stop()
    scratch.leave(SCRATCH, passed=_OUTCOME.get("passed", False))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from tests.tiers import required

    # pytest's own temporary folders inside the run's folder, and short: a test's Unix sockets
    # (HAProxy's, 97 characters at most; Ray's, 107) live under tmp_path. The controller sets
    # it; pytest-xdist gives each worker a folder of its own below (<basetemp>/gw0, ...).
    if not os.environ.get("PYTEST_XDIST_WORKER") and not config.option.basetemp:
        config.option.basetemp = str(SCRATCH / "p")

    required()   # an unknown tier in RAYFLEET_REQUIRE stops the run before any test
    if not os.environ.get("PYTEST_XDIST_WORKER"):   # the controller, or the one process
        from tests.machine import SHM

        if SHM.is_dir():
            _SHM_BEFORE.update(p.name for p in SHM.iterdir())
        _SHM_BEFORE.add("")   # taken: the run's end removes only what appeared after this
    # The processes that run tests count their CPU; xdist's controller runs none.
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses",
                                                             None):
        _LAST[0] = CLOCK.start().seconds()
    # The controller (it collects nothing) names a file for the workers' groups.
    if (getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER")
            and GROUPS_ENV not in os.environ):
        os.environ[GROUPS_ENV] = str(Path(tempfile.mkdtemp(prefix="rayfleet-xdist-")) / "groups")
        config.add_cleanup(lambda: shutil.rmtree(Path(os.environ.pop(GROUPS_ENV)).parent,
                                                 ignore_errors=True))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadscope scheduling with the groups above as scopes (its own
    `xdist_group` marks cannot be used: under pytest 9 they no longer reach the node ids)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            if not self.groups:
                self.groups.update(read_groups(Path(os.environ[GROUPS_ENV])))
            return scope_of(self.groups, nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    groups = group_for_xdist(items)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(GROUPS_ENV):
        Path(f"{os.environ[GROUPS_ENV]}.{worker}").write_text(json.dumps(groups))
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        if not marks & {"ray", "moto", "slow", "faults", "gpu", "aws_live"}:
            item.add_marker(pytest.mark.unit)
        if "aws_live" in marks and not os.environ.get("RAYFLEET_AWS_LIVE"):
            item.add_marker(pytest.mark.skip(reason="set RAYFLEET_AWS_LIVE=1 for real AWS"))


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_runtest_setup(item):
    # A `gpu` test without CUDA: skipped, or failed where RAYFLEET_REQUIRE names gpu
    # (`make test-gpu`), by the one helper every tier's skip goes through.
    if item.get_closest_marker("gpu") and not has_cuda():
        from tests.tiers import unavailable

        unavailable("gpu", "needs CUDA (torch.cuda.is_available() is False here)")


def copy_of_checkout(dest: Path) -> Path:
    """The checkout's tracked files, as they are now, copied under ``dest`` (outside git:
    everything but what .gitignore keeps out of a job's upload)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if files.returncode == 0:
        for rel in filter(None, files.stdout.decode().split("\0")):
            src = REPO / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".venv", ".git", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"))
    return dest


@pytest.fixture(autouse=True)
def _root_logger_as_it_was():
    """Each test leaves the root logger as it found it: a library that calls
    logging.basicConfig inside one test (Ray Serve LLM's imports do) would otherwise leave a
    handler on that test's captured, then closed, stderr, and every later line logged (boto's
    "Found credentials") would print a logging error into another test's output."""
    handlers, level = list(logging.root.handlers), logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


@pytest.fixture(scope="session")
def rayfleet_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rayfleet-home")


@pytest.fixture(scope="session")
def ray_cluster(rayfleet_home, tmp_path_factory):
    """A real `rayfleet local up` cluster: 4 logical CPUs on this 2-core machine so two
    train workers plus Ray Data / Serve replicas fit; loopback ports picked free."""
    # The cluster's default storage (what jobs and Serve apps use when given no path) is the
    # session's own folder, never the home directory of whoever runs the tests.
    storage = tmp_path_factory.mktemp("default-storage")
    env = {**os.environ, "RAYFLEET_HOME": str(rayfleet_home), "RAYFLEET_STORAGE": str(storage)}
    for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        env.pop(k, None)
    gcs, dash = free_port(), free_port()
    # Serve's ingress: the kit's default (HAProxy); RAYFLEET_TEST_INGRESS=python runs the same
    # tests through Serve's Python proxy (how docs/faults.md compares the two).
    ingress = os.environ.get("RAYFLEET_TEST_INGRESS")
    up = run([str(BIN / "rayfleet"), "local", "up", "--num-cpus", "4",
              "--object-store-memory", "1GB", "--port", str(gcs), "--dashboard-port", str(dash),
              *(["--ingress", ingress] if ingress else [])], env=env, timeout=180)
    assert up.returncode == 0, up.stderr
    client = json.loads((rayfleet_home / "local" / "cluster.json").read_text())
    exports = run([str(BIN / "rayfleet"), "local", "env"], env=env, check=True).stdout
    client_env = dict(line.removeprefix("export ").split("=", 1)
                      for line in exports.splitlines())
    info = {"home": rayfleet_home, "storage": storage, "env": {**env, **client_env},
            "client_env": client_env,
            "gcs_port": gcs, "dashboard_port": dash, "pid": client["pid"],
            "dashboard_url": f"http://127.0.0.1:{dash}", "up_stdout": up.stdout}
    yield info
    down = run([str(BIN / "rayfleet"), "local", "down"], env=env, timeout=120)
    # After every job, Serve app and Ray Data run of the session: the head's own teardown
    # finishes (Ray's SIGTERM drain would otherwise hold it until `down` kills it).
    assert down.returncode == 0 and "was killed" not in down.stdout, down.stdout + down.stderr


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """A real moto server on a free loopback port: S3 over HTTP, as boto3/pyarrow see AWS."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")
    yield url
    proc.terminate()
    try:   # werkzeug's server can take longer than this to stop on 2 busy cores: then killed
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def aws_env(moto_server) -> dict:
    """Client environment pointing boto3 and pyarrow at the moto server (fake keys)."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": moto_server}


@pytest.fixture(scope="session")
def s3_client(aws_env):
    import boto3

    return boto3.client("s3", endpoint_url=aws_env["AWS_ENDPOINT_URL_S3"],
                        region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


@pytest.fixture(scope="session")
def checkpoint_bucket(s3_client) -> str:
    s3_client.create_bucket(Bucket="rayfleet-test-checkpoints")
    return "rayfleet-test-checkpoints"


@pytest.fixture
def clean_dir(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="session")
def lm_checkpoint(ray_cluster, tmp_path_factory) -> str:
    """A finished workloads.train checkpoint (tiny model, 10 steps), trained once."""
    storage = tmp_path_factory.mktemp("lm-runs")
    proc = run([str(BIN / "python"), "-m", "workloads.train", "--smoke-test", "--max-steps",
                "10", "--checkpoint-every", "10", "--name", "lm-fixture",
                "--storage-path", str(storage)], env=ray_cluster["env"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return summary_of(proc.stdout)["checkpoint"]


@pytest.fixture
def aws_calls(monkeypatch):
    """Every AWS API operation botocore makes in this process, in order (the bad-input tests
    assert it stays empty: no AWS call made)."""
    import botocore.client

    calls: list[str] = []
    real = botocore.client.BaseClient._make_api_call

    def counting(self, operation, params):
        calls.append(operation)
        return real(self, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", counting)
    return calls


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory) -> Path:
    """A Hugging Face model folder as a Hub download looks (tokenizer + tiny Llama, saved with
    save_pretrained), made offline once per session (tests/hf_fixtures.py)."""
    from tests.hf_fixtures import make_hf_model_dir

    return make_hf_model_dir(tmp_path_factory.mktemp("hf-model") / "tiny-llama")


@pytest.fixture(scope="session")
def sft_jsonl(tmp_path_factory) -> Path:
    """An instruction dataset (JSON Lines: instruction, response)."""
    from tests.hf_fixtures import instruction_records, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("sft") / "train.jsonl", instruction_records())


SFT_MAX_LENGTH = 48


@pytest.fixture(scope="session")
def sft_data(hf_model_dir, sft_jsonl, tmp_path_factory) -> Path:
    """`sft_jsonl` as workloads.data's instruction rows for `hf_model_dir`'s tokenizer (its row
    builder, without Ray), max length SFT_MAX_LENGTH."""
    from tests.hf_fixtures import write_sft_dataset

    return write_sft_dataset(sft_jsonl, tmp_path_factory.mktemp("sft-data") / "data",
                             str(hf_model_dir), SFT_MAX_LENGTH)
