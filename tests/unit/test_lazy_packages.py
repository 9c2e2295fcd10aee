"""The packages that import their names on first use (fedcore.lazy): what they give is what the type checker reads,
every name resolves, and importing one submodule loads no sibling.

Each lazy ``__init__`` names its re-exports twice, once for the runtime (``_EXPORTS``) and once for the type checker
(an ``if TYPE_CHECKING:`` import block); this reads both from the source and holds them equal.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY_PACKAGES = ("fedcore.aggregation", "fedcore.attacks", "fedcore.data", "fedcore.distfl", "fedcore.models",
                 "fedcore.train")


def _declared(package: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(the TYPE_CHECKING imports, ``_EXPORTS``) of ``package``'s ``__init__``: submodule -> names."""
    path = ROOT / package.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text())
    typing_block: dict[str, set[str]] = {}
    exports: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                typing_block.setdefault(imp.module, set()).update(a.asname or a.name for a in imp.names)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            value = ast.literal_eval(node.value)
            exports = {module: set(names) for module, names in value.items()}
    return typing_block, exports


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_the_runtime_exports_are_what_the_type_checker_reads(package: str) -> None:
    typing_block, exports = _declared(package)
    assert exports, f"{package} has no _EXPORTS"
    assert typing_block == exports


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_resolves_to_its_submodule_object(package: str) -> None:
    module = importlib.import_module(package)
    _, exports = _declared(package)
    for submodule, names in exports.items():
        source = importlib.import_module(submodule)
        for name in names:
            assert getattr(module, name) is getattr(source, name), (package, name)
            assert name in dir(module) and name in module.__all__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_a_configuration_submodule_loads_no_sibling_and_no_torch() -> None:
    code = ("import json, sys\n"
            "import fedcore.aggregation.config, fedcore.attacks.config, fedcore.data.base, fedcore.distfl.config\n"
            "import fedcore.models.registry, fedcore.train.registry\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('fedcore.aggregation.', 'fedcore.attacks.',\n"
            "                'fedcore.models.', 'fedcore.train.', 'fedcore.distfl.')))\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'loaded': loaded}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found == {"torch": False, "loaded": ["fedcore.aggregation.config", "fedcore.attacks.config",
                                                "fedcore.distfl.config", "fedcore.models.registry",
                                                "fedcore.train.registry"]}
