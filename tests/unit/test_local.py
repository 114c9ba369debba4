"""`rayfleet local` without a cluster: token file, sizes, ports, one-line errors."""

import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rayfleet.commands import host, local, localhead, localredis, localstate
from rayfleet.errors import ClusterError, ConfigError

RAYFLEET = [sys.executable, "-m", "rayfleet.commands.cli"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLEET_HOME", str(tmp_path / "state"))
    yield tmp_path / "state"
    if localstate.ray_temp_dir().is_dir() and not localstate.ray_temp_dir().is_symlink():
        shutil.rmtree(localstate.ray_temp_dir())   # `up` made it in the shared /tmp


def test_rays_folder_in_the_shared_tmp_is_this_users_own(home, tmp_path):
    """Its name is predictable: a link planted there, or another user's folder, is refused in
    one line; this user's own, left open by an older run, is tightened to 0700."""
    folder = localstate.ray_temp_dir()
    folder.symlink_to(tmp_path)
    try:
        with pytest.raises(ClusterError, match="is a link or another user's"):
            localstate.own_ray_temp_dir()
    finally:
        folder.unlink()
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    os.chown(folder, 65534, 65534)   # nobody's
    try:
        with pytest.raises(ClusterError, match="is a link or another user's"):
            localstate.own_ray_temp_dir()
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755   # not chmodded: not ours
        os.chown(folder, os.geteuid(), os.getegid())
        assert localstate.own_ray_temp_dir() == folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(folder)


def test_token_is_created_once_with_mode_0600(home):
    path = localstate.ensure_token()
    first = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) == 64
    assert localstate.ensure_token().read_text() == first  # generated once, then reused


def test_token_with_loose_mode_is_tightened(home):
    path = localstate.ensure_token()
    os.chmod(path, 0o644)
    localstate.ensure_token()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("text,expected", [("2GB", 2_000_000_000), ("512MiB", 512 * 2**20),
                                           ("1000000", 1_000_000), ("1.5gib", int(1.5 * 2**30))])
def test_parse_size(text, expected):
    assert local.parse_size(text) == expected


def test_bad_size_names_the_flag():
    with pytest.raises(ConfigError, match="--object-store-memory"):
        local.parse_size("lots")


def test_up_refuses_a_taken_port_without_starting_anything(home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ClusterError, match=f"port {port} \\(GCS\\) is already in use"):
            local.up(port=port, dashboard_port=host.free_port(), quiet=True)
    assert localstate.load_state() is None


def test_up_refuses_tiny_object_store(home):
    with pytest.raises(ConfigError, match="minimum"):
        local.up(object_store_memory="10MB", quiet=True)


@pytest.mark.parametrize("args,needle", [
    (["local", "up", "--num-cpus", "0"], "--num-cpus: must be at least 1"),
    (["local", "env"], "no rayfleet local cluster is running"),
    (["local", "status"], "no rayfleet local cluster is running"),
])
def test_cli_errors_are_one_line_exit_2(home, args, needle):
    proc = subprocess.run(RAYFLEET + args, capture_output=True, text=True,
                          env={**os.environ, "RAYFLEET_HOME": str(home)})
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_haproxy_sockets_fit_haproxys_limit_under_a_long_temp_folder(home, monkeypatch):
    """Beside Ray's folder when that is short enough for HAProxy's socket paths (Ray adds the
    node id's 56 characters); under /tmp when TMPDIR is too long for them."""
    from rayfleet.agents.haproxy_guard import MAX_SOCKET_PATH

    for tmpdir, base in (("/var/t", "/var/t"), ("/tmp/" + "x" * 30, "/tmp")):
        monkeypatch.setattr(localstate, "ray_temp_dir",
                            lambda t=tmpdir: Path(t) / "rayfleet-0a1b2c3d4e")
        folder = localstate.haproxy_folder()
        assert str(folder.parent) == base and folder.name == "rfhap-0a1b2c3d4e", folder
        assert len(f"{folder}/{'0' * 56}/metrics.sock") <= MAX_SOCKET_PATH


def test_up_refuses_a_planted_haproxy_folder_in_one_line(home, tmp_path):
    """HAProxy's sockets go to a folder in the shared /tmp: one this user cannot make afresh
    (here a link another user could have planted) stops `up` before Ray starts, in one line,
    and what the link points at is left as it was."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    folder = localstate.haproxy_folder()
    folder.symlink_to(target)
    try:
        proc = subprocess.run(RAYFLEET + ["local", "up", "--port", str(host.free_port()),
                                          "--dashboard-port", str(host.free_port())],
                              capture_output=True, text=True,
                              env={**os.environ, "RAYFLEET_HOME": str(home)}, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"cannot make HAProxy's folder {folder}" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert localstate.load_state() is None and (target / "keep").read_text() == "x"
        assert folder.is_symlink()
    finally:
        folder.unlink()


def test_down_without_cluster_is_harmless(home, capsys):
    assert local.down() is False
    assert "nothing to stop" in capsys.readouterr().out


def test_up_starts_the_kits_ray_start(home, monkeypatch):
    """`up` runs raystart's command line: the dashboard on loopback, usage stats off, the
    node's metrics on facts' local port, the rest of Ray's ports left to Ray."""
    from rayfleet import raystart
    from rayfleet.facts import LOCAL_METRICS_EXPORT_PORT

    started = []

    class Started(Exception):
        pass

    def popen(cmd, **kwargs):
        started.append(cmd)
        raise Started

    monkeypatch.setattr(local, "check_node_env", lambda python: sys.executable)
    monkeypatch.setattr(localhead, "_pick", lambda default: default)
    monkeypatch.setattr(subprocess, "Popen", popen)
    gcs, dashboard = host.free_port(), host.free_port()
    with pytest.raises(Started):
        local.up(port=gcs, dashboard_port=dashboard, num_cpus=2, quiet=True, ingress="python")
    (cmd,) = started
    assert cmd == raystart.argv(
        localhead._ray_bin(sys.executable), head=True, block=True, usage_stats=False,
        ports={"gcs": gcs, "dashboard": dashboard, "client": localhead.DEFAULT_CLIENT_PORT,
               "dashboard-agent-http": localhead.DEFAULT_AGENT_PORT,
               "metrics-export": LOCAL_METRICS_EXPORT_PORT},
        node_ip_address="127.0.0.1", temp_dir=str(localstate.ray_temp_dir()), num_cpus=2)
    assert "--dashboard-host=127.0.0.1" in cmd and "--disable-usage-stats" in cmd
    assert f"--metrics-export-port={LOCAL_METRICS_EXPORT_PORT}" in cmd


def test_up_ha_without_redis_fails_in_one_line_before_starting_anything(home, monkeypatch):
    """`--ha` on a machine without redis-server: one line saying how to install it; no Redis,
    no head, no state."""
    from rayfleet import gcsft

    monkeypatch.setattr(gcsft, "redis_binary", lambda: None)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(ClusterError) as e:
        local.up(port=host.free_port(), dashboard_port=host.free_port(), quiet=True, ha=True)
    assert "apt-get install redis-server" in str(e.value) and "\n" not in str(e.value)
    assert localstate.load_state() is None and not (home / "local" / "redis").exists()


def test_up_ha_runs_ray_start_under_the_supervisor(home, monkeypatch):
    """With --ha the head's `ray start` (raystart's, without --block: that would kill the head
    when gcs_server dies) runs under the kit's supervisor; its environment names the Redis and
    the reconnect timeout, and neither the command line nor the environment holds the
    password (the supervisor reads it from the 0600 file)."""
    from rayfleet import gcsft
    from rayfleet.facts import LOCAL_METRICS_EXPORT_PORT

    started = []

    class Started(Exception):
        pass

    def popen(cmd, **kwargs):
        started.append((cmd, kwargs["env"],
                        (home / "local" / "redis" / gcsft.PASSWORD_FILE).read_text()))
        raise Started

    def start_redis(binary):
        folder = gcsft.make_folder(localredis.redis_folder())
        gcsft.write_config(folder, 7777)
        return None, 7777

    monkeypatch.setattr(local, "check_node_env", lambda python: sys.executable)
    monkeypatch.setattr(localhead, "_pick", lambda default: default)
    monkeypatch.setattr(localhead, "start_redis", start_redis)
    # Redis itself is stood in for above: on a fresh machine it need not be installed yet.
    monkeypatch.setattr(gcsft, "redis_binary", lambda: f"/usr/bin/{gcsft.REDIS_BINARY}")
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("RAY_REDIS_ADDRESS", "10.0.0.9:6379")  # a stray one is not used
    gcs, dashboard = host.free_port(), host.free_port()
    with pytest.raises(Started):
        local.up(port=gcs, dashboard_port=dashboard, quiet=True, ingress="python", ha=True)
    ((cmd, env, password),) = started
    # The head did not start: the Redis folder (password and all) is gone again.
    assert not (home / "local" / "redis").exists()
    split = cmd.index("--")
    assert cmd[:2] == [sys.executable, str(localstate.agent(gcsft.SUPERVISOR_NAME))]
    assert cmd[split + 1:] == local.raystart.argv(
        localhead._ray_bin(sys.executable), head=True, block=False, usage_stats=False,
        ports={"gcs": gcs, "dashboard": dashboard, "client": localhead.DEFAULT_CLIENT_PORT,
               "dashboard-agent-http": localhead.DEFAULT_AGENT_PORT,
               "metrics-export": LOCAL_METRICS_EXPORT_PORT},
        node_ip_address="127.0.0.1", temp_dir=str(localstate.ray_temp_dir()))
    assert env[gcsft.REDIS_ADDRESS_ENV] == "127.0.0.1:7777"
    assert env[gcsft.RECONNECT_TIMEOUT_ENV] == str(gcsft.RECONNECT_TIMEOUT_S)
    assert not any(password in a for a in cmd) and password not in "".join(env.values())


def test_redis_config_is_loopback_and_password_only(tmp_path):
    """The local Redis: 127.0.0.1 and protected mode, a fresh random password; the folder
    0700, the password and the config holding it 0600."""
    from rayfleet import gcsft

    folder = gcsft.make_folder(tmp_path / "redis")
    config = gcsft.write_config(folder, 7777)
    password = (folder / gcsft.PASSWORD_FILE).read_text()
    lines = config.read_text().splitlines()
    assert "bind 127.0.0.1" in lines and "protected-mode yes" in lines and "port 7777" in lines
    assert f"requirepass {password}" in lines and len(password) == 64
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for f in (config, folder / gcsft.PASSWORD_FILE):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    again = gcsft.make_folder(tmp_path / "redis")  # a previous cluster's files are gone
    assert not any(again.iterdir())


FAKE_RAY_START = """
import os, shutil, subprocess, sys
out = sys.argv[1]
open(os.path.join(out, "start-argv"), "w").write("\\n".join(sys.argv))
# A process whose name is gcs_server (a copy of sleep), left running in the group as Ray's is.
binary = os.path.join(out, "gcs_server")
shutil.copy(shutil.which("sleep"), binary)
subprocess.Popen([binary, "600"], stdout=open(os.path.join(out, "gcs.out"), "ab"),
                 stderr=open(os.path.join(out, "gcs.err"), "ab"))
"""


def test_gcs_supervisor_starts_the_gcs_again_then_gives_up_on_a_crash_loop(tmp_path):
    """The head's supervisor (rayfleet/agents/gcs_supervisor.py), over a stand-in for `ray
    start` that leaves a process named gcs_server behind: the password reaches `ray start`
    from the file and is not on the supervisor's own command line; a killed gcs_server is
    started again with the same command line, in the head's process group; after
    MAX_RESTARTS exits in a row, each soon after its start, it stops the head and exits 1."""
    import json
    import signal
    import time

    from rayfleet.agents import gcs_supervisor as sup

    (tmp_path / "start.py").write_text(FAKE_RAY_START)
    password = tmp_path / "password"
    password.write_text("s3cret-pw")
    status = tmp_path / "status.json"
    proc = subprocess.Popen(
        [sys.executable, str(localstate.agent("gcs_supervisor")), "--password-file", str(password),
         "--status", str(status), "--grace-s", "3", "--", sys.executable,
         str(tmp_path / "start.py"), str(tmp_path)], start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait(what, fn, timeout=30):
        end = time.time() + timeout
        while time.time() < end:
            try:
                got = fn()
            except (OSError, ValueError, KeyError, IndexError):
                got = None
            if got:
                return got
            time.sleep(0.1)
        proc.kill()
        raise AssertionError(f"timed out waiting for {what}: {proc.stdout.read()}")

    try:
        gcs = wait("the supervisor to watch gcs_server",
                   lambda: json.loads(status.read_text())["gcs_pid"])
        # What a cloud head's start runs after it (rayfleet render, rayfleet:headHa).
        waited = subprocess.run([sys.executable, str(localstate.agent("gcs_supervisor")),
                                 "--status", str(status), "--wait", "10"],
                                capture_output=True, text=True, timeout=30)
        assert (waited.returncode, waited.stdout) == (0, f"gcs_supervisor: supervising "
                                                         f"gcs_server (pid {gcs})\n")
        argv = (tmp_path / "start-argv").read_text().splitlines()
        assert argv[-1] == "--redis-password=s3cret-pw"
        assert b"s3cret-pw" not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
        cmdline = open(f"/proc/{gcs}/cmdline", "rb").read()
        for i in range(sup.MAX_RESTARTS):
            os.kill(gcs, signal.SIGKILL)
            restarts = wait(f"restart {i + 1}", lambda n=i + 1: (
                r := json.loads(status.read_text())["restarts"]) and len(r) == n and r)
            assert restarts[-1]["old_pid"] == gcs and restarts[-1]["exit"] == "signal 9"
            gcs = restarts[-1]["new_pid"]
            assert open(f"/proc/{gcs}/cmdline", "rb").read() == cmdline
            assert os.getpgid(gcs) == proc.pid
        os.kill(gcs, signal.SIGKILL)  # one exit too many within the window
        assert proc.wait(timeout=30) == 1
        out = proc.stdout.read()
        assert "not starting it again; stopping the head" in out and "s3cret-pw" not in out
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # nothing of the head's group is left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("start,expected", [
    ("import sys; sys.exit(3)", "`ray start` exited 3: the head did not start"),
    (None, "no supervised gcs_server after 2 s"),
])
def test_gcs_supervisor_wait_fails_in_one_line(tmp_path, start, expected):
    """`--wait` (a cloud head's start, after launching the supervisor detached): a `ray start`
    that fails, or a supervisor that never wrote its status, is one line and exit 1."""
    status = tmp_path / "status.json"
    if start is not None:
        (tmp_path / "password").write_text("pw")
        sup = subprocess.run(
            [sys.executable, str(localstate.agent("gcs_supervisor")), "--password-file",
             str(tmp_path / "password"), "--status", str(status), "--grace-s", "1", "--",
             sys.executable, "-c", start], capture_output=True, text=True, timeout=60,
            start_new_session=True)   # it stops its own process group on the way out
        assert sup.returncode == 3
    waited = subprocess.run([sys.executable, str(localstate.agent("gcs_supervisor")), "--status",
                             str(status), "--wait", "2"], capture_output=True, text=True,
                            timeout=30)
    assert waited.returncode == 1 and waited.stdout == ""
    assert expected in waited.stderr and waited.stderr.count("\n") == 1, waited.stderr


def test_gcs_supervisor_starts_a_failed_head_again(tmp_path):
    """A `ray start` that fails once (Ray's raylet gives its dashboard agent a fixed 15 s,
    which a busy node misses) is stopped and run again; the head then comes up supervised."""
    import json
    import signal

    # The failed first try leaves a process in the group, as a half-started raylet would:
    # its pid goes to a file, and the supervisor must stop it before it tries again.
    (tmp_path / "start.py").write_text(
        "import os, subprocess, sys\n"
        "tries = os.path.join(sys.argv[1], 'tries')\n"
        "open(tries, 'a').write('x')\n"
        "if len(open(tries).read()) == 1:\n"
        "    left = subprocess.Popen(['sleep', '300'])\n"
        "    open(os.path.join(sys.argv[1], 'left'), 'w').write(str(left.pid))\n"
        "    sys.exit(1)\n" + FAKE_RAY_START)
    (tmp_path / "password").write_text("pw")
    status = tmp_path / "status.json"
    proc = subprocess.Popen(
        [sys.executable, str(localstate.agent("gcs_supervisor")), "--password-file",
         str(tmp_path / "password"), "--status", str(status), "--grace-s", "3", "--",
         sys.executable, str(tmp_path / "start.py"), str(tmp_path)], start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        waited = subprocess.run([sys.executable, str(localstate.agent("gcs_supervisor")),
                                 "--status", str(status), "--wait", "60"],
                                capture_output=True, text=True, timeout=90)
        assert waited.returncode == 0, waited.stderr
        assert (tmp_path / "tries").read_text() == "xx"
        assert json.loads(status.read_text())["gcs_pid"]
        left = int((tmp_path / "left").read_text())   # what the failed try left is stopped
        assert not Path(f"/proc/{left}").exists() or \
            Path(f"/proc/{left}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", left
        assert "exit" not in json.loads(status.read_text())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
    assert "`ray start` exited 1 (attempt 1 of 3)" in out, out


@pytest.mark.parametrize("recorded", ["ticks", "older-state"])
def test_a_state_file_naming_a_reused_pid_is_forgotten_and_nothing_is_signalled(
        home, capsys, recorded):
    """cluster.json outlived its cluster (a reboot, a SIGKILL) and its pid now names an
    unrelated process group leader: `down` forgets the file in one line and signals nothing,
    whether the file records the head's start ticks or (an older kit's) only its start time."""
    import json
    import time

    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        state = {"pid": stranger.pid, "gcs_port": 1, "dashboard_port": 2, "client_port": 3,
                 "agent_port": 4, "num_cpus": None, "num_gpus": None,
                 "object_store_memory": None, "log": "x", "started_at": time.time() - 3600}
        if recorded == "ticks":   # the head's own start: an hour before this process's
            state["pid_start"] = host.start_ticks(stranger.pid) - 3600 * os.sysconf(
                "SC_CLK_TCK")
        localstate._state_file().parent.mkdir(parents=True, exist_ok=True)
        localstate._state_file().write_text(json.dumps(state))
        assert local.down() is False
        out = capsys.readouterr()
        assert f"its head (pid {stranger.pid}) is gone and the pid is another process's" \
            in out.err and len(out.err.strip().splitlines()) == 1, out
        assert "nothing to stop" in out.out, out
        assert stranger.poll() is None   # not signalled
        assert not localstate._state_file().exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_state_file_naming_its_own_live_head_is_kept(home):
    import json
    import time

    head = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        localstate._state_file().parent.mkdir(parents=True, exist_ok=True)
        localstate._state_file().write_text(json.dumps({
            "pid": head.pid, "pid_start": host.start_ticks(head.pid), "gcs_port": 1,
            "dashboard_port": 2, "client_port": 3, "agent_port": 4, "num_cpus": None,
            "num_gpus": None, "object_store_memory": None, "log": "x",
            "started_at": time.time()}))
        cluster = localstate.load_state()
        assert cluster is not None and cluster.pid == head.pid
        assert host.is_same(head.pid, None, time.time())   # older state: started before now
    finally:
        head.kill()
        head.wait()
