"""`rayfleet env CLUSTER_YAML [--close]`: the tunnels it keeps in the background and the exports
it prints, with real processes, process groups, ports and a real `sh`.

The `ray` these tests put first on PATH is a STAND-IN, not Ray: it implements only
``ray dashboard --port L --remote-port R CLUSTER_YAML`` by listening on 127.0.0.1:L itself and
answering GET /api/version when the request carries the cluster's token (as the head's
dashboard does) -- or, as asked, exits at once with Ray's "Head node of cluster (...) not
found!" or never listens. What it proves is this command's process handling; that real
`ray dashboard` tunnels over SSM carry `ray job submit`, `serve deploy` and the openai client
is for the fake-cloud rehearsal (tests/fakecloud/test_ray_up.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rayfleet.commands import cli, cloudenv, host, render, tunnels
from tests.conftest import REPO

OUTPUTS = REPO / "cluster-configs" / "examples" / "dev-outputs.json"
CLUSTER = "rayfleet-dev"   # dev-outputs.json's cluster

STAND_IN = '''#!{python}
"""A STAND-IN for `ray dashboard` (tests/unit/test_cloudenv.py), not Ray."""
import argparse, http.server, json, os, sys, time

p = argparse.ArgumentParser()
p.add_argument("command", choices=["dashboard"])
p.add_argument("-p", "--port", type=int, required=True)
p.add_argument("--remote-port", type=int, required=True)
p.add_argument("cluster_yaml")
a = p.parse_args()
assert os.path.isfile(a.cluster_yaml), a.cluster_yaml
with open(os.path.join(os.environ["STANDIN_PIDS"], str(os.getpid())), "w") as f:
    json.dump({{"argv": sys.argv[1:], "pgid": os.getpgid(0)}}, f)
print(f"Attempting to establish dashboard locally at http://localhost:{{a.port}}/ connected "
      f"to remote port {{a.remote_port}}", flush=True)
mode = os.environ.get("STANDIN_MODE", "ok")
if mode == "notfound":
    print("Error: Failed to forward dashboard from remote port 8265 to local port 1. There "
          "are a couple possibilities: \\n 1. The remote port is incorrectly specified \\n 2. "
          "The local port 1 is already in use.\\n The exception is: Head node of cluster "
          "(rayfleet-dev) not found!", file=sys.stderr, flush=True)
    sys.exit(1)
if mode == "silent":
    time.sleep(600)
    sys.exit(0)
token = open(os.environ["STANDIN_TOKEN_FILE"]).read().strip()   # the head's copy


class Head(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == f"Bearer {{token}}"
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(json.dumps({{"ray_version": "2.60.0"}}).encode() if ok else b"")

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Head).serve_forever()
'''


def _stand_ins(pids: Path) -> dict[int, dict]:
    return {int(f.name): json.loads(f.read_text()) for f in pids.iterdir()}


def _gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not host.alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A YAML and facts `rayfleet render` wrote, its token in $RAYFLEET_HOME, the stand-in
    first on PATH, proxies that lead nowhere (the kit's probe must go straight). Yields
    (YAML, token file, the folder the stand-ins record their pids in)."""
    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path / "home"))
    bin_dir, pids = tmp_path / "bin", tmp_path / "pids"
    bin_dir.mkdir()
    pids.mkdir()
    ray = bin_dir / "ray"
    ray.write_text(STAND_IN.format(python=sys.executable))
    ray.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    yaml_path = render.render(str(OUTPUTS), out=str(tmp_path / "gen" / "dev.yaml"))
    token = Path(render.default_token_file(CLUSTER)).expanduser()
    monkeypatch.setenv("STANDIN_PIDS", str(pids))
    monkeypatch.setenv("STANDIN_TOKEN_FILE", str(token))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    for key in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")   # discard: refused at once
    for key in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(key, raising=False)
    yield yaml_path, token, pids
    for pid, seen in _stand_ins(pids).items():   # whatever a failed test left running
        if host.alive(pid) and str(ray) in Path(f"/proc/{pid}/cmdline").read_text():
            os.killpg(seen["pgid"], signal.SIGKILL)


def _exports(out: str) -> dict[str, str]:
    return dict(ln.removeprefix("export ").split("=", 1) for ln in out.splitlines()
                if ln.startswith("export "))


def _recorded() -> dict[str, tunnels.Tunnel]:
    return {t.role: t for t in tunnels.load(cloudenv.cluster_folder(CLUSTER))}


def _version(url: str, token: str) -> int:
    req = urllib.request.Request(url + "/api/version",
                                 headers={"Authorization": f"Bearer {token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=5) as r:
        return r.status


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_exports_eval_in_sh_and_carry_no_token(cluster, capsys):
    """`eval "$(rayfleet env YAML)"` in a real sh returns (the tunnels hold none of its
    pipe), and leaves a shell whose Ray variables lead through the tunnel, with the token's
    path, never the token; a RAY_AUTH_TOKEN of the shell's own is unset."""
    yaml_path, token_file, pids = cluster
    token = token_file.read_text().strip()
    script = ('eval "$("$0" -m rayfleet.commands.cli env "$1")" && printf "%s\\n" '
              '"$RAY_ADDRESS" "$RAY_API_SERVER_ADDRESS" "$RAY_DASHBOARD_ADDRESS" '
              '"$RAY_AUTH_MODE" "$RAY_AUTH_TOKEN_PATH" "${RAY_AUTH_TOKEN-unset}" '
              '"$RAYFLEET_STORAGE" "$AWS_DEFAULT_REGION" "$RAYFLEET_SERVE_URL" "$NO_PROXY" '
              '"${RAYFLEET_METRICS_URL-none}" "$RAYFLEET_PACKAGES"')
    env = {**os.environ, "RAY_AUTH_TOKEN": "the-shells-own"}
    done = subprocess.run(["sh", "-c", script, sys.executable, str(yaml_path)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    (address, api, dash, mode, token_path, stray, storage, region, serve, no_proxy,
     metrics, packages) = done.stdout.splitlines()
    rec = _recorded()
    assert address == api == dash == f"http://127.0.0.1:{rec['dashboard'].local_port}"
    assert serve == f"http://127.0.0.1:{rec['serve'].local_port}" != address
    assert (mode, token_path, stray, metrics) == ("token", str(token_file), "unset", "none")
    assert storage == "s3://rayfleet-dev-20250601000000000000000001/rayfleet/runs"
    assert packages == "s3://rayfleet-dev-20250601000000000000000001/rayfleet/packages"
    assert region == "us-east-1" and "127.0.0.1" in no_proxy.split(",")
    assert _version(address, token) == 200
    assert {r: (t.remote_port) for r, t in rec.items()} == {"dashboard": 8265, "serve": 8000}
    argv = sorted(s["argv"] for s in _stand_ins(pids).values())
    assert argv == sorted(["dashboard", "--port", str(t.local_port), "--remote-port",
                           str(t.remote_port), str(yaml_path.absolute())]
                          for t in rec.values())
    assert stat_mode(cloudenv.cluster_folder(CLUSTER) / tunnels.STATE_FILE) == 0o600
    assert done.stderr.strip().splitlines()[-1] == (
        "# Serve's apps: $RAYFLEET_SERVE_URL (the openai client: base_url=$RAYFLEET_SERVE_URL"
        f"/v1). Close the tunnels: rayfleet env {yaml_path} --close")
    logs = "".join(Path(t.log).read_text() for t in rec.values())
    assert token not in done.stdout + done.stderr + logs
    # Not this process's children: --close finds them by pid and start ticks alone.
    assert cli.main(["env", str(yaml_path), "--close"]) == 0
    assert all(_gone(t.pid) for t in rec.values())
    assert not (cloudenv.cluster_folder(CLUSTER) / tunnels.STATE_FILE).exists()
    assert token not in "".join(capsys.readouterr())


def test_a_second_call_reuses_the_tunnels_and_replaces_a_dead_one(cluster, capsys):
    yaml_path, token_file, _ = cluster
    assert cli.main(["env", str(yaml_path)]) == 0
    first_out = _exports(capsys.readouterr().out)
    first = _recorded()
    assert cli.main(["env", str(yaml_path)]) == 0
    out, err = capsys.readouterr()
    assert _exports(out) == first_out and _recorded() == first   # the same pids and ports
    assert "still open" in err and "opening" not in err
    os.killpg(first["serve"].pid, signal.SIGKILL)   # the serve tunnel dies
    assert _gone(first["serve"].pid)
    assert cli.main(["env", str(yaml_path)]) == 0
    out, err = capsys.readouterr()
    now = _recorded()
    assert now["dashboard"] == first["dashboard"]
    assert now["serve"].pid != first["serve"].pid and now["serve"].ours()
    assert _exports(out)["RAYFLEET_SERVE_URL"] == now["serve"].url
    assert "the serve tunnel of 127.0.0.1:" in err and "no longer answers" in err
    assert cli.main(["env", str(yaml_path), "--close"]) == 0
    assert all(_gone(t.pid) for t in now.values())


def test_close_stops_only_what_it_started_and_never_a_reused_pid(cluster, capsys):
    """A recorded pid that now names another process (its start ticks differ) is forgotten,
    never signalled, as `rayfleet local down` treats its head's; then nothing is recorded and
    a second --close says so in one line, exit 0."""
    yaml_path, _, _ = cluster
    assert cli.main(["env", str(yaml_path)]) == 0
    rec = _recorded()
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        reused = tunnels.Tunnel("metrics", stranger.pid, host.start_ticks(stranger.pid) - 100,
                                1, 9090, "x")
        tunnels.save(cloudenv.cluster_folder(CLUSTER), yaml_path, [*rec.values(), reused])
        capsys.readouterr()
        assert cli.main(["env", str(yaml_path), "--close"]) == 0
        err = capsys.readouterr().err
        assert f"forgot (pid {stranger.pid} is another process's now; not signalled)" in err
        assert stranger.poll() is None
        assert all(_gone(t.pid) for t in rec.values())
        assert cli.main(["env", str(yaml_path), "--close"]) == 0
        assert capsys.readouterr().err == \
            f"rayfleet: no tunnels recorded for cluster {CLUSTER} (nothing to stop)\n"
    finally:
        stranger.kill()
        stranger.wait()


def _no_facts_no_token(yaml_path: Path, token: Path, monkeypatch) -> list[str]:
    (yaml_path.parent / "dev.rayfleet.json").unlink()
    token.unlink()
    return ["there is no token at", "run `rayfleet render` for this cluster"]


def _other_token(yaml_path: Path, token: Path, monkeypatch) -> list[str]:
    other = token.with_name("the-heads-token")   # the head was started with another token
    other.write_text("another-token")
    monkeypatch.setenv("STANDIN_TOKEN_FILE", str(other))
    return ["refused the cluster's token (401)", str(token)]


@pytest.mark.parametrize("case, mode, extra, setup, expected", [
    ("missing YAML", "ok", [], None, ["nope.yaml: no such file"]),
    ("no facts, no token", "ok", [], _no_facts_no_token, []),
    ("cluster not up", "notfound", [], None,
     ["exited (1) before its tunnel answered: The exception is: Head node of cluster "
      "(rayfleet-dev) not found!", "is cluster rayfleet-dev up?"]),
    ("tunnel never answers", "silent", ["--timeout", "1"], None,
     ["did not answer within 1 s", "--timeout to wait longer"]),
    ("token refused", "ok", [], _other_token, []),
])
def test_every_failure_is_one_line_exit_2_and_leaves_nothing_running(
        cluster, capsys, monkeypatch, case, mode, extra, setup, expected):
    yaml_path, token_file, pids = cluster
    token = token_file.read_text().strip()
    monkeypatch.setenv("STANDIN_MODE", mode)
    expected = expected + (setup(yaml_path, token_file, monkeypatch) if setup else [])
    path = yaml_path.with_name("nope.yaml") if case == "missing YAML" else yaml_path
    assert cli.main(["env", str(path), *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and token not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rayfleet: error: ") and all(e in last for e in expected), err
    assert [ln for ln in err.splitlines() if not ln.startswith("rayfleet: ")] == [], err
    assert all(_gone(pid, 1.0) for pid in _stand_ins(pids)), _stand_ins(pids)
    assert _recorded() == {}
    logs = list(cloudenv.cluster_folder(CLUSTER).glob("tunnel-*.log"))
    assert all(token not in f.read_text() for f in logs)


def test_fish_form_and_the_metrics_tunnel(cluster, tmp_path, capsys):
    """A YAML rendered with --metrics gets a third tunnel, to the head's Prometheus (its port
    read from the head's start commands render wrote); fish gets fish's words."""
    _, token_file, _ = cluster
    yaml_path = render.render(str(OUTPUTS), out=str(tmp_path / "gen" / "dev.yaml"),
                              metrics=True)
    assert cloudenv.target(str(yaml_path)).remote == {"dashboard": 8265, "serve": 8000,
                                                      "metrics": 9090}
    assert cli.main(["env", str(yaml_path), "--shell", "fish"]) == 0
    out = capsys.readouterr().out
    rec = _recorded()
    assert out.splitlines()[0] == f"set -gx RAY_ADDRESS {rec['dashboard'].url};"
    assert all(ln.startswith("set -gx ") and ln.endswith(";") for ln in out.splitlines())
    assert f"set -gx RAYFLEET_METRICS_URL {rec['metrics'].url};" in out.splitlines()
    assert f"set -gx RAY_AUTH_TOKEN_PATH {token_file};" in out.splitlines()
    assert cli.main(["env", str(yaml_path), "--close"]) == 0
    assert all(_gone(t.pid) for t in rec.values())


def test_export_lines_quote_for_each_shell(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x")
    env = {"A": "/home/a b/auth_token", "B": "it's"}
    assert cloudenv.export_lines(env) == ["unset RAY_AUTH_TOKEN",
                                          "export A='/home/a b/auth_token'",
                                          "export B='it'\"'\"'s'"]
    assert cloudenv.export_lines(env, "fish") == ["set -e RAY_AUTH_TOKEN;",
                                                  "set -gx A '/home/a b/auth_token';",
                                                  "set -gx B 'it\\'s';"]


def test_rayfleet_help_does_not_import_ray():
    code = ("import sys\nfrom rayfleet.commands import cli\ntry:\n    cli.main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('ray' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_close_cancels_the_forward_a_shared_ssh_connection_holds():
    """Ray's ssh shares one connection per cluster (ControlMaster=auto): the master holds every
    tunnel's -L and outlives the tunnel's own ssh, so --close cancels the forward itself, with
    the tunnel's own options and destination and without its remote command (the argv is
    `ray dashboard`'s, as the rehearsal's tunnel log shows it)."""
    argv = ["ssh", "-tt", "-L", "30657:localhost:8265", "-i", "~/.ssh/k.pem", "-o",
            "StrictHostKeyChecking=no", "-o", "ControlMaster=auto", "-o",
            "ControlPath=/tmp/ray_ssh_4813494d13/8e8cb4f833/%C", "-o", "ControlPersist=10s",
            "-o", "ProxyCommand=aws ssm start-session --target %h", "ubuntu@i-b25de983887877f8e",
            "while true; do sleep 86400; done"]
    assert tunnels.cancel_command(argv) == [
        "ssh", "-O", "cancel", "-L", "30657:localhost:8265", "-i", "~/.ssh/k.pem", "-o",
        "StrictHostKeyChecking=no", "-o", "ControlMaster=auto", "-o",
        "ControlPath=/tmp/ray_ssh_4813494d13/8e8cb4f833/%C", "-o", "ControlPersist=10s",
        "-o", "ProxyCommand=aws ssm start-session --target %h", "ubuntu@i-b25de983887877f8e"]
    # No shared connection, or no forward: nothing to cancel.
    assert tunnels.cancel_command(["ssh", "-tt", "-L", "1:localhost:2", "h", "cmd"]) is None
    assert tunnels.cancel_command(["ssh", "-o", "ControlPath=/x/%C", "h", "cmd"]) is None
