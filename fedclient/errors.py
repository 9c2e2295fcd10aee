"""The client's errors, in one leaf module that every part of the client imports (no part imports another's
errors through :mod:`fedclient.client`)."""

from __future__ import annotations

from fedclient.transport import Refused


class FedClientError(RuntimeError):
    """The client cannot take part (model mismatch, refused join, server unreachable for too long, an unusable state
    directory)."""


class FedClientRefused(FedClientError):
    """The server refuses this client for good (a TLS handshake or authentication check failed): retrying cannot
    help. ``check`` names the check; ``fedclient`` exits with status 4 and this one line."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(f"refused: {refused}")
        self.check = refused.check


class Stopped(Exception):
    """:meth:`FedClient.stop` was called: unwinds the client thread from wherever it waits."""


class SessionLost(Exception):
    """The server no longer knows this client's session (it restarted, or dropped the client): join again."""


__all__ = ["FedClientError", "FedClientRefused", "SessionLost", "Stopped"]
