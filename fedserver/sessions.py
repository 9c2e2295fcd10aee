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
    """``max_per_credential`` bounds the sessions one credential (the shared token, or one certificate/key
    identity) holds at once: a token holder cannot open an unbounded number of made-up client ids."""

    def __init__(self, token: str, max_per_credential: int = 0) -> None:
        self._token = token
        self._client_of: dict[str, str] = {}
        self._session_of: dict[str, str] = {}
        self._credential_of: dict[str, str] = {}
        self._held: dict[str, int] = {}
        self.max_per_credential = max_per_credential
        self.log = get_logger("fedserver")

    def authenticate(self, client_id: str, token: str) -> None:
        """Refuse a join with a bad token or client id (raises :class:`ProtocolError`)."""
        if not valid_client_id(client_id):
            raise ProtocolError("INVALID_ARGUMENT", f"client_id {shorten(client_id)!r}: {CLIENT_ID_RULE}")
        # Constant time in the secret's content (hmac.compare_digest); only its length can leak.
        if self._token and not secrets.compare_digest(token.encode(), self._token.encode()):
            self.log.warning("client.join_refused", client_id=client_id, reason="bad token")
            raise ProtocolError("UNAUTHENTICATED", "bad join token")

    def check_room(self, client_id: str, credential: str) -> None:
        """Refuse (``RESOURCE_EXHAUSTED``) a new client id once ``credential`` holds its bound of sessions (a
        re-join of a client that holds one replaces it and is always let in)."""
        if self.max_per_credential and client_id not in self._session_of and \
                self._held.get(credential, 0) >= self.max_per_credential:
            raise ProtocolError("RESOURCE_EXHAUSTED", f"this credential holds {self.max_per_credential} sessions "
                                                      "(security.max_sessions_per_credential)")

    def open(self, client_id: str, credential: str = "") -> str:
        """A new session for ``client_id``; its previous session (if any) ends."""
        old = self._session_of.pop(client_id, None)
        if old is not None:
            self._client_of.pop(old, None)
            self._release(client_id)
        session = secrets.token_hex(16)
        self._client_of[session] = client_id
        self._session_of[client_id] = session
        self._credential_of[client_id] = credential
        self._held[credential] = self._held.get(credential, 0) + 1
        return session

    def _release(self, client_id: str) -> None:
        credential = self._credential_of.pop(client_id, None)
        if credential is not None:
            self._held[credential] -= 1
            if not self._held[credential]:
                del self._held[credential]

    def held(self, credential: str) -> int:
        return self._held.get(credential, 0)

    def client_of(self, session: str) -> str:
        cid = self._client_of.get(session)
        if cid is None:
            raise ProtocolError("UNAUTHENTICATED", "unknown session; join first")
        return cid

    def close(self, session: str) -> str:
        cid = self.client_of(session)
        del self._client_of[session]
        self._session_of.pop(cid, None)
        self._release(cid)
        return cid

    def __contains__(self, session: object) -> bool:
        return session in self._client_of
