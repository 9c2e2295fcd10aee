"""Who sent a request: the identity of a mutual-TLS certificate and/or of an enrolled signing key.

With ``security.client_ca`` (mutual TLS) the client id is the one its certificate carries (the URI SAN
``urn:fedguard:client:<id>``, else the common name); with ``security.client_keys`` every request must carry a
valid Ed25519 signature of an enrolled key (:mod:`fedguard.signing`). With both, the two must name the same
client. The servicer then holds the request to that identity: a Join must be for the authenticated client id,
and every later call's session must belong to it, so a client cannot join, pull or push as another id, and a
stolen session id is useless to anyone else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedcore.config import SecurityConfig
from fedcore.identity import shorten, valid_client_id
from fedguard.signing import AuthError, ReplayGuard, verify_request
from fedserver.errors import ProtocolError

URI_PREFIX = "urn:fedguard:client:"


def certificate_identity(auth_context: dict[str, Any]) -> str | None:
    """The client id a verified peer certificate carries (gRPC's auth context of the call), or None."""
    for raw in auth_context.get("x509_subject_alternative_name", ()):
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if value.startswith(URI_PREFIX):
            return value[len(URI_PREFIX):]
    for raw in auth_context.get("x509_common_name", ()):
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return None


class Authenticator:
    def __init__(self, security: SecurityConfig, clock: Callable[[], float] = time.time) -> None:
        self.mtls = bool(security.client_ca)
        self.keys: dict[str, Ed25519PublicKey] | None = None
        if security.client_keys:
            from fedguard.certs import load_enrollment

            self.keys = load_enrollment(security.client_keys)
        self.guard = ReplayGuard(security.replay_window_s)
        self.clock = clock

    @property
    def signed(self) -> bool:
        return self.keys is not None

    def identify(self, method: str, context: Any, body: bytes) -> str | None:
        """The authenticated client id of this call (None when neither mutual TLS nor keys are configured);
        raises ``UNAUTHENTICATED`` when the call does not prove one."""
        who: str | None = None
        if self.mtls:
            who = certificate_identity(context.auth_context())
            if who is None or not valid_client_id(who):
                raise ProtocolError("UNAUTHENTICATED", "the client certificate carries no valid client id")
        if self.keys is not None:
            try:
                signer = verify_request(self.keys, self.guard, method, context.invocation_metadata() or (), body,
                                        self.clock())
            except AuthError as e:
                raise ProtocolError("UNAUTHENTICATED", f"signature refused: {e}") from None
            if who is not None and signer != who:
                raise ProtocolError("PERMISSION_DENIED", f"signed as {signer!r} over a certificate for {who!r}")
            who = signer
        return who

    @staticmethod
    def require(identity: str | None, client_id: str, what: str) -> None:
        """Refuse (``PERMISSION_DENIED``) a call about ``client_id`` from another authenticated client."""
        if identity is not None and identity != client_id:
            raise ProtocolError("PERMISSION_DENIED", f"{what} belongs to {shorten(client_id)!r}, not to the "
                                                     f"authenticated client {identity!r}")
