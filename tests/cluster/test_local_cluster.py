"""The real `rayfleet local` cluster: token auth on the Jobs API, status, idempotent up."""

import os
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, run

pytestmark = pytest.mark.ray


def _get(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_up_printed_address_dashboard_and_submit_line(ray_cluster):
    out = ray_cluster["up_stdout"]
    assert f"127.0.0.1:{ray_cluster['gcs_port']}" in out
    assert ray_cluster["dashboard_url"] in out
    assert "ray job submit --working-dir . -- python -m workloads.train" in out


def test_token_file_is_private(ray_cluster):
    token = Path(ray_cluster["client_env"]["RAY_AUTH_TOKEN_PATH"])
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_jobs_api_refuses_a_request_without_the_token(ray_cluster):
    url = ray_cluster["dashboard_url"] + "/api/jobs/"
    token = Path(ray_cluster["client_env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    assert _get(url) == 401
    assert _get(url, "not-the-token") in (401, 403)
    assert _get(url, token) == 200


def test_ray_job_submit_without_token_is_refused_and_with_it_runs(ray_cluster, tmp_path):
    # A client with no token anywhere: no env, and a HOME without ~/.ray/auth_token
    # (Ray would pick that default path up on its own).
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    bare.update(HOME=str(tmp_path), PATH=f"{BIN}:{os.environ['PATH']}",
                RAY_API_SERVER_ADDRESS=ray_cluster["dashboard_url"])
    cmd = [str(BIN / "ray"), "job", "submit", "--", "python", "-c", "print('pwned')"]
    refused = run(cmd, env=bare, timeout=120)
    assert refused.returncode != 0
    assert "pwned" not in refused.stdout
    assert "Authentication" in refused.stdout + refused.stderr

    # The same command through `eval "$(rayfleet local env)"` in a plain shell.
    script = (f'eval "$({BIN}/rayfleet local env)" && ray job submit -- python -c '
              '"import ray; ray.init(); print(\'cpus\', ray.cluster_resources()[\'CPU\'])"')
    env = {**bare, "RAYFLEET_HOME": str(ray_cluster["home"])}
    ok = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                        timeout=180, cwd=REPO)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "cpus 4.0" in ok.stdout


def test_a_token_of_the_users_own_does_not_shadow_the_clusters(ray_cluster, tmp_path):
    # Ray >= 2.61 makes token auth the default: the user may already hold a token of another
    # cluster, in ~/.ray/auth_token and in RAY_AUTH_TOKEN (which Ray reads first).
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0" * 32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), PATH=f"{BIN}:{os.environ['PATH']}", RAY_AUTH_TOKEN="1" * 32,
               RAYFLEET_HOME=str(ray_cluster["home"]))
    script = f'eval "$({BIN}/rayfleet local env)" && rayfleet local status && ray job list'
    ok = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                        timeout=120, cwd=REPO)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "ALIVE" in ok.stdout
    # Without the eval, `rayfleet local status` itself still uses the cluster's token.
    assert run([str(BIN / "rayfleet"), "local", "status"], env=env).returncode == 0


def test_status_shows_alive_node_and_free_resources(ray_cluster):
    proc = run([str(BIN / "rayfleet"), "local", "status"], env=ray_cluster["env"], check=True)
    assert "ALIVE" in proc.stdout
    assert "free: CPU" in proc.stdout and "/4" in proc.stdout


def test_up_again_is_idempotent(ray_cluster):
    proc = run([str(BIN / "rayfleet"), "local", "up", "--port", str(ray_cluster["gcs_port"]),
                "--dashboard-port", str(ray_cluster["dashboard_port"])],
               env=ray_cluster["env"], check=True)
    assert "already up" in proc.stdout
    assert os.path.exists(f"/proc/{ray_cluster['pid']}")
    # Settings the running cluster does not have are refused, not silently ignored.
    other = run([str(BIN / "rayfleet"), "local", "up", "--num-cpus", "3",
                 "--object-store-memory", "1GB"], env=ray_cluster["env"])
    assert other.returncode == 2 and other.stderr.strip().splitlines() == [
        "rayfleet: error: a rayfleet local cluster is already up with other settings: "
        "--num-cpus 4 (asked 3); `rayfleet local down` first to restart it with these, or "
        "leave the flags out to use it as it is"], other.stderr
    assert os.path.exists(f"/proc/{ray_cluster['pid']}")


def test_cluster_keeps_its_own_ray_session_folder(ray_cluster, monkeypatch):
    # Ray's job supervisor points each driver at the cluster named in
    # <temp dir>/ray_current_cluster: with the shared /tmp/ray, a cluster started later by
    # someone else on this machine would receive this cluster's jobs.
    from rayfleet.commands import localstate

    monkeypatch.setenv("RAYFLEET_HOME", str(ray_cluster["home"]))
    current = localstate.ray_temp_dir() / "ray_current_cluster"
    # (Ray records the host's address there even for a loopback head; the port is ours.)
    assert current.read_text().strip().endswith(f":{ray_cluster['gcs_port']}")
