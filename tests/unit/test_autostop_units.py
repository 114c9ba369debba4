"""Auto-stop's decision logic without a cluster: the idle window against a clock, and the list
of Ray's own detached actors kept equal to what the installed Ray creates. (Against a real
cluster: tests/cluster/test_autostop.py; the teardown against moto: tests/moto/test_autostop.py.)"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from tests.moto.pulumi_moto import load_agent

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def autostop():
    return load_agent("autostop")


def test_every_detached_actor_namespace_of_rays_libraries_is_known(autostop):
    """Ray Data, Train, Serve and Serve LLM leave detached actors behind after a job or an app;
    each of their namespaces must be in INTERNAL_NAMESPACES, or an idle cluster would never
    stop (found twice: Ray Data's DataUsageCollectionActor, and Serve LLM's TelemetryAgent after
    the llm app was deleted, kept the rehearsal's cluster up)."""
    import ray

    root = pathlib.Path(ray.__file__).parent
    sources = [f for pkg in ("data", "train", "serve", "llm") for f in (root / pkg).rglob("*.py")
               if "tests" not in f.parts]
    constants = {}
    for f in root.rglob("*.py"):
        for name, value in re.findall(r'^(\w*NAMESPACE\w*)\s*=\s*"([^"]+)"', f.read_text(),
                                      re.M):
            constants.setdefault(name, value)
    used = set()
    for f in sources:
        text = f.read_text()
        if 'lifetime="detached"' in text:
            for ref in re.findall(r'namespace=("[^"]+"|\w+)', text):
                if ref == "actor_namespace":   # built per app: "serve::<app>::<deployment>"
                    assert '[SERVE_NAMESPACE]' in text and '"::".join' in text, f
                    used.add("serve::")
                    continue
                used.add(ref.strip('"') if ref.startswith('"') else constants[ref])
    known = autostop.INTERNAL_NAMESPACES | set(autostop.INTERNAL_NAMESPACE_PREFIXES)
    assert used and used <= known, used - known
    assert {"llm_serve_telemetry", "serve::"} <= used




def _watch(autostop, monkeypatch, looks: list[list[str]]) -> tuple[float, str, list[str]]:
    """watch() against a clock that starts at 1000 and moves only when it sleeps, Ray's
    state given look by look: (the time it decided, its reason, what it said)."""
    looks = iter(looks)
    monkeypatch.setattr(autostop, "busy_reasons", lambda ray, now, window: next(looks))
    t = [1000.0]
    said: list[str] = []
    reason = autostop.watch(None, minutes=1, poll_s=30, clock=lambda: t[0],
                            sleep=lambda s: t.__setitem__(0, t[0] + s), out=said.append)
    return t[0], reason, said


def test_an_idle_cluster_is_counted_from_the_watchers_start(autostop, monkeypatch):
    # Idle at every look from the first: not stopped at once (nothing is known of before the
    # start), but at the first look a whole window after it.
    t, reason, said = _watch(autostop, monkeypatch, [[], [], [], [], []])
    assert t == 1000 + 60 and reason.startswith("idle for 1.0 min"), (t, reason)
    assert said == [], said   # nothing busy was ever seen: no line until the decision


def test_the_window_restarts_on_every_busy_look(autostop, monkeypatch):
    t, reason, said = _watch(autostop, monkeypatch, [
        ["job a is running"], [], ["actor K is alive"], [], [], [], []])
    # Looks every 30 s: busy at 1000, idle at 1030, busy again at 1060 (the window restarts),
    # idle from then on: the decision at the first look 60 s after the last busy one.
    assert t == 1060 + 60 and reason.startswith("idle for 1.0 min"), (t, reason)
    assert said[0] == "busy: job a is running" and said[-1].startswith("idle since")


def test_an_unreadable_state_is_never_idle_is_said_every_window_and_disarms(autostop,
                                                                           monkeypatch):
    def broken(*_):
        raise OSError("connection refused")

    monkeypatch.setattr(autostop, "busy_reasons", broken)
    t = [0.0]
    said, alerts = [], []
    # A 1-min window, looks every 30 s, disarmed after 5 min of nothing but unreadable looks.
    with pytest.raises(autostop.Unreadable, match=r"unreadable for 5 min \(OSError: conn"):
        autostop.watch(None, minutes=1, poll_s=30, clock=lambda: t[0],
                       sleep=lambda s: t.__setitem__(0, t[0] + s), out=said.append,
                       alert=lambda line: alerts.append((t[0], line)), unreadable_limit_s=300)
    assert t[0] == 300, t   # never taken for idle before: the window passed five times
    assert [at for at, _ in alerts] == [0, 60, 120, 180, 240], alerts   # once per window
    assert alerts[0][1] == ("busy: Ray's state unreadable (OSError: connection refused); "
                            "counted as busy, disarming after 5 min of it"), alerts
    assert said == [], said


def test_a_readable_look_resets_the_unreadable_clock(autostop, monkeypatch):
    looks = iter([OSError("down")] * 9 + [["job a is running"]] + [OSError("down")] * 9 + [[]] * 9)

    def look(*_):
        item = next(looks)
        if isinstance(item, Exception):
            raise item
        return item

    monkeypatch.setattr(autostop, "busy_reasons", look)
    t = [0.0]
    reason = autostop.watch(None, minutes=1, poll_s=30, clock=lambda: t[0],
                            sleep=lambda s: t.__setitem__(0, t[0] + s), out=lambda _: None,
                            alert=lambda _: None, unreadable_limit_s=300)
    # 270 s unreadable, one busy look, 270 s unreadable again: never 300 s in a row.
    assert reason.startswith("idle for 1.0 min") and t[0] == 18 * 30 + 60, (t, reason)


def test_teardown_checks_before_each_step_and_aborts_when_busy(autostop, monkeypatch):
    """A job that arrives after the workers went keeps the head: Busy, nothing more."""
    terminated, steps = [], []
    fleet = {"i-w1": False, "i-head": True}
    monkeypatch.setattr(autostop, "cluster_instances", lambda ec2, c: [
        {"InstanceId": i, "head": h} for i, h in fleet.items() if i not in terminated])
    monkeypatch.setattr(autostop, "is_head", lambda i: i["head"])

    class EC2:
        def terminate_instances(self, InstanceIds):
            terminated.extend(InstanceIds)

    def check(step):
        steps.append(step)
        if step == "terminating the head":
            raise autostop.Busy(f"before {step}: job late is running")

    with pytest.raises(autostop.Busy, match="before terminating the head: job late"):
        autostop.teardown(EC2(), "c", check, wait_s=5, poll_s=0)
    assert terminated == ["i-w1"] and steps == ["terminating 1 worker(s)",
                                                "terminating the head"], (terminated, steps)


@pytest.mark.parametrize("argv,message", [
    (["--cluster-name", "c", "--minutes", "-5"], "--minutes: must be more than 0, got -5"),
    (["--cluster-name", "c", "--minutes", "5", "--storage", "gs://b"],
     "--storage: must be s3://BUCKET[/PREFIX], got 'gs://b'"),
    (["--cluster-name", "c", "--minutes", "5", "--poll-s", "0"],
     "--poll-s: must be more than 0, got 0"),
    (["--cluster-name", "c", "--minutes", "5", "--unreadable-limit-minutes", "0"],
     "--unreadable-limit-minutes: must be more than 0, got 0"),
    (["--cluster-name", "c", "--minutes", "5", "--gcs-port", "70000"],
     "--gcs-port: must be a port (1-65535), got 70000"),
])
def test_bad_settings_are_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-I", str(REPO / "rayfleet" / "agents" /
                                                    "autostop.py"), "--gcs-port", "1", *argv,
                           "--address", "http://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == f"autostop.py: error: {message}", \
        proc.stderr


@pytest.mark.parametrize("minutes, poll", [("60", 30.0), ("3", 30.0), ("1", 10.0),
                                           ("0.1", 1.0)])
def test_it_looks_every_sixth_of_a_short_window_and_at_most_every_30_s(autostop, minutes, poll):
    args = autostop.parse_args(["--cluster-name", "c", "--minutes", minutes, "--gcs-port", "1",
                                "--address", "http://127.0.0.1:1"])
    assert args.poll_s == pytest.approx(poll)
    assert autostop.parse_args(["--cluster-name", "c", "--minutes", "1", "--poll-s", "2",
                                "--gcs-port", "1", "--address", "x"]).poll_s == 2


def test_a_stopped_shipper_not_yet_reaped_counts_as_gone(autostop, tmp_path):
    """stop_first waits for the log shipper to exit. One that exited but is not reaped yet (a
    zombie: the shipper auto-stop restarted is its own child) is gone: no wait for the timeout
    (each such teardown once waited its full 60 s)."""
    marker = f"shipper-{tmp_path.name}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
    try:
        t0 = time.monotonic()
        saved = autostop.stop_first(marker, timeout_s=30)
        assert time.monotonic() - t0 < 10
        assert [argv[-1] for argv, *_ in saved] == [marker]
        with pytest.raises(ChildProcessError):   # reaped by stop_first
            os.waitpid(child.pid, os.WNOHANG)
    finally:
        child.kill()
