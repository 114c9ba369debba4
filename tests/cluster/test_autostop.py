"""Auto-stop's idleness decision against a real local cluster: the agent (rayfleet/agents/
autostop.py, run as the head runs it, with --dry-run: there is no EC2 here) stays put while a
job runs, while a detached actor of a user lives, and while a Serve application is deployed,
each of them alone for longer than its window; once none is left for its window it decides
to tear the cluster down. The teardown itself is tested against moto
(tests/moto/test_autostop.py) and, end to end, in the fake-cloud rehearsal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import BIN, REPO, free_port, run

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


@pytest.fixture
def small_cluster(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAYFLEET_HOME"] = str(tmp_path / "home")
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
             "--address", env["RAY_DASHBOARD_ADDRESS"]],
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
