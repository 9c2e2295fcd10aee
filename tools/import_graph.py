"""fedcore's module-level imports form no circle.

A circle makes import order matter (a module half-initialised when its partner reads a name from it) and is
usually papered over with a function-level import; the leaf modules ``fedcore.errors``, ``fedcore.options`` and
``fedcore.registry`` exist so that none is needed. This walks the source with :mod:`ast` (nothing is imported):
imports run at import time count (module body, class bodies, ``if``/``try``/``with`` at module level), those under
``if TYPE_CHECKING:`` do not, and imports inside functions are listed apart (they cannot form a circle at import
time, but each is a place where one may be hidden). ``python tools/import_graph.py`` prints the report;
``tests/unit/test_import_graph.py`` holds fedcore to it and ``tools/dev/seams_metrics.py`` counts with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fedcore"


@dataclass(frozen=True)
class Imports:
    """The fedcore modules one module imports at import time, inside functions, and for the type checker only."""

    module_level: frozenset[str]
    function_level: frozenset[str]
    type_checking: frozenset[str]


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``package``."""
    files: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


MODULE, FUNCTION, TYPE_CHECKING = "module", "function", "type_checking"


def _import_nodes(body: list[ast.stmt], where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import under ``body`` with where it runs: at import time, inside a function, or never."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _import_nodes(node.body, TYPE_CHECKING if where == TYPE_CHECKING else FUNCTION)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, TYPE_CHECKING)
            yield from _import_nodes(node.orelse, where)
        else:  # class bodies and module-level if/try/with/for blocks run at import time
            for name in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, name, []):
                    block = child.body if isinstance(child, ast.ExceptHandler) else [child]
                    yield from _import_nodes(block, where)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The fedcore modules an import statement runs (the named module, a submodule named in ``from``, parents)."""
    names: set[str] = set()
    source = ""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = {source} | {f"{source}.{alias.name}" for alias in node.names}
    targets: set[str] = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            candidate = ".".join(parts[:i])
            if candidate in known:
                targets.add(candidate)
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    # A module's own packages are initialised before it runs: importing through them is no edge, except a
    # ``from <own package> import name`` that takes a name the package's __init__ defines (not a submodule):
    # that reads the half-initialised package and works only by the order of its __init__ (a real circle).
    reads_own_package: set[str] = set()
    if isinstance(node, ast.ImportFrom) and source in own_packages and any(
            f"{source}.{alias.name}" not in known for alias in node.names):
        reads_own_package.add(source)
    return (targets - own_packages - {module}) | reads_own_package


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Imports]:
    """Module -> its imports of other modules of ``package``."""
    files = module_files(root, package)
    known = set(files)
    graph: dict[str, Imports] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found: dict[str, set[str]] = {MODULE: set(), FUNCTION: set(), TYPE_CHECKING: set()}
        for node, where in _import_nodes(tree.body, MODULE):
            found[where].update(_targets(node, module, path.name == "__init__.py", known))
        top = found[MODULE]
        graph[module] = Imports(frozenset(top), frozenset(found[FUNCTION] - top),
                                frozenset(found[TYPE_CHECKING] - top - found[FUNCTION]))
    return graph


def circles(graph: dict[str, Imports], *, deferred: bool = False, typing_only: bool = False) -> list[tuple[str, ...]]:
    """Every elementary circle of imports, each starting at its smallest name, sorted.

    Module-level imports only by default (a circle there breaks or depends on import order); with ``deferred`` the
    imports inside functions count too (a circle there is one put off, not gone), with ``typing_only`` also those
    under ``if TYPE_CHECKING:`` (a circle between the ideas of two modules, though never run).
    """
    empty: frozenset[str] = frozenset()
    edges = {m: sorted(i.module_level | (i.function_level if deferred else empty)
                       | (i.type_checking if typing_only else empty)) for m, i in graph.items()}
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str], on_path: set[str]) -> None:
        for nxt in edges.get(node, []):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in on_path:  # each circle found once, from its smallest module
                on_path.add(nxt)
                path.append(nxt)
                walk(start, nxt, path, on_path)
                path.pop()
                on_path.discard(nxt)

    for start in sorted(edges):
        walk(start, start, [start], {start})
    return sorted(found, key=lambda c: (len(c), c))


def report(graph: dict[str, Imports]) -> str:
    lines = []
    for kind, options in (("module-level", {}), ("module- and function-level", {"deferred": True}),
                          ("all (TYPE_CHECKING too)", {"deferred": True, "typing_only": True})):
        found = circles(graph, **options)
        lines.append(f"{len(found)} circle(s) of {kind} imports in {PACKAGE}"
                     f" ({len({frozenset(c) for c in found if len(c) == 2})} between two modules):")
        lines += ["  " + " -> ".join((*c, c[0])) for c in found]
    deferred = sorted((m, t) for m, i in graph.items() for t in i.function_level)
    lines.append(f"{len(deferred)} function-level import(s) of {PACKAGE} modules:")
    lines += [f"  {m} -> {t}" for m, t in deferred]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(import_graph()))
