"""Signed requests: enrolled Ed25519 keys, body binding, replay window."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedguard.signing import NONCE, SIGNATURE, TIMESTAMP, AuthError, ReplayGuard, sign_request, verify_request

M = "/fedguard.v1.Federation/Join"


def _setup() -> tuple[Ed25519PrivateKey, dict[str, object], ReplayGuard]:
    key = Ed25519PrivateKey.generate()
    return key, {"alice": key.public_key()}, ReplayGuard(60.0)


def test_a_signed_request_verifies_once() -> None:
    key, keys, guard = _setup()
    md = sign_request(key, "alice", M, b"body", 1000.0)
    assert verify_request(keys, guard, M, md, b"body", 1000.5) == "alice"  # type: ignore[arg-type]
    with pytest.raises(AuthError, match="replayed"):
        verify_request(keys, guard, M, md, b"body", 1001.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("tamper", ["body", "method", "client", "timestamp", "nonce", "signature", "missing",
                                    "other_key", "unknown_client", "too_old", "future"])
def test_every_part_of_the_request_is_bound(tamper: str) -> None:
    key, keys, guard = _setup()
    keys["bob"] = Ed25519PrivateKey.generate().public_key()
    now = 1000.0
    md = dict(sign_request(key, "alice", M, b"body", now))
    body, method = b"body", M
    if tamper == "body":
        body = b"other"
    elif tamper == "method":
        method = "/fedguard.v1.Federation/Leave"
    elif tamper == "client":
        md["fg-client"] = "bob"
    elif tamper == "timestamp":
        md[TIMESTAMP] = str(int(md[TIMESTAMP]) + 1)
    elif tamper == "nonce":
        md[NONCE] = "0" * 32
    elif tamper == "signature":
        md[SIGNATURE] = md[SIGNATURE][:-4] + "AAA="
    elif tamper == "missing":
        del md[SIGNATURE]
    elif tamper == "other_key":
        md = dict(sign_request(Ed25519PrivateKey.generate(), "alice", M, b"body", now))
    elif tamper == "unknown_client":
        md = dict(sign_request(key, "mallory", M, b"body", now))
    elif tamper == "too_old":
        now += 61
    elif tamper == "future":
        now -= 61
    with pytest.raises(AuthError):
        verify_request(keys, guard, method, list(md.items()), body, now)  # type: ignore[arg-type]
    assert len(guard) == 0  # nothing but a valid signature consumes a nonce


def test_the_replay_set_is_bounded_and_eviction_never_reopens_a_replay() -> None:
    key, keys, _ = _setup()
    guard = ReplayGuard(60.0, max_entries=10)
    first = sign_request(key, "alice", M, b"b", 1000.0)
    verify_request(keys, guard, M, first, b"b", 1000.0)  # type: ignore[arg-type]
    for i in range(20):
        verify_request(keys, guard, M, sign_request(key, "alice", M, b"b", 1000.0 + i / 100),  # type: ignore[arg-type]
                       b"b", 1000.2)
    assert len(guard) <= 10
    with pytest.raises(AuthError):  # its nonce was evicted, but its timestamp is now below the floor
        verify_request(keys, guard, M, first, b"b", 1000.3)  # type: ignore[arg-type]
    # Entries older than the window expire.
    verify_request(keys, guard, M, sign_request(key, "alice", M, b"b", 2000.0), b"b", 2000.0)  # type: ignore[arg-type]
    assert len(guard) == 1
