"""The packages stack in one direction: fedguard (wire contract, signing, certificates) at the bottom of the
shells, fedserver and fedclient above it, fedlaunch (the launcher and the run tools) on top.

An import statement anywhere in a module (top level or inside a function) counts, plain or dynamic.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the packages it must never import
ABOVE = {"fedguard": ("fedserver", "fedclient", "fedlaunch"), "fedserver": ("fedlaunch",),
         "fedclient": ("fedlaunch",)}


def _imports_of(names: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(names)
    return re.compile(rf"^\s*(?:from|import)\s+(?:{alternatives})\b|import_module\(\s*[\"'](?:{alternatives})\b",
                      re.MULTILINE)


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_a_package_never_imports_the_packages_above_it(package: str) -> None:
    banned = _imports_of(ABOVE[package])
    found = [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for path in sorted((ROOT / package).rglob("*.py"))
             for m in [banned.search(path.read_text())] if m is not None]
    assert not found, found


def test_the_pattern_finds_plain_function_level_and_dynamic_imports() -> None:
    banned = _imports_of(("fedlaunch",))
    for source in ("import fedlaunch\n", "from fedlaunch.cli import main\n", "def f():\n    from fedlaunch import x\n",
                   "importlib.import_module('fedlaunch.hosts')\n"):
        assert banned.search(source), source
    assert not banned.search("print('python -m fedlaunch')\nimport fedlaunchx\n")


def test_the_wire_package_holds_only_the_contract_signing_and_certificates() -> None:
    # The contract: the protobuf conversions (wire) and the framed transport's format (framing).
    modules = {p.relative_to(ROOT / "fedguard").as_posix() for p in (ROOT / "fedguard").glob("*.py")}
    assert modules == {"__init__.py", "wire.py", "framing.py", "signing.py", "certs.py"}


def test_the_launcher_and_run_tools_scripts_are_fedlaunch() -> None:
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("fedguard-launch", "fedguard-status", "fedguard-export", "fedguard-plot"):
        assert scripts[name].startswith("fedlaunch."), (name, scripts[name])
