"""Moved to :mod:`fedlaunch` (``python -m fedlaunch``, the ``fedguard-launch`` script): this name answers for old
command lines and imports while they move, and goes once nothing uses it."""

from __future__ import annotations

import importlib
import sys
from typing import Any

_MODULES = ("cli", "options", "plan", "credentials", "supervise", "hosts", "follow", "progress", "logs")


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        found = getattr(importlib.import_module(f"fedlaunch.{module}"), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module 'fedguard.launch' has no attribute {name!r} (the launcher is fedlaunch now)")


if __name__ == "__main__":
    from fedlaunch.cli import main

    sys.exit(main())
