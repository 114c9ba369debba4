"""workloads.serve `lm` on the session's real Ray cluster, through the real `openai` client:
completions, chat, SSE streaming, dynamic batching under concurrency, OpenAI error bodies,
and the builder's one-line refusal of a missing or corrupt checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from rayfleet.commands import localstate
from rayfleet.facts import RAY_PORTS_BY_NAME
from tests.conftest import REPO
from tests.workloads.conftest import deploy_lm, serve_shutdown

pytestmark = pytest.mark.ray
MODEL = "rayfleet-lm"


@pytest.fixture(scope="module")
def lm_url(ray_cluster, lm_checkpoint, tmp_path_factory):
    # A longer batch window than the default makes batching deterministic on a busy 2-core box.
    url = deploy_lm(ray_cluster, lm_checkpoint, tmp_path_factory.mktemp("serve"),
                    batch_wait_timeout_s=0.3)
    yield url
    serve_shutdown(ray_cluster)


@pytest.fixture(scope="module")
def client(lm_url):
    import openai

    return openai.OpenAI(base_url=lm_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def http(url: str, body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(client, lm_url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, body = http(lm_url + "/health")
    assert status == 200 and body["status"] == "ok"


def _listeners(root_pid: int, haproxy_folder: Path) -> list[tuple[str, int, str, int]]:
    """(address, port, process name, pid) of every TCP listener of the cluster's processes (the
    head's `ray start` and everything below it, and the HAProxy started on this cluster's
    config: one that a reload started may no longer sit below it), from `ss -ltnpH`."""
    import psutil

    pids = {root_pid} | {p.pid for p in psutil.Process(root_pid).children(recursive=True)}
    for proc in psutil.process_iter(["cmdline"]):
        if str(haproxy_folder) in " ".join(proc.info["cmdline"] or ()):
            pids.add(proc.pid)
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        addr, _, port = cols[3].rpartition(":")
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                found.append((addr.strip("[]"), int(port), name, int(pid)))
    return found


def test_haproxy_serves_and_nothing_new_listens_on_the_world(ray_cluster, lm_url,
                                                             monkeypatch):
    """The session cluster's ingress is HAProxy (rayfleet.ingress, the default): HAProxy
    answers on the Serve port; every HAProxy socket, the replica's direct-ingress port and the
    fallback proxy are on loopback; what listens beyond loopback is Ray's own (GCS, raylet and
    workers' gRPC, behind the token), and none of it on a port of the ingress."""
    port = int(lm_url.rsplit(":", 1)[1])
    monkeypatch.setenv("RAYFLEET_HOME", str(ray_cluster["home"]))
    folder = localstate.haproxy_folder()   # this cluster's HAProxy files
    assert folder.is_dir(), folder
    # Ray reloads HAProxy when Serve's routing changes (earlier tests deploy and shut apps
    # down on this cluster): read the listeners once HAProxy holds the Serve port again.
    deadline = time.time() + 60
    while True:
        found = _listeners(ray_cluster["pid"], folder)
        haproxy = {(a, p) for a, p, n, _ in found if n == "haproxy"}
        if ("127.0.0.1", port) in haproxy or time.time() > deadline:
            break
        time.sleep(1)
    world = {(a, p, n) for a, p, n, _ in found if a not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")}
    assert (("127.0.0.1", port) in haproxy), (port, found)          # HAProxy is the ingress
    assert all(a == "127.0.0.1" for a, _ in haproxy), haproxy      # stats, exporter, frontend
    direct = RAY_PORTS_BY_NAME["serve-direct-ingress"]
    replica = [(a, p) for a, p, n, _ in found if direct.from_port <= p <= direct.to_port]
    assert replica and all(a == "127.0.0.1" for a, _ in replica), found
    assert not [w for w in world if w[2] == "haproxy" or w[1] in {port, *(p for _, p in haproxy)}
                or direct.from_port <= w[1] <= direct.to_port], world
    assert all(n in ("gcs_server", "raylet") or n.startswith(("ray::", "ray-", "python"))
               for _, _, n in world), sorted(world)


def test_completion_is_seeded_and_bytes_long(client):
    a = client.completions.create(model=MODEL, prompt="def main(", max_tokens=12, seed=7)
    b = client.completions.create(model=MODEL, prompt="def main(", max_tokens=12, seed=7)
    assert a.choices[0].text == b.choices[0].text  # same seed, same answer
    assert a.choices[0].finish_reason == "length"
    assert a.usage.prompt_tokens == 9 and a.usage.completion_tokens >= 1
    assert a.object == "text_completion" and a.model == MODEL


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "what is ray?"}], max_tokens=10)
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert r.usage.completion_tokens >= 1


def test_streaming_completion_and_chat(client):
    plain = client.completions.create(model=MODEL, prompt="import ", max_tokens=20, seed=3,
                                      temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="import ", max_tokens=20,
                                            seed=3, temperature=0, stream=True))
    assert len(chunks) > 2  # token by token, not one blob
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chat)


def test_concurrent_requests_form_batches(client, lm_url):
    def one(i: int):
        return client.completions.create(model=MODEL, prompt="class Foo", max_tokens=16,
                                         seed=i)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    seen = [r.model_extra["rayfleet"]["batch_size"] for r in results]
    assert max(seen) > 1, seen
    status, stats = http(lm_url + "/v1/stats")
    assert status == 200 and stats["max_batch_size_seen"] > 1, stats


def test_openai_error_bodies(client, lm_url):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 500, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens"
    # Malformed JSON, a missing field and an oversized body: same shape, 400.
    for body in (b"{not json", json.dumps({"prompt": "x"}).encode(),
                 json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode()):
        status, err = http(lm_url + "/v1/completions", body)
        assert status == 400, err
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["type"] == "invalid_request_error"


def test_serve_config_files_are_valid_and_point_at_the_builders():
    from ray.serve.schema import ServeDeploySchema

    builders = {}
    for path in sorted((REPO / "cluster-configs" / "serve").glob("*.yaml")):
        schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
        assert schema.http_options.host == "127.0.0.1", path   # rule 22: loopback only
        builders[path.stem] = schema.applications[0].import_path
    assert builders == {"lm": "workloads.serve.lm:app_builder",
                        "rag": "workloads.serve.rag:app_builder",
                        "rag-llm": "workloads.serve.rag:app_builder",
                        "llm": "workloads.serve.llm:app_builder"}
    lm = ServeDeploySchema.model_validate(yaml.safe_load(
        (REPO / "cluster-configs" / "serve" / "lm.yaml").read_text()))
    auto = lm.applications[0].deployments[0].autoscaling_config
    assert auto["min_replicas"] <= auto["max_replicas"]


def test_builder_refuses_bad_args_in_one_line(tmp_path, lm_checkpoint, monkeypatch):
    # Serve shows a RayServeException's message as it is in `serve status` (any other
    # exception from a builder becomes a whole traceback there).
    from ray.serve.exceptions import RayServeException

    from workloads.serve.lm import app_builder

    monkeypatch.setenv("RAYFLEET_STORAGE", str(tmp_path / "empty-storage"))
    broken = tmp_path / "broken"
    shutil.copytree(lm_checkpoint, broken)
    with open(broken / "model.pt", "ab") as f:
        f.write(b"junk")
    for args, message in [
            ({"checkpoint": str(tmp_path / "nope")}, "does not exist"),
            ({}, "'latest': no finished workloads.train run under " + str(tmp_path)),
            ({"checkpoint": "runs/demo/checkpoint_000002"},
             "args.checkpoint: runs/demo/checkpoint_000002 is a relative path"),
            ({"checkpoint": lm_checkpoint, "max_batch_size": "eight"},
             "args.max_batch_size: must be a number, got 'eight'"),
            ({"checkpoint": lm_checkpoint, "batch_wait_timeout_s": "nan"},
             "args.batch_wait_timeout_s: must be at least 0"),
            ({"checkpoint": str(broken)}, "corrupt")]:
        with pytest.raises(RayServeException, match=re.escape(message)) as e:
            app_builder(args)
        assert str(e.value).startswith("lm app: ") and "\n" not in str(e.value)
    assert not (tmp_path / "empty-storage").exists()   # looked for, not created


def test_serve_config_checks_the_args_before_a_deploy(tmp_path, lm_checkpoint, monkeypatch,
                                                    capsys):
    """Without --package-to (a cluster on this machine), `rayfleet serve-config` runs the
    app's own argument check and writes the config with the resolved args, or refuses in one
    line and writes nothing: what `serve deploy` would only show in `serve status`."""
    from rayfleet.commands.cli import main

    out = tmp_path / "lm.yaml"
    # The fixture run's storage folder as the default storage: `checkpoint: latest` finds it.
    monkeypatch.setenv("RAYFLEET_STORAGE", str(Path(lm_checkpoint).parent.parent))
    cmd = ["serve-config", str(REPO / "cluster-configs/serve/lm.yaml"), "-o", str(out)]
    for arg, needle in [("checkpoint=runs/demo/checkpoint_000002", "is a relative path"),
                        (f"checkpoint={tmp_path}/nope", "does not exist"),
                        ("max_batch_size=eight", "args.max_batch_size: must be a number")]:
        assert main(cmd + ["--arg", arg]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and not out.exists(), err
    assert main(cmd) == 0, capsys.readouterr().err     # as committed: checkpoint: latest
    args = yaml.safe_load(out.read_text())["applications"][0]["args"]
    assert args["checkpoint"] == lm_checkpoint and args["max_batch_size"] == 8
