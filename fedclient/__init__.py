"""fedguard device client: embed :class:`FedClient` in an app, or run the ``fedclient`` CLI."""

from fedclient.client import Backoff, ClientSummary, FedClient, FedClientError
from fedcore.config import ClientConfig

__all__ = ["Backoff", "ClientConfig", "ClientSummary", "FedClient", "FedClientError"]
