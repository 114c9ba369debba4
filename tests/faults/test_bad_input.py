"""The bad-input suite (docs/faults.md, "Bad input"): wrong inputs across the kit,
each refused the same way.

Every case in CASES is a wrong input a user could plausibly type or hand over: a flag of the
`rayfleet` CLI, a Pulumi stack file, the `pulumi stack output` JSON, a cluster YAML, an option
of a training or data job, a checkpoint. For each one the test asserts what the user would see:

- a non-zero exit (2, RayfleetError's code) and ONE line on stderr, starting with the
  program's name, that contains the expected words (the key at fault and what to do);
- no traceback and nothing on stdout;
- no AWS API call: botocore's ``_make_api_call`` is counted in-process, and every AWS endpoint
  (botocore and pyarrow's S3 client alike) points at a local "trap" socket that records any
  connection, so even a call through another client would be seen;
- Ray untouched: ``import ray`` is blocked while a case runs (a job option must be refused
  before the job books the cluster);
- no file created, changed or removed: every input lives in the test's folder, beside a
  previous render, a previous run's checkpoints and a previous data output, and the folder's
  file names, sizes, mtimes and hashes are compared before and after.

Cases run in-process through each program's own ``main(argv)`` (the same code path as the
console scripts, which only add ``sys.exit``); a few real subprocesses, one per entry-point
kind, prove the no-traceback property end to end. One refusal must read S3 first (the `llm`
generator's LoRA adapters live in cloud storage, the only place Ray fetches them from): it has
its own test below, against the moto server. Serve HTTP errors (malformed JSON body,
prompt over the context, unknown model, oversized request) are in tests/workloads/test_serve.py
against the deployed app; they are not repeated here.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, REPO, run

pytestmark = pytest.mark.faults

CONFIGS = REPO / "cluster-configs"
EXAMPLE_YAML = CONFIGS / "aws-a100.example.yaml"
EXAMPLE_OUTPUTS = CONFIGS / "examples" / "dev-outputs.json"
EXAMPLE_STACK = REPO / "Pulumi.dev.yaml"
PREVIOUS_RENDER = "# a previous, good render: a failed render must leave it alone\n"


# ----------------------------------------------------------------------------- the inputs

def _stack(tmp: Path, **overrides) -> None:
    doc = yaml.safe_load(EXAMPLE_STACK.read_text())
    for key, value in overrides.items():
        if value is None:
            doc["config"].pop(f"rayfleet:{key}", None)
        else:
            doc["config"][key if ":" in key else f"rayfleet:{key}"] = value
    (tmp / "Pulumi.bad.yaml").write_text(yaml.safe_dump(doc))


def _outputs(tmp: Path, mutate: Callable[[dict], object]) -> None:
    doc = json.loads(EXAMPLE_OUTPUTS.read_text())
    mutate(doc["rayfleet"])
    (tmp / "outputs.json").write_text(json.dumps(doc))


def _cluster(tmp: Path, mutate: Callable[[dict], object]) -> None:
    doc = yaml.safe_load(EXAMPLE_YAML.read_text())
    mutate(doc)
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(doc))


def _write(rel: str, data: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return setup


def _checkpoint(tmp: Path, name: str = "ckpt") -> Path:
    """A finished DDP checkpoint in the kit's layout (tiny model, the kit's own marker)."""
    import torch

    from workloads.common import runs as ckpt
    from workloads.common.model import GPT, PRESETS

    d = tmp / name
    d.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(GPT(PRESETS["tiny"]).state_dict(), d / "model.pt")
    (d / "model_config.json").write_text(json.dumps(PRESETS["tiny"].to_dict()))
    (d / "trainer_state.json").write_text(json.dumps({"step": 10, "epoch": 0,
                                                      "batch_in_epoch": 10}))
    ckpt.write_marker(d, step=10, strategy="ddp", world_size=1, final=True)
    return d


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def _previous_smoke_run(tmp: Path) -> None:
    """A finished `--smoke-test` run (default name smoke-ddp, built-in corpus, 10 steps) in
    {tmp}/runs, with the run file the driver records beside Ray's snapshot."""
    from workloads.common.model import PRESETS
    from workloads.common.runs import RUN_FILE, SNAPSHOT
    from workloads.train.runinfo import run_identity

    run_dir = tmp / "runs" / "smoke-ddp"
    run_dir.mkdir(parents=True)
    d = _checkpoint(run_dir, "checkpoint_2025-01-01_00-00-00.000000")
    (run_dir / SNAPSHOT).write_text(json.dumps(
        {"latest_checkpoint_result": {"checkpoint_dir_name": d.name}}))
    (run_dir / RUN_FILE).write_text(json.dumps(run_identity(PRESETS["tiny"].to_dict(), "ddp",
                                                            2, None)))


def _damaged_checkpoint(how: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        from workloads.common.runs import MARKER

        d = _checkpoint(tmp)
        if how == "truncated":
            _truncate(d / "model.pt")
        elif how == "no-marker":
            (d / MARKER).unlink()
        elif how == "marker-not-json":
            (d / MARKER).write_text('{"step": 10, "files": {')
        elif how == "garbage-same-size":
            size = (d / "model.pt").stat().st_size
            (d / "model.pt").write_bytes(b"\0" * size)
    return setup


def _previous_run_with_truncated_checkpoint(tmp: Path) -> None:
    # What Ray Train V2 leaves in storage: the run folder, its checkpoint, and the snapshot
    # that names the latest checkpoint a re-run resumes from.
    from workloads.common.runs import SNAPSHOT

    run_dir = tmp / "runs" / "gpt"
    run_dir.mkdir(parents=True)
    d = _checkpoint(run_dir, "checkpoint_2025-01-01_00-00-00.000000")
    (run_dir / SNAPSHOT).write_text(json.dumps(
        {"latest_checkpoint_result": {"checkpoint_dir_name": d.name}}))
    _truncate(d / "model.pt")


@functools.cache
def _hf_assets() -> Path:
    """Made once per process (the tokenizer is trained, the rows tokenized): the tiny Llama
    (tests/hf_fixtures.py), instruction rows for it, another model of the same architecture
    with other weights, and a PEFT adapter folder the kit's own export wrote for the first
    (an untrained adapter: what is refused is its base, named in rayfleet_base.json)."""
    from tests.hf_fixtures import (instruction_records, make_hf_model_dir, make_model,
                                   write_jsonl, write_sft_dataset)
    from workloads.train import hf_model, inputs, options

    root = Path(tempfile.mkdtemp(prefix="rayfleet-bad-input-hf-"))
    atexit.register(shutil.rmtree, root, True)
    model = make_hf_model_dir(root / "tiny-llama")
    data = write_sft_dataset(write_jsonl(root / "sft.jsonl", instruction_records()),
                             root / "sft", str(model), 48)
    shutil.copytree(model, root / "other-base")
    make_model(root / "other-base", 512, seed=1)
    opts = options.TrainOptions.parse(["--model", str(model), "--dataset", str(data),
                                      "--lora-r", "8", "--lora-targets", "q_proj,v_proj"])
    spec, source, tokenizer = inputs.resolve_hf(opts, inputs.dataset_manifest(str(data)))
    lm = hf_model.build(source, spec.config, lora=spec.lora)
    hf_model.export_adapter(lm.state_dict(), spec.lora, tokenizer, root / "adapter")
    return root


def _hf(*names: str) -> Callable[[Path], None]:
    """Copies of _hf_assets' folders into the case's folder."""
    def setup(tmp: Path) -> None:
        for name in names:
            shutil.copytree(_hf_assets() / name, tmp / name)
    return setup


def _parquet_without_tokens(tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "ds").mkdir()
    pq.write_table(pa.table({"text": ["a document"]}), tmp / "ds" / "shard-00000-000.parquet")


def _jsonl(lines: list[bytes]) -> Callable[[Path], None]:
    return _write("corpus/a.jsonl", b"".join(line + b"\n" for line in lines))


LATIN1_JSONL = [('{"text": "Cr\u00e8me br\u00fbl\u00e9e number %d, a latin-1 document"}' % i)
                .encode("latin-1") for i in range(20)]
GOOD_JSONL = [json.dumps({"body": f"document {i} " * 8}).encode() for i in range(20)]


# ----------------------------------------------------------------------------- the cases

@dataclass(frozen=True)
class Case:
    id: str
    program: str          # rayfleet | workloads.train | workloads.data | checkpoint | serve
    argv: list[str]       # {tmp} is the test's folder, {yaml} the example cluster YAML
    expected: str         # words the one error line must contain
    setup: Callable[[Path], None] | None = None
    code: int = 2
    call: Callable[[Path], object] | None = field(default=None, compare=False)


def _validate(rel: str) -> Callable[[Path], object]:
    def call(tmp: Path):
        from workloads.common.runs import validate

        return validate(tmp / rel)
    return call


def _load_weights(tmp: Path):
    from workloads.common.runs import load_full_weights

    return load_full_weights(tmp / "ckpt")


def _serve_app(ckpt: str = "ckpt", adapter: str | None = None,
               **args) -> Callable[[Path], object]:
    def call(tmp: Path):
        # What the Serve config's builder (`serve deploy`) and `rayfleet serve-config` check
        # before any replica exists.
        from workloads.serve.lm import check_args

        return check_args({"checkpoint": str(tmp / ckpt), **args,
                           **({"adapter": str(tmp / adapter)} if adapter else {})})
    return call


RENDER = ["render", "{tmp}/outputs.json", "-o", "{tmp}/generated.yaml",
          "--token-file", "{tmp}/home/clusters/rayfleet-dev/auth_token"]
COST_STACK = ["cost", "{yaml}", "--stack-file", "{tmp}/Pulumi.bad.yaml"]
TRAIN = ["--storage-path", "{tmp}/runs"]
DATA = ["--output", "{tmp}/data-out"]
HF_TRAIN = ["--model", "{tmp}/tiny-llama", "--dataset", "{tmp}/sft", *TRAIN]
SPOT = "ray.worker.p4d.24xlarge.spot"

CASES = [
    # -- the rayfleet CLI itself
    Case("cli-unknown-command", "rayfleet", ["frobnicate"], "invalid choice: 'frobnicate'"),
    Case("cli-missing-argument", "rayfleet", ["cost"], "required: CLUSTER_YAML"),
    Case("cli-gpus-not-a-number", "rayfleet", ["preflight", "{yaml}", "--num-gpus", "two"],
         "argument --num-gpus: expected a number, got 'two'"),
    Case("local-port-out-of-range", "rayfleet", ["local", "up", "--port", "99999"],
         "--port: must be a TCP port between 1 and 65535"),
    Case("local-object-store-size", "rayfleet",
         ["local", "up", "--object-store-memory", "lots"], "cannot read 'lots' as a size"),
    Case("local-status-without-cluster", "rayfleet", ["local", "status"],
         "no rayfleet local cluster is running; start one with `rayfleet local up`"),
    Case("sweep-bad-cluster-name", "rayfleet", ["sweep", "--cluster-name", "my cluster*",
                                                "--region", "us-east-1"],
         "--cluster-name: 'my cluster*' is not a Ray cluster name"),
    Case("sweep-region-typo", "rayfleet", ["sweep", "--cluster-name", "c", "--region",
                                           "us-east1"], 'did you mean "us-east-1"'),
    # Not the AWS profile's region, which may not be the cluster's: no guess, no AWS call.
    Case("sweep-name-without-region", "rayfleet", ["sweep", "--cluster-name", "c"],
         "--region: required with --cluster-name"),
    Case("sweep-yaml-region-typo", "rayfleet", ["sweep", "{tmp}/cluster.yaml"],
         "provider.region: 'us-east1' is not an AWS region (did you mean \"us-east-1\"?)",
         lambda t: _cluster(t, lambda c: c["provider"].update(region="us-east1"))),
    Case("logs-run-before-its-yaml", "rayfleet", ["logs", "my-run", "{yaml}"],
         f"the cluster YAML comes first: rayfleet logs {EXAMPLE_YAML} my-run"),
    # -- the stack config (Pulumi.<stack>.yaml), as `rayfleet cost --stack-file` reads it
    Case("stack-world-open-cidr", "rayfleet", COST_STACK,
         "rayfleet:operatorCidrs: 0.0.0.0/0 opens SSH and the dashboard to the whole internet",
         lambda t: _stack(t, operatorCidrs=["0.0.0.0/0"])),
    Case("stack-malformed-cidr", "rayfleet", COST_STACK,
         "rayfleet:operatorCidrs: '10.0.0.0/33' is not a CIDR",
         lambda t: _stack(t, operatorCidrs=["10.0.0.0/33"])),
    Case("stack-unknown-instance-type", "rayfleet", COST_STACK,
         'rayfleet:workerInstanceTypes: \'p4d.24xlage\' is not a GPU worker type of the '
         'catalog; allowed: p4d.24xlarge, p4de.24xlarge, p5.48xlarge, p5e.48xlarge, '
         'p5en.48xlarge (did you mean "p4d.24xlarge"?)',
         lambda t: _stack(t, workerInstanceTypes=["p4d.24xlarge", "p4d.24xlage"])),
    Case("stack-duplicate-instance-type", "rayfleet", COST_STACK,
         "rayfleet:workerInstanceTypes: lists p4d.24xlarge twice",
         lambda t: _stack(t, workerInstanceTypes=["p4d.24xlarge", "p4d.24xlarge"])),
    Case("stack-no-instance-type", "rayfleet", COST_STACK,
         "rayfleet:workerInstanceTypes: is empty; name at least one GPU worker type",
         lambda t: _stack(t, workerInstanceTypes=[])),
    Case("stack-retired-single-type-key", "rayfleet", COST_STACK,
         "rayfleet:workerInstanceType: was replaced by rayfleet:workerInstanceTypes, a list, "
         "most preferred first; set rayfleet:workerInstanceTypes: [p5.48xlarge] instead",
         lambda t: _stack(t, workerInstanceType="p5.48xlarge")),
    Case("stack-region-without-p4d", "rayfleet", COST_STACK,
         "rayfleet:workerInstanceTypes: p4d.24xlarge is not offered in rayfleet:region "
         "us-west-1", lambda t: _stack(t, region="us-west-1", workerAz="")),
    Case("stack-min-over-max", "rayfleet", COST_STACK,
         "rayfleet:minWorkers: is 3 but rayfleet:maxWorkers is 2",
         lambda t: _stack(t, minWorkers=3, maxWorkers=2)),
    Case("stack-invalid-bucket-name", "rayfleet", COST_STACK,
         "rayfleet:bucketPrefix: 'Rayfleet_Data' may hold only lowercase letters",
         lambda t: _stack(t, bucketPrefix="Rayfleet_Data")),
    Case("stack-gpu-head", "rayfleet", COST_STACK,
         "rayfleet:headInstanceType: p4d.24xlarge is a GPU type",
         lambda t: _stack(t, headInstanceType="p4d.24xlarge")),
    Case("stack-typo-key", "rayfleet", COST_STACK, "rayfleet:azcount: is not a rayfleet setting",
         lambda t: _stack(t, **{"rayfleet:azcount": 3})),
    Case("stack-capacity-block-by-group", "rayfleet", COST_STACK,
         "rayfleet:capacityReservations[0].resourceGroupArn: cannot target a Capacity Block",
         lambda t: _stack(t, capacityReservations=[{
             "instanceType": "p4d.24xlarge", "availabilityZone": "us-east-1b",
             "capacityBlock": True,
             "resourceGroupArn": "arn:aws:resource-groups:us-east-1:123456789012:group/g"}])),
    Case("stack-reservation-of-another-type", "rayfleet", COST_STACK,
         "rayfleet:capacityReservations[0].instanceType: 'p5.48xlarge' is not one of "
         "rayfleet:workerInstanceTypes",
         lambda t: _stack(t, capacityReservations=[{
             "instanceType": "p5.48xlarge", "availabilityZone": "us-east-1b",
             "id": "cr-0123456789abcdef0"}])),
    Case("stack-fallback-az-is-the-workers", "rayfleet", COST_STACK,
         "rayfleet:workerFallbackAzs: lists us-east-1b, which is rayfleet:workerAz",
         lambda t: _stack(t, workerFallbackAzs=["us-east-1c", "us-east-1b"])),
    Case("stack-fallback-az-of-another-region", "rayfleet", COST_STACK,
         "rayfleet:workerFallbackAzs: 'us-west-2c' is not an availability zone of "
         'rayfleet:region us-east-1 (expected a list such as [us-east-1c]) (did you mean '
         '"us-east-1c"?)', lambda t: _stack(t, workerFallbackAzs=["us-west-2c"])),
    Case("stack-not-utf8", "rayfleet", COST_STACK, "is not UTF-8 text",
         _write("Pulumi.bad.yaml", "config:\n  rayfleet:clusterName: caf\u00e9\n"
                .encode("latin-1"))),
    # -- the stack outputs JSON that `rayfleet render` turns into a cluster YAML
    Case("outputs-missing-file", "rayfleet", RENDER, "outputs.json: no such file"),
    Case("outputs-reservation-without-target", "rayfleet", RENDER,
         "node_types.workers[0].capacity_reservation: must name exactly one of id and "
         "resource_group_arn",
         lambda t: _outputs(t, lambda o: o["node_types"]["workers"][0].update(
             market="reserved", capacity_reservation={"availability_zone": "us-east-1b",
                                                      "subnet_id": "subnet-1"}))),
    Case("outputs-not-json", "rayfleet", RENDER, "not JSON",
         _write("outputs.json", "{'rayfleet': 1}")),
    Case("outputs-missing-key", "rayfleet", RENDER, "lacks private_subnet_ids",
         lambda t: _outputs(t, lambda o: o.pop("private_subnet_ids"))),
    Case("outputs-unknown-instance-type", "rayfleet", RENDER, 'did you mean "p4d.24xlarge"',
         lambda t: _outputs(t, lambda o: o["node_types"]["workers"][0].update(
             instance_type="p4d.24xlage"))),
    Case("outputs-min-over-max", "rayfleet", RENDER,
         "node_types.workers[0]: min_workers 3 must be an integer between 0 and max_workers 1",
         lambda t: _outputs(t, lambda o: o["node_types"]["workers"][0].update(min_workers=3))),
    Case("outputs-schema-version", "rayfleet", RENDER, "schema_version 3 is not 2",
         lambda t: _outputs(t, lambda o: o.update(schema_version=3))),
    Case("outputs-older-schema", "rayfleet", RENDER,
         "schema_version 1 is older than 2 (one worker type; now "
         "rayfleet:workerInstanceTypes, several); re-run `pulumi up`",
         lambda t: _outputs(t, lambda o: o.update(schema_version=1))),
    Case("render-out-is-a-folder", "rayfleet", [*RENDER[:2], "-o", "{tmp}", *RENDER[4:]],
         "is a folder; name the YAML file to write", lambda t: _outputs(t, lambda o: None)),
    Case("render-token-under-a-file", "rayfleet",
         [*RENDER[:4], "--token-file", "{tmp}/generated.yaml/auth_token"],
         "--token-file", lambda t: _outputs(t, lambda o: None)),
    Case("render-idle-timeout-zero", "rayfleet", [*RENDER, "--idle-timeout", "0"],
         "--idle-timeout: must be at least 1 minute"),
    # -- cluster YAMLs, as lint / cost / preflight read them
    Case("yaml-not-yaml", "rayfleet", ["lint", "{tmp}/cluster.yaml"], "not valid YAML at line",
         _write("cluster.yaml", "provider:\n  type: [aws\n")),
    Case("yaml-not-a-cluster", "rayfleet", ["lint", "{tmp}/cluster.yaml"],
         "not a Ray cluster YAML (no provider: section)", _write("cluster.yaml", "- a\n- b\n")),
    Case("yaml-provider-not-a-mapping", "rayfleet", ["preflight", "{tmp}/cluster.yaml"],
         "provider: must be a mapping", lambda t: _cluster(t, lambda c: c.update(provider="aws"))),
    Case("yaml-unknown-instance-type", "rayfleet", ["cost", "{tmp}/cluster.yaml"],
         'InstanceType: \'p4d.24xlage\' is not in the price table of 2025-06-15 (did you mean '
         '"p4d.24xlarge"?)', lambda t: _cluster(t, lambda c: c["available_node_types"][SPOT][
             "node_config"].update(InstanceType="p4d.24xlage"))),
    Case("yaml-min-over-max", "rayfleet", ["cost", "{tmp}/cluster.yaml"],
         f"available_node_types.{SPOT}: min_workers 5 > max_workers 1",
         lambda t: _cluster(t, lambda c: c["available_node_types"][SPOT].update(min_workers=5))),
    Case("yaml-workers-not-a-number", "rayfleet", ["cost", "{tmp}/cluster.yaml"],
         f"{SPOT}.max_workers: must be a whole number >= 0, got 'two'",
         lambda t: _cluster(t, lambda c: c["available_node_types"][SPOT].update(
             max_workers="two"))),
    Case("yaml-node-type-empty", "rayfleet", ["cost", "{tmp}/cluster.yaml"],
         f"available_node_types.{SPOT}: must be a mapping",
         lambda t: _cluster(t, lambda c: c["available_node_types"].update({SPOT: None}))),
    Case("cost-hours-nan", "rayfleet", ["cost", "{yaml}", "--hours-per-month", "nan"],
         "--hours-per-month: must be between 0 and 744, got nan"),
    Case("cost-negative-budget", "rayfleet", ["cost", "{yaml}", "--budget-usd", "-5"],
         "--budget-usd: must be a positive amount of USD"),
    Case("preflight-more-gpus-than-any-node", "rayfleet",
         ["preflight", "{yaml}", "--num-gpus", "16"],
         "no node type offers 16 GPUs (the most is 8)"),
    Case("preflight-region-typo", "rayfleet", ["preflight", "{tmp}/cluster.yaml"],
         "provider.region: 'us-east1' is not an AWS region (did you mean \"us-east-1\"?)",
         lambda t: _cluster(t, lambda c: c["provider"].update(region="us-east1"))),
    Case("preflight-not-an-aws-cluster", "rayfleet",
         ["preflight", str(CONFIGS / "onprem.yaml")], "preflight checks AWS clusters"),
    # -- training job options: refused before Ray is imported, let alone the cluster booked
    Case("train-nan-learning-rate", "workloads.train", ["--lr", "nan", *TRAIN],
         "--lr: must be a positive finite number, got nan"),
    Case("train-negative-learning-rate", "workloads.train", ["--lr=-3e-4", *TRAIN],
         "--lr: must be a positive finite number, got -0.0003"),
    Case("train-hang-bound-below-the-floor", "workloads.train",
         ["--hang-floor-s", "5", *TRAIN],
         "--hang-floor-s: must be 0 (no watch) or at least 10 seconds, got 5"),
    Case("train-hang-factor-nan", "workloads.train", ["--hang-factor", "nan", *TRAIN],
         "--hang-factor: must be at least 2, got nan"),
    Case("train-zero-batch-size", "workloads.train", ["--batch-size", "0", *TRAIN],
         "--batch-size: must be at least 1"),
    Case("train-zero-workers", "workloads.train", ["--num-workers", "0", *TRAIN],
         "--num-workers: must be at least 1, got 0"),
    Case("train-unknown-model", "workloads.train", ["--model", "125M", *TRAIN],
         'unknown model size \'125M\'; allowed: tiny, small, 125m, 350m, 760m, 1b (did you '
         'mean "125m"?)'),
    Case("train-unknown-strategy", "workloads.train", ["--strategy", "dpp", *TRAIN],
         '--strategy: unknown strategy \'dpp\'; allowed: ddp, fsdp, deepspeed (did you mean '
         '"ddp"?)'),
    Case("train-zero-stage-1", "workloads.train", ["--zero-stage", "1", *TRAIN],
         "--zero-stage: must be 2 or 3"),
    Case("train-resources-not-json", "workloads.train",
         ["--resources-per-worker", "{{GPU: 1}}", *TRAIN], "must be a JSON object of numbers"),
    Case("train-invalid-bucket-name", "workloads.train",
         ["--storage-path", "s3://My_Bucket/runs"], "'My_Bucket' is not a valid S3 bucket name"),
    Case("train-name-escapes-storage", "workloads.train", ["--name", "../elsewhere", *TRAIN],
         "--name: '../elsewhere' must be letters, digits"),
    Case("train-corpus-smaller-than-a-batch", "workloads.train",
         ["--corpus-bytes", "1000", *TRAIN], "--corpus-bytes: 1000 bytes make 7 sequences"),
    Case("train-env-without-value", "workloads.train", ["--env", "WANDB_MODE", *TRAIN],
         "--env expects KEY=VALUE, got 'WANDB_MODE'"),
    Case("train-unknown-flag", "workloads.train", ["--epochs", "3", *TRAIN],
         "unrecognized arguments: --epochs 3"),
    Case("train-dataset-missing", "workloads.train", ["--dataset", "{tmp}/no-such-data", *TRAIN],
         "no-such-data does not exist; give 'stdlib' or the --output folder of workloads.data"),
    Case("train-dataset-without-tokens", "workloads.train", ["--dataset", "{tmp}/ds", *TRAIN],
         "has no 'tokens' column (columns: text)", _parquet_without_tokens),
    # The same --name again with another model or dataset: never a silent "resume".
    Case("train-same-name-other-model", "workloads.train",
         ["--smoke-test", "--seq-len", "32", "--storage-path", "{tmp}/runs"],
         "--name: run 'smoke-ddp' in {tmp}/runs has a model of another shape: model.seq_len 64 "
         "(this run: 32)", _previous_smoke_run),
    Case("train-same-name-other-dataset", "workloads.train",
         ["--smoke-test", "--dataset", "stdlib", "--storage-path", "{tmp}/runs"],
         "exists with other settings: dataset built-in corpus (this run: stdlib); the same "
         "--name resumes it: give a new --name, or --allow-changes", _previous_smoke_run),
    Case("train-resume-truncated-checkpoint", "workloads.train",
         ["--name", "gpt", *TRAIN], "is corrupt: model.pt is",
         _previous_run_with_truncated_checkpoint),
    # LoRA (--lora-r): refused before any worker, the model folder read but nothing written.
    Case("train-lora-on-byte-gpt", "workloads.train", ["--smoke-test", "--lora-r", "8", *TRAIN],
         "--lora-r: is for Hugging Face models (--model <folder>); the kit's byte GPT trains "
         "all its weights"),
    Case("train-lora-targets-match-no-module", "workloads.train",
         [*HF_TRAIN, "--lora-r", "8", "--lora-targets", "q_proj,qkv_proj"],
         "--lora-targets: Target modules ['qkv_proj'] not found in the base model",
         _hf("tiny-llama", "sft")),
    Case("train-lora-all-linear-in-a-list", "workloads.train",
         [*HF_TRAIN, "--lora-r", "8", "--lora-targets", "all-linear,lm_head"],
         "--lora-targets: all-linear stands alone", _hf("tiny-llama", "sft")),
    Case("train-lora-flag-without-rank", "workloads.train", [*HF_TRAIN, "--lora-alpha", "16"],
         "--lora-alpha: needs --lora-r (LoRA's rank)", _hf("tiny-llama", "sft")),
    Case("train-lora-dropout-out-of-range", "workloads.train",
         [*HF_TRAIN, "--lora-r", "8", "--lora-dropout", "1.5"],
         "--lora-dropout: must be in [0, 1), got 1.5", _hf("tiny-llama", "sft")),
    Case("train-lora-on-fresh-weights", "workloads.train",
         ["--model-config", "{tmp}/tiny-llama", *HF_TRAIN[2:], "--lora-r", "8"],
         "--lora-r: adapts pretrained weights", _hf("tiny-llama", "sft")),
    # --hf-shard-size: the hf/ export's largest file.
    Case("train-hf-shard-size-unreadable", "workloads.train",
         [*HF_TRAIN, "--hf-shard-size", "lots"],
         "--hf-shard-size: cannot read 'lots' as a size; use e.g. 2GB or 512MiB",
         _hf("tiny-llama", "sft")),
    Case("train-hf-shard-size-on-byte-gpt", "workloads.train",
         ["--smoke-test", "--hf-shard-size", "1GB", *TRAIN],
         "--hf-shard-size: is for Hugging Face models (--model <folder>)"),
    # -- data job options and corpora
    Case("data-missing-input", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "--input: {tmp}/corpus does not exist"),
    Case("data-empty-corpus", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "holds no text files (.txt, .md, .py, .rst); the corpus is empty",
         lambda t: (t / "corpus").mkdir()),
    Case("data-empty-files", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "every input file is empty", _write("corpus/a.txt", "")),
    Case("data-corpus-shorter-than-a-sequence", "workloads.data",
         ["--input", "{tmp}/corpus", *DATA], "is shorter than one sequence of 129 tokens",
         _write("corpus/a.txt", "too short\n")),
    Case("data-non-utf8-jsonl", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "a.jsonl line 1 is not UTF-8", _jsonl(LATIN1_JSONL)),
    Case("data-malformed-jsonl", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "a.jsonl line 21 is not JSON", _jsonl([*GOOD_JSONL, b'{"body": "unterminated'])),
    Case("data-unknown-column", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "--column: no column 'text'", _jsonl(GOOD_JSONL)),
    Case("data-mixed-formats", "workloads.data", ["--input", "{tmp}/corpus", *DATA],
         "mixes jsonl, text files; pick one",
         lambda t: (_jsonl(GOOD_JSONL)(t), _write("corpus/b.txt", "x" * 500)(t))),
    Case("data-zero-seq-len", "workloads.data", ["--seq-len", "0", *DATA],
         "--seq-len: must be at least 1"),
    Case("data-output-is-a-file", "workloads.data",
         ["--input", "{tmp}/corpus", "--output", "{tmp}/corpus/a.txt"],
         "cannot create the folder", _write("corpus/a.txt", "a line of text\n" * 40)),
    # -- checkpoints, through the validators that guard resume and serving
    Case("checkpoint-missing", "checkpoint", [], "does not exist", call=_validate("nope")),
    Case("checkpoint-never-finished", "checkpoint", [],
         "is incomplete (no rayfleet_checkpoint.json); it was never finished",
         _damaged_checkpoint("no-marker"), call=_validate("ckpt")),
    Case("checkpoint-marker-not-json", "checkpoint", [],
         "is corrupt (rayfleet_checkpoint.json is not JSON)",
         _damaged_checkpoint("marker-not-json"), call=_validate("ckpt")),
    Case("checkpoint-truncated-weights", "checkpoint", [], "is corrupt: model.pt is",
         _damaged_checkpoint("truncated"), call=_load_weights),
    Case("checkpoint-garbage-weights", "checkpoint", [], "cannot load model.pt",
         _damaged_checkpoint("garbage-same-size"), call=_load_weights),
    Case("serve-truncated-checkpoint", "serve", [], "is corrupt: model.pt is",
         _damaged_checkpoint("truncated"), call=_serve_app()),
    Case("serve-unknown-app-argument", "serve", [],
         'args.max_batch: unknown argument for the lm app', lambda t: _checkpoint(t),
         call=_serve_app(max_batch=4)),
    Case("serve-lora-adapter-of-another-base", "serve", [],
         "args.adapter: the adapter {tmp}/adapter was trained on ",
         _hf("other-base", "adapter"), call=_serve_app("other-base", adapter="adapter")),
]


# ----------------------------------------------------------------------------- the guards

class Trap:
    """A loopback TCP listener that records every connection: every AWS endpoint points here
    during a case, so any AWS call, from botocore or pyarrow's own S3 client, is seen."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits: list[tuple] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            self.hits.append(peer)
            conn.close()


@pytest.fixture(scope="module")
def trap():
    t = Trap()
    yield t
    t.sock.close()


def aws_env(trap: Trap, home: Path) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": trap.url, "AWS_ENDPOINT_URL_S3": trap.url,
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            # One attempt: a call that slips through fails at once instead of retrying.
            "AWS_MAX_ATTEMPTS": "1", "RAYFLEET_HOME": str(home),
            "RAYFLEET_STORAGE": str(home / "default-storage")}


@pytest.fixture
def guarded(trap, tmp_path, monkeypatch, aws_calls):
    """Env pointing AWS at the trap, botocore calls counted, `import ray` blocked."""
    for k, v in aws_env(trap, tmp_path / "home").items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    trap.hits.clear()
    return aws_calls


def snapshot(root: Path) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel] = ("dir",)
        else:
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def assert_refused(rc: int, out: str, err: str, prog: str, expected: str, code: int = 2,
                   quiet_stdout: bool = True) -> str:
    """The user's view of a refused input: exit code, one line naming it, no traceback."""
    assert "Traceback" not in out + err, err[-3000:]
    assert rc == code != 0, f"exit {rc}: {err[-2000:]}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err[-3000:]}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"
    if quiet_stdout:
        assert out.strip() == "", out[-2000:]
    return lines[0]


# ----------------------------------------------------------------------------- the tests

def _main(program: str) -> Callable[[list[str]], int]:
    if program == "rayfleet":
        from rayfleet.commands.cli import main
    elif program == "workloads.train":
        from workloads.train.driver import main
    elif program == "workloads.data":
        from workloads.data.pipeline import main
    else:
        raise AssertionError(program)
    return main


def _as_entry_point(case: Case, tmp: Path) -> Callable[[list[str]], int]:
    """Validators are not programs: run them as an entry point runs its work, so their error
    reaches the user the same way (run_main: one line, exit code 2)."""
    from rayfleet.entrypoint import run_main

    def work(_argv) -> int:
        case.call(tmp)
        return 0  # accepted: the test fails on the exit code

    return lambda argv: run_main(work, argv, case.program)


def test_at_least_thirty_distinct_cases():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) >= 30
    kinds = {c.program for c in CASES}
    assert kinds == {"rayfleet", "workloads.train", "workloads.data", "checkpoint", "serve"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_no_aws_no_ray_nothing_written(case, tmp_path, guarded, trap,
                                                             monkeypatch, capsys):
    # The inputs a user already has: a previous good render, and a previous data output.
    (tmp_path / "generated.yaml").write_text(PREVIOUS_RENDER)
    (tmp_path / "data-out" / "_done").mkdir(parents=True)
    (tmp_path / "data-out" / "_done" / "shard-00000.json").write_text('{"shard": 0}')
    if case.setup:
        case.setup(tmp_path)
    # Import what the case runs before `import ray` is blocked (importing is not using Ray;
    # the serve app module imports Ray Serve at module level, as Serve's import_path needs).
    main = _as_entry_point(case, tmp_path) if case.call else _main(case.program)
    started: list[str] = []
    if case.program == "serve":
        import ray
        from ray import serve

        import workloads.serve.lm  # noqa: F401

        # Ray Serve is imported, but no cluster is started or joined and nothing deployed.
        for mod, name in ((ray, "init"), (serve, "start"), (serve, "run")):
            monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: started.append(_n))
    else:
        # Every Ray module, not only `ray`: `from ray.data import X` would otherwise still
        # succeed once an earlier test had imported ray.data (sys.modules is looked at first).
        for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")] or ["ray"]:
            monkeypatch.setitem(sys.modules, name, None)
    before = snapshot(tmp_path)
    argv = [a.format(tmp=tmp_path, yaml=EXAMPLE_YAML) for a in case.argv]
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert_refused(rc, out, err, case.program, case.expected.format(tmp=tmp_path), case.code)
    assert guarded == [], f"AWS API calls made: {guarded}"
    assert trap.hits == [], "something connected to the AWS endpoint"
    assert started == [], f"Ray used: {started}"
    assert snapshot(tmp_path) == before, "a file was created, changed or removed"


def test_a_finished_run_says_so_and_trains_nothing(tmp_path, monkeypatch, capsys):
    """Re-running a finished run's command answers that it is finished: no Ray, no summary
    that looks like a fresh run, nothing in storage changed."""
    from workloads.train.driver import main

    _previous_smoke_run(tmp_path)
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")] or ["ray"]:
        monkeypatch.setitem(sys.modules, name, None)
    before = snapshot(tmp_path)
    rc = main(["--smoke-test", "--max-steps", "10", "--storage-path", str(tmp_path / "runs")])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines() == [
        f"[rayfleet] run 'smoke-ddp' already finished at step 10 (--max-steps 10; checkpoint "
        f"{tmp_path}/runs/smoke-ddp/checkpoint_2025-01-01_00-00-00.000000); nothing to train: "
        "a new --name starts a new run, a larger --max-steps continues this one"]
    assert snapshot(tmp_path) == before


def test_the_guards_see_an_aws_call(tmp_path, guarded, trap, capsys):
    """The counters are live: a valid command that does call AWS is seen by both (so an
    empty count above means no call, not a blind counter)."""
    from rayfleet.commands.cli import main

    rc = main(["sweep", "--cluster-name", "rayfleet-dev", "--region", "us-east-1"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot list EC2 resources" in err
    assert guarded and guarded[0] == "DescribeInstances"
    assert trap.hits


def test_llm_config_refuses_a_lora_adapter_of_another_base_in_one_line(moto_server, tmp_path,
                                                                         monkeypatch, capsys):
    """The `llm` generator's --lora-path is cloud storage (Ray 2.60 fetches adapters from there
    only), so its adapters are read from S3 (the moto server) before anything is written: not
    a CASES row, whose guard is no AWS call at all. Otherwise refused the same way: an adapter
    the kit trained on the tiny Llama, served on other weights, is one line, exit 2, no
    traceback, no config written, Ray not imported."""
    import boto3

    from workloads.serve import llm_config

    bucket = "rayfleet-bad-input"
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=bucket)
    for f in (_hf_assets() / "adapter").iterdir():
        s3.upload_file(str(f), bucket, f"adapters/sft/{f.name}")
    _hf("other-base")(tmp_path)
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": moto_server,
                 "RAYFLEET_HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")] or ["ray"]:
        monkeypatch.setitem(sys.modules, name, None)
    before = snapshot(tmp_path)
    capsys.readouterr()
    rc = llm_config.main(["--device", "cpu", "--model-id", "tiny", "--max-model-len", "256",
                          "--model-source", str(tmp_path / "other-base"),
                          "--lora-path", f"s3://{bucket}/adapters", "--max-lora-rank", "8",
                          "--output", str(tmp_path / "llm.yaml")])
    out, err = capsys.readouterr()
    # (stdout may hold vLLM's import-time log lines: the generator checks the model against
    # vLLM's own config code; the refusal is stderr's one line.)
    line = assert_refused(rc, out, err, llm_config.PROG,
                          f"--lora-path: the adapter s3://{bucket}/adapters/sft was trained on "
                          f"{_hf_assets() / 'tiny-llama'} (weights ", quiet_stdout=False)
    assert f"not on {tmp_path / 'other-base'} (weights " in line
    assert snapshot(tmp_path) == before


# One real process per entry-point kind: the console script or `python -m`, as a user runs
# it, with AWS pointed at the trap and Ray at nothing.
SUBPROCESS_CASES = [
    ("rayfleet-console-script", [str(BIN / "rayfleet"), *COST_STACK], "rayfleet",
     "0.0.0.0/0 opens SSH", lambda t: _stack(t, operatorCidrs=["0.0.0.0/0"])),
    ("python-m-workloads.train", [str(BIN / "python"), "-m", "workloads.train", "--lr", "nan",
                                  *TRAIN], "workloads.train", "--lr: must be a positive", None),
    ("python-m-workloads.data", [str(BIN / "python"), "-m", "workloads.data", "--input",
                                 "{tmp}/corpus", *DATA], "workloads.data",
     "a.jsonl line 1 is not UTF-8", _jsonl(LATIN1_JSONL)),
]


@pytest.mark.parametrize("name,cmd,prog,expected,setup", SUBPROCESS_CASES,
                         ids=[c[0] for c in SUBPROCESS_CASES])
def test_real_process_one_line_no_traceback(name, cmd, prog, expected, setup, tmp_path, trap):
    if setup:
        setup(tmp_path)
    env = {**os.environ, **aws_env(trap, tmp_path / "home")}
    env.pop("RAY_ADDRESS", None)
    trap.hits.clear()
    before = snapshot(tmp_path)
    proc = run([a.format(tmp=tmp_path, yaml=EXAMPLE_YAML) for a in cmd], env=env, timeout=120)
    assert_refused(proc.returncode, proc.stdout, proc.stderr, prog, expected)
    assert trap.hits == []
    assert snapshot(tmp_path) == before


@pytest.mark.ray
def test_non_utf8_text_corpus_on_the_cluster_leaves_no_partial_shard(ray_cluster, tmp_path):
    """A latin-1 text corpus is only found out while Ray Data cleans it (one document per
    file, decoded on the workers): the job still ends in one line, and the output folder it
    created is gone again - no empty shard a re-run would skip, no half-written file."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes("".join(
        f"Cr\u00e8me br\u00fbl\u00e9e, caf\u00e9, d\u00e9j\u00e0 vu: line {i} of a latin-1 "
        "document.\n" for i in range(300)).encode("latin-1"))
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    proc = run([str(BIN / "python"), "-m", "workloads.data", "--smoke-test", "--input",
                str(corpus), "--output", str(out)], env=ray_cluster["env"], timeout=300)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("workloads.data: error: "), errors
    assert "nothing left after cleaning" in errors[0] and "not UTF-8" in errors[0]
    assert not out.exists()
    assert snapshot(tmp_path) == before
