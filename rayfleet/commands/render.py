"""`rayfleet render`: the stack outputs of `pulumi up` -> a Ray cluster-launcher YAML.

The outputs (the contract is ``rayfleet/stack.py``) come from a file, stdin (``-``) or
``pulumi stack output --json`` (the ``rayfleet`` key). The YAML is built by
:mod:`rayfleet.launcher` (a pipeline of fragments over one :class:`RenderOptions`); this
command makes the options, writes the token and the node agents beside it, and writes the YAML
to ``cluster-configs/generated/<stack>.yaml``, with render's facts for other commands beside it
(``<stack>.rayfleet.json``, read by :func:`rayfleet.clusteryaml.render_facts`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rayfleet import nodeenv, runstore
from rayfleet.agents import fallover
from rayfleet.clusteryaml import RenderFacts, facts_path
from rayfleet.commands import metrics as prometheus
from rayfleet.commands.localstate import ensure_token
from rayfleet.errors import ConfigError, RayfleetError
from rayfleet.ingress import DEFAULT_INGRESS
from rayfleet.launcher import pipeline
from rayfleet.launcher.agents import (AGENT_NAMES, AGENTS, AUTOSCALER_V1, PYCACHE_PREFIX,
                                      REMOTE_SCORER, SCORER_ALSO, STOP_AGENTS, agent_command,
                                      agents_folder, head_agents, scorer_env)
from rayfleet.launcher.headha import (GCS_SUPERVISOR_WAIT_S, HA_HEAD_WHY, HA_WORKER_WHY,
                                      REMOTE_GCS_STORE_TOKEN, REMOTE_GCS_STORE_TOKEN_ENV,
                                      REMOTE_GCS_SUPERVISOR_STATUS, gcs_env,
                                      gcs_store_token_command, head_placement, head_ray_start)
from rayfleet.launcher.nodesetup import (LOGIN_PATH, TORCH_CPU_INDEX, VLLM_BUILDS,
                                         llm_setup_commands, setup_commands)
from rayfleet.launcher.options import RenderOptions
from rayfleet.launcher.pipeline import header
from rayfleet.launcher.remote import (LOCKED, PROVE_ENV, RAY_BIN, REMOTE_AGENTS, REMOTE_TOKEN,
                                      REMOTE_TOKEN_ENV, VENV)
from rayfleet.launcher.reserved import reservation_options
from rayfleet.launcher.serveingress import INGRESS_WHY, REMOTE_HAPROXY, ingress_commands
from rayfleet.launcher.start import ray_start
from rayfleet.launcher.why import Why, plain
from rayfleet.stack import StackOutputs
from rayfleet.stack import parse as parse_outputs

# What this module offered before the YAML moved to rayfleet.launcher, for its importers.
__all__ = [
    "AGENTS", "AGENT_NAMES", "AUTOSCALER_V1", "ConfigError", "GCS_SUPERVISOR_WAIT_S", "GENERATED",
    "HA_HEAD_WHY", "HA_WORKER_WHY", "INGRESS_WHY", "LOCKED", "LOGIN_PATH", "PROVE_ENV",
    "PYCACHE_PREFIX", "RAY_BIN", "REMOTE_AGENTS", "REMOTE_GCS_STORE_TOKEN",
    "REMOTE_GCS_STORE_TOKEN_ENV", "REMOTE_GCS_SUPERVISOR_STATUS", "REMOTE_HAPROXY",
    "REMOTE_SCORER", "REMOTE_TOKEN", "REMOTE_TOKEN_ENV", "RayfleetError", "RenderOptions",
    "STOP_AGENTS", "TORCH_CPU_INDEX", "VENV", "VLLM_BUILDS", "Why", "agent_command",
    "agents_folder", "build_config", "copy_agents", "default_token_file", "facts", "gcs_env",
    "gcs_store_token_command", "head_agents", "head_placement", "head_ray_start", "header",
    "ingress_commands", "llm_setup_commands", "load_outputs", "options", "parse_outputs", "plain",
    "ray_start", "refuse_foreign", "render", "render_text", "reservation_options", "scorer_env",
    "setup_commands",
]

# Relative to where the command runs (the user's checkout), as README shows it.
GENERATED = Path("cluster-configs") / "generated"


def load_outputs(source: str, stdin=None) -> StackOutputs:
    """Outputs from a file path, or ``-`` for stdin."""
    if source == "-":
        return parse_outputs((stdin or sys.stdin).read(), "stdin")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RayfleetError(f"{source}: no such file; run `pulumi stack output --json > "
                            f"{source}` or pass - to read stdin") from None
    except OSError as e:
        raise RayfleetError(f"{source}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise RayfleetError(f"{source}: not UTF-8 text (byte {e.start}); pass the output of "
                            "`pulumi stack output --json`") from None
    return parse_outputs(text, source)


def default_token_file(cluster_name: str) -> str:
    home = os.environ.get("RAYFLEET_HOME")
    base = Path(home).expanduser() if home else Path("~/.rayfleet")
    return str(base / "clusters" / cluster_name / "auth_token")


def options(token_file: str, key_name: str | None = None, idle_timeout_minutes: int = 10,
            autostop_minutes: int | None = None, metrics: bool = False,
            pyproject: Path | None = None, vllm: str = "cuda",
            ingress: str = DEFAULT_INGRESS) -> RenderOptions:
    """`rayfleet render`'s flags as the one options object. The node environment is the
    installed kit's (``pyproject``: another declaration, for tests); ``metrics`` puts
    Prometheus on the head (its commands are this level's, rayfleet/commands/metrics.py)."""
    return RenderOptions(
        token_file=token_file, node_env=nodeenv.load(pyproject), key_name=key_name,
        idle_timeout_minutes=idle_timeout_minutes, autostop_minutes=autostop_minutes,
        prometheus=tuple(prometheus.head_commands(haproxy=ingress == "haproxy"))
        if metrics else (),
        vllm=vllm, ingress=ingress)


def build_config(o: StackOutputs, token_file: str, key_name: str | None = None,
                 idle_timeout_minutes: int = 10, autostop_minutes: int | None = None,
                 metrics: bool = False, pyproject: Path | None = None,
                 vllm: str = "cuda", ingress: str = DEFAULT_INGRESS) -> dict[str, Any]:
    """The cluster YAML as a mapping (values possibly wrapped in :class:`Why`), from the
    flags (:func:`options`)."""
    return pipeline.build_config(o, options(token_file, key_name, idle_timeout_minutes,
                                            autostop_minutes, metrics, pyproject, vllm, ingress))


def render_text(o: StackOutputs, token_file: str, key_name: str | None = None,
                idle_timeout_minutes: int = 10, autostop_minutes: int | None = None,
                metrics: bool = False, vllm: str = "cuda",
                ingress: str = DEFAULT_INGRESS) -> str:
    """The cluster YAML's text, from the flags (:func:`options`)."""
    return pipeline.render_text(o, options(token_file, key_name, idle_timeout_minutes,
                                           autostop_minutes, metrics, vllm=vllm,
                                           ingress=ingress))


def facts(o: StackOutputs, token_file: str) -> RenderFacts:
    """What other commands read back of this render (the file beside the YAML)."""
    return RenderFacts(storage_uri=o.storage_uri, run_store=runstore.root(o.storage_uri),
                       stack=o.stack, cluster_name=o.cluster_name, region=o.region,
                       token_file=token_file)


# The file that marks an agents folder as render's own: only such a folder is replaced.
AGENTS_MARK = ".rayfleet-agents"


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is one copy_agents made: marked, or (an older kit's) holding nothing
    but what it copies."""
    if (folder / AGENTS_MARK).is_file():
        return True
    copied = {f"{n}.py" for n in AGENT_NAMES} | {Path(REMOTE_SCORER).name, "__pycache__",
                                                 nodeenv.CONSTRAINTS}
    return folder.is_dir() and not folder.is_symlink() and all(
        p.name in copied for p in folder.iterdir())


def refuse_foreign(folder: Path) -> None:
    if folder.is_symlink() or (folder.exists() and not _ours(folder)):
        raise RayfleetError(f"{folder} exists and is not a folder of `rayfleet render`'s; move "
                            "it, or pick another --token-file (the agents go beside it)")


def copy_agents(dest: str, constraints: str | None = None) -> Path:
    """The node agents into ``dest`` (the YAML's file_mounts source), with the lock's
    constraints the setup commands install under, replaced whole; a folder there that render
    did not make is refused, never deleted."""
    import shutil

    constraints = constraints or nodeenv.node_constraints()
    folder = Path(dest).expanduser()
    refuse_foreign(folder)
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        (tmp / AGENTS_MARK).write_text("made by `rayfleet render`; replaced whole on each "
                                       "render\n")
        for name in AGENT_NAMES:
            shutil.copy2(AGENTS / f"{name}.py", tmp / f"{name}.py")
        (tmp / nodeenv.CONSTRAINTS).write_text(constraints)
        scorer = tmp / Path(REMOTE_SCORER).name
        scorer.mkdir()
        shutil.copy2(AGENTS / "fallover.py", scorer / f"{fallover.MODULE}.py")
        for name in SCORER_ALSO:
            shutil.copy2(AGENTS / f"{name}.py", scorer / f"{name}.py")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RayfleetError(f"cannot copy the node agents to {folder} ({e.strerror})") from None
    return folder


def render(source: str, out: str | None = None, token_file: str | None = None,
           key_name: str | None = None, idle_timeout_minutes: int = 10,
           create_token: bool = True, stdin=None,
           autostop_minutes: int | None = None, metrics: bool = False,
           vllm: str | None = None, ingress: str = DEFAULT_INGRESS) -> Path:
    o = load_outputs(source, stdin)
    if autostop_minutes is None:   # the stack's rayfleet:autostopMinutes
        autostop_minutes = o.autostop_minutes
    autostop_minutes = autostop_minutes or None
    if vllm is None:   # the stack's rayfleet:vllm
        vllm = o.vllm
    token_file = token_file or default_token_file(o.cluster_name)
    text = pipeline.render_text(o, options(token_file, key_name, idle_timeout_minutes,
                                           autostop_minutes, metrics, vllm=vllm,
                                           ingress=ingress))
    path = Path(out) if out else GENERATED / f"{o.stack}.yaml"
    # Everything that can fail is checked before anything is created, so a bad --output leaves
    # no token behind and a bad --token-file leaves no YAML behind.
    if path.is_dir():
        raise RayfleetError(f"--output {path}: is a folder; name the YAML file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RayfleetError(f"--output {path}: cannot create its folder ({e.strerror})") from None
    refuse_foreign(Path(agents_folder(token_file)).expanduser())
    constraints = nodeenv.node_constraints()   # none: nothing written
    if create_token:
        try:
            ensure_token(token_file)  # 0600, created once; never printed
        except OSError as e:
            raise RayfleetError(f"--token-file {token_file}: cannot create it ({e.strerror}); "
                                "pick a path in a folder you own") from None
    copy_agents(agents_folder(token_file), constraints)
    # The facts first: a YAML `ray up` may read never has an older render's facts beside it.
    _write(facts_path(path), facts(o, token_file).to_json(), mode=0o644)
    _write(path, text)
    return path


def _write(path: Path, text: str, mode: int | None = None) -> None:
    """Written to a temporary file and moved into place: an interrupted or failed write never
    leaves a half-written file where `ray up` or another command would read it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        if mode is not None:   # others' commands read it, whatever the umask
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RayfleetError(f"--output {path}: cannot write ({e.strerror})") from None
