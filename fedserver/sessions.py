"""Sessions and join authentication: which client a session id stands for.

A join checks the shared token (constant-time) and the client id, then opens a fresh session; a re-join replaces
the client's previous session. Sessions live in memory only: after a server restart every client re-joins (its
client id, index and history are in the restored round state).
"""

from __future__ import annotations

import secrets

from fedcore.identity import CLIENT_ID_RULE, shorten, valid_client_id
from fedcore.log import get_logger
from fedserver.errors import ProtocolError


class Sessions:
    def __init__(self, token: str) -> None:
        self._token = token
        self._client_of: dict[str, str] = {}
        self._session_of: dict[str, str] = {}
        self.log = get_logger("fedserver")

    def authenticate(self, client_id: str, token: str) -> None:
        """Refuse a join with a bad token or client id (raises :class:`ProtocolError`)."""
        if not valid_client_id(client_id):
            raise ProtocolError("INVALID_ARGUMENT", f"client_id {shorten(client_id)!r}: {CLIENT_ID_RULE}")
        # Constant time in the secret's content (hmac.compare_digest); only its length can leak.
        if self._token and not secrets.compare_digest(token.encode(), self._token.encode()):
            self.log.warning("client.join_refused", client_id=client_id, reason="bad token")
            raise ProtocolError("UNAUTHENTICATED", "bad join token")

    def open(self, client_id: str) -> str:
        """A new session for ``client_id``; its previous session (if any) ends."""
        old = self._session_of.pop(client_id, None)
        if old is not None:
            self._client_of.pop(old, None)
        session = secrets.token_hex(16)
        self._client_of[session] = client_id
        self._session_of[client_id] = session
        return session

    def client_of(self, session: str) -> str:
        cid = self._client_of.get(session)
        if cid is None:
            raise ProtocolError("UNAUTHENTICATED", "unknown session; join first")
        return cid

    def close(self, session: str) -> str:
        cid = self.client_of(session)
        del self._client_of[session]
        self._session_of.pop(cid, None)
        return cid

    def __contains__(self, session: object) -> bool:
        return session in self._client_of
