"""Exact, order-independent accumulation of weighted float32 vectors in 128-bit fixed point.

:class:`FixedPointSum` keeps ``Σ_i m_i u_i`` (u_i a float32 ``[P]`` vector, m_i a float64 multiplier such as
weight x clip scale) as two int64 accumulators per coordinate, so that the sum is an exact integer whatever
the order of the adds: integer addition is associative and commutative (and int64 wrap-around cancels), so
any permutation of the same adds leaves bit-identical accumulators.

Per add and coordinate (all of it a deterministic function of u_i and m_i alone):

1. ``c = float64(u) * m`` (one float64 rounding);
2. ``hi = round(c * 2^A)`` and the exact remainder ``r = c - hi * 2^-A`` (``|r| <= 2^-(A+1)``), then
   ``lo = round(r * 2^(A+B))``; rounding is to nearest, ties to even. Both come from the "magic number"
   trick: ``t = c + 1.5 * 2^(52-A)`` rounds c to a multiple of 2^-A, and the int64 bit pattern of t is that
   multiple plus a constant offset, so the float64 results are added to the int64 accumulators as they are
   (no float-to-int conversion); the K offsets are removed at the end;
3. ``H += hi``, ``L += lo`` in 64-bit two's complement (the adds run on unsigned views of the int64
   accumulators, so wrapping modulo 2^64 is well defined; only the final sums must fit int64, and they do).

The represented value is ``(H * 2^B + L) * 2^-(A+B)`` and differs from the exact ``Σ c_i`` by at most
``K * 2^-(A+B+1)`` per coordinate (each c_i is rounded once to the resolution).

Constants and range (:data:`A` = 16, :data:`B` = 47, at most :data:`MAX_UPDATES` = 2^16 adds):

- per add, every coordinate must satisfy ``|m * u_j| <= 2^30`` (:data:`ADD_LIMIT`, about 1.07e9); then
  ``|hi| <= 2^46`` and ``|lo| <= 2^46``, so neither true sum can leave int64 with up to 2^16 adds and
  the represented weighted sum can reach ``±2^46`` (about 7.0e13);
- resolution ``2^-(A+B) = 2^-63`` (about 1.08e-19): each term is exact to within 2^-64.

:meth:`FixedPointSum.value` forms ``sum / divisor`` in float64 from the exact integers and rounds it to
float32 once. For a weighted mean (divisor ``Σ w_i``) the fixed-point error is at most ``K * 2^-64 / Σ w_i``
(<= 2^-64 when every weight is >= 1): below half a float32 ulp of any mean coordinate larger than about
1e-12, so the mean agrees with a float64 reference to float32 rounding.

Cost: 16 bytes per coordinate whatever the number of adds, plus a cache-sized float64 scratch; an add is
eight vectorized numpy passes over cache-sized column chunks (numpy: its int64 arithmetic wraps by
definition, and its ufuncs release the GIL, so a second worker thread can take half of the columns).
:meth:`FixedPointSum.add_rows` adds a block of small vectors in the same eight passes (:func:`block_rows` of them
fill one chunk): the same terms rounded the same way, summed per coordinate in the same modular integers, so the
accumulators are bit-identical to the adds one by one, and a model of a few thousand parameters pays numpy's
per-call cost once per block instead of once per update.
"""

from __future__ import annotations

import math
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import numpy.typing as npt
import torch

A = 16
B = 47
MAX_UPDATES = 1 << 16
ADD_LIMIT = 2.0 ** (46 - A)
RESOLUTION = 2.0 ** -(A + B)

# Columns per chunk of an add: the two float64 scratch vectors (2 * 512 KiB) stay in cache, and numpy's
# per-call overhead is small next to the chunk's work.
CHUNK = 1 << 16
# Vectors added at once by add_rows (streaming FedAvg's block), at most: a block of small updates fills one chunk.
MAX_BLOCK_ROWS = 64
# Threads an add splits its columns over, at most (the work is bound by memory bandwidth beyond a few).
MAX_WORKERS = 4
# Chunk-sized float64/int64 scratch vectors, at most: 2 per add worker, plus 5 while value() runs.
SCRATCH_VECTORS = 2 * MAX_WORKERS + 5

_MAGIC_HI = 1.5 * 2.0 ** (52 - A)  # ulp 2^-A: c + _MAGIC_HI rounds c to a multiple of 2^-A
_MAGIC_LO = 1.5 * 2.0 ** (52 - A - B)  # ulp 2^-(A+B)
_SCALE_HI = 2.0 ** -A
_SCALE_LO = 2.0 ** -(A + B)
_LO_MASK = (1 << B) - 1

_pool: ThreadPoolExecutor | None = None


def block_rows(num_params: int) -> int:
    """How many ``[num_params]`` vectors fill one chunk (at most :data:`MAX_BLOCK_ROWS`): the block streaming
    FedAvg gathers and adds with :meth:`FixedPointSum.add_rows`; 1 (no block) for more than half a chunk."""
    return max(1, min(MAX_BLOCK_ROWS, CHUNK // max(num_params, 1)))


def scratch_len(num_params: int) -> int:
    """Float64 values per scratch vector: a chunk, or a block of :func:`block_rows` vectors when that is less."""
    return min(CHUNK, max(num_params, 1) * block_rows(num_params))


def _bits(x: float) -> int:
    """The bit pattern of the float64 ``x`` as an unsigned integer."""
    return int(struct.unpack("<Q", struct.pack("<d", x))[0])


_BITS_HI = _bits(_MAGIC_HI)
_BITS_LO = _bits(_MAGIC_LO)


def _worker_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=MAX_WORKERS - 1, thread_name_prefix="fixedpoint")
    return _pool


def _forget_pool() -> None:
    # A forked child has none of the parent's threads: it starts its own pool when it needs one.
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


Scratch = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]


def _fold(x: npt.NDArray[np.float64], t: npt.NDArray[np.float64], hi: npt.NDArray[np.uint64],
          lo: npt.NDArray[np.uint64]) -> None:
    """Round the terms ``c`` in ``x`` (``[w]``, or ``[n, w]``: n terms per coordinate) to fixed point and add them to
    the accumulators' ``[w]`` slices ``hi`` and ``lo`` (mod 2^64); ``x`` and ``t`` (same shape) are overwritten."""
    np.add(x, _MAGIC_HI, out=t)  # t = c rounded to a multiple of 2^-A, offset by the magic number
    _add_terms(hi, t.view(np.uint64))  # H += hi + bits(magic)
    np.subtract(t, _MAGIC_HI, out=t)  # hi * 2^-A (exact)
    np.subtract(x, t, out=x)  # r = c - hi * 2^-A (exact)
    np.add(x, _MAGIC_LO, out=x)  # r rounded to a multiple of 2^-(A+B), offset
    _add_terms(lo, x.view(np.uint64))  # L += lo + bits(magic)


def _add_terms(acc: npt.NDArray[np.uint64], terms: npt.NDArray[np.uint64]) -> None:
    """``acc += terms`` (one row) or ``acc += Σ rows of terms``, modulo 2^64 (so in any order)."""
    np.add(acc, terms if terms.ndim == 1 else terms.sum(axis=0, dtype=np.uint64), out=acc)


def encode(u: torch.Tensor | npt.NDArray[np.float32] | npt.NDArray[np.float64], multiplier: float,
           out: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None = None,
           ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The limbs ``(hi, lo)`` (new uint64 ``[P]`` arrays, or the two arrays of ``out``, overwritten) of
    ``multiplier * u`` in the fixed point of :class:`FixedPointSum`: for a float32 ``u`` (a tensor or an array)
    exactly the accumulators of a fresh ``FixedPointSum(P)`` after ``add(u, multiplier)`` (magic offsets included),
    so that the limbs of several vectors summed modulo 2^64 (:meth:`FixedPointSum.add_encoded`) equal those adds bit
    for bit. A float64 ``u`` (values computed in float64, e.g. extra scalars to sum beside the parameters) takes the
    same path from the float64 term ``c = u * multiplier``. The caller keeps every ``|c|`` within :data:`ADD_LIMIT`
    (:meth:`FixedPointSum.range_error`).
    """
    if isinstance(u, torch.Tensor):
        if u.dtype != torch.float32 or u.dim() != 1:
            raise ValueError(f"expected a float32 [P] tensor, got {u.dtype} {tuple(u.shape)}")
        arr: npt.NDArray[np.float32] | npt.NDArray[np.float64] = u.detach().contiguous().numpy()
    else:
        arr = u
        if arr.dtype not in (np.float32, np.float64) or arr.ndim != 1:
            raise ValueError(f"expected a float32 or float64 [P] array, got {arr.dtype} {arr.shape}")
    n, m = arr.shape[0], float(multiplier)
    if out is None:
        hi, lo = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    else:
        hi, lo = out
        if any(a.dtype != np.uint64 or a.shape != (n,) for a in (hi, lo)):
            raise ValueError(f"out must be two uint64 [{n}] arrays, got {[(a.dtype, a.shape) for a in (hi, lo)]}")
        hi.fill(0)
        lo.fill(0)
    size = min(CHUNK, max(n, 1))
    x_buf, t_buf = np.empty(size), np.empty(size)
    for s in range(0, n, CHUNK):  # chunk by chunk, as FixedPointSum.add: the scratch stays in cache
        e = min(s + CHUNK, n)
        x, t = x_buf[: e - s], t_buf[: e - s]
        np.copyto(x, arr[s:e])  # float32 -> float64 is exact
        if m != 1.0:
            np.multiply(x, m, out=x)  # c = float64(u) * m
        _fold(x, t, hi[s:e], lo[s:e])
    return hi, lo


class FixedPointSum:
    """``Σ m_i u_i`` over float32 ``[P]`` vectors, exact in fixed point and independent of the order of the
    adds (see the module docstring for the range, the resolution and the cost).

    ``workers``: threads an add splits its columns over (the caller's thread plus ``workers - 1`` pool
    threads), at most :data:`MAX_WORKERS` and one per chunk; None follows ``torch.get_num_threads()``. The
    result does not depend on it.

    ``hi`` and ``lo`` are the raw ``[P]`` int64 accumulators (H and L plus ``count`` times the magic
    numbers' bit patterns, modulo 2^64); :meth:`value` reads the sum.
    """

    def __init__(self, num_params: int, workers: int | None = None) -> None:
        self.num_params = num_params
        self.hi = torch.zeros(num_params, dtype=torch.int64)
        self.lo = torch.zeros(num_params, dtype=torch.int64)
        # Unsigned views for the adds: arithmetic modulo 2^64 is defined behaviour for unsigned integers.
        self._hi = self.hi.numpy().view(np.uint64)
        self._lo = self.lo.numpy().view(np.uint64)
        self.count = 0
        n_chunks = max(1, -(-num_params // CHUNK))
        want = torch.get_num_threads() if workers is None else workers
        self.workers = max(1, min(want, n_chunks, MAX_WORKERS))
        size = scratch_len(num_params)
        self._scratch: list[Scratch] = [(np.empty(size), np.empty(size)) for _ in range(self.workers)]

    @property
    def nbytes(self) -> int:
        """Bytes of the accumulators and the scratch (independent of the number of adds)."""
        return int(self._hi.nbytes + self._lo.nbytes + sum(x.nbytes + t.nbytes for x, t in self._scratch))

    @staticmethod
    def range_error(max_abs: float, multiplier: float) -> str | None:
        """Why a vector with ``max |u_j| = max_abs`` cannot be added with ``multiplier``, or None if it can."""
        bound = max_abs * multiplier  # rounding is monotone: every |fl(u_j * m)| <= fl(max_abs * m)
        if bound <= ADD_LIMIT:
            return None
        return (f"update out of the exact-aggregation range: max|u| * weight * clip scale = {bound:.10g} "
                f"exceeds 2^{46 - A} = {ADD_LIMIT:.10g} (fixed point with resolution 2^-{A + B})")

    def add(self, u: torch.Tensor, multiplier: float) -> None:
        """Add ``multiplier * u`` (u: float32 ``[P]`` on the CPU, every ``|multiplier * u_j| <= ADD_LIMIT``:
        the caller checks that with :meth:`range_error`)."""
        if self.count >= MAX_UPDATES:
            raise ValueError(f"exact aggregation holds at most {MAX_UPDATES} updates")
        if u.dtype != torch.float32 or u.shape != (self.num_params,):
            raise ValueError(f"expected a float32 tensor of shape ({self.num_params},), got {u.dtype} "
                             f"{tuple(u.shape)}")
        un = u.detach().contiguous().numpy()
        m = float(multiplier)
        p, w = self.num_params, self.workers
        if w == 1:
            self._add_range(un, m, 0, p, self._scratch[0])
        else:
            n_chunks = -(-p // CHUNK)
            bounds = [min(p, (n_chunks * j // w) * CHUNK) for j in range(w + 1)]
            pool = _worker_pool()
            futures: list[Future[None]] = [
                pool.submit(self._add_range, un, m, bounds[j], bounds[j + 1], self._scratch[j]) for j in range(1, w)
            ]
            self._add_range(un, m, bounds[0], bounds[1], self._scratch[0])
            for f in futures:
                f.result()
        self.count += 1

    def add_rows(self, rows: torch.Tensor, multipliers: list[float]) -> None:
        """Add ``multipliers[i] * rows[i]`` for every row of the float32 ``[n, P]`` block (each term within
        ``ADD_LIMIT``, as for :meth:`add`): the same accumulators, bit for bit, as ``n`` calls of :meth:`add`.
        A block that fits the scratch (``n * P`` values, at most :func:`block_rows` rows of a small model) is
        added in one set of passes; a larger one row by row."""
        n = len(multipliers)
        p = self.num_params
        if rows.dtype != torch.float32 or rows.shape != (n, p):
            raise ValueError(f"expected a float32 tensor of shape ({n}, {p}), got {rows.dtype} {tuple(rows.shape)}")
        if self.count + n > MAX_UPDATES:
            raise ValueError(f"exact aggregation holds at most {MAX_UPDATES} updates")
        x_buf, t_buf = self._scratch[0]
        if n * p > x_buf.size:
            for i in range(n):
                self.add(rows[i], multipliers[i])
            return
        x, t = x_buf[: n * p].reshape(n, p), t_buf[: n * p].reshape(n, p)
        np.copyto(x, rows.detach().contiguous().numpy())
        np.multiply(x, np.asarray(multipliers, dtype=np.float64).reshape(n, 1), out=x)  # c = float64(u) * m
        _fold(x, t, self._hi, self._lo)
        self.count += n

    def add_encoded(self, hi: npt.NDArray[np.uint64], lo: npt.NDArray[np.uint64], count: int = 1) -> None:
        """Add raw limbs modulo 2^64 (uint64 ``[P]``: the sum of ``count`` vectors' :func:`encode` limbs, e.g. the
        unmasked result of secure aggregation) and count ``count`` adds: the accumulators then equal, bit for bit,
        those of the ``count`` adds themselves."""
        p = self.num_params
        for name, limb in (("hi", hi), ("lo", lo)):
            if limb.dtype != np.uint64 or limb.shape != (p,):
                raise ValueError(f"expected {name} as a uint64 array of shape ({p},), got {limb.dtype} {limb.shape}")
        if count < 0 or self.count + count > MAX_UPDATES:
            raise ValueError(f"exact aggregation holds at most {MAX_UPDATES} updates (count {count})")
        np.add(self._hi, hi, out=self._hi)
        np.add(self._lo, lo, out=self._lo)
        self.count += count

    def _add_range(self, un: npt.NDArray[np.float32], m: float, start: int, stop: int, scratch: Scratch) -> None:
        x_buf, t_buf = scratch
        hi, lo = self._hi, self._lo
        for s in range(start, stop, CHUNK):
            e = min(s + CHUNK, stop)
            x, t = x_buf[: e - s], t_buf[: e - s]
            np.copyto(x, un[s:e])
            if m != 1.0:
                np.multiply(x, m, out=x)  # c = float64(u) * m
            _fold(x, t, hi[s:e], lo[s:e])

    def exact(self, index: int) -> Fraction:
        """The represented sum at coordinate ``index`` as an exact fraction (for tests and diagnostics)."""

        def signed(raw: int, bits: int) -> int:
            v = (raw - self.count * bits) % (1 << 64)
            return v - (1 << 64) if v >= 1 << 63 else v

        h = signed(int(self._hi[index]), _BITS_HI)
        low = signed(int(self._lo[index]), _BITS_LO)
        return Fraction(h * (1 << B) + low, 1 << (A + B))

    def value(self, divisor: float = 1.0) -> torch.Tensor:
        """The sum divided by ``divisor`` as a new float32 ``[P]`` tensor: ``(H * 2^B + L) * 2^-(A+B)`` is
        formed in float64 from the normalized integers (``0 <= L < 2^B``), divided, then rounded to float32;
        a deterministic function of the exact integer sums. Works chunk by chunk (five chunk-sized scratch
        vectors); the accumulators are not modified."""
        if not (math.isfinite(divisor) and divisor != 0.0):
            raise ValueError(f"divisor must be finite and non-zero, got {divisor}")
        result = torch.empty(self.num_params, dtype=torch.float32)
        res = result.numpy()
        mod = (1 << 64) - 1
        off_hi, off_lo = (self.count * _BITS_HI) & mod, (self.count * _BITS_LO) & mod
        size = min(CHUNK, max(self.num_params, 1))
        h, low, carry = np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.int64)
        v, f = np.empty(size), np.empty(size)
        for s in range(0, self.num_params, CHUNK):
            e = min(s + CHUNK, self.num_params)
            n = e - s
            hh, ll, cc, vv, ff = h[:n], low[:n], carry[:n], v[:n], f[:n]
            np.subtract(self._hi[s:e], off_hi, out=hh.view(np.uint64))  # Σ hi mod 2^64: exact, |Σ hi| <= 2^62
            np.subtract(self._lo[s:e], off_lo, out=ll.view(np.uint64))  # Σ lo, |Σ lo| <= 2^62
            np.right_shift(ll, B, out=cc)  # floor(Σ lo / 2^B)
            np.add(hh, cc, out=hh)
            np.bitwise_and(ll, _LO_MASK, out=ll)  # Σ lo mod 2^B, in [0, 2^B): exact as float64
            np.multiply(hh, _SCALE_HI, out=vv)
            np.multiply(ll, _SCALE_LO, out=ff)
            np.add(vv, ff, out=vv)
            np.divide(vv, divisor, out=vv)
            np.copyto(res[s:e], vv, casting="same_kind")
        return result
