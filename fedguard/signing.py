"""Signed requests: a client proves its enrolled identity on every call without mutual TLS.

Each client has an Ed25519 key pair (``fedguard-certs keygen``); the server holds the public keys
(``security.client_keys``, an enrollment file). Every request carries four metadata entries:

- ``fg-client``: the client id; ``fg-ts``: milliseconds since the Unix epoch; ``fg-nonce``: 16 random bytes
  (hex); ``fg-sig``: base64 of the Ed25519 signature over :func:`canonical`, which binds the RPC method, the
  client id, the timestamp, the nonce and the SHA-256 of the exact request bytes (the session id is a field of
  every request after the join, so it is covered too).

The server accepts a signature only from an enrolled key, with a timestamp within ``window_s`` of its clock and a
nonce it has not seen within the window (:class:`ReplayGuard`), so a captured request cannot be replayed, moved
to another method or re-targeted at another session. The nonces are also appended to a journal in the run dir
(:class:`ReplayJournal`: one ``timestamp client nonce`` line each, no secrets), loaded and compacted at start,
so a request captured before a server restart is refused after it too. An update's chunks are bound through the header's
``payload_sha256`` (the header is what is signed). Flower's node authentication signs a timestamp only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO

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


class ReplayJournal:
    """The nonces a :class:`ReplayGuard` accepted, appended to a file (``<ms> <client> <nonce>`` per line) so
    that they outlive the process. One buffered write per accepted request, flushed to the OS (it survives a
    crash or kill -9 of the server; not a power cut: no fsync per request). :meth:`load` reads the lines still
    inside the window, skipping damaged ones, and rewrites the file with only those (compaction, atomic); the
    guard compacts again when the file holds several times more lines than it remembers."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self.lines = 0

    def load(self, since_ms: int) -> list[tuple[int, str, str]]:
        entries: list[tuple[int, str, str]] = []
        try:
            with open(self.path, encoding="ascii", errors="replace") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 20 or len(parts[2]) != 32:
                        continue  # a line cut by a crash, or damage: that nonce is simply not remembered
                    if int(parts[0]) >= since_ms:
                        entries.append((int(parts[0]), parts[1], parts[2]))
        except FileNotFoundError:
            pass
        entries.sort()
        self.rewrite(entries)
        return entries

    def rewrite(self, entries: Iterable[tuple[int, str, str]]) -> None:
        """Replace the journal with ``entries`` (temporary file, then rename) and keep appending to it."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        n = 0
        with open(tmp, "w", encoding="ascii") as f:
            for ts, client, nonce in entries:
                f.write(f"{ts} {client} {nonce}\n")
                n += 1
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="ascii")  # noqa: SIM115 (closed in close())
        self.lines = n

    def append(self, timestamp_ms: int, client_id: str, nonce: str) -> None:
        if self._file is None:
            return
        self._file.write(f"{timestamp_ms} {client_id} {nonce}\n")
        self._file.flush()
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ReplayGuard:
    """Nonces seen within the window, oldest first; bounded: beyond ``max_entries`` the oldest are dropped, and
    a timestamp older than the oldest dropped one is refused, so eviction never re-opens a replay. With a
    ``journal`` the accepted nonces persist: those still inside the window at ``now_ms`` are loaded at start."""

    def __init__(self, window_s: float, max_entries: int = 1_000_000, journal: ReplayJournal | None = None,
                 now_ms: int = 0) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._floor_ms = 0  # requests at or before this timestamp are refused (their nonces may be forgotten)
        self.journal = journal
        if journal is not None:
            for ts, client, nonce in journal.load(now_ms - self.window_ms):
                self._seen[(client, nonce)] = ts

    def check(self, client_id: str, nonce: str, timestamp_ms: int, now_ms: int) -> None:
        if abs(now_ms - timestamp_ms) > self.window_ms:
            side = "ahead of" if timestamp_ms > now_ms else "behind"
            raise AuthError(f"request timestamp is {abs(now_ms - timestamp_ms) / 1000:.1f} s {side} the server's "
                            f"clock (window {self.window_ms / 1000:.0f} s): set the client's clock (NTP)")
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
        if self.journal is not None:
            self.journal.append(timestamp_ms, client_id, nonce)
            if self.journal.lines > max(10_000, 4 * len(self._seen)):
                self.journal.rewrite((ts, c, n) for (c, n), ts in self._seen.items())

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
    if len(md[TIMESTAMP]) > 20 or not (md[TIMESTAMP].isascii() and md[TIMESTAMP].isdigit()):  # not "²"
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


__all__ = ["CLIENT", "NONCE", "SIGNATURE", "TIMESTAMP", "AuthError", "ReplayGuard", "ReplayJournal", "canonical",
           "sign_request", "verify_request"]
