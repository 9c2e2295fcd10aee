"""Structure figures of the code base, before/after a refactor (issue 27): import circles in fedcore, the longest
file and class, SGD loops, places that list the trainer names, duplicated blocks.

    python tools/dev/seams_metrics.py              # this tree
    python tools/dev/seams_metrics.py --repo DIR   # another checkout (e.g. a worktree of the base commit)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# The import walker is the one tests/unit/test_import_graph.py holds fedcore to (one definition of a circle).
from tools.import_graph import circles, import_graph

PACKAGES = ("fedcore", "fedserver", "fedclient", "fedguard", "fedlaunch")


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
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--no-duplicates", action="store_true", help="skip the duplicated-blocks count (slow)")
    a = ap.parse_args(argv)
    root = a.repo.resolve()
    graph = import_graph(root)
    circ = circles(graph)
    lazy = circles(graph, deferred=True)
    typing = circles(graph, deferred=True, typing_only=True)
    report = {"import_circles_fedcore": len(circ), "circles": circ,
              "import_circles_with_function_level_imports": len(lazy),
              "import_circles_with_type_checking_imports": len(typing), "circles_with_type_checking": typing,
              **longest(root),
              "sgd_loops": sgd_loops(root), "trainer_name_lists": trainer_name_lists(root)}
    if not a.no_duplicates:
        report["duplicated_blocks"] = duplicated_blocks(root)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
