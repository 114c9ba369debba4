"""The GPU health gate (rayfleet/agents/gpugate.py): its parsers on the tools' outputs
(tests/unit/gpu_samples), and the gate as a node runs it, over stand-ins printing them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rayfleet.agents import gpugate
from tests.gpu_standins import SAMPLES, install

AGENT = gpugate.__file__
P4D = {"node_type": "ray.worker.p4d.24xlarge.spot", "instance_type": "p4d.24xlarge",
       "gpus": 8, "gpu": "A100-40G", "efa": 4, "nccl_busbw_gbps": 115}


def test_the_parsers_read_each_tools_output():
    gpus = gpugate.parse_gpus((SAMPLES / "ecc-healthy.csv").read_text())
    assert [g["name"] for g in gpus] == ["NVIDIA A100-SXM4-40GB"] * 8
    assert {g["ecc"] for g in gpus} == {"Enabled"} and {g["uncorrected"] for g in gpus} == {0}
    assert gpugate.parse_efa((SAMPLES / "fi_info-efa-4.txt").read_text()) == [
        "rdmap144s27-rdm", "rdmap160s27-rdm", "rdmap16s27-rdm", "rdmap32s27-rdm"]
    assert len(gpugate.parse_efa((SAMPLES / "fi_info-efa-3.txt").read_text())) == 3
    dcgm = gpugate.parse_dcgm((SAMPLES / "dcgmi-diag-r1-pass.txt").read_text())
    assert len(dcgm) == 9 and set(dcgm.values()) == {"Pass"}   # metadata and Info rows out
    assert gpugate.parse_dcgm((SAMPLES / "dcgmi-diag-r1-fail.txt").read_text())[
        "Page Retirement/Row Remap"] == "Fail"
    assert gpugate.parse_busbw((SAMPLES / "all_reduce_perf-8gpu.txt").read_text()) == 224.44
    assert [x for _, x in gpugate.parse_xids((SAMPLES / "kernel-clean.log").read_text())] == [13]


@pytest.mark.parametrize("name,gpu,ok", [
    ("NVIDIA A100-SXM4-40GB", "A100-40G", True), ("NVIDIA A100-SXM4-80GB", "A100-40G", False),
    ("NVIDIA H100 80GB HBM3", "H100", True), ("NVIDIA H200", "H200", True),
    ("NVIDIA H100 80GB HBM3", "H200", False), ("Tesla T4", "A100-80G", False)])
def test_the_gpu_model_is_the_catalogs(name, gpu, ok):
    assert gpugate.model_matches(name, gpu) is ok


@pytest.mark.parametrize("text,says", [
    ("0, 00000000:10:1C.0, NVIDIA A100-SXM4-40GB, Enabled, [N/A]\n", "ECC errors are unreadable"),
    ("0, 00000000:10:1C.0, NVIDIA A100-SXM4-40GB, Disabled, 0\n", "ECC Disabled"),
    ("No devices were found\n", "not the 5 fields"),
])
def test_gpus_it_cannot_read_are_refused(monkeypatch, text, says):
    monkeypatch.setattr(gpugate, "output", lambda argv, ok_codes=(0,): text)
    with pytest.raises(gpugate.Refused, match=says):
        gpugate.check_gpus({**P4D, "gpus": 1})


def _gate(tmp_path, which: str | None, expect: dict | str = P4D):
    bin_dir = tmp_path / "bin"
    if which:
        install(bin_dir, which)
    path = tmp_path / "gpu-gate.json"
    path.write_text(expect if isinstance(expect, str) else json.dumps(expect))
    return subprocess.run([sys.executable, AGENT, "--expect", str(path)], capture_output=True,
                          text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})


@pytest.mark.parametrize("which,says", [
    ("ecc", "refused: gpus: GPU 3 (00000000:20:1D.0): 2 uncorrectable ECC error(s)"),
    ("xid", "refused: xid: Xid 74 (NVLink error) on PCI:0000:b9:00 since boot"),
    ("no-efa", "refused: efa: 3 EFA device(s), the catalog's p4d.24xlarge has 4"),
    ("dcgm", "refused: dcgm: dcgmi diag -r 1 failed: Page Retirement/Row Remap"),
    ("slow-nccl", "refused: nccl: NCCL all-reduce bus bandwidth 22.44 GB/s, under the floor "
                  "115 for p4d.24xlarge"),
])
def test_a_faulty_node_is_refused_in_one_line_naming_the_fault(tmp_path, which, says):
    p = _gate(tmp_path, which)
    assert p.returncode == 1 and p.stderr == "", p.stderr
    (line,) = p.stdout.splitlines()
    assert line.startswith("rayfleet gate: ray.worker.p4d.24xlarge.spot ") and says in line


def test_a_healthy_node_passes_every_check(tmp_path):
    p = _gate(tmp_path, "healthy")
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("healthy: 8x NVIDIA A100-SXM4-40GB, ECC on, 0 uncorrectable; no fatal XID since "
            "boot (1 other); EFA 4/4; DCGM r1 9 tests pass; NCCL all-reduce 224.44 GB/s >= "
            "115") in p.stdout
    # Another model than the catalog's, or a node of more GPUs, is not the type's.
    assert "is NVIDIA A100-SXM4-40GB, not the catalog's H100" in _gate(
        tmp_path, None, {**P4D, "gpu": "H100"}).stdout


@pytest.mark.parametrize("expect,says", [
    ("{", "cannot read the expectation"),
    (json.dumps({**P4D, "nccl_busbw_gbps": 0}), "the floor above 0"),
    (json.dumps({k: v for k, v in P4D.items() if k != "efa"}), "is not a gate expectation"),
])
def test_an_expectation_it_does_not_understand_is_refused(tmp_path, expect, says):
    p = _gate(tmp_path, "healthy", expect)
    assert p.returncode == 1 and says in p.stdout and p.stderr == ""


def test_a_missing_tool_is_a_refusal_not_a_pass(tmp_path):
    p = _gate(tmp_path, None)
    assert p.returncode == 1 and "refused: gpus: nvidia-smi not found" in p.stdout


def test_the_cap_counts_a_types_refusals_within_the_window():
    now = 1_800_000_000
    refused = [{"node_type": "t", "ok": False, "time": now - 60 * i, "line": f"refused: {i}"}
               for i in range(gpugate.CAP)]
    assert gpugate.capped(refused[:-1], "t", now) is None
    assert gpugate.capped(refused, "other", now) is None
    line = gpugate.capped(refused, "t", now)
    assert line == (f"t: no more launches: {gpugate.CAP} nodes refused by the GPU health gate "
                    f"within {gpugate.CAP_WINDOW_S // 60} min (last: refused: 0)")
    old = [{**r, "time": r["time"] - gpugate.CAP_WINDOW_S} for r in refused]
    healthy = [{**r, "ok": True} for r in refused]
    assert gpugate.capped(old, "t", now) is None and gpugate.capped(healthy, "t", now) is None


UBUNTU = 'PRETTY_NAME="Ubuntu 22.04.5 LTS"\nNAME="Ubuntu"\nVERSION_ID="22.04"\nID=ubuntu\n'


def test_dcgm_is_installed_from_nvidias_repository_where_the_image_lacks_it(tmp_path,
                                                                            monkeypatch):
    """NVIDIA's steps, each through sudo (a stand-in recording them, which leaves a `dcgmi`
    behind as the package would); then the check runs the installed `dcgmi`."""
    bin_dir = install(tmp_path / "bin", "healthy")
    (bin_dir / "dcgmi").rename(tmp_path / "dcgmi.pkg")
    (bin_dir / "sudo").write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/sudo.log\n'
        f'[ "$1 $2" = "systemctl --now" ] && cp {tmp_path}/dcgmi.pkg {bin_dir}/dcgmi\n'
        'exit 0\n')
    (bin_dir / "sudo").chmod(0o755)
    (tmp_path / "os-release").write_text(UBUNTU)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(gpugate, "OS_RELEASE", str(tmp_path / "os-release"))
    with pytest.raises(gpugate.Refused, match="dcgmi not found"):
        gpugate.check_dcgm(P4D)                      # not asked to install: refused
    assert gpugate.check_dcgm({**P4D, "install_dcgm": True}) == "DCGM r1 9 tests pass"
    repo = "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64"
    assert (tmp_path / "sudo.log").read_text().splitlines() == [
        f"curl -fsSLo /tmp/cuda-keyring_1.1-1_all.deb {repo}/cuda-keyring_1.1-1_all.deb",
        "dpkg -i /tmp/cuda-keyring_1.1-1_all.deb", "apt-get update -q",
        "apt-get install -y -q --install-recommends datacenter-gpu-manager-4-cuda12",
        "systemctl --now enable nvidia-dcgm"]
    assert gpugate.install_dcgm() == f"dcgmi at {bin_dir}/dcgmi"    # installed: nothing done


def test_dcgm_on_another_image_than_ubuntu_is_a_refusal():
    with pytest.raises(gpugate.Refused, match=r"on Ubuntu only \(this image is Amazon Linux"):
        gpugate.dcgm_install_steps('ID="amzn"\nPRETTY_NAME="Amazon Linux 2023"\n', "")
    with pytest.raises(gpugate.Refused, match="names no CUDA version"):
        gpugate.dcgm_install_steps(UBUNTU, "Driver Version : 550.127.05\n")
