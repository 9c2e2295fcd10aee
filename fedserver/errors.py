"""The error every coordinator part raises for a call it refuses; the servicer turns it into a gRPC status."""

from __future__ import annotations


class ProtocolError(Exception):
    """A call the coordinator refuses; ``code`` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
