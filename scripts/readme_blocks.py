"""README's runnable examples: every fenced ```bash block in README.md follows a marker,

    <!-- readme-test expect="REGEX" [expect="REGEX" ...] -->   run it; it must exit 0 and
                                                                 print every REGEX
    <!-- readme-test skip: why -->                              not runnable here, and why

read by tests/cluster/test_readme.py (which runs them all, in order) and by `make demo-hf`
(which runs one section's):

    python scripts/readme_blocks.py "Your own Hugging Face model"   # that section's blocks
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r'<!-- readme-test(?P<opts>[^\n]*?)-->\n```bash\n(?P<body>.*?)\n```', re.S)
EXPECT = re.compile(r'expect="((?:[^"\\]|\\.)*)"')
FENCE = re.compile(r"^```bash$", re.M)


def examples(text: str) -> list[tuple[int, str, list[str] | None]]:
    """(line, body, expected regexes or None for a skipped block) for each marked block."""
    out = []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start("body"))
        opts = m.group("opts").strip()
        if opts.startswith("skip:"):
            if not opts[len("skip:"):].strip():
                raise ValueError(f"README line {line}: skip without a reason")
            out.append((line, m.group("body"), None))
        else:
            expects = [e.replace('\\"', '"') for e in EXPECT.findall(opts)]
            if not expects:
                raise ValueError(f"README line {line}: a readme-test marker with nothing to "
                                 "expect")
            out.append((line, m.group("body"), expects))
    return out


def section(text: str, heading: str) -> str:
    """The text of the `## ` section whose heading starts with `heading`."""
    m = re.search(rf"^## {re.escape(heading)}.*?$(?P<body>.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise ValueError(f"README has no section '## {heading}'")
    return m.group("body")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: readme_blocks.py SECTION-HEADING", file=sys.stderr)
        return 2
    try:
        runnable = [body for _, body, expects in examples(section(README.read_text(), argv[0]))
                    if expects is not None]
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
