"""The security rules have one home, rayfleet/rules.py, and the repository cites only those:
every "rule N" anywhere names a rule of the registry, docs/security.md explains each one under
its registry title, and `rayfleet lint` and the policy pack enforce what the registry says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rayfleet.commands import lint
from rayfleet.rules import RULES

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TEXT = (".py", ".md", ".yml", ".yaml", ".j2", ".sh", ".toml", ".ini", ".cfg", ".txt")
# "rule 21", "Rule 13", "rules 16-19", "rules 1–2 and 4–20", "rules 20, 21"
NUMBERS = r"\d+(?:\s*[-–]\s*\d+)?"
CITATION = re.compile(rf"\b[Rr]ules? ({NUMBERS}(?:(?:,\s*|,? and ){NUMBERS})*)")


def repository_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in listed.splitlines()
            if (p.endswith(TEXT) or Path(p).name == "Makefile") and (REPO / p).is_file()]


def cited(text: str) -> set[int]:
    out: set[int] = set()
    for group in CITATION.findall(text):
        for part in re.split(r",\s*|,? and ", group):
            lo, *hi = re.split(r"\s*[-–]\s*", part)
            out.update(range(int(lo), int(hi[0] if hi else lo) + 1))
    return out


def test_the_citation_reader_reads_ranges_and_lists():
    assert cited("rules 1–2 and 4–6 (and rule 21); Rules 20, 22") == {1, 2, 4, 5, 6, 20, 21, 22}
    assert cited("rule %d" % 30) == {30}  # what the next test would refuse


def test_every_rule_cited_in_the_repository_is_in_the_registry():
    unknown = {}
    for path in repository_files():
        numbers = cited(path.read_text(encoding="utf-8", errors="replace")) - set(RULES)
        if numbers:
            unknown[str(path.relative_to(REPO))] = sorted(numbers)
    assert not unknown, f"rules cited but not in rayfleet/rules.py: {unknown}"


def test_nothing_cites_a_document_outside_the_repository():
    outside = "DES" + "IGN"  # the design notes the kit was built from; users never see them
    hits = [f"{p.relative_to(REPO)}:{n}" for p in repository_files()
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace")
                                     .splitlines(), 1) if outside in line]
    assert not hits, hits


def test_docs_explain_every_rule_under_its_registry_title():
    doc = (REPO / "docs" / "security.md").read_text()
    sections = re.findall(r'<a id="rule-(\d+)"></a>\n## Rule (\d+): (.+)\n((?:.+\n?)+)', doc)
    assert [int(a) for a, *_ in sections] == sorted(RULES)
    places = {"pack": "policy pack", "config": "stack config", "lint": "rayfleet lint",
              "test": "tests"}
    for anchor, number, title, body in sections:
        rule = RULES[int(number)]
        assert int(anchor) == rule.number and title == rule.title, number
        enforced = re.search(r"Enforced: (.+)", body.replace("\n", " ")).group(1)
        named = {k for k, words in places.items() if words in enforced}
        assert named == set(rule.enforced), (number, enforced)
        if rule.controls:
            assert all(c.strip().removeprefix("nearest ").split("/")[0].split("-")[0] in body
                       for c in rule.controls.split(",")), number


def test_lint_checks_exactly_the_rules_the_registry_gives_it():
    source = Path(lint.__file__).read_text()
    found = {int(n) for n in re.findall(r"Finding\((?:ERROR|WARNING), (\d+)", source)}
    assert found == {n for n, r in RULES.items() if "lint" in r.enforced}
