"""The runnable examples of README.md and the docs/ pages: every fenced ```bash block follows
a marker,

    <!-- readme-test expect="REGEX" [expect="REGEX" ...] -->   run it; it must exit 0 and
                                                                 print every REGEX
    <!-- readme-test skip: why -->                              not runnable here, and why
    <!-- readme-test fakecloud expect="REGEX" ... -->           run by the fake-cloud
                                                                 rehearsal, not on the local
                                                                 cluster

read by tests/cluster/test_readme.py (which runs them all, in the order of PAGES, each page's
in its own order), by tests/fakecloud/test_ray_up.py (the `fakecloud` ones: README's AWS
steps, against a cluster `ray up` launched) and by `make demo-hf` (which runs one section's):

    python scripts/readme_blocks.py "Your own Hugging Face model"   # that section's blocks
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The order the examples run in: README's quickstarts first, then the pages that continue them
# (docs/workloads.md picks up the README's local cluster and shell state). Every page of docs/
# is listed, so a new page's examples cannot be missed (tests/cluster/test_readme.py).
PAGES = ("README.md", "docs/local-cluster.md", "docs/workloads.md", "docs/nodes.md",
         "docs/node-types.md", "docs/aws.md", "docs/on-prem.md", "docs/operations.md",
         "docs/security.md", "docs/testing.md", "docs/faults.md", "docs/benchmarks.md",
         "docs/house.md", "docs/cli.md")
MARKER = re.compile(r'<!-- readme-test(?P<opts>[^\n]*?)-->\n```bash\n(?P<body>.*?)\n```', re.S)
EXPECT = re.compile(r'expect="((?:[^"\\]|\\.)*)"')
FENCE = re.compile(r"^```bash$", re.M)


FAKECLOUD = "fakecloud"


def examples(text: str, page: str = "README", runner: str = "cluster"
             ) -> list[tuple[int, str, list[str] | None]]:
    """(line, body, expected regexes or None for a block this ``runner`` does not run) for
    each marked block; with runner "fakecloud", only the blocks marked for it."""
    out = []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start("body"))
        opts = m.group("opts").strip()
        fake = opts.split(" ", 1)[0] == FAKECLOUD
        if fake:
            opts = opts[len(FAKECLOUD):].strip()
        elif runner == FAKECLOUD:
            continue
        if opts.startswith("skip:"):
            if not opts[len("skip:"):].strip():
                raise ValueError(f"{page} line {line}: skip without a reason")
            out.append((line, m.group("body"), None))
        else:
            expects = [e.replace('\\"', '"') for e in EXPECT.findall(opts)]
            if not expects:
                raise ValueError(f"{page} line {line}: a readme-test marker with nothing to "
                                 "expect")
            out.append((line, m.group("body"), expects if fake == (runner == FAKECLOUD)
                        else None))
    return out


def all_examples(root: Path = ROOT, runner: str = "cluster"
                 ) -> list[tuple[str, str, list[str] | None]]:
    """("<page> line N", body, expects) for every marked block of every page, in run order
    (``runner``: as examples())."""
    return [(f"{page} line {line}", body, expects) for page in PAGES
            for line, body, expects in examples((root / page).read_text(), page, runner)]


def section(text: str, heading: str) -> str:
    """The text of the `## ` section whose heading starts with `heading`."""
    m = re.search(rf"^## {re.escape(heading)}.*?$(?P<body>.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise ValueError(f"README has no section '## {heading}'")
    return m.group("body")


def find_section(heading: str, root: Path = ROOT) -> tuple[str, str]:
    """(page, text) of the first `## heading` section in README or the docs pages."""
    for page in PAGES:
        try:
            return page, section((root / page).read_text(), heading)
        except ValueError:
            continue
    raise ValueError(f"README has no section '## {heading}'")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: readme_blocks.py SECTION-HEADING", file=sys.stderr)
        return 2
    try:
        page, text = find_section(argv[0])
        runnable = [body for _, body, expects in examples(text, page) if expects is not None]
    except ValueError as e:
        print(f"readme_blocks: {e}", file=sys.stderr)
        return 2
    if not runnable:
        print(f"readme_blocks: no runnable block under '## {argv[0]}'", file=sys.stderr)
        return 2
    print("\n".join(runnable))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
