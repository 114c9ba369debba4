"""workloads.train on the real local Ray cluster: each strategy, S3 checkpoints on a real moto
server (and serving from them), fail-fast resource checks and bad input."""

import json
import time

import pytest

from tests.conftest import BIN, run, summary_of

pytestmark = pytest.mark.ray
TRAIN = [str(BIN / "python"), "-m", "workloads.train"]


def train(ray_cluster, args, extra_env=None, timeout=400):
    """The driver run directly against the cluster (RAY_ADDRESS), as a notebook would."""
    return run(TRAIN + args, env={**ray_cluster["env"], **(extra_env or {})}, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_strategies_train_and_write_per_rank_shards(ray_cluster, tmp_path, strategy):
    proc = train(ray_cluster, ["--smoke-test", "--strategy", strategy, "--max-steps", "10",
                               "--checkpoint-every", "10", "--storage-path", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    s = summary_of(proc.stdout)
    assert s["steps"] == 10 and s["final_loss"] < s["first_loss"]
    marker = json.loads((tmp_path / f"smoke-{strategy}" / s["checkpoint"].rsplit("/", 1)[1]
                         / "rayfleet_checkpoint.json").read_text())
    files = marker["files"]
    if strategy == "fsdp":
        assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= set(files) or \
            marker["world_size"] == 2  # rank 1's shard is merged in by Ray, not in rank 0's list
        ckdir = tmp_path / "smoke-fsdp" / s["checkpoint"].rsplit("/", 1)[1] / "dcp"
        assert (ckdir / "__1_0.distcp").exists() and (ckdir / "__0_0.distcp").exists()
    else:
        ckdir = tmp_path / "smoke-deepspeed" / s["checkpoint"].rsplit("/", 1)[1] / "ds" / "ckpt"
        assert len(list(ckdir.glob("zero_pp_rank_*_optim_states.pt"))) == 2
    assert "model.pt" in files  # full weights on the final checkpoint, for serving


@pytest.mark.moto
def test_s3_checkpoints_on_moto_serve_from_s3(ray_cluster, aws_env, s3_client, checkpoint_bucket,
                                             monkeypatch):
    # Resuming from S3 (and from a local path, by name) is fault 2's and fault 4's subject in
    # tests/faults/test_train_faults.py, and `ray job submit` of training is the demo's and
    # fault 2's; here: a DDP smoke run, what it leaves in the bucket, and serving from it.
    proc = train(ray_cluster, ["--smoke-test", "--name", "s3-run", "--checkpoint-every", "5",
                               "--max-steps", "10", "--storage-path",
                               f"s3://{checkpoint_bucket}/runs"], aws_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    keys = [o["Key"] for o in s3_client.list_objects_v2(
        Bucket=checkpoint_bucket, Prefix="runs/s3-run/")["Contents"]]
    assert any(k.endswith("/rayfleet_checkpoint.json") for k in keys)
    assert any(k.endswith("/model.pt") for k in keys)
    assert "runs/s3-run/loss.png" in keys and "runs/s3-run/metrics.csv" in keys
    s = summary_of(proc.stdout)
    assert s["steps"] == 10 and s["strategy"] == "ddp" and s["final_loss"] < s["first_loss"]
    assert "global batch 16 seqs = 8 x 1 accum x 2 workers" in proc.stdout
    assert "lr 0.003 x 2 = 0.006" in proc.stdout   # linear LR scaling with world size
    png = s3_client.get_object(Bucket=checkpoint_bucket, Key="runs/s3-run/loss.png")
    assert png["Body"].read()[:4] == b"\x89PNG"
    final = s["checkpoint"]
    assert final.startswith(f"s3://{checkpoint_bucket}/runs/")
    # ... and the `lm` app's loader serves straight from that s3:// checkpoint.
    from workloads.serve.lm import check_checkpoint, load_checkpoint

    for key, value in aws_env.items():
        monkeypatch.setenv(key, value)
    assert check_checkpoint(final)["step"] == 10
    model_config, state = load_checkpoint(final)
    assert model_config["seq_len"] == 64 and "tok.weight" in state


def test_gpus_on_cpu_cluster_fail_in_seconds(ray_cluster, tmp_path):
    t0 = time.time()
    proc = train(ray_cluster, ["--smoke-test", "--use-gpu", "--storage-path", str(tmp_path)],
                 timeout=120)
    assert proc.returncode == 2
    assert "no GPU at all" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert time.time() - t0 < 60  # not a hang waiting for resources


def test_too_many_workers_fail_naming_what_is_missing(ray_cluster, tmp_path):
    proc = train(ray_cluster, ["--smoke-test", "--num-workers", "2", "--cpus-per-worker", "3",
                               "--storage-path", str(tmp_path)], timeout=120)
    assert proc.returncode == 2
    assert "fits only 1" in proc.stderr and "CPU 4" in proc.stderr


@pytest.mark.moto
def test_missing_bucket_is_one_line_before_any_training(ray_cluster, aws_env):
    proc = train(ray_cluster, ["--smoke-test", "--storage-path", "s3://no-such-bucket-rf/x"],
                 aws_env, timeout=120)
    assert proc.returncode == 2
    assert "bucket 'no-such-bucket-rf' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "[rayfleet] run" not in proc.stdout


@pytest.mark.parametrize("argv,needle", [
    (["--strategy", "zero"], "--strategy: unknown strategy"),
    (["--num-workers", "0"], "--num-workers: must be at least 1"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])
def test_bad_input_one_line_exit_2(argv, needle, tmp_path):
    proc = run(TRAIN + argv + ["--storage-path", str(tmp_path)], timeout=60)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
