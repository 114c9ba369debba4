"""The head's log shipper (rayfleet/agents/logship.py) against the session's real Ray cluster
and the moto server, then `rayfleet logs` reading back what it copied, as a user would.

One job, gated so that it is seen running: its logs are copied while it runs (after the
bucket, missing at first, appears: the agent logs the failure and keeps going) and once more
when the agent is stopped (SIGTERM); the job ends while no agent runs, the next agent makes
its final copy, and a third finds it stored. Killing the cluster itself is rehearsed in the
fake cloud (ray down, then rayfleet logs); here only the agent stops."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rayfleet.commands import cli
from tests.conftest import BIN, REPO, run, wait_until

pytestmark = [pytest.mark.moto, pytest.mark.ray]

AGENT = REPO / "rayfleet" / "agents" / "logship.py"

JOB = """\
import sys, time
from pathlib import Path
import ray

print("driver line one", flush=True)

@ray.remote
def shout(token):
    print(f"worker line {token}", flush=True)
    return token

ray.get(shout.remote(sys.argv[1]))
gate = Path(sys.argv[2])
deadline = time.time() + 120
while not gate.exists() and time.time() < deadline:
    time.sleep(0.2)
print("driver line two", flush=True)
"""


def _get(s3, bucket: str, key: str) -> bytes | None:
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    except s3.exceptions.NoSuchBucket:
        return None


class Agent:
    """logship.py as the head runs it: a subprocess with its own log file."""

    def __init__(self, log: Path, storage: str, address: str, env: dict):
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(AGENT), "--storage", storage, "--address", address,
                 "--every-s", "1", "--poll-s", "0.3"],
                env=env, cwd=log.parent, stdout=f, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, what: str, line: str) -> None:
        wait_until(what, lambda: line in self.text(), detail=self.text)

    def stop(self) -> list[str]:
        """SIGTERM: it makes its last copy and exits 0; its lines, each UTC-stamped."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0, self.text()
        lines = self.text().splitlines()
        assert lines[-1].endswith(" stopped"), lines[-3:]
        assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", ln) for ln in lines), lines
        return lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def shipped(ray_cluster, aws_env, s3_client, tmp_path_factory):
    """A finished job whose logs the agent copied (bucket, prefix, run id, worker token)."""
    tmp_path = tmp_path_factory.mktemp("logship")
    bucket, run_id, token = (f"logs-{uuid.uuid4().hex[:8]}", f"rf-logs-{uuid.uuid4().hex[:8]}",
                             uuid.uuid4().hex[:12])
    storage = f"s3://{bucket}/rayfleet"
    logs = f"rayfleet/runs/{run_id}/logs"
    job_dir, gate = tmp_path / "job", tmp_path / "gate"
    job_dir.mkdir()
    (job_dir / "job.py").write_text(JOB)
    agents = []

    def agent(n: int) -> Agent:
        agents.append(Agent(tmp_path / f"logship-{n}.log", storage,
                            ray_cluster["dashboard_url"], {**ray_cluster["env"], **aws_env}))
        return agents[-1]

    def copied_running():
        record = _get(s3_client, bucket, f"{logs}/job.json")
        return record and json.loads(record)["status"] == "RUNNING" and any(
            token.encode() in (_get(s3_client, bucket, o["Key"]) or b"")
            for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{logs}/workers/")
            .get("Contents", []))

    try:
        first = agent(1)
        run([str(BIN / "ray"), "job", "submit", "--no-wait", "--submission-id", run_id,
             "--working-dir", str(job_dir), "--", "python", "job.py", token, str(gate)],
            env=ray_cluster["env"], timeout=120, check=True)
        # The bucket does not exist yet: one line per failed copy, and the agent keeps going.
        first.wait_for("a failed copy", f"{run_id}: copy failed, will retry")
        s3_client.create_bucket(Bucket=bucket)
        wait_until("a copy while the job runs, with the worker's log", copied_running,
                   detail=first.text)
        running = json.loads(_get(s3_client, bucket, f"{logs}/job.json"))
        assert running["final"] is False and running["entrypoint"].startswith("python job.py")
        # Copies with nothing new upload nothing.
        wait_until("a copy with nothing changed", lambda: re.search(
            rf"{run_id}: copied \(RUNNING\) .*: 0 of \d+ files changed", first.text()),
                   detail=first.text)
        # Stopped while the job runs: a last copy of it on the way out.
        lines = first.stop()
        stopping = next(i for i, ln in enumerate(lines) if "stopping: a last copy" in ln)
        assert any(f"{run_id}: copied (RUNNING)" in ln for ln in lines[stopping:]), lines

        # The job ends while no agent runs; the next one (the head restarted) copies it in
        # full once, and a third finds nothing left to do.
        gate.touch()
        second = agent(2)
        second.wait_for("the final copy", f"{run_id}: final copy (SUCCEEDED)")
        lines = second.stop()
        assert sum(f"{run_id}: final copy" in ln for ln in lines) == 1
        assert "final copy" in [ln for ln in lines if run_id in ln][-1], lines
        third = agent(3)
        third.wait_for("the stored final copy", f"{run_id}: final copy already in the bucket")
        assert not any(run_id in ln and "copied" in ln for ln in third.stop())
    finally:
        gate.touch()
        for a in agents:
            a.kill()
    return {"bucket": bucket, "storage": storage, "run": run_id, "token": token,
            "env": {**aws_env, "PATH": ray_cluster["env"]["PATH"]}}


def test_logs_are_copied_while_running_and_read_back_after(shipped):
    env, run_id, storage = shipped["env"], shipped["run"], shipped["storage"]
    rf = str(BIN / "rayfleet")
    shown = run([rf, "logs", run_id, "--storage", storage], env=env, check=True)
    head, *body = shown.stdout.splitlines()
    assert head.startswith(f"run {run_id}: SUCCEEDED") and "python job.py" in head, head
    assert "driver line one" in body and "driver line two" in body, shown.stdout

    listed = run([rf, "logs", run_id, "--storage", storage, "--list"], env=env, check=True)
    worker_out = [ln.split()[0] for ln in listed.stdout.splitlines()
                  if ln.startswith("logs/workers/") and ln.split()[0].endswith(".out")]
    assert "logs/driver.log" in listed.stdout and "logs/job.json" in listed.stdout
    assert worker_out, listed.stdout
    # The worker's own Ray log (not the driver's echo of it), by its file name alone.
    files = [run([rf, "logs", run_id, "--storage", storage, "--file", name.rsplit("/", 1)[-1]],
                 env=env, check=True).stdout for name in worker_out]
    assert any(f"worker line {shipped['token']}" in f for f in files), files
    final = json.loads(run([rf, "logs", run_id, "--storage", storage, "--file", "job.json"],
                           env=env, check=True).stdout)
    assert final["final"] is True and final["driver_exit_code"] == 0
    assert "runtime_env" not in final

    # An unknown run: one line naming the closest that exists.
    typo = run([rf, "logs", run_id[:-1] + "x", "--storage", storage], env=env)
    assert typo.returncode == 2 and typo.stdout == "", typo
    assert typo.stderr.count("\n") == 1 and f"closest: {run_id}" in typo.stderr, typo.stderr


def test_storage_from_the_rendered_yaml_and_the_autostop_log(shipped, s3_client, tmp_path,
                                                             capsys, monkeypatch):
    for k, v in shipped["env"].items():
        monkeypatch.setenv(k, v)
    # The checked-in rendered example, with the facts `rayfleet render` writes beside it (not
    # in git: made here from the example's outputs), their storage this test's bucket; the
    # header comment still names the example's bucket, which the facts win over.
    from rayfleet.commands import render

    example = REPO / "cluster-configs" / "aws-a100.example.yaml"
    config = tmp_path / "dev.yaml"
    config.write_text(example.read_text())
    o = render.load_outputs(str(REPO / "cluster-configs" / "examples" / "dev-outputs.json"))
    facts = dataclasses.replace(render.facts(o, str(tmp_path / "token")),
                                storage_uri=f"{shipped['storage']}/")
    (tmp_path / "dev.rayfleet.json").write_text(facts.to_json())
    assert cli.main(["logs", str(config), shipped["run"], "--file",
                     "driver.log"]) == 0
    assert "driver line two" in capsys.readouterr().out
    out = tmp_path / "job.json"
    assert cli.main(["logs", str(config), shipped["run"], "--file",
                     "logs/job.json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["submission_id"] == shipped["run"]
    assert cli.main(["logs", str(config), shipped["run"], "--file",
                     "logs/job.json", "-o", str(tmp_path / "no" / "such" / "dir")]) == 2
    assert "-o: cannot write " in capsys.readouterr().err
    capsys.readouterr()

    assert cli.main(["logs", str(config), "--cluster", "rayfleet-dev"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no clusters/rayfleet-dev/autostop.log" in err, err
    s3_client.put_object(Bucket=shipped["bucket"],
                         Key="rayfleet/clusters/rayfleet-dev/autostop.log",
                         Body=b"2026-11-23T10:00:00Z idle 30 min: stopping\n")
    assert cli.main(["logs", str(config), "--cluster", "rayfleet-dev"]) == 0
    assert capsys.readouterr().out == "2026-11-23T10:00:00Z idle 30 min: stopping\n"


def test_a_missing_bucket_is_one_line(aws_env, monkeypatch, capsys):
    for k, v in aws_env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["logs", "r1", "--storage", "s3://no-such-bucket-rf/p"]) == 2
    err = capsys.readouterr().err
    assert err == ("rayfleet: error: cannot read s3://no-such-bucket-rf/p/: bucket "
                   "no-such-bucket-rf does not exist (is this the stack's bucket?)\n")


def test_files_beside_the_logs_are_listed_and_a_binary_one_needs_o(shipped, s3_client):
    # What a training run named after its job leaves beside the logs (runs/<id>/metrics.csv
    # and loss.png), made here by the training summary's own writers: this test checks that
    # `rayfleet logs` lists them and refuses to print a binary one. That a training job
    # submitted with --submission-id writes them there is checked where one runs on a cloud
    # node (tests/fakecloud/test_ray_up.py: the training job's keys, then `rayfleet logs
    # --list` after the cluster is gone).
    from workloads.common import runs as ckpt
    from workloads.common.runs import loss_png

    history = [{"step": 1, "loss": 2.0, "lr": 0.001, "tokens_per_s": 10.0},
               {"step": 2, "loss": 1.5, "lr": 0.001, "tokens_per_s": 10.0}]
    for name, body in (("metrics.csv", ckpt.history_csv(history).encode()),
                       ("loss.png", loss_png(history, "logs test"))):
        s3_client.put_object(Bucket=shipped["bucket"],
                             Key=f"rayfleet/runs/{shipped['run']}/{name}", Body=body)
    rf = str(BIN / "rayfleet")
    listed = run([rf, "logs", shipped["run"], "--storage", shipped["storage"], "--list"],
                 env=shipped["env"], check=True).stdout
    assert "metrics.csv" in listed and "loss.png" in listed
    csv = run([rf, "logs", shipped["run"], "--storage", shipped["storage"], "--file",
               "metrics.csv"], env=shipped["env"], check=True).stdout
    assert csv.splitlines() == ckpt.history_csv(history).splitlines(), csv
    png = run([rf, "logs", shipped["run"], "--storage", shipped["storage"], "--file",
               "loss.png"], env=shipped["env"])
    assert png.returncode == 2 and "is binary; write it with -o PATH" in png.stderr
