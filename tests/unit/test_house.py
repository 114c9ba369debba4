"""The house's sizes (docs/house.md, convention 16): no module of the kit over 500 lines, no
function over 80, so that each room keeps one concern a reader can hold at once."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rayfleet", "workloads", "infra")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]


def long_modules(paths: list[Path], limit: int = MAX_MODULE_LINES, base: Path = REPO) -> list[str]:
    return [f"{p.relative_to(base)}: {n} lines" for p in paths
            if (n := len(p.read_text().splitlines())) > limit]


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES,
                   base: Path = REPO) -> list[str]:
    """Every def (methods and nested ones too) longer than ``limit``, from its first decorator
    to its last line."""
    out = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > limit:
                    out.append(f"{p.relative_to(base)}: {node.name} is {n} lines")
    return out


def test_no_module_over_the_limit():
    found = long_modules(_sources())
    assert not found, "\n".join(found)


def test_no_function_over_the_limit():
    found = long_functions(_sources())
    assert not found, "\n".join(found)


def test_the_checks_see_a_long_module_and_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long = tmp_path / "m.py"
    long.write_text(f"@staticmethod\ndef f():\n{body}\n")   # 82 lines with its decorator
    short = tmp_path / "s.py"
    short.write_text("class C:\n    def g(self):\n        return 1\n")
    assert long_functions([long, short], base=tmp_path) == ["m.py: f is 82 lines"]
    assert long_modules([long, short], limit=81, base=tmp_path) == ["m.py: 82 lines"]
    assert long_modules([long, short], base=tmp_path) == []
