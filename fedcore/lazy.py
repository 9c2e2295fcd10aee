"""Packages whose names are imported on first use (PEP 562), so that importing one submodule loads no other.

A package such as :mod:`fedcore.aggregation` re-exports its submodules' names (``from fedcore.aggregation import
StreamingFedAvg``). Importing them all in its ``__init__`` would make every submodule import cost the whole package,
torch included, even for the torch-free configuration section (``fedcore.aggregation.config``). Instead the
package's ``__init__`` names, per submodule, what it re-exports; :func:`lazy_exports` returns the module-level
``__getattr__`` and ``__dir__`` that import the submodule when one of its names is first read (then cached in the
package). The type checker reads the same names from an ``if TYPE_CHECKING:`` import block in the ``__init__``;
``tests/unit/test_lazy_packages.py`` checks that both lists agree and that every name resolves.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each submodule (absolute name) to the names
    the package re-exports from it."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # the next read is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__


def exported_names(exports: Mapping[str, Sequence[str]]) -> list[str]:
    """Every name ``exports`` re-exports, sorted (the package's ``__all__``)."""
    return sorted(name for names in exports.values() for name in names)
