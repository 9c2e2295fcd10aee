"""fedcore's module-level imports form no circle.

A circle makes import order matter (a module half-initialised when its partner reads a name from it) and is
usually papered over with a function-level import; the leaf modules ``fedcore.errors``, ``fedcore.options`` and
``fedcore.registry`` exist so that none is needed. This walks the source with :mod:`ast` (nothing is imported):
imports run at import time count (module body, class bodies, ``if``/``try``/``with`` at module level), those under
``if TYPE_CHECKING:`` do not, and imports inside functions are listed apart (they cannot form a circle at import
time, but each is a place where one may be hidden). The walker is
:mod:`tools.import_graph` (``python tools/import_graph.py`` prints the report).
"""

from __future__ import annotations

from pathlib import Path

from tools.import_graph import circles, import_graph


def test_fedcore_has_no_import_circle() -> None:
    found = circles(import_graph())
    assert not found, "import circles in fedcore:\n" + "\n".join(" -> ".join((*c, c[0])) for c in found)


def test_no_function_level_import_hides_a_circle() -> None:
    found = circles(import_graph(), deferred=True)
    assert not found, "circles through function-level imports in fedcore:\n" + "\n".join(
        " -> ".join((*c, c[0])) for c in found)


def test_the_leaf_modules_import_only_the_error_module() -> None:
    graph = import_graph()
    assert graph["fedcore.errors"].module_level == set()
    assert graph["fedcore.options"].module_level == {"fedcore.errors"}
    assert graph["fedcore.registry"].module_level <= {"fedcore.errors", "fedcore.options"}


def test_the_walker_finds_a_circle_and_skips_type_checking_and_function_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "a.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nelse:\n    pass\n"
        "try:\n    from .. import a\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("from pkg import a\n\ndef f():\n    from pkg.sub import b\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"].module_level == {"pkg.a"}  # the TYPE_CHECKING import of c skipped
    assert graph["pkg.a"].module_level == {"pkg.sub", "pkg.sub.b"}  # importing pkg.sub.b runs pkg.sub first
    assert graph["pkg.c"].function_level == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.b"].type_checking == {"pkg.c"}
    assert circles(graph) == [("pkg.a", "pkg.sub.b"), ("pkg.a", "pkg.sub", "pkg.sub.b")]
    assert ("pkg.c", "pkg.sub.b") in circles(graph, deferred=True, typing_only=True)
    assert ("pkg.c", "pkg.sub.b") not in circles(graph, deferred=True)


def test_a_submodule_reading_a_name_from_its_half_initialised_package_is_a_circle(tmp_path: Path) -> None:
    # fedcore.models <-> fedcore.models.zoo at 249f39b: the package's __init__ imports the zoo at its end and the
    # zoo takes register_model from the package; importing a sibling submodule through the package is no edge.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def register(): ...\nfrom pkg import zoo, other\n")
    (pkg / "zoo.py").write_text("from pkg import register\n")
    (pkg / "other.py").write_text("from pkg import zoo\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.zoo"].module_level == {"pkg"}
    assert graph["pkg.other"].module_level == {"pkg.zoo"}
    assert circles(graph)[0] == ("pkg", "pkg.zoo")

