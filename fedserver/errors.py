"""The error every coordinator part raises for a call it refuses (the servicer turns it into a gRPC status), and
the server's exit statuses."""

from __future__ import annotations

# ``fedserver`` exit statuses besides 0 (completed) and 1 (unexpected error).
EXIT_CONFIG, EXIT_STALLED, EXIT_STOPPED = 2, 3, 4


class ProtocolError(Exception):
    """A call the coordinator refuses; ``code`` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
