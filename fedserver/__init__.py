"""fedguard coordinator service: the ``fedserver`` CLI, :func:`serve` and :class:`ServerThread`.

The names below are imported on first use (PEP 562), so that ``fedserver --help`` and configuration errors
answer without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedserver.app import ServerThread, serve
    from fedserver.coordinator import Coordinator, ProtocolError

_EXPORTS = {"ServerThread": "fedserver.app", "serve": "fedserver.app", "Coordinator": "fedserver.coordinator",
            "ProtocolError": "fedserver.coordinator"}

__all__ = ["Coordinator", "ProtocolError", "ServerThread", "serve"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedserver' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
