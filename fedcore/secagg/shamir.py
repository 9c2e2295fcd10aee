"""Shamir secret sharing of byte strings over the prime field GF(2^521 - 1).

A secret of at most :data:`MAX_SECRET_BYTES` bytes is the field element ``int(0x01 || secret)`` (the leading 0x01
keeps its length, leading zero bytes included); :func:`split` evaluates a random polynomial of degree ``t - 1``
with that constant term at the holders' distinct non-zero points x, :func:`reconstruct` interpolates it at 0 from
t shares. Fewer than t shares reveal nothing about the secret. Coefficients come from :mod:`secrets`.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

PRIME = (1 << 521) - 1  # a Mersenne prime: secrets up to 64 bytes fit below it with their length marker
MAX_SECRET_BYTES = 64
X_BYTES = 4
Y_BYTES = 66  # ceil(521 / 8)
SHARE_BYTES = X_BYTES + Y_BYTES
MAX_X = (1 << (8 * X_BYTES)) - 1


class ShamirError(ValueError):
    """Shares that cannot give the secret: too few, duplicated, inconsistent or malformed."""


@dataclass(frozen=True)
class Share:
    """One holder's share: the point x (>= 1) and the polynomial's value y there."""

    x: int
    y: int

    def __repr__(self) -> str:  # a share is secret material: never print its value
        return f"Share(x={self.x}, y=...)"

    def to_bytes(self) -> bytes:
        """``x`` (4 bytes) and ``y`` (66 bytes), big-endian: :data:`SHARE_BYTES` bytes."""
        return self.x.to_bytes(X_BYTES, "big") + self.y.to_bytes(Y_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        if len(data) != SHARE_BYTES:
            raise ShamirError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
        share = cls(int.from_bytes(data[:X_BYTES], "big"), int.from_bytes(data[X_BYTES:], "big"))
        _check(share)
        return share


def _check(share: Share) -> None:
    if not 1 <= share.x <= MAX_X:
        raise ShamirError(f"share point x must be in [1, {MAX_X}], got {share.x}")
    if not 0 <= share.y < PRIME:
        raise ShamirError(f"share of holder {share.x} is not a field element")


def split(secret: bytes, threshold: int, xs: Sequence[int],
          randbelow: Callable[[int], int] = secrets.randbelow) -> list[Share]:
    """Shares of ``secret`` for the holders at points ``xs`` (distinct, in [1, 2^32 - 1]), any ``threshold`` of
    which give it back. ``randbelow`` draws the polynomial's coefficients (cryptographic by default)."""
    if len(secret) > MAX_SECRET_BYTES:
        raise ShamirError(f"a secret is at most {MAX_SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(xs):
        raise ShamirError(f"threshold must be in [1, {len(xs)}] for {len(xs)} holders, got {threshold}")
    if len(set(xs)) != len(xs):
        raise ShamirError("holder points must be distinct")
    for x in xs:
        _check(Share(x, 0))
    coeffs = [int.from_bytes(b"\x01" + secret, "big")] + [randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        y = 0
        for a in reversed(coeffs):
            y = (y * x + a) % PRIME
        shares.append(Share(x, y))
    return shares


@functools.lru_cache(maxsize=4096)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for j, xj in enumerate(xs):
        num = den = 1
        for m, xm in enumerate(xs):
            if m != j:
                num *= xm
                den *= xm - xj
        out.append(num * pow(den % PRIME, -1, PRIME) % PRIME)
    return tuple(out)


def _interpolate(xs: tuple[int, ...], ys: list[int], at: int) -> int:
    total = 0
    for j, (xj, yj) in enumerate(zip(xs, ys, strict=True)):
        num = den = 1
        for m, xm in enumerate(xs):
            if m != j:
                num *= at - xm
                den *= xj - xm
        total += yj * num * pow(den % PRIME, -1, PRIME)
    return total % PRIME


def reconstruct(shares: Iterable[Share], threshold: int, length: int | None = None, check_all: bool = False) -> bytes:
    """The secret from at least ``threshold`` shares of distinct holders (the first ``threshold`` by x are used).
    ``length``: the secret's expected size in bytes, checked (a wrong share then fails with probability
    ``1 - 2^-(8 * (64 - length) + 9)``). ``check_all``: also check that every share beyond the first ``threshold``
    lies on their polynomial (``O(threshold^2)`` each). Raises :class:`ShamirError` for too few shares, a holder
    given twice (whether its values agree or not) or shares that do not encode one secret."""
    if threshold < 1:
        raise ShamirError(f"threshold must be >= 1, got {threshold}")
    by_x: dict[int, int] = {}
    for s in shares:
        _check(s)
        if s.x in by_x:
            what = "duplicate share" if by_x[s.x] == s.y else "inconsistent shares"
            raise ShamirError(f"{what} for holder {s.x}")
        by_x[s.x] = s.y
    if len(by_x) < threshold:
        raise ShamirError(f"too few shares: {len(by_x)} of the {threshold} needed")
    ordered = sorted(by_x)
    xs = tuple(ordered[:threshold])
    if check_all:
        for x in ordered[threshold:]:
            if _interpolate(xs, [by_x[xm] for xm in xs], x) != by_x[x]:
                raise ShamirError(f"inconsistent shares: holder {x}'s share is not on the others' polynomial")
    value = sum(c * by_x[x] for c, x in zip(_lagrange_at_zero(xs), xs, strict=True)) % PRIME
    size = (value.bit_length() + 7) // 8
    encoded = value.to_bytes(size, "big")
    if not encoded or encoded[0] != 1 or (length is not None and size != length + 1):
        raise ShamirError("inconsistent shares: they do not encode a secret"
                          + (f" of {length} bytes" if length is not None else ""))
    return encoded[1:]
