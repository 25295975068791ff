"""The README stays short, every relative link in it, docs/ and dev/ resolves (file and anchor), and
every dev/ script is indexed, says what it prints and exists where the docs and code name it."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "dev" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
DEV_SCRIPTS = sorted(p for p in (REPO / "dev").glob("*/*") if p.suffix in (".py", ".sh"))
DEV_PATH = re.compile(r"\bdev/[\w/]+\.(?:py|sh)\b")
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


def test_dev_scripts_are_grouped_and_indexed():
    index = (REPO / "dev" / "README.md").read_text()
    assert DEV_SCRIPTS and not list((REPO / "dev").glob("*.py")), "dev/ scripts live in dev/<group>/"
    missing = [
        str(p.relative_to(REPO / "dev")) for p in DEV_SCRIPTS if f"`{p.parent.name}/{p.name}`" not in index
    ]
    assert not missing, f"not in dev/README.md: {missing}"


@pytest.mark.parametrize("script", [p for p in DEV_SCRIPTS if p.suffix == ".py"], ids=lambda p: p.name)
def test_a_dev_script_says_first_what_it_prints(script):
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    assert doc.startswith("Prints "), f"{script.name}: the docstring's first line says what it prints"


def test_dev_paths_named_anywhere_exist():
    named = set()
    for folder in ("docs", "dev", "vistrain", "tests", "configs", "tools"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".md", ".py", ".yaml", ".sh"):
                named.update(DEV_PATH.findall(path.read_text()))
    named.update(DEV_PATH.findall((REPO / "README.md").read_text()))
    assert named
    assert not sorted(p for p in named if not (REPO / p).exists()), "named dev/ paths that do not exist"


def _own_images_command(page: Path) -> str:
    """The indented command block of a page that pretrains on a disk folder, joined into one line."""
    for block in page.read_text().split("\n\n"):
        lines = block.splitlines()
        if lines and all(line.startswith("    ") for line in lines) and "DATA_SOURCES=[disk_folder]" in block:
            return " ".join(line.strip().rstrip("\\").strip() for line in lines)
    raise AssertionError(f"{page.name}: no own-images command")


def test_readme_and_getting_started_give_one_own_images_command():
    readme = _own_images_command(REPO / "README.md")
    assert readme == _own_images_command(REPO / "docs" / "getting-started.md")
    assert "config.CHECKPOINT.DIR=" in readme, "your own images get a run folder of their own"
