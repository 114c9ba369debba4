"""docs/testing.md's "What proves each capability": every test its table names exists.

Each row names, for one capability a user would notice, the test that proves it, as
`tests/dir/test_file.py::test_name` (or `::TestClass::test_name`). A test renamed or removed
would leave its row pointing at nothing: the table and each file it names are read with `ast`
(nothing imported, nothing collected), and the row that lost its proof is named."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

SECTION = "## What proves each capability"
HEADER = ["capability", "proved by"]
REF = re.compile(r"`([^`]*)`")
FIX = "a proof was removed or renamed: update docs/testing.md"


def table(text: str) -> list[list[str]]:
    """The cells of each row of the section's table (header and separator left out)."""
    assert SECTION in text, f"docs/testing.md has no '{SECTION}' section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells != HEADER and not all(set(c) <= set("-: ") for c in cells):
            rows.append(cells)
    return rows


def defined(path: Path) -> set[str]:
    """What a test file defines: `name` at module level, `Class::name` in its classes."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{m.name}" for m in node.body
                      if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)}
    return names


def problems(rows: list[list[str]], repo: Path) -> list[str]:
    """One line per row or reference that does not hold, naming the row."""
    found: list[str] = []
    seen: dict[Path, set[str]] = {}
    for cells in rows:
        if len(cells) != 2:
            found.append(f"row {cells!r}: {len(cells)} cells, not | capability | proved by |")
            continue
        capability, cell = cells
        refs = REF.findall(cell)
        if not refs:
            found.append(f"row {capability!r}: names no test")
        for ref in refs:
            file, _, name = ref.partition("::")
            path = repo / file
            if not (file.startswith("tests/") and file.endswith(".py") and
                    name.rpartition("::")[2].startswith("test")):
                found.append(f"row {capability!r}: `{ref}` is not "
                             "tests/<file>.py::[<Class>::]test_<name>")
            elif not path.is_file():
                found.append(f"row {capability!r}: `{ref}`: no file {file}; {FIX}")
            elif name not in seen.setdefault(path, defined(path)):
                found.append(f"row {capability!r}: `{ref}`: {file} defines no {name}; {FIX}")
    return found


def test_every_proof_named_in_testing_md_exists():
    rows = table((REPO / "docs" / "testing.md").read_text())
    assert len(rows) >= 30, f"docs/testing.md '{SECTION}': {len(rows)} rows, at least 30 wanted"
    capabilities = [cells[0] for cells in rows]
    assert all(capabilities), "docs/testing.md: a row with an empty capability cell"
    twice = sorted({c for c in capabilities if capabilities.count(c) > 1})
    assert not twice, f"docs/testing.md: capabilities listed twice: {twice}"
    found = problems(rows, REPO)
    assert not found, "\n".join(found)


def test_the_check_names_a_proof_that_does_not_exist(tmp_path):
    here = "tests/unit/test_capabilities.py"
    crafted = (f"{SECTION}\n\nText.\n\n| capability | proved by |\n|---|---|\n"
               f"| still proved | `{here}::test_every_proof_named_in_testing_md_exists` |\n"
               f"| renamed proof | `{here}::test_every_proof_named_in_testing_md_exists`; "
               f"`{here}::test_that_was_renamed` |\n"
               "| removed file | `tests/unit/test_gone.py::test_x` |\n"
               "| a helper, not a test | `tests/unit/test_capabilities.py::table` |\n"
               "| no proof | nothing here |\n\n## Next\n\n| x | `tests/nope.py::test_y` |\n")
    rows = table(crafted)
    assert [cells[0] for cells in rows] == ["still proved", "renamed proof", "removed file",
                                            "a helper, not a test", "no proof"]
    found = problems(rows, REPO)
    assert found == [
        f"row 'renamed proof': `{here}::test_that_was_renamed`: {here} defines no "
        f"test_that_was_renamed; {FIX}",
        f"row 'removed file': `tests/unit/test_gone.py::test_x`: no file "
        f"tests/unit/test_gone.py; {FIX}",
        f"row 'a helper, not a test': `{here}::table` is not "
        "tests/<file>.py::[<Class>::]test_<name>",
        "row 'no proof': names no test"], found
    # A method of a test class is named Class::method, and only that way.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_k.py").write_text("class TestK:\n    def test_m(self): ...\n")
    assert problems([["method", "`tests/test_k.py::TestK::test_m`"]], tmp_path) == []
    assert problems([["bare", "`tests/test_k.py::test_m`"]], tmp_path) == [
        f"row 'bare': `tests/test_k.py::test_m`: tests/test_k.py defines no test_m; {FIX}"]
