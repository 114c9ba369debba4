"""GPU health gate: a GPU worker proves its GPUs, EFA and NCCL before it offers them to Ray.

    python gpugate.py [--expect ~/.rayfleet/gpu-gate.json] [--storage s3://BUCKET/PREFIX]

The last setup step of every GPU worker type (render writes the type's expectation, from the
catalog, to --expect first). In order, stopping at the first that fails:

- ``gpus``: nvidia-smi's GPU count and model against the catalog's, ECC on and no uncorrectable
  error since the driver loaded;
- ``xid``: the kernel log since boot (journalctl -k -b) holds no XID of FATAL_XIDS;
- ``efa``: `fi_info -p efa -t FI_EP_RDM` lists the catalog's count of EFA devices;
- ``dcgm``: `dcgmi diag -r DCGM_LEVEL` passes every test (level 1: deployment checks, seconds);
  with --install-dcgm (render's), DCGM is installed first where the image lacks it (the
  PyTorch Deep Learning AMIs' release notes list no DCGM; the Base ones carry DCGM 4);
- ``nccl``: NCCL's all_reduce_perf among the node's GPUs (NCCL_BYTES, one size) reaches the
  catalog's bus-bandwidth floor for the type.

A missing tool, an output it cannot read, or an expectation it does not understand is a
refusal, never a pass. Exit 0 and one line ("healthy: ..."), or exit 1 and one line
("refused: <check>: why"): Ray's updater then marks the node failed, the autoscaler terminates
it and launches another, so no work lands on it. The verdict goes to the run store too,
``<storage>/health/<node type>/<UTC time>-<host>.json``, where `rayfleet status` shows it and the
head's scorer (fallover.py) counts refusals: CAP refusals of a type within CAP_WINDOW_S and the
scorer launches that type no more (:func:`capped`), so a bad AMI or type cannot loop launches.

Also the GPU facts the spot agent's passive watch shares (the XID catalog, the nvidia-smi query,
their parsers). Standalone: the standard library, and boto3 for the record (the node
environment has it).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

EXPECT_FILE = "~/.rayfleet/gpu-gate.json"
EXPECT_KEYS = ("node_type", "instance_type", "gpus", "gpu", "efa", "nccl_busbw_gbps")
HEALTH = "health"           # the verdicts' folder under the stack's storage
CAP = 3                     # refusals of one node type ...
CAP_WINDOW_S = 3600         # ... within this long, and the scorer launches it no more
DCGM_LEVEL = 1
NCCL_BYTES = "256M"
# Where the Deep Learning AMIs keep the tools off PATH: EFA's libfabric, the NCCL tests.
TOOL_DIRS = ("/opt/amazon/efa/bin", "/usr/local/cuda/efa/test-cuda-*", "/opt/nccl-tests/build")
# NVIDIA's XID catalog: the errors after which the GPU needs a reset or the node replacing
# (others, e.g. 13, 31, 43, 45, are most often the application's own and are only logged).
FATAL_XIDS = {48: "double-bit ECC error", 64: "ECC row remapping or page retirement failed",
              74: "NVLink error", 79: "GPU has fallen off the bus", 94: "contained ECC error",
              95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error"}
XID = re.compile(r"NVRM: Xid \((PCI:[0-9A-Fa-f:.]+)\): (\d+),")
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,pci.bus_id,name,ecc.mode.current,"
             "ecc.errors.uncorrected.volatile.total", "--format=csv,noheader,nounits"]
TOOL_TIMEOUT_S = 600


class Refused(Exception):
    """A check's one-line reason."""


# -- parsers (the tools' outputs; samples in tests/unit/gpu_samples) ------------------------

def parse_gpus(text: str) -> list[dict]:
    """nvidia-smi's GPU_QUERY rows: index, bus, name, ECC mode, uncorrectable errors (None
    where nvidia-smi has no figure, e.g. ``[N/A]``)."""
    rows = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            raise Refused(f"nvidia-smi printed {line!r}, not the 5 fields asked for")
        index, bus, name, mode, count = fields
        rows.append({"index": index, "bus": bus, "name": name, "ecc": mode,
                     "uncorrected": int(count) if count.isdigit() else None})
    return rows


def parse_ecc(text: str) -> dict[str, int | None]:
    """GPU index -> uncorrectable ECC errors since the driver loaded (None: no ECC to read)."""
    return {g["index"]: g["uncorrected"] for g in parse_gpus(text)}


def parse_xids(text: str) -> list[tuple[str, int]]:
    """(PCI address, XID) of each NVIDIA XID event in kernel log lines."""
    return [(m.group(1), int(m.group(2))) for line in text.splitlines()
            if (m := XID.search(line))]


def parse_efa(text: str) -> list[str]:
    """The EFA devices (libfabric domains) in `fi_info -p efa -t FI_EP_RDM`'s listing."""
    return sorted({m.group(1) for m in re.finditer(r"^\s*domain:\s*(\S+)", text, re.M)})


def parse_dcgm(text: str) -> dict[str, str]:
    """Test -> result (Pass, Fail, Skip, Warn) of `dcgmi diag`'s table, metadata rows left
    out."""
    results = {}
    for m in re.finditer(r"^\|\s*([^|]*?)\s*\|\s*(Pass|Fail|Skip|Warn)[^|]*\|", text, re.M):
        results[m.group(1)] = m.group(2)
    return results


def parse_busbw(text: str) -> float:
    """NCCL tests' "# Avg bus bandwidth : X" (GB/s)."""
    m = re.search(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.]+)", text, re.M)
    if not m:
        raise Refused("all_reduce_perf printed no average bus bandwidth")
    wrong = re.search(r"^#\s*Out of bounds values\s*:\s*(\d+)", text, re.M)
    if wrong and int(wrong.group(1)):
        raise Refused(f"all_reduce_perf found {wrong.group(1)} wrong values")
    return float(m.group(1))


def model_matches(name: str, gpu: str) -> bool:
    """Whether nvidia-smi's name (``NVIDIA A100-SXM4-40GB``) is the catalog's model
    (``A100-40G``: the family, and the memory where the key has one)."""
    family, _, memory = gpu.partition("-")
    return family in name and (not memory or f"{memory}B" in name)


# -- checks ---------------------------------------------------------------------------------

def tool(name: str) -> str:
    """The tool from TOOL_DIRS (the AMI's own builds, newest CUDA first), else from PATH."""
    found = None
    for folder in TOOL_DIRS:
        for d in sorted(glob.glob(folder), reverse=True):
            found = found or shutil.which(name, path=d)
    found = found or shutil.which(name)
    if not found:
        raise Refused(f"{name} not found (on PATH or in {', '.join(TOOL_DIRS)})")
    return found


def output(argv: list[str], ok_codes=(0,)) -> str:
    argv = [tool(argv[0]), *argv[1:]]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Refused(f"{Path(argv[0]).name} ran past {TOOL_TIMEOUT_S} s") from None
    if p.returncode not in ok_codes:
        last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise Refused(f"{Path(argv[0]).name} exited {p.returncode}: {last[0][:200]}")
    return p.stdout


def check_gpus(want: dict) -> str:
    gpus = parse_gpus(output(GPU_QUERY))
    if len(gpus) != want["gpus"]:
        raise Refused(f"{len(gpus)} GPU(s), the catalog's {want['instance_type']} has "
                      f"{want['gpus']}")
    for g in gpus:
        if not model_matches(g["name"], want["gpu"]):
            raise Refused(f"GPU {g['index']} is {g['name']}, not the catalog's {want['gpu']}")
        if g["ecc"] != "Enabled":
            raise Refused(f"GPU {g['index']} ({g['bus']}): ECC {g['ecc']}")
        if g["uncorrected"] is None:
            raise Refused(f"GPU {g['index']} ({g['bus']}): its uncorrectable ECC errors are "
                          "unreadable")
        if g["uncorrected"]:
            raise Refused(f"GPU {g['index']} ({g['bus']}): {g['uncorrected']} uncorrectable "
                          "ECC error(s)")
    return f"{len(gpus)}x {gpus[0]['name']}, ECC on, 0 uncorrectable"


def check_xid(want: dict) -> str:
    seen = parse_xids(output(["journalctl", "-k", "-b", "--no-pager", "-o", "cat"]))
    fatal = [(pci, x) for pci, x in seen if x in FATAL_XIDS]
    if fatal:
        pci, x = fatal[0]
        raise Refused(f"Xid {x} ({FATAL_XIDS[x]}) on {pci} since boot")
    return f"no fatal XID since boot ({len(seen)} other)"


def check_efa(want: dict) -> str:
    if not want["efa"]:
        return "no EFA on this type"
    devices = parse_efa(output(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"], ok_codes=(0, 1)))
    if len(devices) != want["efa"]:
        raise Refused(f"{len(devices)} EFA device(s), the catalog's {want['instance_type']} "
                      f"has {want['efa']}")
    return f"EFA {len(devices)}/{want['efa']}"


# NVIDIA's DCGM 4 install on Ubuntu (its installation guide): the CUDA network repository's
# keyring, then the package for the driver's CUDA major version, then its host engine.
DCGM_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64"
DCGM_KEYRING = "cuda-keyring_1.1-1_all.deb"
OS_RELEASE = "/etc/os-release"


def parse_os_release(text: str) -> dict[str, str]:
    return {k: v.strip('"') for k, _, v in (ln.partition("=") for ln in text.splitlines()) if v}


def parse_cuda_major(text: str) -> str:
    """The driver's CUDA major version in `nvidia-smi -q` ("CUDA Version : 12.8")."""
    m = re.search(r"^\s*CUDA Version\s*:\s*(\d+)\.", text, re.M)
    if not m:
        raise Refused("nvidia-smi -q names no CUDA version, so no DCGM package can be chosen")
    return m.group(1)


def dcgm_install_steps(os_release: str, nvidia_smi_q: str) -> list[list[str]]:
    """The commands that install DCGM where the image lacks it (Ubuntu only)."""
    release = parse_os_release(os_release)
    if release.get("ID") != "ubuntu":
        raise Refused(f"dcgmi is not installed and the kit installs DCGM on Ubuntu only (this "
                      f"image is {release.get('PRETTY_NAME') or release.get('ID') or 'unknown'})")
    repo = DCGM_REPO.format(distro="ubuntu" + release.get("VERSION_ID", "").replace(".", ""))
    keyring = f"/tmp/{DCGM_KEYRING}"
    return [["sudo", "curl", "-fsSLo", keyring, f"{repo}/{DCGM_KEYRING}"],
            ["sudo", "dpkg", "-i", keyring],
            ["sudo", "apt-get", "update", "-q"],
            ["sudo", "apt-get", "install", "-y", "-q", "--install-recommends",
             f"datacenter-gpu-manager-4-cuda{parse_cuda_major(nvidia_smi_q)}"],
            ["sudo", "systemctl", "--now", "enable", "nvidia-dcgm"]]


def install_dcgm() -> str:
    """DCGM installed where `dcgmi` is not found; what was done, in a few words."""
    try:
        return f"dcgmi at {tool('dcgmi')}"
    except Refused:
        pass
    steps = dcgm_install_steps(Path(OS_RELEASE).read_text(),
                               output(["nvidia-smi", "-q"]))
    for argv in steps:
        output(argv)
    return f"DCGM installed ({steps[3][-1]})"


def check_dcgm(want: dict) -> str:
    if want.get("install_dcgm"):
        install_dcgm()
    results = parse_dcgm(output(["dcgmi", "diag", "-r", str(DCGM_LEVEL)], ok_codes=range(256)))
    if not results:
        raise Refused("dcgmi diag printed no test results")
    failed = [t for t, r in results.items() if r == "Fail"]
    if failed:
        raise Refused(f"dcgmi diag -r {DCGM_LEVEL} failed: {', '.join(failed)}")
    return f"DCGM r{DCGM_LEVEL} {len(results)} tests pass"


def check_nccl(want: dict) -> str:
    bw = parse_busbw(output(["all_reduce_perf", "-b", NCCL_BYTES, "-e", NCCL_BYTES,
                             "-g", str(want["gpus"]), "-n", "20", "-w", "5"]))
    floor = want["nccl_busbw_gbps"]
    if bw < floor:
        raise Refused(f"NCCL all-reduce bus bandwidth {bw:g} GB/s, under the floor {floor:g} "
                      f"for {want['instance_type']}")
    return f"NCCL all-reduce {bw:g} GB/s >= {floor:g}"


CHECKS = (("gpus", check_gpus), ("xid", check_xid), ("efa", check_efa), ("dcgm", check_dcgm),
          ("nccl", check_nccl))


def expectation(path: str) -> dict:
    """The type's expectation as render wrote it; anything else is refused."""
    try:
        want = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise Refused(f"cannot read the expectation {path} ({e})") from None
    if not isinstance(want, dict) or set(EXPECT_KEYS) - set(want):
        raise Refused(f"{path} is not a gate expectation (keys {', '.join(EXPECT_KEYS)})")
    numbers = ("gpus", "efa", "nccl_busbw_gbps")
    if any(not isinstance(want[k], (int, float)) or isinstance(want[k], bool) or want[k] < 0
           for k in numbers) or want["gpus"] < 1 or not want["nccl_busbw_gbps"]:
        raise Refused(f"{path}: gpus, efa and nccl_busbw_gbps must be numbers, gpus and the "
                      "floor above 0")
    return want


def run_gate(want: dict, clock=time.monotonic) -> dict:
    """Every check in order until one refuses: the verdict, with each check's seconds."""
    done, start = [], clock()
    for name, check in CHECKS:
        t0 = clock()
        try:
            says = check(want)
        except Refused as e:
            done.append({"check": name, "ok": False, "says": str(e), "s": round(clock() - t0, 2)})
            return {"ok": False, "line": f"refused: {name}: {e}", "checks": done,
                    "s": round(clock() - start, 2)}
        done.append({"check": name, "ok": True, "says": says, "s": round(clock() - t0, 2)})
    return {"ok": True, "line": "healthy: " + "; ".join(c["says"] for c in done),
            "checks": done, "s": round(clock() - start, 2)}


# -- records ----------------------------------------------------------------------------------

def split_storage(storage: str) -> tuple[str, str]:
    m = re.fullmatch(r"s3://([^/]+)/*(.*?)/*", storage)
    if not m:
        raise ValueError(f"--storage {storage!r} is not s3://BUCKET/PREFIX")
    return m.group(1), m.group(2)


def record_key(prefix: str, node_type: str, when: float, host: str) -> str:
    stamp = datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return "/".join(p for p in (prefix, HEALTH, node_type, f"{stamp}-{host}.json") if p)


def put_record(s3, storage: str, record: dict) -> str:
    bucket, prefix = split_storage(storage)
    key = record_key(prefix, record["node_type"], record["time"], record["host"])
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(record).encode(),
                  ContentType="application/json")
    return f"s3://{bucket}/{key}"


def read_records(s3, storage: str, since: float = 0) -> list[dict]:
    """The verdicts under the storage's health folder recorded from ``since`` (Unix time, by
    the key's stamp), oldest first; records it cannot read are left out."""
    bucket, prefix = split_storage(storage)
    folder = "/".join(p for p in (prefix, HEALTH) if p) + "/"
    floor = record_key("", "", since, "").rsplit("/", 1)[-1].removesuffix("-.json")
    records = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder):
        for obj in page.get("Contents", []):
            if obj["Key"].rsplit("/", 1)[-1] < floor:
                continue
            try:
                r = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            except ValueError:
                continue
            if isinstance(r, dict) and {"node_type", "ok", "time", "line"} <= set(r):
                records.append(r)
    return sorted(records, key=lambda r: r["time"])


def capped(records: list[dict], node_type: str, now: float) -> str | None:
    """The cap's one line when ``node_type`` had CAP refusals within CAP_WINDOW_S, else None."""
    refused = [r for r in records if r["node_type"] == node_type and not r["ok"]
               and now - r["time"] <= CAP_WINDOW_S]
    if len(refused) < CAP:
        return None
    return (f"{node_type}: no more launches: {len(refused)} nodes refused by the GPU health "
            f"gate within {CAP_WINDOW_S // 60} min (last: "
            f"{max(refused, key=lambda r: r['time'])['line']})")


def s3_client(timeout_s: float = 30, attempts: int = 3):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(connect_timeout=min(10, timeout_s),
                                            read_timeout=timeout_s,
                                            retries={"max_attempts": attempts}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--expect", default=EXPECT_FILE)
    p.add_argument("--storage", metavar="s3://BUCKET/PREFIX",
                   help="where the verdict is recorded (the stack's storage)")
    p.add_argument("--install-dcgm", action="store_true",
                   help="install DCGM first where dcgmi is not found (Ubuntu: NVIDIA's "
                        "CUDA repository)")
    args = p.parse_args(argv)
    try:
        want = {**expectation(args.expect), "install_dcgm": args.install_dcgm}
    except Refused as e:
        print(f"rayfleet gate: refused: {e}", flush=True)
        return 1
    verdict = run_gate(want)
    host = socket.gethostname()
    print(f"rayfleet gate: {want['node_type']} {host}: {verdict['line']} ({verdict['s']:g} s)",
          flush=True)
    if args.storage:
        record = {**verdict, "node_type": want["node_type"],
                  "instance_type": want["instance_type"], "host": host, "time": time.time()}
        try:
            print(f"rayfleet gate: recorded in {put_record(s3_client(), args.storage, record)}")
        except Exception as e:  # noqa: BLE001 - any failure to record is said, in one line
            print(f"rayfleet gate: could not record the verdict in {args.storage}: "
                  f"{type(e).__name__}: {str(e)[:200]}", flush=True)
            return 1
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
