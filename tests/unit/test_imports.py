"""The house's shape, read from the kit's own imports: no circle, no upward edge.

Every ``import`` and ``from ... import`` in rayfleet/, workloads/, infra/ and bench/ is read with
``ast`` (function-local ones too), resolved to the kit's module it names, and checked against
the levels below. A module may import its own level's package and any lower level, never a
higher one or a peer; and the module graph has no cycle at all.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rayfleet", "workloads", "infra", "bench")

# (level, prefix, group): the longest prefix a module starts with gives its level and group.
# Peers share a level but not a group, and may not import each other.
LEVELS: list[tuple[int, str, str]] = [
    # Standalone programs shipped to the nodes: the standard library and the node environment.
    (0, "rayfleet.agents", "agents"),
    # The core: what the workloads, infra and the commands stand on; one group.
    *((1, f"rayfleet.{m}", "core") for m in ("errors", "entrypoint", "facts", "rules",
                                              "catalog", "configkeys", "configcheck",
                                              "reservations", "nodes", "config", "stack",
                                              "ingress", "nodeenv", "raystart")),
    (1, "rayfleet", "core"),   # the package itself (__init__)
    # The workloads' one shared level: models, the run store, corpora, CLI helpers.
    (2, "workloads.common", "common"),
    (2, "workloads", "common"),   # the package itself (__init__)
    # Peers over it: each imports common and the core, never another.
    *((3, f"workloads.{m}", m) for m in ("data", "train", "embed", "serve")),
    (3, "infra", "infra"),
    # The operator's commands, above everything the cluster runs.
    (4, "rayfleet.commands", "commands"),
    (5, "bench", "bench"),
]
# What the core and the agents may take from outside the standard library.
THIRD_PARTY = {
    # An agent's sibling too, by the name a node imports it under (the agents' own folder).
    "agents": {"boto3", "botocore", "ray"}
    | {p.stem for p in (REPO / "rayfleet" / "agents").glob("*.py")},
    "core": {"yaml", "pulumi"},
}


def _group(module: str) -> tuple[int, str]:
    best = max((p for p in LEVELS if module == p[1] or module.startswith(p[1] + ".")),
               key=lambda p: len(p[1]), default=None)
    assert best is not None, f"{module} is in no level of tests/unit/test_imports.py"
    return best[0], best[2]


def _modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, kit: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The kit's modules ``module`` imports, and the top-level names of everything else."""
    is_package = path.name == "__init__.py"
    ours, theirs = set(), set()

    def add(name: str) -> None:
        top = name.split(".")[0]
        if top not in ROOTS and top != "tests":
            theirs.add(top)
            return
        while name and name not in kit:   # `import a.b.c` names a.b.c, or its package
            name = name.rpartition(".")[0]
        if name and name != module:
            ours.add(name)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            for alias in node.names:   # `from pkg import mod` imports the module pkg.mod
                add(f"{name}.{alias.name}" if f"{name}.{alias.name}" in kit else name)
    return ours, theirs


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    kit = _modules()
    edges, third = {}, {}
    for module, path in kit.items():
        edges[module], third[module] = _imports(module, path, kit)
    return edges, third


def test_every_module_has_a_level(graph):
    for module in graph[0]:
        _group(module)


def test_no_upward_edge_and_no_peer_edge(graph):
    edges, _ = graph
    bad = []
    for module, targets in edges.items():
        level, group = _group(module)
        for target in sorted(targets):
            t_level, t_group = _group(target)
            if t_level > level or (t_level == level and t_group != group):
                bad.append(f"{module} (level {level}) imports {target} (level {t_level})")
    assert not bad, "\n".join(bad)


def test_no_import_circle(graph):
    edges, _ = graph
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_core_and_agents_take_only_their_third_party(graph):
    _, third = graph
    bad = []
    for module, names in third.items():
        level, group = _group(module)
        if level > 1:
            continue
        allowed = THIRD_PARTY[group]
        extra = {n for n in names if n not in sys.stdlib_module_names} - allowed - {"__future__"}
        if extra:
            bad.append(f"{module}: {sorted(extra)}")
    assert not bad, "\n".join(bad)


def test_the_reader_sees_a_circle_and_an_upward_edge(tmp_path, monkeypatch):
    """The checks above read real edges: a planted circle and back-arrow are found."""
    kit = {"rayfleet.facts": tmp_path / "facts.py", "rayfleet.commands.local": tmp_path / "l.py",
           "workloads.train.x": tmp_path / "t.py", "workloads.serve.y": tmp_path / "s.py"}
    kit["rayfleet.facts"].write_text("def f():\n    from rayfleet.commands import local\n")
    kit["rayfleet.commands.local"].write_text("from rayfleet.facts import f\nimport numpy\n")
    kit["workloads.train.x"].write_text("from ..serve import y\n")
    kit["workloads.serve.y"].write_text("from workloads.train.x import z\n")
    edges = {m: _imports(m, p, kit)[0] for m, p in kit.items()}
    assert edges == {"rayfleet.facts": {"rayfleet.commands.local"},
                     "rayfleet.commands.local": {"rayfleet.facts"},
                     "workloads.train.x": {"workloads.serve.y"},
                     "workloads.serve.y": {"workloads.train.x"}}
    with pytest.raises(AssertionError, match="rayfleet.facts .level 1. imports rayfleet.commands"):
        test_no_upward_edge_and_no_peer_edge((edges, {}))
    with pytest.raises(AssertionError, match="workloads.serve.y"):
        test_no_import_circle((edges, {}))
