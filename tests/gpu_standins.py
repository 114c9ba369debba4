"""Stand-ins for a GPU node's tools (nvidia-smi, journalctl, fi_info, dcgmi, all_reduce_perf),
each printing one of the samples in tests/unit/gpu_samples (their sources: its README). The GPU
health gate's unit tests and the fake cloud's GPU nodes put them first on PATH.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SAMPLES = Path(__file__).parent / "unit" / "gpu_samples"
HEALTHY = {"nvidia-smi": "ecc-healthy.csv", "nvidia-smi-q": "nvidia-smi-q.txt",
           "journalctl": "kernel-clean.log", "fi_info": "fi_info-efa-4.txt",
           "dcgmi": "dcgmi-diag-r1-pass.txt", "all_reduce_perf": "all_reduce_perf-8gpu.txt"}
# A p4d node as each check finds it: healthy, or with one fault.
SETS = {
    "healthy": HEALTHY,
    "ecc": {**HEALTHY, "nvidia-smi": "ecc-uncorrected.csv"},
    "xid": {**HEALTHY, "journalctl": "xid-kernel.log"},
    "no-efa": {**HEALTHY, "fi_info": "fi_info-efa-3.txt"},
    "dcgm": {**HEALTHY, "dcgmi": "dcgmi-diag-r1-fail.txt"},
    "slow-nccl": {**HEALTHY, "all_reduce_perf": "all_reduce_perf-8gpu-slow.txt"},
}


def install(folder: Path, which: str) -> Path:
    """The stand-ins of set ``which`` into ``folder`` (each beside the sample it prints)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool, sample in SETS[which].items():
        shutil.copyfile(SAMPLES / sample, folder / f"{tool}.out")
        if tool == "nvidia-smi-q":
            continue    # what nvidia-smi prints for -q
        script = folder / tool
        q = ' [ "$1" = -q ] && exec cat "$(dirname "$0")/nvidia-smi-q.out";' * (
            tool == "nvidia-smi")
        script.write_text(f'#!/bin/sh\n{q}\ncat "$(dirname "$0")/{tool}.out"\n')
        script.chmod(0o755)
    return folder
