"""workloads.train on the real local Ray cluster: fail-fast resource checks and bad input.
Training runs with each strategy, S3 checkpoints (moto) and serving from them are in
tests/fakecloud/test_ray_up.py, on nodes `ray up` built from the cluster YAML; resumes
are the fault tests' subject (tests/faults/)."""

import pytest

from tests.conftest import BIN, kit_lines, run

pytestmark = pytest.mark.ray
TRAIN = [str(BIN / "python"), "-m", "workloads.train"]


def train(ray_cluster, args, extra_env=None, timeout=400):
    """The driver run directly against the cluster (RAY_ADDRESS), as a notebook would."""
    return run(TRAIN + args, env={**ray_cluster["env"], **(extra_env or {})}, timeout=timeout)


def test_gpus_on_cpu_cluster_fail_in_seconds(ray_cluster, tmp_path):
    # A hang waiting for resources that never come would hit the subprocess timeout.
    proc = train(ray_cluster, ["--smoke-test", "--use-gpu", "--storage-path", str(tmp_path)],
                 timeout=120)
    assert proc.returncode == 2
    assert "no GPU at all" in proc.stderr
    assert len(kit_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr


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
