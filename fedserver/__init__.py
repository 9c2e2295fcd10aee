"""fedguard coordinator service: the ``fedserver`` CLI, :func:`serve` and :class:`ServerThread`."""

from fedserver.app import ServerThread, serve
from fedserver.coordinator import Coordinator, ProtocolError

__all__ = ["Coordinator", "ProtocolError", "ServerThread", "serve"]
