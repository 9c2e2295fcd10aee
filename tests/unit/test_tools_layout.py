"""tools/ in rooms (issue 54, item 5): no tool imports ``tests``, and every tool command the docs quote names a file
that exists and answers ``--help``.

The quoted commands are ``python tools/<path>.py`` and ``python -m tools.<module>`` in README.md, CONTRIBUTING.md and
docs/**/*.md; CHANGELOG.md and docs/results/benchmark_history.md are history (what ran then) and are not checked.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HISTORY = {"CHANGELOG.md", "docs/results/benchmark_history.md"}
ROOMS = ("bench", "experiments", "dev", "prototypes")
COMMAND = re.compile(r"python[0-9.]*\s+(?:-m\s+(tools(?:\.[A-Za-z_][A-Za-z0-9_]*)+)|(tools/[A-Za-z0-9_/]+\.py))")


def _docs() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if p.is_file() and str(p.relative_to(ROOT)) not in HISTORY]


def quoted_tools() -> dict[str, list[str]]:
    """Each quoted tool, as a path relative to the repository (``tools/x/y.py``) -> the pages quoting it."""
    found: dict[str, list[str]] = {}
    for page in _docs():
        rel = str(page.relative_to(ROOT))
        for m in COMMAND.finditer(page.read_text()):
            path = m[2] if m[2] else m[1].replace(".", "/") + ".py"
            found.setdefault(path, []).append(rel)
    return found


def test_the_rooms_are_packages() -> None:
    for room in ROOMS:
        assert (ROOT / "tools" / room / "__init__.py").is_file(), f"tools/{room}/ has no __init__.py"


def test_no_tool_imports_tests() -> None:
    offenders = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "tests" or n.startswith("tests.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"tools import tests (move the helper into the tools package): {offenders}"


def test_every_quoted_tool_exists() -> None:
    quoted = quoted_tools()
    assert len(quoted) >= 20, f"expected the docs to quote the tools; found {sorted(quoted)}"
    missing = {path: pages for path, pages in quoted.items() if not (ROOT / path).is_file()}
    assert not missing, f"quoted tool commands naming no file: {missing}"


def _help(path: str) -> tuple[str, int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    return path, done.returncode, (done.stdout + done.stderr)[-600:]


@pytest.mark.timeout(300)
def test_every_quoted_tool_answers_help() -> None:
    paths = sorted(p for p in quoted_tools() if (ROOT / p).is_file())
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        results = list(pool.map(_help, paths))
    failed = [f"{path}: exit {rc}\n{tail}" for path, rc, tail in results if rc != 0]
    assert not failed, "quoted tools failing --help:\n" + "\n".join(failed)
