"""Every relative link in README.md and docs/**/*.md resolves: the file exists and, with a #fragment,
the target page has a heading of that GitHub-style anchor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a `# comment` in bash is no heading)."""
    lines, inside = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation other than - and _ dropped, spaces to -, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in prose(path):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        found += [target for target in LINK.findall(line) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]
    return found


def test_pages_exist() -> None:
    assert (ROOT / "docs" / "FILES.md").is_file() and len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
