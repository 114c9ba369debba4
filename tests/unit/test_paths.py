"""Paths as the user means them: relative paths inside a Ray job, error lines never cut
mid-word, and no ignored file that git tracks."""

from __future__ import annotations

import subprocess

import pytest

from rayfleet.errors import ConfigError
from tests.conftest import REPO
from workloads.common import storage


@pytest.fixture
def in_job_package(tmp_path, monkeypatch):
    """A cwd laid out as Ray unpacks `--working-dir` for a job's driver."""
    package = (tmp_path / "session_x" / "runtime_resources" / "working_dir_files"
               / "_ray_pkg_0123abcd")
    (package / "corpus").mkdir(parents=True)
    monkeypatch.chdir(package)
    return package


def test_relative_output_in_a_ray_job_is_refused(in_job_package):
    assert storage.job_package_dir() == str(in_job_package)
    with pytest.raises(ConfigError) as e:
        storage.user_path("runs/data/smoke-seq64", "--output", output=True)
    assert str(e.value) == (
        f"--output: runs/data/smoke-seq64 is a relative path, and this job runs in Ray's "
        f"temporary copy of the working directory ({in_job_package}): what is written there is "
        f"lost with it; give an absolute path (on a local cluster: \"$PWD/runs/data/smoke-seq64\")"
        " or s3://bucket/prefix")
    # An input must have been uploaded with the job; one that was not is refused the same way.
    with pytest.raises(ConfigError, match="it is not there"):
        storage.user_path("runs/data/smoke-seq64", "--dataset", output=False)
    assert storage.user_path("corpus", "--input", output=False) == str(in_job_package / "corpus")
    # Absolute paths and s3:// are what they say, in a job or not.
    assert storage.user_path("/data/out", "--output", output=True) == "/data/out"
    assert storage.user_path("s3://b/p", "--output", output=True) == "s3://b/p"


def test_relative_path_outside_a_job_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.job_package_dir() is None
    assert storage.user_path("runs/x", "--output", output=True) == str(tmp_path / "runs" / "x")


def test_reading_a_missing_folder_does_not_create_it(tmp_path):
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.resolve(str(tmp_path / "embeddings"), check_writable=False, create=False)
    assert not (tmp_path / "embeddings").exists()


def test_long_errors_are_shortened_at_a_word_boundary():
    long = ("AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 6, Couldn't "
            "resolve host name for https://my-bucket.s3.us-east-1.amazonaws.com " * 5)
    short = storage._first_line(RuntimeError(long + "\nsecond line"))
    assert len(short) <= 304 and short.endswith(" ...")
    assert long.startswith(short.removesuffix(" ...")) and long[len(short) - 4] == " "
    assert storage._first_line(RuntimeError("short\nmore")) == "short"


def test_git_tracks_no_file_that_gitignore_ignores():
    proc = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    assert proc.stdout == ""
