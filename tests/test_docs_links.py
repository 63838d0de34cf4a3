"""The documentation's links resolve: every relative link in README.md, docs/ and
bench/results/history.md names a file that exists and, with ``#anchor``, a heading of it; every
Python block of the guides parses. ``python tests/test_docs_links.py`` prints what it finds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pages another part of the tree provides; a link to one is checked once the page exists
PROVIDED_ELSEWHERE: set = set()  # pages another change adds; none now

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "bench" / "results" / "history.md"]
    found += sorted((ROOT / "docs").rglob("*.md"))
    return [p for p in found if p.exists()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)}


def broken_links() -> list[str]:
    bad = []
    for page in pages():
        text = FENCE.sub("", page.read_text())
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                if rel not in PROVIDED_ELSEWHERE:
                    bad.append(f"{where}: no file {rel}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: no heading #{anchor} in {rel}")
    return bad


def test_links_resolve():
    assert pages(), "no documentation pages found"
    bad = broken_links()
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in pages()])
def test_python_blocks_parse(page):
    for code in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S):
        ast.parse(code, filename=page)


def test_slug_matches_github():
    assert slug("score_mods, H200") == "score_mods-h200"
    assert slug("Per-row arrays, document ids") == "per-row-arrays-document-ids"
    assert slug("In a `transformers` model") == "in-a-transformers-model"


if __name__ == "__main__":
    for line in broken_links() or ["every link resolves"]:
        print(line)
