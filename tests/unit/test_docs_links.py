"""Docs a user can find: every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` at a heading of its target (GitHub's anchor rules: lower-case, punctuation dropped, spaces to '-')."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchor(heading: str) -> str:
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    body = FENCE.sub("", path.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", body, re.M)}


def _links(path: Path) -> list[str]:
    body = FENCE.sub("", path.read_text())
    return [a or b for a, b in LINK.findall(body)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"


def test_the_readme_stays_a_front_page() -> None:
    """The README is the two commands, the story, a quickstart and links (issue 29): at most 200 lines."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[2:6] == ["```bash", *lines[3:5], "```"] and lines[3].startswith("bash tools/demo.sh")
    assert lines[4].startswith("bash tools/test.sh")


# A citation in prose or code: docs/<file>.md, "<section>" (a heading, or a bold or italic lead-in of a paragraph).
CITATION = re.compile(r'(docs/[\w/.-]+\.md),?\s+"([^"]+)"')
SOURCES = [p for d in ("fedcore", "fedserver", "fedclient", "fedlaunch", "fedguard", "tools")
           for p in sorted((ROOT / d).rglob("*.py"))] + DOCS


def _sections(path: Path) -> list[str]:
    text = path.read_text()
    return ([m.group(1) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)]
            + re.findall(r"\*\*([^*]+)\*\*", text) + re.findall(r"(?<![*\w])\*([^*\s][^*]*)\*(?![*\w])", text))


def test_every_cited_section_exists() -> None:
    """Code and docs that send a reader to `docs/x.md, "Section"` name a file that exists and a heading (or a
    paragraph's bold or italic lead-in) there that contains the words: a section that moved is a broken pointer."""
    broken, cache = [], {}
    for src in SOURCES:
        # Comments and docstrings wrap: join the lines, dropping a comment's leading '#'.
        text = re.sub(r"\s+", " ", re.sub(r"\n\s*#\s?", " ", src.read_text()))
        for doc, section in CITATION.findall(text):
            path = ROOT / doc
            if not path.exists():
                broken.append(f"{src.relative_to(ROOT)}: {doc} (no such file)")
                continue
            sections = cache.setdefault(doc, [s.lower() for s in _sections(path)])
            if not any(section.lower() in s for s in sections):
                broken.append(f'{src.relative_to(ROOT)}: {doc}, "{section}" (no such section)')
    assert not broken, "\n".join(broken)
