"""The GPU health gate's verdicts in the bucket (moto server): the gate as a node runs it,
over the stand-in tools, recording each node's verdict; `rayfleet status`'s health lines and
the head scorer's cap reading them back."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import boto3
import pytest

from rayfleet.agents import fallover, gpugate
from rayfleet.commands import status
from tests.gpu_standins import install

pytestmark = [pytest.mark.moto]

TYPE = "ray.worker.p4d.24xlarge.ondemand"
WANT = {"node_type": TYPE, "instance_type": "p4d.24xlarge", "gpus": 8, "gpu": "A100-40G",
        "efa": 4, "nccl_busbw_gbps": 115}


def _node(tmp_path, aws_env, storage: str, which: str, host: str):
    """One node's gate: its stand-in tools, its expectation, its hostname (unshare --uts)."""
    home = tmp_path / host
    install(home / "bin", which)
    (home / "gpu-gate.json").write_text(json.dumps(WANT))
    return subprocess.run(
        ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "-",
         sys.executable, gpugate.__file__, "--expect", str(home / "gpu-gate.json"),
         "--storage", storage], capture_output=True, text=True, timeout=60,
        env={**aws_env, "PATH": f"{home / 'bin'}:/usr/bin:/bin"})


def test_verdicts_are_recorded_shown_per_node_and_cap_the_type(tmp_path, aws_env,
                                                                monkeypatch):
    for k, v in aws_env.items():
        monkeypatch.setenv(k, v)
    bucket = f"health-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket)
    storage = f"s3://{bucket}/rayfleet/"
    assert status.health_lines(storage) == [
        "GPU health: no GPU node has run the health gate in the last 24 h"]

    refused = [_node(tmp_path, aws_env, storage, which, f"ip-10-0-1-{i}")
               for i, which in enumerate(["xid", "no-efa", "slow-nccl"][:gpugate.CAP - 1])]
    healthy = _node(tmp_path, aws_env, storage, "healthy", "ip-10-0-1-9")
    assert [p.returncode for p in refused] == [1] * len(refused) and healthy.returncode == 0
    assert all(p.stdout.splitlines()[-1].startswith(f"rayfleet gate: recorded in {storage}"
                                                     f"health/{TYPE}/")
               for p in [*refused, healthy])
    lines = status.health_lines(storage)
    assert lines[0] == "GPU health (the gate's verdicts of the last 24 h):"
    assert [ln.split(": ", 1)[1] for ln in lines[1:]] == [
        "refused: xid: Xid 74 (NVLink error) on PCI:0000:b9:00 since boot",
        "refused: efa: 3 EFA device(s), the catalog's p4d.24xlarge has 4",
        healthy.stdout.splitlines()[0].split(": ", 2)[2].rsplit(" (", 1)[0]]
    assert [ln.split()[1] for ln in lines[1:]] == ["ip-10-0-1-0", "ip-10-0-1-1", "ip-10-0-1-9"]

    # Under the cap, the scorer still launches the type; one refusal more and it stops, and
    # status says so in the scorer's words.
    monkeypatch.setattr(fallover, "_health", {"at": None, "records": [], "said": set()})
    monkeypatch.setenv(fallover.HEALTH_ENV, storage)
    assert fallover.capped(TYPE) is None
    assert _node(tmp_path, aws_env, storage, "dcgm", "ip-10-0-1-7").returncode == 1
    fallover._health["at"] = None
    line = fallover.capped(TYPE)
    assert line and line.startswith(f"{TYPE}: no more launches: {gpugate.CAP} nodes refused")
    assert line.endswith("(last: refused: dcgm: dcgmi diag -r 1 failed: Page Retirement/Row "
                         "Remap)")
    assert status.health_lines(storage)[-1] == f"  {line}"
    # A bucket it cannot read: one line, not a traceback.
    assert status.health_lines("s3://no-such-bucket-here/p/")[0].startswith(
        "GPU health: cannot read s3://no-such-bucket-here/p/health/ (NoSuchBucket")
