"""README and the docs/ pages: every relative link leads somewhere in the repository."""

from __future__ import annotations

import re

from scripts.readme_blocks import PAGES
from tests.conftest import REPO

# [text](target) outside code; images and links alike. Absolute URLs are not checked here.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans."""
    return LINK.findall(CODE.sub("", text))


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = {_anchor(h.replace("`", "")) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        source = REPO / page
        for target in _links(source.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (source.parent / path).resolve() if path else source
            if not dest.is_relative_to(REPO) or not dest.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_reads_links_and_headings_as_github_does():
    assert _links("see [faults](docs/faults.md#bad-input), not `[x](code.md)`") == \
        ["docs/faults.md#bad-input"]
    assert _anchor("The Pulumi program: what the offline tests prove — and what they don't") \
        == "the-pulumi-program-what-the-offline-tests-prove--and-what-they-dont"
    assert _anchor("Data: workloads.data") == "data-workloadsdata"


def test_the_node_types_page_table_is_the_catalogs():
    """docs/node-types.md's table of GPU worker types is generated from rayfleet/catalog.json;
    a price, region or EFA count changed in one and not the other fails here."""
    from rayfleet import catalog

    text = (REPO / "docs" / "node-types.md").read_text()
    m = re.search(r"<!-- node-types-table: [^\n]*-->\n(.*?)<!-- /node-types-table -->", text,
                  re.S)
    assert m, "docs/node-types.md lost its generated-table markers"
    assert m.group(1) == catalog.worker_table(), (
        "docs/node-types.md's table drifted from the catalog; paste "
        "`python -c 'from rayfleet import catalog; print(catalog.worker_table(), end=\"\")'`")
    assert set(catalog.worker_types()) == set(re.findall(r"^\| `([^`]+)` \|", m.group(1), re.M))


def test_the_reservation_examples_are_configs_the_kit_accepts():
    """docs/aws.md's two lines and docs/node-types.md's example of rayfleet:capacityReservations
    (and Pulumi.dev.yaml's commented one) are what rayfleet/config.py accepts for the example
    stack's worker types."""
    import yaml

    from rayfleet.config import StackConfig

    found = []
    for page in ("docs/aws.md", "docs/node-types.md", "Pulumi.dev.yaml"):
        text = (REPO / page).read_text()
        if page.endswith(".yaml"):
            blocks = ["\n".join(ln.replace("# ", "", 1) for ln in text.splitlines()
                                if "capacityReservations" in ln or "- {instanceType" in ln)]
        else:
            blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
        for block in blocks:
            if "capacityReservations" not in block:
                continue
            doc = yaml.safe_load(block)
            doc = doc.get("config", doc)
            values = {"rayfleet:workerInstanceTypes": ["p4d.24xlarge", "p4de.24xlarge"],
                      "rayfleet:capacityReservations": doc["rayfleet:capacityReservations"]}
            found.append((page, len(StackConfig.from_mapping(values).nodes
                                    .capacity_reservations)))
    assert found == [("docs/aws.md", 2), ("docs/node-types.md", 2), ("Pulumi.dev.yaml", 1)]


def test_the_fallback_az_examples_are_configs_the_kit_accepts():
    """docs/node-types.md's example of rayfleet:workerFallbackAzs and Pulumi.dev.yaml's
    commented one are what rayfleet/config.py accepts with the example stack's workerAz."""
    import yaml

    from rayfleet.config import StackConfig

    dev = (REPO / "Pulumi.dev.yaml").read_text()
    (line,) = [ln for ln in dev.splitlines() if "workerFallbackAzs:" in ln]
    blocks = [line.replace("# ", "", 1)] + [
        b for b in re.findall(r"```yaml\n(.*?)```", (REPO / "docs/node-types.md").read_text(),
                              re.S) if "workerFallbackAzs" in b]
    assert len(blocks) == 2
    worker_az = yaml.safe_load(dev)["config"]["rayfleet:workerAz"]
    for block in blocks:
        doc = yaml.safe_load(block)
        doc = doc.get("config", doc)
        values = {"rayfleet:workerAz": doc.get("rayfleet:workerAz", worker_az),
                  "rayfleet:workerFallbackAzs": doc["rayfleet:workerFallbackAzs"]}
        assert StackConfig.from_mapping(values).nodes.worker_fallback_azs == ("us-east-1c",)
