"""Training faults (faults 1, 2, 4, 5 and 11 of docs/faults.md) on real local Ray clusters.

11. A rank SIGSTOPped mid-run (hung, not dead): the other rank's hang watch names it, ends
   the worker group, and the new group resumes from the latest checkpoint.
1. A Ray Train worker killed mid-run: FailureConfig restarts the worker group, which resumes
   from the latest checkpoint and redoes at most one checkpoint interval.
2. The job driver killed: resubmitting the same job resumes from the checkpoint in storage.
   Faults 11, 1 and 2 land on one job, one after the other (Ray Train starts fewer on 2
   cores), which ends where an uninterrupted run with the same seed ends.
4. S3 cut while a checkpoint is written: one line naming the storage; the partial upload is
   never resumed from; a damaged latest checkpoint is refused without touching storage.
5. A worker node of a two-node cluster lost: the run fails in one line naming the lost
   capacity (instead of waiting forever), and resumes on what is left with fewer workers.
"""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, kit_lines, run, summary_of
from tests.faults.conftest import wait_for as _wait_for
from workloads.common import runs
from workloads.common.storage import resolve

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]

STEPS = 80
ARGS = ["--smoke-test", "--model", "small", "--max-steps", str(STEPS), "--checkpoint-every",
        "10", "--log-every", "5", "--seed", "7"]
HANG_FLOOR_S = 10   # hangwatch.MIN_FLOOR_S: the test's steps take ~0.1 s


def test_hung_rank_killed_worker_then_killed_driver_resume_to_the_uninterrupted_loss(
        ray_cluster, tmp_path):
    """Faults 11, 1 and 2 on one job, each landing mid-run. `ray job submit` (its log streams
    the workers' lines): rank 0 is SIGSTOPped once a checkpoint is registered (a hung rank: its
    process lives, Ray's health check would wait 10 minutes); rank 1's hang watch names it and
    the group restarts from the latest checkpoint, the hang counted apart from --max-failures.
    Once that group has registered a checkpoint, its rank 0 is SIGKILLed; the restarted group
    resumes from the latest checkpoint. Once that group has registered a checkpoint of its own,
    the job driver is SIGKILLed (the harshest stop: no cleanup) and the job ends unfinished; the
    same command submitted again resumes from storage and finishes, with no second start. The
    run ends at the loss of an uninterrupted run with the same seed, to the last digit: a resume
    that lost the optimizer's moments, the RNG or the data position, at any fault, lands
    elsewhere."""
    name = "killed"
    entry = ["python", "-m", "workloads.train", *ARGS, "--name", name,
             "--storage-path", str(tmp_path), "--hang-floor-s", str(HANG_FLOOR_S),
             "--max-failures", "1"]
    submit = [str(BIN / "ray"), "job", "submit", "--working-dir", "."]
    first_id = f"rf-fault12-{uuid.uuid4().hex[:8]}"
    run([*submit, "--no-wait", "--submission-id", first_id, "--", *entry],
        env=ray_cluster["env"], timeout=180, check=True)
    storage = resolve(str(tmp_path), check_writable=False)
    snapshot = _file_reader(storage, name)
    # The job's log (the driver's output with the workers' lines), read through the Jobs REST
    # API as it grows (`ray job submit`'s own log stream can close while the job runs on).
    # Fault 11, then fault 1: stop, then kill, a worker only once Ray Train has registered a
    # checkpoint (of the group that runs): one reported but not yet registered by the
    # controller is not resumed from (the restart would start further back, which is Ray's
    # behaviour, not a kit fault). Fault 2: once the group restarted after the kill has
    # registered a checkpoint after the one it resumed from, kill the driver.
    stopped: dict = {}
    verdict = hang_resumed = None
    killed_pid = last_step_at_kill = registered = resumed = driver = None
    text, done = "", 0
    deadline = time.time() + 400
    while driver is None and time.time() < deadline:
        text = _job_logs(ray_cluster, first_id)
        lines, done = text[done:text.rfind("\n") + 1].splitlines(), text.rfind("\n") + 1
        latest = (_latest_registered(snapshot, "metrics") or {}).get("step") or 0
        for line in lines:
            m = re.search(r"RayTrainWorker pid=(\d+).*\[rayfleet\] step (\d+)/", line)
            if m and not stopped and int(m.group(2)) >= 15 and latest:
                stopped = {"pid": int(m.group(1)), "step": int(m.group(2)),
                           "registered": latest, "at": time.monotonic()}
                os.kill(stopped["pid"], signal.SIGSTOP)
            if "[rayfleet] hung: " in line and stopped and verdict is None:
                verdict = (line, time.monotonic())
            r = re.search(r"\[rayfleet\] resumed from step (\d+)", line)
            if r and verdict and hang_resumed is None:
                hang_resumed = (int(r.group(1)), time.monotonic())
            elif (m and hang_resumed and killed_pid is None and int(m.group(1)) != stopped["pid"]
                  and latest > hang_resumed[0]):
                registered = latest
                killed_pid, last_step_at_kill = int(m.group(1)), int(m.group(2))
                os.kill(killed_pid, signal.SIGKILL)
            elif r and killed_pid is not None and resumed is None:
                resumed = int(r.group(1))
        if resumed is not None and latest > resumed:
            driver = {"registered": _latest_registered(snapshot),
                      "step": _latest_registered(snapshot, "metrics")["step"],
                      "pids": _driver_pids(str(tmp_path))}
            if len(driver["pids"]) == 1:
                os.kill(driver["pids"][0], signal.SIGKILL)
        elif _job_status(ray_cluster, first_id) not in ("PENDING", "RUNNING"):
            break
        time.sleep(0.2)
    # Fault 11: the stopped rank named by the other's watch (its pid, its node) within the
    # bound and a few beats; the new group resumed from the checkpoint registered when it
    # stopped (or a later one), at most one checkpoint interval back.
    assert stopped and verdict, "no hang verdict:\n" + text[-3000:]
    assert re.search(rf"\[rayfleet\] hung: no rank advanced for [\d.]+ s past step \d+ \(bound "
                     rf"[\d.]+ s: [^)]*\): rank 0 on [\d.]+ \(node \w+\) \(pid {stopped['pid']}\) "
                     rf"at step \d+ stopped answering; ending the worker group", verdict[0]), \
        verdict[0]
    noticed_s = verdict[1] - stopped["at"]
    bound_s = float(re.search(r"\(bound ([\d.]+) s", verdict[0]).group(1))
    assert noticed_s < bound_s + 10, (noticed_s, verdict[0])
    assert hang_resumed, text[-3000:]
    assert stopped["registered"] <= hang_resumed[0] <= stopped["step"], (stopped, hang_resumed)
    assert stopped["step"] - hang_resumed[0] <= 10, (stopped, hang_resumed)
    measured = {"noticed_s": round(noticed_s, 1), "bound_s": bound_s,
                "resumed_s": round(hang_resumed[1] - stopped["at"], 1),
                "steps_redone": stopped["step"] - hang_resumed[0]}
    print(f"fault 11 measured: {json.dumps(measured)}", flush=True)
    assert killed_pid is not None, "the run ended before a worker could be killed:\n" + text[-3000:]
    assert resumed is not None, text[-3000:]
    # Resumed from the checkpoint registered when the worker died (or a later one that
    # registered in the moment before the group stopped), never from scratch or an older one.
    assert registered <= resumed <= last_step_at_kill, (registered, resumed, last_step_at_kill)
    # At most one checkpoint interval redone (--checkpoint-every 10).
    assert last_step_at_kill - resumed <= 10, (resumed, last_step_at_kill)

    # Fault 2: the driver was killed mid-run, after the restarted group's own checkpoint.
    assert driver is not None and len(driver["pids"]) == 1, (driver, text[-3000:])
    driver_ckpt = driver["registered"]
    assert runs.read_marker(storage.fs, storage.join(name, driver_ckpt)) is not None
    status = _wait_for("the first job to end", lambda: (
        s := _job_status(ray_cluster, first_id)) not in ("PENDING", "RUNNING") and s,
        timeout=120)
    assert status in ("FAILED", "STOPPED"), status  # it did not finish on its own
    assert "RAYFLEET_SUMMARY" not in _job_logs(ray_cluster, first_id)

    second = run([*submit, "--", *entry], env=ray_cluster["env"], timeout=400)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-4000:]
    again = re.search(r"resuming from step (\d+) \((\S+)\)", out2)
    # Mid-run: the killed driver had not finished (else this would be "already complete").
    assert again and driver["step"] <= int(again.group(1)) < STEPS, out2[-3000:]
    assert Path(again.group(2)).name >= driver_ckpt  # that checkpoint or a later one
    assert f"[rayfleet] resumed from step {again.group(1)}" in out2  # the workers did too
    # What the run left in storage: its final checkpoint is the last step, and its metrics.csv ends
    # at the loss the job's summary printed.
    final = runs.check_latest_checkpoint(storage, name)
    assert final["final"] and final["step"] == STEPS, final
    final_loss = runs.read_metrics(storage, name)[-1]["loss"]
    s = summary_of(second.stdout)
    assert s["steps"] == STEPS and s["final_loss"] == final_loss, (s, final_loss)
    # The hang and its restart are the first job's: the second's summary saw none.
    assert s["hangs"] == [], s
    # No second start: the resubmitted job trained only the steps after its checkpoint (a
    # restart from 0 would log step 5 again).
    logged = [int(n) for n in re.findall(rf"\[rayfleet\] step (\d+)/{STEPS}", second.stdout)]
    assert logged and min(logged) > int(again.group(1)), (logged, again.group(1))

    # The uninterrupted reference: the same loop, seed and world size under plain torchrun
    # (docs/house.md, convention 5: one loop; an uninterrupted Ray Train run ends at the
    # same loss to the last digit, and torchrun starts in seconds instead of ~20).
    clean = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                            "-m", "workloads.train.torchrun", *ARGS,
                            "--output", str(tmp_path / "clean")],
                           env=ray_cluster["env"], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    # The reference's result is its final checkpoint (torchrun writes the same layout).
    last = runs.local_checkpoints(tmp_path / "clean")[-1]
    reference = runs.validate(last)
    assert reference["step"] == STEPS and reference["world_size"] == 2, reference
    reference_loss = runs.read_history((last / runs.METRICS).read_text())[-1]["loss"]
    assert summary_of(clean.stdout)["loss"] == reference_loss
    assert final_loss == pytest.approx(reference_loss, abs=2e-3), (final_loss, reference_loss)


# -- helpers -------------------------------------------------------------------------------

def _latest_registered(read, field: str = "checkpoint_dir_name"):
    """The checkpoint Ray Train resumes from (the run store's latest_result: registered only
    after every rank's upload succeeded); `field` of it (its folder name, or the "metrics" it
    was reported with). `read()` returns the run's snapshot bytes or None."""
    return (runs.latest_result(read()) or {}).get(field)


def _file_reader(storage, name: str):
    """The snapshot of run `name` under `storage`, as it is now (None before there is one)."""
    return lambda: runs.read_file(storage.fs, storage.join(name, runs.SNAPSHOT))


def _job_status(ray_cluster, submission_id: str) -> str:
    """The Jobs REST API with the cluster token (the `ray job status` CLI takes seconds to
    start on a busy 2-core machine; this is one request)."""
    token = Path(ray_cluster["client_env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req = urllib.request.Request(f"{ray_cluster['dashboard_url']}/api/jobs/{submission_id}",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["status"]


def _job_logs(ray_cluster, submission_id: str) -> str:
    """The job's log so far, one Jobs REST API request (as _job_status)."""
    token = Path(ray_cluster["client_env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req = urllib.request.Request(
        f"{ray_cluster['dashboard_url']}/api/jobs/{submission_id}/logs",
        headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["logs"]


def _driver_pids(marker: str) -> list[int]:
    """The job's Python driver: a process running workloads.train whose arguments name
    `marker` (this test's own tmp_path, so nobody else's process matches)."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if (args and Path(args[0]).name.startswith("python") and "workloads.train" in args
                and "submit" not in args and any(marker in a for a in args)):
            pids.append(int(proc_dir.name))
    return pids


def _one_line_error(proc_stderr: str) -> str:
    """The kit's one line, the last of the driver's stderr. Before it, Ray forwards its actors'
    own logs, each line tagged "(Name pid=N)": Ray Train's controller and workers log the
    failure with their tracebacks there (docs/faults.md says so); the driver itself prints no
    traceback."""
    own = kit_lines(proc_stderr)
    assert len(own) == 1 and "Traceback" not in own[0], "\n".join(own)[-3000:]
    last = [ln for ln in proc_stderr.splitlines() if ln.strip()][-1]
    assert last == own[0], (last, own[0])
    return own[0]


# -- faults 4 and 5: a short run ---------------------------------------------------------

SHORT = ["--smoke-test", "--model", "tiny", "--max-steps", "60", "--checkpoint-every", "10",
         "--log-every", "10", "--seed", "3"]


# -- fault 4: storage fails while a checkpoint is written -------------------------------------

class _S3Gate:
    """A TCP forwarder between the kit and the moto server: S3 as the network sees it. The
    test can cut it (every open connection reset, new ones reset on accept) after some more
    bytes of requests, so the cut can land inside a checkpoint upload (which files made it
    depends on timing; the test asserts only what holds either way)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.lock = threading.Lock()
        self.budget: int | None = None  # request bytes still allowed; None: no limit
        self.cut = False
        self.conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, nbytes: int) -> None:
        with self.lock:
            self.budget = nbytes

    def restore(self) -> None:
        with self.lock:
            self.cut, self.budget = False, None

    def close(self) -> None:
        self.server.close()
        self._reset_all()

    @staticmethod
    def _reset(s: socket.socket) -> None:
        # SO_LINGER 0: close() sends RST, as a dead endpoint or a middlebox would.
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass

    def _reset_all(self) -> None:
        with self.lock:
            conns, self.conns = list(self.conns), set()
        for s in conns:
            self._reset(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.cut:
                self._reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                self._reset(client)
                continue
            with self.lock:
                self.conns |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if request and data:
                with self.lock:
                    if self.budget is not None:
                        self.budget -= len(data)
                        self.cut = self.cut or self.budget < 0
            if not data or self.cut:
                if self.cut:
                    self._reset_all()
                else:
                    for s in (src, dst):
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return


@pytest.fixture
def s3_gate(moto_server):
    gate = _S3Gate(moto_server)
    yield gate
    gate.close()


def _listing(s3_client, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: (o["Size"], o["ETag"]) for p in pages for o in p.get("Contents", [])}


@pytest.mark.moto
def test_storage_cut_mid_checkpoint_is_one_line_and_never_resumed_from(
        ray_cluster, aws_env, s3_client, checkpoint_bucket, s3_gate):
    """S3 cut (connections reset) in the middle of a checkpoint upload: after pyarrow's and
    Ray's retries the run stops with one line naming the storage. The partial upload is never
    the checkpoint resumed from; a damaged latest checkpoint is refused without touching
    storage; once storage and that checkpoint are whole again, the same command resumes
    from it and finishes."""
    prefix = f"fault4-{uuid.uuid4().hex[:8]}"
    name = "s3-cut"
    run_prefix = f"{prefix}/{name}/"
    cmd = [str(BIN / "python"), "-m", "workloads.train", *SHORT, "--max-steps", "40",
           "--max-failures", "0", "--name", name,
           "--storage-path", f"s3://{checkpoint_bucket}/{prefix}"]
    env = {**ray_cluster["env"], **aws_env, "AWS_ENDPOINT_URL_S3": s3_gate.url}

    def snapshot() -> bytes | None:
        try:
            return s3_client.get_object(Bucket=checkpoint_bucket, Key=run_prefix
                                        + runs.SNAPSHOT)["Body"].read()
        except s3_client.exceptions.NoSuchKey:
            return None

    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        registered = _wait_for("the first registered checkpoint",
                               lambda: _latest_registered(snapshot), proc)
        # ~1.5 MB per checkpoint: the cut lands inside the next one's upload.
        s3_gate.cut_after(300_000)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, out[-3000:] + err[-3000:]
    line = _one_line_error(err)
    assert f"storage s3://{checkpoint_bucket}/{prefix} failed during training" in line
    assert "Re-run the same command" in line
    assert "RAYFLEET_SUMMARY" not in out
    # On an idle machine a whole next checkpoint can land between reading `registered` and
    # arming the cut; the latest *registered* one is what a resume uses, and the rest of this
    # test proves it is whole and is the one resumed from, never the cut upload.
    latest = _latest_registered(snapshot)
    assert latest is not None and latest >= registered, (latest, registered)
    registered = latest
    s3_gate.restore()

    keys = _listing(s3_client, checkpoint_bucket, run_prefix)
    others = {k.split("/")[2] for k in keys if k.count("/") > 2} - {registered}
    model_key = f"{run_prefix}{registered}/{runs.FULL_WEIGHTS}"
    whole = s3_client.get_object(Bucket=checkpoint_bucket, Key=model_key)["Body"].read()
    s3_client.put_object(Bucket=checkpoint_bucket, Key=model_key, Body=whole[:1000])
    before = _listing(s3_client, checkpoint_bucket, run_prefix)
    refused = run(cmd, env=env, timeout=180)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    line = _one_line_error(refused.stderr)
    assert f"s3://{checkpoint_bucket}/{model_key.rsplit('/', 1)[0]} is corrupt: " \
           f"{runs.FULL_WEIGHTS} is 1000 bytes, expected {len(whole)}" in line
    assert _listing(s3_client, checkpoint_bucket, run_prefix) == before  # nothing touched

    s3_client.put_object(Bucket=checkpoint_bucket, Key=model_key, Body=whole)
    resumed = run(cmd, env=env, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    m = re.search(r"resuming from step (\d+) \((\S+)\)", resumed.stdout)
    assert m and m.group(2).endswith(f"/{registered}"), resumed.stdout[-3000:]
    assert not any(o in m.group(2) for o in others)  # never the partial upload
    assert summary_of(resumed.stdout)["steps"] == 40
    # The run in storage ends there too: the final checkpoint Ray registered is step 40.
    done = _latest_registered(snapshot)
    marker = runs.parse_marker(done, s3_client.get_object(
        Bucket=checkpoint_bucket, Key=f"{run_prefix}{done}/{runs.MARKER}")["Body"].read())
    assert marker["final"] and marker["step"] == 40, marker


# -- fault 5: a worker node of a two-node cluster lost -----------------------------------------

def test_lost_worker_node_fails_naming_the_lost_capacity(two_node_cluster, tmp_path):
    """2 workers x 1 CPU on two 1-CPU nodes: one worker per node. The second node is killed
    after the first checkpoint. Ray Train restarts the worker group (FailureConfig), which
    cannot be placed on what is left: instead of Train V2's default of retrying that forever,
    the run fails in one line naming the dead node and what still fits. (Re-running with the
    advised --num-workers resumes from storage: the resubmission path of fault 2, not repeated
    here to keep `make test` inside its budget.)"""
    name = "node-lost"
    cmd = [str(BIN / "python"), "-m", "workloads.train", *SHORT, "--name", name,
           "--storage-path", str(tmp_path / "runs")]
    env = {**two_node_cluster["env"], "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "8"}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    storage = resolve(str(tmp_path / "runs"), check_writable=False)
    snapshot = _file_reader(storage, name)
    try:
        registered = _wait_for("the first registered checkpoint",
                               lambda: _latest_registered(snapshot), proc)
        os.killpg(two_node_cluster["worker"].pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)  # a hang fails here
    finally:
        proc.kill()
    assert proc.returncode == 2, out[-3000:] + err[-3000:]
    line = _one_line_error(err)
    assert "could not be placed again" in line and "is DEAD, it had {CPU: 1}" in line, line
    assert "the cluster now fits 1" in line and "--num-workers 1" in line, line
    assert "RAYFLEET_SUMMARY" not in out
    # What the advised re-run would resume from, the latest registered checkpoint (later ones
    # may have registered, and older ones been retired by num_to_keep, while the node died),
    # is whole in storage. Resuming from it by resubmission is fault 2's test.
    latest = _latest_registered(snapshot)
    assert latest is not None and latest >= registered, (latest, registered)
    marker = runs.read_marker(storage.fs, storage.join(name, latest))
    assert marker is not None and marker["step"] >= 10, marker
