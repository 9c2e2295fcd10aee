"""Shamir secret sharing over GF(2^521 - 1): round trips, thresholds and the errors for bad share sets."""

from __future__ import annotations

import itertools
import random

import pytest

from fedcore.secagg import shamir
from fedcore.secagg.shamir import PRIME, ShamirError, Share, reconstruct, split


@pytest.mark.parametrize("secret", [bytes(32), b"\x00\x00\x01" + bytes(29), bytes(range(32)), b"", b"\xff" * 64])
def test_round_trip_keeps_every_byte(secret: bytes) -> None:
    shares = split(secret, 3, [1, 2, 3, 4, 5])
    assert reconstruct(shares, 3) == secret
    assert reconstruct(shares[::-1], 3, length=len(secret), check_all=True) == secret


def test_any_threshold_subset_reconstructs() -> None:
    secret = bytes(range(100, 132))
    shares = split(secret, 4, [3, 7, 9, 12, 20, 41])
    for subset in itertools.combinations(shares, 4):
        assert reconstruct(subset, 4, length=32) == secret


def test_below_threshold_fails_and_reveals_nothing_usable() -> None:
    secret = bytes(range(32))
    shares = split(secret, 5, list(range(1, 9)))
    with pytest.raises(ShamirError, match="too few shares: 4 of the 5"):
        reconstruct(shares[:4], 5)
    # treated as a lower-degree polynomial, four shares give garbage, not the secret
    with pytest.raises(ShamirError, match="do not encode"):
        reconstruct(shares[:4], 4, length=32)


def test_duplicate_and_inconsistent_shares_are_named() -> None:
    shares = split(b"k" * 32, 2, [1, 2, 3])
    with pytest.raises(ShamirError, match="duplicate share for holder 1"):
        reconstruct([shares[0], shares[0], shares[1]], 2)
    with pytest.raises(ShamirError, match="inconsistent shares for holder 1"):
        reconstruct([shares[0], Share(1, (shares[0].y + 1) % PRIME), shares[1]], 2)
    tampered = Share(3, (shares[2].y + 1) % PRIME)
    with pytest.raises(ShamirError, match="holder 3's share is not on"):
        reconstruct([shares[0], shares[1], tampered], 2, check_all=True)
    with pytest.raises(ShamirError, match="do not encode"):
        reconstruct([shares[0], tampered], 2, length=32)


def test_split_refuses_bad_parameters() -> None:
    with pytest.raises(ShamirError, match="at most 64 bytes"):
        split(bytes(65), 2, [1, 2])
    with pytest.raises(ShamirError, match="threshold"):
        split(b"x", 3, [1, 2])
    with pytest.raises(ShamirError, match="distinct"):
        split(b"x", 2, [1, 1])
    with pytest.raises(ShamirError, match="x must be"):
        split(b"x", 1, [0])


def test_share_bytes_round_trip_and_repr_hides_the_value() -> None:
    share = split(bytes(32), 2, [70000, 5], randbelow=random.Random(1).randrange)[0]
    raw = share.to_bytes()
    assert len(raw) == shamir.SHARE_BYTES and Share.from_bytes(raw) == share
    assert str(share.y) not in repr(share) and "70000" in repr(share)
    with pytest.raises(ShamirError, match="70 bytes"):
        Share.from_bytes(raw[:-1])
    with pytest.raises(ShamirError, match="not a field element"):
        Share.from_bytes(raw[:4] + b"\xff" * 66)
