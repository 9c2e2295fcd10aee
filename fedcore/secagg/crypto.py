"""Key agreement, key derivation, share encryption and advertisement signatures for secure aggregation.

- Key pairs are X25519 (:class:`KeyPair`, private keys from the operating system's randomness); two parties derive
  a 32-byte key from their agreement with HKDF-SHA256, the HKDF info binding the purpose, the federation, the round
  and the parties (:func:`derive_key`), so a key (a share-encryption key, a pairwise mask seed) serves one purpose
  in one round only.
- Shares travel sealed with ChaCha20-Poly1305 (:func:`seal`, :func:`open_sealed`): random 12-byte nonce, the
  associated data binding federation, round, sender and recipient, so a ciphertext replayed into another round or
  to another party fails to open.
- Advertisements are signed by the transport's identity keys: the core takes a :data:`Signer` (bytes -> signature)
  on the client and a :data:`Verifier` ``(client_id, message, signature) -> bool`` wherever advertisements are read,
  and signs and verifies :func:`advertisement_message` of (federation, round, client id, c_pk, s_pk). The verifier
  is where the transport binds a client id to its identity (e.g. the Ed25519 key of its certificate):
  :func:`ed25519_signer` and :func:`ed25519_verifier` are such a pair.

Private keys never appear in a repr or in any serialized state.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
DOMAIN = b"fedguard/secagg/v1"

# Purposes of derived keys and signed or hashed messages.
SHARE_KEY = "share-key"
MASK_SEED = "mask-seed"
SHARE_AAD = "share"
ADVERTISEMENT = "advertisement"
COMMITMENT = "self-mask-commitment"

Signer = Callable[[bytes], bytes]
Verifier = Callable[[str, bytes, bytes], bool]


class DecryptionError(ValueError):
    """A sealed share that does not open: wrong key, wrong round or parties, or tampered with."""


def encode_parts(*parts: str | int | bytes) -> bytes:
    """A canonical, unambiguous encoding of a tuple of parts (type tag, length, value each)."""
    out = bytearray(DOMAIN)
    for p in parts:
        if isinstance(p, bytes):
            tag, data = b"b", p
        elif isinstance(p, str):
            tag, data = b"s", p.encode("utf-8")
        else:
            tag, data = b"i", int(p).to_bytes(16, "big", signed=True)
        out += tag + len(data).to_bytes(4, "big") + data
    return bytes(out)


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair: the private key (never printed) and the raw 32-byte public key."""

    private: X25519PrivateKey = field(repr=False, compare=False)
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        key = X25519PrivateKey.generate()
        return cls(key, key.public_key().public_bytes_raw())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        key = X25519PrivateKey.from_private_bytes(raw)
        return cls(key, key.public_key().public_bytes_raw())

    def private_bytes(self) -> bytes:
        """The raw 32-byte private key (to be secret-shared, never stored in the clear)."""
        return self.private.private_bytes_raw()


def derive_key(private: X25519PrivateKey, peer_public: bytes, purpose: str, *context: str | int) -> bytes:
    """HKDF-SHA256 of the X25519 agreement of ``private`` with ``peer_public``: 32 bytes for ``purpose`` in
    ``context`` (federation, round, parties). Raises ValueError for a malformed or low-order peer key."""
    if len(peer_public) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(peer_public)}")
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=encode_parts(purpose, *context)).derive(shared)


def share_key(private: X25519PrivateKey, peer_public: bytes, federation_id: str, round_: int, sender: str,
              recipient: str) -> bytes:
    """The key sealing ``sender``'s shares for ``recipient`` in this round (one direction, one round)."""
    return derive_key(private, peer_public, SHARE_KEY, federation_id, round_, sender, recipient)


def mask_seed(private: X25519PrivateKey, peer_public: bytes, federation_id: str, round_: int, a: str,
              b: str) -> bytes:
    """The pairwise mask seed of ``a`` and ``b`` in this round: the same from either side."""
    lo, hi = sorted((a, b))
    return derive_key(private, peer_public, MASK_SEED, federation_id, round_, lo, hi)


def share_aad(federation_id: str, round_: int, sender: str, recipient: str) -> bytes:
    return encode_parts(SHARE_AAD, federation_id, round_, sender, recipient)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``nonce || ChaCha20-Poly1305(key, nonce, plaintext, aad)`` with a fresh random nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """The plaintext of :func:`seal`'s output; raises :class:`DecryptionError` unless it authenticates."""
    if len(blob) < NONCE_BYTES + 16:
        raise DecryptionError("sealed share too short")
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag:
        raise DecryptionError("sealed share does not authenticate (wrong key, round or parties)") from None


def advertisement_message(federation_id: str, round_: int, client_id: str, c_pk: bytes, s_pk: bytes) -> bytes:
    """The bytes an advertisement's signature covers."""
    return encode_parts(ADVERTISEMENT, federation_id, round_, client_id, c_pk, s_pk)


def commitment(federation_id: str, round_: int, client_id: str, seed: bytes) -> bytes:
    """SHA-256 commitment to a client's self-mask seed: lets the server check the seed it reconstructs (the
    seed is 32 random bytes, so the hash reveals nothing of it)."""
    return hashlib.sha256(encode_parts(COMMITMENT, federation_id, round_, client_id, seed)).digest()


def ed25519_signer(key: Ed25519PrivateKey) -> Signer:
    """A :data:`Signer` with an Ed25519 identity key."""
    return key.sign


def ed25519_verifier(keys: Mapping[str, Ed25519PublicKey]) -> Verifier:
    """A :data:`Verifier` over the clients' Ed25519 identity keys (client id -> public key): an unknown id or a
    bad signature verifies False."""

    def verify(client_id: str, message: bytes, signature: bytes) -> bool:
        key = keys.get(client_id)
        if key is None:
            return False
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    return verify
