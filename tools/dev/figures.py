"""docs/figures.toml, the one source of fedguard's current figures (issue 54): read it, render a figure as pages
quote it, find the pages' quotes that differ from it, and let a benchmark tool rewrite its own entries.

A page quotes a figure inside a marker the check can find::

    <!-- fig:round_overhead_k10 -->0.0046–0.0082 s<!-- /fig -->

and ``tests/unit/test_figures.py`` fails when the text between the markers is not :func:`render` of the entry.
A benchmark tool given ``--figures PATH`` calls :func:`update` with what it measured (value and date; the other
fields stay as written), so the pages' test then names every page that still quotes the old figure.

    python tools/dev/figures.py                      # every figure, rendered, with its command
    python tools/dev/figures.py --check             # the pages' quotes against docs/figures.toml (exit 1 on a mismatch)
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "docs" / "figures.toml"
FIELDS = ("value", "unit", "what", "command", "machine", "date", "source")
MARKER = re.compile(r"<!-- fig:([a-z0-9_]+) -->(.*?)<!-- /fig -->", re.S)
OPEN_MARKER = re.compile(r"<!-- fig:([a-z0-9_]+) -->")

Figures = Mapping[str, Mapping[str, str]]


def load(path: Path = DEFAULT) -> dict[str, dict[str, str]]:
    """The figures of ``path``: name -> its fields (all strings)."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    return {name: {k: str(v) for k, v in entry.items()} for name, entry in data.items()}


def render(entry: Mapping[str, str]) -> str:
    """A figure as the pages quote it: ``value unit`` (``value×`` for a unit starting with ×)."""
    value, unit = entry["value"], entry.get("unit", "")
    if not unit:
        return value
    return f"{value}{unit}" if unit.startswith("×") else f"{value} {unit}"


def problems(figures: Figures) -> list[str]:
    """Entries that lack a field, or whose source page (and heading) does not exist."""
    out = []
    for name, entry in figures.items():
        missing = [f for f in FIELDS if not entry.get(f)]
        if missing:
            out.append(f"{name}: missing {', '.join(missing)}")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry.get("date", "")):
            out.append(f"{name}: date {entry.get('date')!r} is not YYYY-MM-DD")
        source = entry.get("source", "")
        file_part, _, anchor = source.partition("#")
        if file_part and not (ROOT / file_part).exists():
            out.append(f"{name}: source {file_part} does not exist")
        elif anchor and anchor not in _anchors(ROOT / file_part):
            out.append(f"{name}: source {file_part} has no heading #{anchor}")
    return out


def mismatches(text: str, figures: Figures, where: str = "page") -> list[str]:
    """Every marker in ``text`` whose quote differs from its figure, or that names no figure / is not closed."""
    out = []
    for m in MARKER.finditer(text):
        name, quoted = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if name not in figures:
            out.append(f"{where}:{line}: fig:{name} is not in docs/figures.toml")
        elif quoted != render(figures[name]):
            out.append(f"{where}:{line}: fig:{name} says {quoted!r}, docs/figures.toml {render(figures[name])!r}")
    if len(OPEN_MARKER.findall(text)) != len(MARKER.findall(text)):
        out.append(f"{where}: a <!-- fig:... --> marker without its <!-- /fig -->")
    return out


def quoted(text: str) -> set[str]:
    """The figures ``text`` quotes in markers."""
    return {m.group(1) for m in MARKER.finditer(text)}


def check_pages(pages: Iterable[Path], figures: Figures) -> list[str]:
    out = []
    for page in pages:
        out += mismatches(page.read_text(), figures, str(page.relative_to(ROOT)))
    return out


def update(path: Path, name: str, value: str, date: str | None = None) -> None:
    """Rewrite ``name``'s value (and date: today's, UTC, unless given) in ``path``, leaving every other line as it is.
    Raises KeyError when ``path`` has no such figure."""
    date = date or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lines = path.read_text().splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == f"[{name}]")
    except StopIteration:
        raise KeyError(f"{path}: no figure [{name}]") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    for i in range(start + 1, end):
        key = lines[i].split("=", 1)[0].strip()
        if key == "value":
            lines[i] = f"value = {_toml_string(value)}\n"
        elif key == "date":
            lines[i] = f"date = {_toml_string(date)}\n"
    text = "".join(lines)
    tomllib.loads(text)  # never write a file that does not parse
    path.write_text(text)


def span(values: Sequence[float], fmt: str = "{:g}") -> str:
    """``min–max`` of ``values`` (one value when they are all equal), as the pages write a range."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _toml_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (as tests/unit/test_docs_links.py computes them)."""
    if path.suffix != ".md":
        return set()
    body = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    out = set()
    for m in re.finditer(r"^#+\s+(.*)$", body, re.M):
        text = re.sub(r"`", "", m.group(1).strip().lower())
        out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def pages() -> list[Path]:
    """The pages whose markers are checked: README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--figures", type=Path, default=DEFAULT, help="the figures file (default docs/figures.toml)")
    ap.add_argument("--check", action="store_true", help="check every page's quotes; exit 1 on a mismatch")
    a = ap.parse_args(argv)
    figures = load(a.figures)
    if a.check:
        found = problems(figures) + check_pages(pages(), figures)
        for line in found:
            print(line)
        print(f"{len(found)} problem(s)" if found else "every quoted figure matches docs/figures.toml")
        return 1 if found else 0
    for name, entry in figures.items():
        print(f"{name}: {render(entry)} ({entry['date']}; {entry['command']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
