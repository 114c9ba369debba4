"""A model fetched from s3:// into the node's /tmp goes when the process that fetched it ends
(workloads/common/hf.py): every run, replica and job once left its copy behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.moto


def test_a_fetched_model_folder_goes_with_its_process(aws_env, s3_client, checkpoint_bucket):
    s3_client.put_object(Bucket=checkpoint_bucket, Key="fetch-test/model/config.json",
                         Body=b'{"model_type": "llama"}')
    code = ("from workloads.common import hf; "
            f"p = hf.fetch('s3://{checkpoint_bucket}/fetch-test/model', '--model'); "
            "print(p); assert (p / 'config.json').read_text().startswith('{')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **aws_env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert folder.name.startswith("rayfleet-hf-")
    assert not folder.exists(), f"{folder} outlived the process that fetched it"
