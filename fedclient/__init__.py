"""fedguard device client: embed :class:`FedClient` in an app, or run the ``fedclient`` CLI.

The names below are imported on first use (PEP 562), so that ``fedclient --help`` and configuration errors
answer without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedclient.client import FedClient
    from fedclient.connection import Backoff
    from fedclient.embed import ModelNotReady, ServedModel
    from fedclient.errors import FedClientError
    from fedclient.runner import ClientSummary
    from fedcore.client_state import ClientNflState, ClientRoundReport
    from fedcore.config import ClientConfig
    from fedcore.data import ClientData
    from fedcore.data.source import DataSource

_EXPORTS = {"Backoff": "fedclient.connection", "ClientSummary": "fedclient.runner", "FedClient": "fedclient.client",
            "FedClientError": "fedclient.errors", "ClientConfig": "fedcore.config",
            "ModelNotReady": "fedclient.embed", "ServedModel": "fedclient.embed",
            "ClientNflState": "fedcore.client_state", "ClientRoundReport": "fedcore.client_state",
            "ClientData": "fedcore.data", "DataSource": "fedcore.data.source"}

__all__ = ["Backoff", "ClientConfig", "ClientData", "ClientNflState", "ClientRoundReport", "ClientSummary",
           "DataSource", "FedClient", "FedClientError", "ModelNotReady", "ServedModel"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedclient' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
