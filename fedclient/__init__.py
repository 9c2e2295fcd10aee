"""fedguard device client: embed :class:`FedClient` in an app, or run the ``fedclient`` CLI.

The names below are imported on first use (PEP 562), so that ``fedclient --help`` and configuration errors
answer without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedclient.client import Backoff, ClientSummary, FedClient, FedClientError
    from fedcore.config import ClientConfig

_EXPORTS = {"Backoff": "fedclient.client", "ClientSummary": "fedclient.client", "FedClient": "fedclient.client",
            "FedClientError": "fedclient.client", "ClientConfig": "fedcore.config"}

__all__ = ["Backoff", "ClientConfig", "ClientSummary", "FedClient", "FedClientError"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedclient' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
