"""`make regen`: write what the Ansible role, cluster-configs/onprem.yaml and Pulumi.yaml's
`config:` block (from rayfleet/configkeys.py's SCHEMA) mirror of the kit,
from the kit's one declaration of each fact (docs/house.md, convention 11). Only the mirrored
values are rewritten, line by line; every comment and the order around them stay.

Usage: python scripts/regen.py [--check]   (--check writes nothing and exits 1 naming each
file that would change, one line each)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from rayfleet import facts, nodeenv, raystart  # noqa: E402
from rayfleet.configkeys import SCHEMA  # noqa: E402
from rayfleet.commands import render  # noqa: E402
from rayfleet.ingress import DEFAULT_INGRESS, haproxy_env  # noqa: E402

ROLE = Path("infra/ansible/roles/ray_node")
DEFAULTS = ROLE / "defaults" / "main.yml"
SPEC = ROLE / "meta" / "argument_specs.yml"
LAUNCH = ROLE / "templates" / "ray-node-run.sh.j2"
ONPREM = Path("cluster-configs/onprem.yaml")
PULUMI = Path("Pulumi.yaml")
# What the role installs on a node, shipped in its own files/ so that it stands alone: byte
# copies of the kit's, so a copy is recognisably the same file.
COPIES = {ROLE / "files" / src.name: src for src in (
    Path("rayfleet/agents/haproxy_guard.py"), Path("rayfleet/agents/haproxy_watch.py"),
    Path("rayfleet/agents/envcheck.py"), Path("rayfleet/node-constraints.txt"))}
SPEC_OPTION_INDENT = 6   # argument_specs: main: options: <name>:
SPEC_WIDTH = 96          # where a default's flow list wraps


class Stale(Exception):
    """A mirror regen cannot place its value in (a key gone, a flag not pinned)."""


# ----------------------------------------------------------------------------- the facts

def role_ports(launch: str) -> dict[str, int]:
    """Each role variable the launch script passes to a `ray start` port flag, with RAY_PORTS'
    number for that flag."""
    var_of_flag = dict(re.findall(r"(--[a-z-]+)=\{\{ (ray_node_\w+) \}\}", launch))
    ports = {}
    for p in facts.RAY_PORTS:
        if not p.flag.startswith("--"):
            continue  # ssh, and Serve's ports (the Serve config's to set)
        for flag, number in zip(p.flag.split("/"), (p.from_port, p.to_port), strict=False):
            if flag not in var_of_flag:
                raise Stale(f"{LAUNCH}: the launch script does not pin {flag}")
            ports[var_of_flag[flag]] = number
    return ports


def role_scalars(launch: str) -> dict[str, str]:
    """The role's single-value defaults that are the kit's facts, as YAML text."""
    ray, *_ = nodeenv.load().requirements
    pin = re.fullmatch(r"ray(?:\[[^\]]*\])?==(\S+)", ray)
    if pin is None:
        raise Stale(f"the node environment's first requirement is not Ray's pin: {ray}")
    return {**{var: str(n) for var, n in role_ports(launch).items()},
            "ray_node_ray_version": json.dumps(pin.group(1)),
            "ray_node_dashboard_host": raystart.DASHBOARD_HOST,
            "ray_node_serve_ingress": DEFAULT_INGRESS}


def role_lists() -> dict[str, list[str]]:
    """The role's node environment: pyproject.toml's pins, as the cluster YAML installs them."""
    env = nodeenv.load()
    ray, *rest = env.requirements
    extras = re.fullmatch(r"ray(?:\[([^\]]*)\])?==\S+", ray).group(1) or ""
    return {"ray_node_ray_extras": [e for e in extras.split(",") if e],
            "ray_node_pip_packages": rest,
            "ray_node_pip_packages_after_torch": list(env.after_torch),
            "ray_node_build_tools": list(nodeenv.BUILD_TOOLS),
            "ray_node_llm_packages": list(env.llm)}


def role_haproxy_environment() -> dict[str, str]:
    """rayfleet.ingress's environment, with the role's own folder and guard."""
    return haproxy_env("{{ ray_node_haproxy_dir }}", "{{ ray_node_haproxy_guard }}")


def onprem_start(head: bool) -> list[str]:
    """On-prem's start commands: render's, without the AWS agents and the autoscaler scorer."""
    # render.build_config's environment of every node's `ray start` (token auth, the venv first).
    auth = (f"export PATH={render.VENV.replace('~', '$HOME', 1)}/bin:$PATH RAY_AUTH_MODE=token "
            f"RAY_AUTH_TOKEN_PATH={render.REMOTE_TOKEN_ENV}")
    start = (render.ray_start(head=True, autoscaling_config=facts.BOOTSTRAP_CONFIG) if head
             else render.ray_start(head=False, address=f"$RAY_HEAD_IP:{facts.port('gcs')}"))
    return [f"{render.RAY_BIN} stop", f"ulimit -n {raystart.NOFILE}; {auth}"
            f"{render.ingress_commands(DEFAULT_INGRESS)}; {start}"]


# ----------------------------------------------------------------------------- line editing

def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _end(lines: list[str], i: int) -> int:
    """The line after key ``i``'s value: the next blank line or one indented no deeper."""
    j = i + 1
    while j < len(lines) and lines[j].strip() and _indent(lines[j]) > _indent(lines[i]):
        j += 1
    return j


def _find(lines: list[str], key: str, indent: int, lo: int = 0, hi: int | None = None) -> int:
    rx = re.compile(rf"{' ' * indent}{re.escape(key)}:(\s|$)")
    for i in range(lo, len(lines) if hi is None else hi):
        if rx.match(lines[i]):
            return i
    raise Stale(f"no `{key}:` at indent {indent} to write")


def put(lines: list[str], key: str, new: list[str], indent: int = 0, lo: int = 0,
        hi: int | None = None) -> None:
    """Replace ``key:`` (at ``indent``, within lines[lo:hi]) and its value with ``new``."""
    i = _find(lines, key, indent, lo, hi)
    lines[i:_end(lines, i)] = new


def block(key: str, value: list | dict, indent: int = 0) -> list[str]:
    """``key:`` with its list or mapping below it, in block style, as render writes YAML."""
    dumped = yaml.safe_dump(value, default_flow_style=False, sort_keys=False, width=4096)
    return [f"{' ' * indent}{key}:", *(f"{' ' * (indent + 2)}{ln}" for ln in dumped.splitlines())]


def flow(key: str, items: list[str], indent: int) -> list[str]:
    """``key: [a, b, ...]``, wrapped at SPEC_WIDTH with the items aligned after the bracket."""
    head = f"{' ' * indent}{key}: ["
    words = [json.dumps(i) if yaml.safe_dump([i], default_flow_style=True).startswith("['")
             else i for i in items]
    out, line = [], head
    for n, word in enumerate(words):
        word += "]" if n == len(words) - 1 else ","
        if line != head and len(line) + 1 + len(word) > SPEC_WIDTH:
            out.append(line)
            line = " " * len(head) + word
        else:
            line += ("" if line == head else " ") + word
    return out + [line if words else head + "]"]


# ----------------------------------------------------------------------------- the mirrors

def defaults_text(text: str, launch: str) -> str:
    lines = text.splitlines()
    for key, value in role_scalars(launch).items():
        put(lines, key, [f"{key}: {value}"])
    for key, items in role_lists().items():
        put(lines, key, block(key, items))
    env = role_haproxy_environment()
    put(lines, "ray_node_haproxy_environment", ["ray_node_haproxy_environment:", *(
        f"  {k}: {json.dumps(v)}" for k, v in env.items())])
    return "\n".join(lines) + "\n"


def spec_text(text: str, launch: str) -> str:
    lines = text.splitlines()
    indent = SPEC_OPTION_INDENT + 2
    values = {**{k: [f"{' ' * indent}default: {v}"] for k, v in role_scalars(launch).items()},
              **{k: flow("default", v, indent) for k, v in role_lists().items()}}
    for option, new in values.items():
        i = _find(lines, option, SPEC_OPTION_INDENT)
        put(lines, "default", new, indent, i + 1, _end(lines, i))
    return "\n".join(lines) + "\n"


def onprem_text(text: str) -> str:
    lines = text.splitlines()
    put(lines, "setup_commands", block("setup_commands", render.setup_commands(nodeenv.load())))
    put(lines, "head_start_ray_commands", block("head_start_ray_commands", onprem_start(True)))
    put(lines, "worker_start_ray_commands",
        block("worker_start_ray_commands", onprem_start(False)))
    return "\n".join(lines) + "\n"


def _scalar(value) -> str:
    return '""' if value == "" else yaml.safe_dump(value, default_flow_style=True).strip(
        ).removesuffix("\n...").removesuffix("...").strip()


def pulumi_text(text: str) -> str:
    """Pulumi.yaml with its ``config:`` block (the file's last) written from configkeys.SCHEMA:
    each key's type, default and description, as Pulumi's project file declares them."""
    lines = text.splitlines()
    if "config:" not in lines:
        raise Stale("no top-level `config:` block to write")
    out = lines[:lines.index("config:") + 1]
    for key in SCHEMA:
        out.append(f"  {key.qualified}:")
        if key.type == "objects":
            out += ["    # Untyped on purpose: a list of objects, and a project's config types "
                    "are string, integer,",
                    "    # boolean and arrays of those; rayfleet/config.py checks every entry "
                    "before any resource."]
        else:
            out.append(f"    type: {key.type}")
        if key.type == "array":
            out += ["    items:", "      type: string"]
        if isinstance(key.default, list) and key.default:
            out += ["    default:", *(f"      - {_scalar(v)}" for v in key.default)]
        else:
            out.append(f"    default: {_scalar(key.default)}")
        out += ["    description: >-", *textwrap.wrap(key.description, SPEC_WIDTH,
                                                      initial_indent=" " * 6,
                                                      subsequent_indent=" " * 6,
                                                      break_on_hyphens=False,
                                                      break_long_words=False)]
    return "\n".join(out) + "\n"


def wanted(root: Path) -> dict[Path, bytes]:
    """Every file regen writes (relative to ``root``), with what it should hold."""
    launch = (root / LAUNCH).read_text()

    def edited(path: Path, edit) -> bytes:
        try:
            return edit((root / path).read_text()).encode()
        except Stale as e:
            raise Stale(f"{path}: {e}") from None

    out = {dest: (root / src).read_bytes() for dest, src in COPIES.items()}
    out[DEFAULTS] = edited(DEFAULTS, lambda t: defaults_text(t, launch))
    out[SPEC] = edited(SPEC, lambda t: spec_text(t, launch))
    out[ONPREM] = edited(ONPREM, onprem_text)
    out[PULUMI] = edited(PULUMI, pulumi_text)
    return out


def stale(root: Path, files: dict[Path, bytes]) -> list[Path]:
    """The files under ``root`` whose content is not what regen writes."""
    return [p for p, data in files.items()
            if not (root / p).is_file() or (root / p).read_bytes() != data]


def main(argv: list[str] | None = None, root: Path = REPO) -> int:
    parser = argparse.ArgumentParser(prog="scripts/regen.py", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each file that would change")
    args = parser.parse_args(argv)
    try:
        files = wanted(root)
    except Stale as e:
        print(f"regen: {e}", file=sys.stderr)
        return 1
    changed = stale(root, files)
    if args.check:
        for path in changed:
            print(f"{path}: not what `make regen` writes; run make regen", file=sys.stderr)
        return 1 if changed else 0
    for path in changed:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(files[path])
        if path in COPIES:   # the guard and its watcher are executables, as the kit's are
            os.chmod(root / path, (root / COPIES[path]).stat().st_mode & 0o777)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
