"""Signed requests: a client proves its enrolled identity on every call without mutual TLS.

Each client has an Ed25519 key pair (``fedguard-certs keygen``); the server holds the public keys
(``security.client_keys``, an enrollment file). Every request carries four metadata entries:

- ``fg-client``: the client id; ``fg-ts``: milliseconds since the Unix epoch; ``fg-nonce``: 16 random bytes
  (hex); ``fg-sig``: base64 of the Ed25519 signature over :func:`canonical`, which binds the RPC method, the
  client id, the timestamp, the nonce and the SHA-256 of the exact request bytes (the session id is a field of
  every request after the join, so it is covered too).

The server accepts a signature only from an enrolled key, with a timestamp within ``window_s`` of its clock and a
nonce it has not seen within the window (:class:`ReplayGuard`), so a captured request cannot be replayed, moved
to another method or re-targeted at another session. An update's chunks are bound through the header's
``payload_sha256`` (the header is what is signed). Flower's node authentication signs a timestamp only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

CLIENT, TIMESTAMP, NONCE, SIGNATURE = "fg-client", "fg-ts", "fg-nonce", "fg-sig"
_DOMAIN = b"fedguard-request-v1"


class AuthError(Exception):
    """A request whose signature cannot be accepted; the message is the reason (never echoes secrets)."""


def canonical(method: str, client_id: str, timestamp_ms: int, nonce: str, body: bytes) -> bytes:
    """The bytes a client signs: domain, method, client id, timestamp, nonce, SHA-256 of the request body."""
    digest = hashlib.sha256(body).hexdigest()
    return b"\n".join([_DOMAIN, method.encode(), client_id.encode(), str(timestamp_ms).encode(), nonce.encode(),
                       digest.encode()])


def sign_request(key: Ed25519PrivateKey, client_id: str, method: str, body: bytes,
                 now_s: float) -> list[tuple[str, str]]:
    """The metadata entries that authenticate ``body`` sent to ``method`` (e.g. "/fedguard.v1.Federation/Join")."""
    ts = int(now_s * 1000)
    nonce = secrets.token_hex(16)
    sig = key.sign(canonical(method, client_id, ts, nonce, body))
    return [(CLIENT, client_id), (TIMESTAMP, str(ts)), (NONCE, nonce),
            (SIGNATURE, base64.b64encode(sig).decode("ascii"))]


class ReplayGuard:
    """Nonces seen within the window, oldest first; bounded: beyond ``max_entries`` the oldest are dropped, and
    a timestamp older than the oldest dropped one is refused, so eviction never re-opens a replay."""

    def __init__(self, window_s: float, max_entries: int = 1_000_000) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._floor_ms = 0  # requests at or before this timestamp are refused (their nonces may be forgotten)

    def check(self, client_id: str, nonce: str, timestamp_ms: int, now_ms: int) -> None:
        if abs(now_ms - timestamp_ms) > self.window_ms:
            raise AuthError(f"request timestamp is {abs(now_ms - timestamp_ms) / 1000:.1f} s from the server's "
                            f"clock (window {self.window_ms / 1000:.0f} s)")
        self._expire(now_ms)
        if timestamp_ms <= self._floor_ms:
            raise AuthError("request timestamp too old for the replay window")
        key = (client_id, nonce)
        if key in self._seen:
            raise AuthError("replayed request (nonce already used)")
        self._seen[key] = timestamp_ms
        while len(self._seen) > self.max_entries:
            _, ts = self._seen.popitem(last=False)
            self._floor_ms = max(self._floor_ms, ts)

    def _expire(self, now_ms: int) -> None:
        # Entries are in arrival order; timestamps are near-monotonic within the window, so expiring from the
        # front is enough to bound the set (an out-of-order entry only lingers until the ones before it expire).
        cutoff = now_ms - self.window_ms
        while self._seen:
            key, ts = next(iter(self._seen.items()))
            if ts >= cutoff:
                break
            del self._seen[key]

    def __len__(self) -> int:
        return len(self._seen)


def verify_request(keys: Mapping[str, Ed25519PublicKey], guard: ReplayGuard, method: str,
                   metadata: Sequence[tuple[str, str | bytes]], body: bytes, now_s: float) -> str:
    """The enrolled client id that signed this request; :class:`AuthError` with the reason otherwise."""
    md: dict[str, str] = {}
    for k, v in metadata:
        if k in (CLIENT, TIMESTAMP, NONCE, SIGNATURE):
            if k in md:
                raise AuthError(f"metadata {k} given twice")
            md[k] = v.decode("ascii", "replace") if isinstance(v, bytes) else v
    missing = [k for k in (CLIENT, TIMESTAMP, NONCE, SIGNATURE) if k not in md]
    if missing:
        raise AuthError(f"request not signed (missing metadata {', '.join(missing)})")
    client_id = md[CLIENT]
    key = keys.get(client_id)
    if key is None:
        raise AuthError("no enrolled key for this client id")
    if len(md[TIMESTAMP]) > 20 or not md[TIMESTAMP].isdigit():
        raise AuthError("malformed timestamp")
    nonce = md[NONCE]
    if len(nonce) != 32 or any(c not in "0123456789abcdef" for c in nonce):
        raise AuthError("malformed nonce (32 hex digits expected)")
    try:
        sig = base64.b64decode(md[SIGNATURE], validate=True)
    except (binascii.Error, ValueError):
        raise AuthError("malformed signature") from None
    ts = int(md[TIMESTAMP])
    try:
        key.verify(sig, canonical(method, client_id, ts, nonce, body))
    except InvalidSignature:
        raise AuthError("bad signature") from None
    # Only a valid signature consumes a nonce: forged requests cannot fill the replay set.
    guard.check(client_id, nonce, ts, int(now_s * 1000))
    return client_id


__all__ = ["CLIENT", "NONCE", "SIGNATURE", "TIMESTAMP", "AuthError", "ReplayGuard", "canonical", "sign_request",
           "verify_request"]
