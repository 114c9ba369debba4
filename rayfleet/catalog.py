"""The instance catalog: what the kit knows about EC2 instance types and GPUs, read from one
dated data file shipped with the package (``rayfleet/catalog.json``).

Config (which types a stack may use), render (a node type's resources come from the stack,
which took them from here), lint ("is this a GPU type?"), preflight (which EC2 vCPU quota a
type counts against), cost (prices) and the training loop and driver (GPU memory, peak FLOP/s)
all ask here. The file holds:

- ``gpu_families``: EC2 families whose instances carry GPUs (NVIDIA p2-p6, g3-g6, g5g; AMD
  g4ad; Trainium and Inferentia are not GPUs), keyed by the letters before the generation
  digit, with the vCPU quota group their instances count against (``P``: "Running On-Demand
  P instances" and "All P Spot Instance Requests").
- ``gpus``: by Ray accelerator type (the ``accelerator_type:X`` resource): memory per GPU and
  dense bf16 peak FLOP/s for MFU (A100 312 TFLOP/s, H100/H200 SXM 989 TFLOP/s; null where the
  kit has no figure).
- ``worker_types``: the GPU workers a stack may choose (``rayfleet:workerInstanceTypes``):
  p4d and p4de (8x A100 40/80 GB, https://aws.amazon.com/ec2/instance-types/p4/), p5 (8x H100),
  p5e and p5en (8x H200) (https://aws.amazon.com/ec2/instance-types/p5/): vCPUs, memory, GPUs
  and their model (a key of ``gpus``), Elastic Fabric Adapters (one per network card: p4d and
  p4de 4, p5 and p5e 32, p5en 16, as AWS's EFA page lists them,
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html), the regions
  that offer them and their $/hour (null where no price could be confirmed: see ``prices``),
  and the floor of NCCL's in-node all-reduce bus bandwidth (``nccl_busbw_gbps``, GB/s, as
  nccl-tests' all_reduce_perf prints it) under which the GPU health gate refuses a node
  (rayfleet/agents/gpugate.py): half of what NVIDIA publishes for the same 8-GPU NVSwitch
  systems (DGX A100 about 230 GB/s: p4d, p4de; DGX H100/H200 about 480 GB/s: p5, p5e,
  p5en). Not measured on AWS by this project: no GPU machine has run the gate yet; a broken
  NVLink or a GPU fallen back to PCIe shows as a tenth of normal, far under either floor.
  The regions are the AWS instance-type pages and ``aws ec2 describe-instance-type-offerings``
  as remembered from mid-2025, not re-checked live (the p5 family's least surely): they only
  decide which regions the config accepts, `rayfleet preflight` confirms each type in the
  workers' AZ with AWS. p4de (A100 80 GB) was launched in two regions and has stayed there.
- ``head_families`` x ``head_sizes``: the CPU head types. x86 families only: the head boots
  the same Deep Learning AMI as the workers so that Ray and Python are identical on every node
  (rule 25); a Graviton head would need an arm64 image. GiB per vCPU: c=2, m=4, r=8.
- ``prices``: when and where the prices were taken. EC2 prices cannot be fetched offline (the
  Pricing API needs credentials and the network), so every cost report repeats the date.

Standard library only: the training loop reads it on GPU machines that carry torch but not
the operator's packages.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class InstanceSpec:
    """A node type's offer, declared by render as Ray resources (docs/house.md, convention 3)."""

    name: str
    vcpus: int
    memory_gib: int
    gpus: int = 0
    gpu_memory_gib: int = 0
    # Elastic Fabric Adapters: one per network card (p4d: 4 cards x 100 Gbps; p5: 32).
    efa_interfaces: int = 0
    # The GPU model, a key of the catalog's ``gpus`` (``A100-40G``, ``H100``); "" for none.
    gpu: str = ""
    # The GPU health gate's floor for NCCL's in-node all-reduce bus bandwidth, GB/s; 0: none.
    nccl_busbw_gbps: float = 0

    @property
    def accelerator_type(self) -> str:
        """The Ray resource ``accelerator_type:<this>`` render declares: the GPU model without
        its memory size (``A100`` for p4d and p4de alike, ``H100``, ``H200``), as the kit has
        always named A100 workers; the memory is in ``gpu_memory_gib``."""
        return self.gpu.partition("-")[0]


@functools.cache
def data() -> Mapping[str, Any]:
    """The catalog file as loaded (package data: works from a wheel as from a checkout)."""
    text = resources.files("rayfleet").joinpath("catalog.json").read_text(encoding="utf-8")
    return json.loads(text)


@functools.cache
def worker_types() -> Mapping[str, InstanceSpec]:
    gpus = data()["gpus"]
    return {name: InstanceSpec(name, t["vcpus"], t["memory_gib"], gpus=t["gpus"],
                               gpu_memory_gib=gpus[t["gpu"]]["memory_gib"],
                               efa_interfaces=t["efa_interfaces"], gpu=t["gpu"],
                               nccl_busbw_gbps=t.get("nccl_busbw_gbps", 0))
            for name, t in data()["worker_types"].items()}


@functools.cache
def head_types() -> Mapping[str, InstanceSpec]:
    out = {}
    for family, f in data()["head_families"].items():
        for size, vcpus in data()["head_sizes"].items():
            name = f"{family}.{size}"
            out[name] = InstanceSpec(name, vcpus, vcpus * f["gib_per_vcpu"])
    return out


@functools.cache
def worker_regions() -> Mapping[str, tuple[str, ...]]:
    """Regions that offer each worker type."""
    return {name: tuple(t["regions"]) for name, t in data()["worker_types"].items()}


def quota_group(instance_type: str) -> str | None:
    """The EC2 vCPU quota group of a GPU instance type (``P``, ``G``); None if no GPU."""
    m = re.fullmatch(r"([a-z]+)\d+[a-z0-9-]*", instance_type.partition(".")[0])
    family = data()["gpu_families"].get(m.group(1)) if m and "." in instance_type else None
    return family["quota_group"] if family else None


def is_gpu_type(instance_type: str) -> bool:
    return quota_group(instance_type) is not None


def gpu_memory_gib(accelerator_type: str) -> float:
    """Memory of one GPU of a Ray accelerator type (e.g. ``A100-80G``); 0 if unknown."""
    return (data()["gpus"].get(accelerator_type) or {}).get("memory_gib", 0)


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by its device name (``NVIDIA A100-SXM4-80GB``)."""
    return next((g["peak_bf16_flops"] for k, g in data()["gpus"].items()
                 if g["peak_bf16_flops"] and k in device_name), None)


def prices() -> dict[str, Any]:
    """The dated price table: ``gpu`` ($/hour per worker type), ``cpu_per_vcpu_hour`` (per
    head family), ``as_of``, ``source``, ``regions``, ``currency``; each price by market
    (``on_demand``, ``spot``). A worker price is None where none could be confirmed for the
    date (``source`` says which)."""
    d = data()
    return {**d["prices"],
            "gpu": {n: dict(t["price_per_hour"]) for n, t in d["worker_types"].items()},
            "cpu_per_vcpu_hour": {n: dict(f["price_per_vcpu_hour"])
                                  for n, f in d["head_families"].items()}}


def worker_table() -> str:
    """The GPU worker types as the Markdown table of docs/node-types.md (a test regenerates it
    and fails when the page drifts from the catalog)."""
    p = data()["prices"]
    rows = ["| type | GPUs | GPU memory | vCPUs | memory | EFA (network cards) | NCCL floor "
            "| regions | on-demand $/h | spot $/h | price date |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]

    def price(value: float | None) -> str:
        return "not confirmed" if value is None else f"{value:.2f}"

    for name, t in data()["worker_types"].items():
        spec = worker_types()[name]
        cost = t["price_per_hour"]
        rows.append(f"| `{name}` | {spec.gpus}x {spec.accelerator_type} | "
                    f"{spec.gpu_memory_gib} GB each | {spec.vcpus} | {spec.memory_gib} GiB | "
                    f"{spec.efa_interfaces} | {spec.nccl_busbw_gbps:g} GB/s | "
                    f"{', '.join(t['regions'])} | "
                    f"{price(cost['on_demand'])} | {price(cost['spot'])} | {p['as_of']} |")
    return "\n".join(rows) + "\n"
