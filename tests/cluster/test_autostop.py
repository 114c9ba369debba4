"""Auto-stop's idleness decision against a real local cluster: the agent (rayfleet/agents/
autostop.py, run as the head runs it, with --dry-run: there is no EC2 here) stays put while a
job runs, while a detached actor of a user lives, and while a Serve application is deployed,
each of them alone for longer than its window; once none is left for its window it decides
to tear the cluster down. The teardown itself is tested against moto
(tests/moto/test_autostop.py) and, end to end, in the fake-cloud rehearsal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import BIN, REPO, free_port, run
from tests.moto.pulumi_moto import moto_account  # noqa: F401, F811 (a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
AGENT = REPO / "rayfleet" / "agents" / "autostop.py"
WINDOW_S = 6   # --minutes 0.1

KEEP_ACTOR = """
import ray

ray.init()

@ray.remote(num_cpus=0)
class Keeper:
    def ping(self):
        return 1

k = Keeper.options(name="keeper", namespace="user", lifetime="detached").remote()
ray.get(k.ping.remote())
print("KEPT", flush=True)
"""

SERVE_NOT_ACTOR = """
import sys, ray
from ray import serve

ray.init()
port = int(sys.argv[1])

@serve.deployment(ray_actor_options={"num_cpus": 0})
class Probe:
    def __call__(self, request):
        return "ok"

serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(Probe.bind(), name="probe", route_prefix="/probe")
ray.kill(ray.get_actor("keeper", namespace="user"))
print("SWAPPED", flush=True)
"""

DROP_SERVE_THEN_RUN = """
import sys, time, ray
from ray import serve

ray.init()
serve.delete("probe")
print("DROPPED", flush=True)
time.sleep(float(sys.argv[1]))   # this job alone, running, for longer than the window
"""


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    """One single-node cluster for both tests (each leaves it idle: its actors killed, its
    app deleted, the autoscaler running again), started once: a start is about 20 CPU-s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAYFLEET_HOME"] = str(tmp_path_factory.mktemp("autostop-cluster") / "home")
    up = run([str(BIN / "rayfleet"), "local", "up", "--num-cpus", "1", "--object-store-memory",
              "200MB", "--port", str(free_port()), "--dashboard-port", str(free_port())],
             env=env, timeout=180)
    assert up.returncode == 0, up.stderr
    exports = run([str(BIN / "rayfleet"), "local", "env"], env=env, check=True).stdout
    env.update(ln.removeprefix("export ").split("=", 1) for ln in exports.splitlines())
    try:
        yield env
    finally:
        run([str(BIN / "rayfleet"), "local", "down"], env=env, timeout=120)


class Agent:
    """The agent as a subprocess, its lines read as they come."""

    def __init__(self, env: dict, log):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), "--cluster-name", "local", "--minutes",
             str(WINDOW_S / 60), "--poll-s", "0.5", "--dry-run",
             "--address", env["RAY_DASHBOARD_ADDRESS"],
             "--gcs-port", env["RAY_ADDRESS"].rsplit(":", 1)[1]],
            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=open(log, "w"),
            stderr=subprocess.STDOUT)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def busy_lines(self, since: int) -> list[str]:
        return [ln for ln in self.lines()[since:] if " busy: " in ln]


def _job(env: dict, tmp_path, name: str, code: str, *args: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "main.py").write_text(code)
    out = run([str(BIN / "ray"), "job", "submit", "--working-dir", str(d), "--", "python",
               "main.py", *args], env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _hold(agent: Agent, seconds: float) -> None:
    """The agent must still be watching after ``seconds`` (longer than its window)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert agent.proc.poll() is None, agent.lines()[-5:]
        time.sleep(0.5)


def _alone(line: str) -> str:
    """The one reason of a busy line ("<stamp> autostop: busy: A; B" holds two)."""
    reason = line.split(" autostop: busy: ", 1)[1]
    assert "; " not in reason, line
    return reason


def test_a_job_an_actor_and_a_serve_app_each_keep_the_cluster_up(small_cluster, tmp_path):
    """Each alone for longer than the window: a user's detached actor, then a Serve app, then
    a running job; then nothing, and the decision."""
    env = small_cluster
    assert "KEPT" in _job(env, tmp_path, "actor", KEEP_ACTOR)
    # The agent starts once the actor lives: on busy cores `ray job submit` alone can take
    # longer than the window, and an agent started before it rightly finds the cluster idle.
    agent = Agent(env, tmp_path / "autostop.log")
    try:
        _hold(agent, WINDOW_S + 3)   # the job's submission leaves the window: the actor alone
        reason = _alone(agent.busy_lines(0)[-1])
        assert reason.startswith("actor Keeper ") and reason.endswith(" is alive"), reason

        assert "SWAPPED" in _job(env, tmp_path, "serve", SERVE_NOT_ACTOR, str(free_port()))
        _hold(agent, WINDOW_S + 3)   # the app alone
        assert _alone(agent.busy_lines(0)[-1]) == "Serve application 'probe' is deployed"

        since = len(agent.lines())
        # The app deleted, then the job runs on alone past the window: still up when it ends.
        assert "DROPPED" in _job(env, tmp_path, "run", DROP_SERVE_THEN_RUN, str(WINDOW_S + 2))
        assert agent.proc.poll() is None, agent.lines()[-5:]
        busy = agent.busy_lines(since)
        assert any(re.fullmatch(r"job \S+ is running", _alone(ln)) for ln in busy
                   if "; " not in ln), busy

        # Nothing left: the window, then the decision.
        agent.proc.wait(timeout=WINDOW_S + 60)
        assert agent.proc.returncode == 0, agent.lines()[-5:]
        tail = agent.lines()
        assert "would tear local down: idle for" in tail[-1], tail[-5:]
        assert not any("probe" in ln or "Keeper" in ln
                       for ln in agent.busy_lines(len(tail) - 3)), tail[-5:]
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()


SHIPPER = """
import os, signal, sys, time

class Late:
    def ping(self):
        return 1

def last_copy(*_):
    # The first SIGTERM stands for work that arrives inside the teardown window: a detached
    # actor of a user, made while auto-stop waits for this "log shipper" to finish.
    if not os.path.exists(sys.argv[1]):
        open(sys.argv[1], "w").close()
        import ray
        ray.init()
        late = ray.remote(num_cpus=0)(Late)
        late = late.options(name="late", namespace="user", lifetime="detached").remote()
        ray.get(late.ping.remote())
    sys.exit(0)

signal.signal(signal.SIGTERM, last_copy)
print("SHIPPING", flush=True)
while True:
    time.sleep(1)
"""

KILL_LATE = """
import ray
ray.init()
ray.kill(ray.get_actor("late", namespace="user"))
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_work_inside_the_teardown_window_aborts_it_then_all_goes(
        small_cluster, moto_account, tmp_path):  # noqa: F811 (the fixture imported above)
    """The real agent, a real cluster's autoscaler, EC2 on moto: an actor made while the
    log shipper makes its last copy aborts the teardown (nothing terminated; the autoscaler
    and the shipper run again); once it is gone, the workers and then the head go."""
    ec2 = moto_account.client("ec2")
    cluster = f"rf-{os.getpid()}"
    image = ec2.describe_images()["Images"][0]["ImageId"]
    ids = {kind: ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "ray-cluster-name", "Value": cluster},
                                              {"Key": "ray-node-type", "Value": kind}]}])[
        "Instances"][0]["InstanceId"] for kind in ("head", "worker")}
    env = {**small_cluster, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
           "PYTHONUNBUFFERED": "1"}
    gcs_port = env["RAY_ADDRESS"].rsplit(":", 1)[1]
    script = tmp_path / f"shipper-{cluster}.py"
    script.write_text(SHIPPER)
    shipper_log = tmp_path / "shipper.log"
    shipper = subprocess.Popen([sys.executable, str(script), str(tmp_path / "made")], env=env,
                               stdout=open(shipper_log, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    log = tmp_path / "autostop.log"
    agent = None
    monitor = None
    try:
        deadline = time.monotonic() + 60
        while "SHIPPING" not in shipper_log.read_text():
            assert time.monotonic() < deadline and shipper.poll() is None, shipper_log.read_text()
            time.sleep(0.2)
        agent = subprocess.Popen(
            [sys.executable, str(AGENT), "--cluster-name", cluster, "--minutes",
             str(WINDOW_S / 60), "--poll-s", "0.5", "--address", env["RAY_DASHBOARD_ADDRESS"],
             "--gcs-port", gcs_port, "--stop-first", script.name],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

        def lines() -> list[str]:
            return [ln.split(" autostop: ", 1)[-1] for ln in log.read_text().splitlines()]

        deadline = time.monotonic() + 180
        while not any(ln.endswith("watching again") for ln in lines()):
            assert time.monotonic() < deadline and agent.poll() is None, lines()[-8:]
            time.sleep(0.5)
        time.sleep(2)   # the autoscaler resumed, the shipper restarted, watching again
        said = lines()
        paused = [ln for ln in said if ln.startswith("paused Ray's autoscaler (pid ")]
        assert len(paused) == 1, said
        monitor = int(paused[0].split("pid ")[1].rstrip(")"))
        aborted = next(ln for ln in said if ln.startswith("teardown aborted"))
        # The actor, and (its driver's job being a moment old) that job too.
        assert re.fullmatch(r"teardown aborted before terminating 1 worker\(s\): (job \w+ "
                            r"(is \w+|was submitted at [\d:]+ UTC); )?actor Late \(\w+, job \w+"
                            r"\) is alive; watching again", aborted), aborted
        assert not any(ln.startswith(("terminating", "terminated")) for ln in said), said
        assert f"resumed Ray's autoscaler (pid {monitor})" in said, said
        assert _state(monitor) != "T", said   # running again
        restarted = [ln for ln in said if ln.startswith("restarted ")]
        assert len(restarted) == 1, said
        again = int(restarted[0].split("pid ")[1].rstrip(")"))
        with open(f"/proc/{again}/cmdline", "rb") as f:
            assert script.name.encode() in f.read()
        live = {i["InstanceId"] for r in ec2.describe_instances(Filters=[
            {"Name": "instance-state-name", "Values": ["running"]}])["Reservations"]
            for i in r["Instances"]}
        assert set(ids.values()) <= live, live

        _job(env, tmp_path, "kill", KILL_LATE)
        agent.wait(timeout=180)
        said = lines()
        assert agent.returncode == 0, said[-8:]
        tail = said[said.index(aborted):]
        assert [ln for ln in tail if ln.startswith(("terminating", "terminated"))] == [
            f"terminating 1 worker(s): {ids['worker']}", f"terminating the head: {ids['head']}",
            f"terminated 2 instance(s): {ids['worker']} {ids['head']}"], tail
        assert _state(monitor) == "T", tail   # paused: nothing relaunched while it went
        states = {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances(
            InstanceIds=list(ids.values()))["Reservations"] for i in r["Instances"]}
        assert set(states.values()) == {"terminated"}, states
    finally:
        if monitor is not None:
            os.kill(monitor, signal.SIGCONT)   # on a real head it went with the instance
        for proc in (agent, shipper):
            if proc is not None and proc.poll() is None:
                proc.kill()
        subprocess.run(["pkill", "-f", script.name])
