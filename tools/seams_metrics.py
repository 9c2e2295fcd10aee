"""Structure figures of the code base, before/after a refactor (issue 27): import circles in fedcore, the longest
file and class, SGD loops, places that list the trainer names, duplicated blocks.

    python tools/seams_metrics.py              # this tree
    python tools/seams_metrics.py --repo DIR   # another checkout (e.g. a worktree of the base commit)
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = ("fedcore", "fedserver", "fedclient", "fedguard", "fedlaunch")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _in_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def module_imports(root: Path, path: Path, package: str, deferred: bool = False) -> set[str]:
    """The modules of ``package`` that ``path`` imports at module level (not inside ``if TYPE_CHECKING:``), as
    dotted names of existing modules; with ``deferred`` also the imports inside functions (a circle broken only
    by deferring an import is still a circle of the design)."""
    mod = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _in_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With,
                                                ast.For, ast.While)):
                visit(node.body)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node.level, node.module)
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)

    visit(ast.parse(path.read_text()).body)
    known = {module_name(root, p) for p in (root / package).rglob("*.py")}
    return {m for m in out if m in known and m != mod}


def import_graph(root: Path, package: str = "fedcore", deferred: bool = False) -> dict[str, set[str]]:
    """Module-level import edges within ``package``. Importing ``a.b.c`` also runs ``a`` and ``a.b``'s
    ``__init__``: those edges are included."""
    graph: dict[str, set[str]] = {}
    for p in sorted((root / package).rglob("*.py")):
        mod = module_name(root, p)
        own_ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        deps: set[str] = set()
        for m in module_imports(root, p, package, deferred):
            parts = m.split(".")
            # Importing a.b.c runs a's and a.b's __init__ first (implicit edges), except the packages this module
            # is itself in (they are already running); an explicit import of a parent package is a real edge.
            deps.update(a for a in (".".join(parts[:i]) for i in range(1, len(parts))) if a not in own_ancestors)
            deps.add(m)
        deps.discard(mod)
        graph[mod] = deps & {module_name(root, q) for q in (root / package).rglob("*.py")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def longest(root: Path) -> dict[str, object]:
    files = [p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")
             if "/v1/" not in str(p)]
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files), reverse=True)
    classes = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                classes.append((lines, methods, f"{p.relative_to(root)}:{node.name}"))
    classes.sort(reverse=True)
    by_methods = max(classes, key=lambda c: (c[1], c[0]))
    return {"longest_files": sizes[:3], "longest_class": classes[0], "most_methods_class": by_methods}


def sgd_loops(root: Path) -> list[str]:
    """Functions in fedcore with an optimizer step inside a for/while loop (a local training loop)."""
    out = []
    for p in sorted((root / "fedcore").rglob("*.py")):
        tree = ast.parse(p.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for loop in ast.walk(fn):
                if isinstance(loop, (ast.For, ast.While)) and any(
                        isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "step"
                        and not c.args for c in ast.walk(loop)):
                    out.append(f"{p.relative_to(root)}:{fn.name}")
                    break
    # A nested function counts once, under its innermost name.
    return sorted(set(out))


TRAINER_NAMES = ("vanilla", "flguard", "lindt", "ditto", "apfl", "fedntd", "moon", "hydra")


def trainer_name_lists(root: Path) -> list[str]:
    """Places in code (not tests/docs) where four or more trainer names stand in one statement or string: a
    hand-written list of the trainers."""
    out = []
    for pkg in (*PACKAGES, "tools"):
        d = root / pkg
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*.py")):
            if p.name in ("seams_metrics.py", "golden_seams.py"):
                continue
            tree = ast.parse(p.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return, ast.Call)) or (
                        isinstance(node, ast.Constant) and isinstance(node.value, str)):
                    text = ast.get_source_segment(p.read_text(), node) or ""
                    found = {n for n in TRAINER_NAMES if re.search(rf"\b{n}\b", text)}
                    if len(found) >= 4 and isinstance(node, (ast.Assign, ast.AnnAssign, ast.Constant)):
                        out.append(f"{p.relative_to(root)}:{node.lineno}")
    return sorted(set(out))


def duplicated_blocks(root: Path) -> str:
    tool = shutil.which("duplicates")
    if tool is None:
        return "duplicates tool not found"
    res = subprocess.run([tool, "--repo", str(root), "--most", "1", "--seconds", "120"], capture_output=True,
                         text=True, check=False)
    return res.stdout.splitlines()[0] if res.stdout else res.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--no-duplicates", action="store_true", help="skip the duplicated-blocks count (slow)")
    a = ap.parse_args(argv)
    root = a.repo.resolve()
    circ = circles(import_graph(root))
    lazy = circles(import_graph(root, deferred=True))
    report = {"import_circles_fedcore": len(circ), "circles": circ,
              "import_circles_fedcore_with_deferred_imports": len(lazy), "circles_with_deferred": lazy,
              **longest(root),
              "sgd_loops": sgd_loops(root), "trainer_name_lists": trainer_name_lists(root)}
    if not a.no_duplicates:
        report["duplicated_blocks"] = duplicated_blocks(root)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
