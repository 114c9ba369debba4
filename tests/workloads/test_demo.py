"""`make demo`'s script (scripts/demo.sh + demo_cluster.sh), its wiring checked in seconds.

What each stage does on a real cluster is proven by README's examples, which run the same
commands for real on the session cluster (tests/cluster/test_readme.py): the data job
(`workloads.data --smoke-test --output .../smoke-seq64`), training streaming its output
(`workloads.train --smoke-test --dataset ...`), `serve deploy cluster-configs/serve/lm.yaml`
and the openai client's answer from the `lm` app. Running the demo for real repeated all of
that (~65 s). Here `ray`, `serve` and `rayfleet` are stand-ins on PATH that record what the
script asks of them and answer as the real ones do (summary lines, a checkpoint folder), and an
OpenAI-style endpoint on the demo's port answers the client; what is checked is what only the
script does: the commands it submits (the data job's is README's, the training flags pass the
real driver's checks), the checkpoint the training summary names is the one it deploys, on its
own port, the client's two requests, the summary it prints, and the cluster: a running one is
used and left up, else one is started and taken down (with Serve) on exit."""

from __future__ import annotations

import json
import os
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from scripts.readme_blocks import all_examples
from tests.conftest import BIN, REPO, free_port, run

SHIM = r'''
import json, os, pathlib, sys

name, argv = sys.argv[1], sys.argv[2:]
state = pathlib.Path(os.environ["DEMO_SHIM_DIR"])
record = {"cmd": name, "argv": argv, "cwd": os.getcwd()}
if name == "serve" and argv[:1] == ["deploy"]:
    record["config"] = pathlib.Path(argv[1]).read_text()
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")


def summary(d):
    print("RAYFLEET_SUMMARY " + json.dumps(d))


if name == "rayfleet":
    up = state / "cluster-up"
    if argv == ["local", "env"]:
        if not up.exists():
            sys.exit("rayfleet: no rayfleet local cluster is running")
        for k, v in {"RAY_ADDRESS": "127.0.0.1:6390",
                     "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:8290",
                     "RAY_DASHBOARD_ADDRESS": "http://127.0.0.1:8290", "RAY_AUTH_MODE": "token",
                     "RAY_AUTH_TOKEN_PATH": str(state / "auth_token")}.items():
            print(f"export {k}={v}")
    elif argv[:2] == ["local", "up"]:
        up.touch()
        print("rayfleet local cluster is up")
    elif argv[:2] == ["local", "down"]:
        up.unlink()
elif name == "ray":
    assert argv[:2] == ["job", "submit"], argv
    entry = argv[argv.index("--") + 1:]
    flags = dict(zip(entry, entry[1:]))
    if entry[:3] == ["python", "-m", "workloads.data"]:
        print("[rayfleet] 2960 sequences of seq_len 64")
        summary({"rows": 2960, "seq_len": 64, "output": flags["--output"], "written": 4,
                 "skipped": 0})
    elif entry[:3] == ["python", "-m", "workloads.train"]:
        run = pathlib.Path(flags["--storage-path"]) / flags["--name"]
        (run / "checkpoint_000002").mkdir(parents=True)
        print(f"(RayTrainWorker pid=1) [rayfleet] step {flags['--max-steps']}/"
              f"{flags['--max-steps']} loss 2.5000")
        summary({"name": flags["--name"], "steps": int(flags["--max-steps"]),
                 "first_loss": 5.5, "final_loss": 2.5,
                 "checkpoint": str(run / "checkpoint_000002"),
                 "loss_png": str(run / "loss.png")})
    else:
        sys.exit(f"unexpected job {entry}")
    print("Job 'raysubmit_1' succeeded")
elif name == "serve" and argv[:1] == ["deploy"]:
    print("Sent deploy request successfully.")
'''

ANSWER = "with open(path) as f:"
COMPLETION = "    return open(path).readlines()"


class _OpenAIStandIn(BaseHTTPRequestHandler):
    """/health, and the two OpenAI routes the demo's client calls; the bodies are recorded."""

    requests: list[tuple[str, dict]] = []

    def _send(self, body: dict | None) -> None:
        data = json.dumps(body or {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._send({"status": "ok"} if self.path == "/health" else None)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body))
        usage = {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13}
        if self.path == "/v1/chat/completions":
            self._send({"id": "c1", "object": "chat.completion", "created": 0,
                        "model": body["model"], "usage": usage, "choices": [{
                            "index": 0, "finish_reason": "length",
                            "message": {"role": "assistant", "content": ANSWER}}]})
        else:
            self._send({"id": "c2", "object": "text_completion", "created": 0,
                        "model": body["model"], "usage": usage, "choices": [{
                            "index": 0, "finish_reason": "length", "logprobs": None,
                            "text": COMPLETION}]})

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _OpenAIStandIn)
    _OpenAIStandIn.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], _OpenAIStandIn.requests
    server.shutdown()
    server.server_close()


def _readme_command(module: str) -> list[str]:
    """README's (or a docs page's) `ray job submit ... -m <module> --smoke-test ...` line (run
    for real by tests/cluster/test_readme.py), as argv."""
    for _, body, expects in all_examples(REPO):
        for line in body.replace("\\\n", " ").splitlines():
            if expects is not None and f"-m {module} --smoke-test" in line:
                return shlex.split(line.split("#", 1)[0])
    raise AssertionError(f"README runs no {module} --smoke-test")


@pytest.mark.parametrize("running", [True, False], ids=["cluster-running", "no-cluster"])
def test_demo_script_wires_every_stage(tmp_path, endpoint, running):
    port, requests = endpoint
    shims = tmp_path / "bin"
    shims.mkdir()
    (tmp_path / "shim.py").write_text(SHIM)
    for name in ("ray", "serve", "rayfleet"):
        (shims / name).write_text(f'#!/bin/sh\nexec "{BIN / "python"}" "{tmp_path / "shim.py"}"'
                                  f' {name} "$@"\n')
        (shims / name).chmod(0o755)
    if running:
        (tmp_path / "cluster-up").touch()
    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{shims}:{BIN}:{env.get('PATH', '')}", DEMO_SHIM_DIR=str(tmp_path),
               RAYFLEET_HOME=str(tmp_path / "home"), RAYFLEET_STORAGE=str(runs),
               SERVE_PORT=str(port))
    proc = run(["bash", str(REPO / "scripts" / "demo.sh")], env=env, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-3000:]
    calls = [json.loads(ln) for ln in (tmp_path / "calls.jsonl").read_text().splitlines()]

    # The two jobs, submitted from the repository with its code (--working-dir .).
    jobs = [c for c in calls if c["cmd"] == "ray"]
    assert len(jobs) == 2 and all(c["cwd"] == str(REPO) for c in jobs)
    assert all(c["argv"][:4] == ["job", "submit", "--working-dir", "."] for c in jobs)
    data, train = (c["argv"][c["argv"].index("--") + 1:] for c in jobs)
    dataset = str(runs / "data" / "smoke-seq64")
    # The data job is README's, output aside (README's own run of it proves it works).
    readme_data = _readme_command("workloads.data")
    assert data == readme_data[readme_data.index("--") + 1:-1] + [dataset]
    # Training streams that output; its flags pass the real driver's checks.
    assert train[:3] == ["python", "-m", "workloads.train"]
    from workloads.train import options

    args = options.TrainOptions.parse(train[3:])
    options.check_options(args)
    assert args.smoke_test and args.dataset == dataset and args.num_workers == 2
    assert args.storage_path == str(runs) and args.name.startswith("demo-")
    assert args.max_steps == 300 and args.checkpoint_every == 100  # `make demo`'s defaults

    # The checkpoint the training summary named, deployed with the committed lm config on
    # the demo's own port (nothing else changed).
    deploys = [c for c in calls if c["cmd"] == "serve" and c["argv"][0] == "deploy"]
    assert len(deploys) == 1
    deployed = yaml.safe_load(deploys[0]["config"])
    checkpoint = str(runs / args.name / "checkpoint_000002")
    committed = yaml.safe_load((REPO / "cluster-configs" / "serve" / "lm.yaml").read_text())
    committed["http_options"]["port"] = port
    committed["applications"][0]["args"]["checkpoint"] = checkpoint
    assert deployed == committed

    # The openai client's two requests, and what it printed of the answers.
    assert [(p, b["model"]) for p, b in requests] == [
        ("/v1/chat/completions", "rayfleet-lm"), ("/v1/completions", "rayfleet-lm")]
    assert requests[0][1]["messages"] == [{"role": "user", "content": "How do I open a file?"}]
    assert requests[1][1]["prompt"] == "def read_lines(path):\n"
    assert f"  A: {ANSWER}" in out and COMPLETION in out
    assert "7 tokens from a rayfleet-lm" in out

    for stage in ("workloads.data", "workloads.train", "serve deploy", "openai client",
                  "summary"):
        assert stage in out, stage
    assert "2960 sequences x 65 tokens in " + dataset in out
    assert f"{args.name}: 300 steps, loss 5.500 -> 2.500" in out
    assert f"checkpoint     {checkpoint}" in out
    assert f"loss curve     {runs / args.name / 'loss.png'}" in out
    assert "stage times    up " in out and "dashboard      http://127.0.0.1:8290" in out

    # The cluster: a running one is used and left up; else started, then taken down with
    # Serve once the demo is done.
    local = [c["argv"][:2] for c in calls if c["cmd"] == "rayfleet" and c["argv"][1] != "env"]
    if running:
        assert "using the running rayfleet local cluster" in out
        assert local == [] and "rayfleet local down" not in out
        assert (tmp_path / "cluster-up").exists()
    else:
        assert local == [["local", "up"], ["local", "down"]]
        up = next(c for c in calls if c["argv"][:2] == ["local", "up"])
        assert up["argv"][2:] == ["--num-cpus", "4", "--object-store-memory", "1GB"]
        assert [c["argv"] for c in calls][-2:] == [["shutdown", "-y"], ["local", "down"]]
        assert not (tmp_path / "cluster-up").exists()
