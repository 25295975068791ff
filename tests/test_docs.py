"""The README stays short, and every relative link in it and in docs/ resolves (file and anchor)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
README_LIMIT_BYTES = 15 * 1024


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    seen, out = {}, set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(page: Path):
    for target in LINK.findall(page.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/"


def test_anchor_slugs_follow_github():
    assert slug("## Auto-tuning") == "auto-tuning"
    assert slug("Hybrid sharding: shard within a node, replicate across nodes") == (
        "hybrid-sharding-shard-within-a-node-replicate-across-nodes"
    )
    assert slug("`MODEL.FSDP_CONFIG` knobs") == "modelfsdp_config-knobs"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere)\n")
    assert list(relative_links(page)) == ["#title", "missing.md", "#nowhere"]
    assert "title" in anchors(page) and "nowhere" not in anchors(page)
