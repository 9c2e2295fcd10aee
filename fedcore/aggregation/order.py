"""Coordinate-wise order statistics over the rows of a ``[n, c]`` column chunk, with elementwise min/max only.

``torch.sort``/``median``/``kthvalue``/``topk`` along dim 0 copy every column into a scratch buffer and are
slow for the short columns (n = K updates) of an aggregation: 15-40 ns per element on one core. Here each
comparison is a ``torch.minimum``/``torch.maximum`` of two ``[c]`` rows, so the work is ``2 * comparators``
vectorized operations over cache-sized rows, with two interchangeable schedules:

- insertion registers (:func:`extreme_values`): the k smallest (largest) values, ``Σ_i min(i+1, k)``
  comparators; cheapest when only values near the ends are needed (trimmed mean with small m);
- a Batcher odd-even merge sorting network (:func:`sorting_network`), pruned to the n real rows and to the
  comparators that reach the requested positions (:func:`selection_network`); ``O(n log² n)``, cheapest
  for middle positions (median).

:func:`order_statistics` picks the schedule with fewer comparators, unless even that one needs more than
:data:`SORT_OPS_PER_ELEM` elementwise operations per input value: then (n >~ 100 rows and positions away from
the ends, e.g. the median of 100 updates) numpy's SIMD sort of the chunk is cheaper and is used instead.
Results are exact (min/max do not round) and ties are handled as in a sort. Inputs must be finite (the
aggregators reject non-finite updates).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

# Column-chunk budget of the order-statistic kernels: n * c elements per working copy (8 MiB of float32), at
# most this many columns per chunk, and at least this many (so Python overhead per comparator stays small).
ORDER_CHUNK_ELEMS = 1 << 21
ORDER_CHUNK_MAX_COLS = 1 << 16
ORDER_CHUNK_MIN_COLS = 1 << 10
# Above this many min/max operations per input value, np.sort of the chunk (along the rows) is faster than the
# comparator schedules: measured crossover on one core of an AMD EPYC VM, 17-19 operations (n = 70-100 rows);
# at n = 200 (24 operations) the sort is ~1.8x faster (tools/bench/bench_aggregation.py shows the effect per rule).
SORT_OPS_PER_ELEM = 16.0


def order_chunk_cols(n: int, num_params: int) -> int:
    """Columns per chunk for order statistics over n rows."""
    cols = max(ORDER_CHUNK_MIN_COLS, min(ORDER_CHUNK_MAX_COLS, ORDER_CHUNK_ELEMS // max(n, 1)))
    return max(1, min(cols, num_params))


def order_workspace(n: int, num_params: int) -> tuple[int, str]:
    """Upper bound on the transient bytes of the order-statistic kernels over n rows, with the arithmetic:
    a working copy (and, for Bulyan, a gathered copy) of the chunk, <= n stacked order statistics, scratch."""
    c = order_chunk_cols(n, num_params)
    return (3 * n + 8) * c * 4, f"(3*{n}+8)*{c}*4 B for order-statistic chunks"


def extreme_values(x: torch.Tensor, k: int, largest: bool = False) -> list[torch.Tensor]:
    """The k smallest (or largest) values of every column of ``[n, c]``, in order (ties counted), as k ``[c]``
    vectors: ``out[j]`` is the (j+1)-th smallest (largest). Insertion through k running registers."""
    n, c = int(x.shape[0]), int(x.shape[1])
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    regs = [torch.full((c,), float("-inf") if largest else float("inf"), dtype=x.dtype) for _ in range(k)]
    a, b = torch.empty(c, dtype=x.dtype), torch.empty(c, dtype=x.dtype)
    keep, push = (torch.maximum, torch.minimum) if largest else (torch.minimum, torch.maximum)
    for i in range(n):
        v = x[i]
        for j in range(min(i + 1, k)):
            push(regs[j], v, out=a)  # the value that moves on down the registers
            keep(regs[j], v, out=regs[j])
            v = a
            a, b = b, a
    return regs


@lru_cache(maxsize=64)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators (i, j), i < j, of Batcher's odd-even merge sort for n inputs (ascending: min goes to i).

    Built for the next power of two and pruned to the n real inputs: the missing inputs act as +inf, which
    never moves, so every comparator touching one is a no-op.
    """
    size = 1
    while size < n:
        size *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


@lru_cache(maxsize=256)
def selection_network(n: int, positions: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The comparators of :func:`sorting_network` whose outputs reach the given sorted positions."""
    needed = set(positions)
    kept: list[tuple[int, int]] = []
    for i, j in reversed(sorting_network(n)):
        if i in needed or j in needed:
            kept.append((i, j))
            needed.update((i, j))
    kept.reverse()
    return tuple(kept)


def _insertion_cost(n: int, k: int) -> int:
    return sum(min(i + 1, k) for i in range(n)) if k > 0 else 0


@lru_cache(maxsize=256)
def schedule(n: int, positions: tuple[int, ...], sortable: bool = True) -> str:
    """How :func:`order_statistics` computes the given (sorted, distinct) positions of n rows: ``"insertion"``,
    ``"network"``, or ``"sort"`` when that is cheaper than the cheaper comparator schedule (``sortable``:
    the dtype is one numpy sorts)."""
    low = [p for p in positions if p < n - 1 - p]
    k_low = max(low) + 1 if low else 0
    k_high = max((n - p for p in positions if p not in low), default=0)
    insertion = _insertion_cost(n, k_low) + _insertion_cost(n, k_high)
    network = len(selection_network(n, positions))
    if sortable and 2 * min(insertion, network) > SORT_OPS_PER_ELEM * n:
        return "sort"
    return "insertion" if insertion <= network else "network"


def _sortable(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float32, torch.float64)


def sorted_columns(x: torch.Tensor) -> torch.Tensor:
    """A sorted copy of ``[n, c]`` along the rows (numpy's SIMD sort; ``x`` may be a strided column slice)."""
    return torch.from_numpy(np.sort(x.numpy(), axis=0))


def order_statistics(x: torch.Tensor, positions: Sequence[int]) -> list[torch.Tensor]:
    """Values at the given 0-based positions of every column of ``[n, c]`` sorted ascending (``[c]`` each)."""
    n = int(x.shape[0])
    pos = tuple(sorted(set(positions)))
    if not pos or pos[0] < 0 or pos[-1] >= n:
        raise ValueError(f"positions must lie in [0, {n}), got {list(positions)}")
    how = schedule(n, pos, _sortable(x))
    values: dict[int, torch.Tensor] = {}
    if how == "sort":
        ordered = sorted_columns(x)
        values = {p: ordered[p] for p in pos}
    elif how == "insertion":
        low = [p for p in pos if p < n - 1 - p]
        high = [p for p in pos if p not in low]
        if low:
            regs = extreme_values(x, max(low) + 1)
            values.update({p: regs[p] for p in low})
        if high:
            regs = extreme_values(x, n - min(high), largest=True)
            values.update({p: regs[n - 1 - p] for p in high})
    else:
        work = x.clone()
        rows = list(work.unbind(0))
        spare = torch.empty_like(rows[0])
        for i, j in selection_network(n, pos):
            torch.minimum(rows[i], rows[j], out=spare)
            torch.maximum(rows[i], rows[j], out=rows[j])
            rows[i], spare = spare, rows[i]
        values = {p: rows[p] for p in pos}
    return [values[p] for p in positions]


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 of ``[n, c]``, averaging the two middle values when n is even (as ``np.median``)."""
    n = int(x.shape[0])
    if n % 2 == 1:
        return order_statistics(x, [n // 2])[0].clone()
    lower, upper = order_statistics(x, [n // 2 - 1, n // 2])
    return lower.mul(0.5).add_(upper, alpha=0.5)


def clamped_sum(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``Σ_i clamp(x[i], lo, hi)`` over the rows of ``[n, c]``, one cache-sized row at a time, accumulated in
    float64 (the callers subtract multiples of lo and hi from it: float32 would lose the middle values)."""
    total = torch.zeros(lo.shape, dtype=torch.float64)
    tmp = torch.empty_like(lo)
    for i in range(int(x.shape[0])):
        torch.clamp(x[i], lo, hi, out=tmp)
        total.add_(tmp)
    return total


def trimmed_sum(x: torch.Tensor, m: int) -> torch.Tensor:
    """Per column of ``[n, c]`` (finite values, 0 <= m < n/2): the sum of the values left after dropping the m
    largest and the m smallest.

    With ``lo``/``hi`` the (m+1)-th smallest/largest value, ``clamp(x, lo, hi)`` maps the m smallest values
    to lo, the m largest to hi and leaves the middle ones unchanged (ties included), so the middle sum is
    ``Σ clamp(x, lo, hi) - m*lo - m*hi``. lo and hi are middle values themselves: dropped outliers never
    enter the arithmetic, however large they are. Returns float64.
    """
    n = int(x.shape[0])
    if m == 0:
        return x.sum(dim=0, dtype=torch.float64)
    if schedule(n, (m, n - 1 - m), _sortable(x)) == "sort":
        return sorted_columns(x)[m : n - m].sum(dim=0, dtype=torch.float64)
    lo, hi = order_statistics(x, [m, n - 1 - m])
    return clamped_sum(x, lo, hi).sub_(lo, alpha=m).sub_(hi, alpha=m)


def closest_to_median_mean(x: torch.Tensor, beta: int) -> torch.Tensor:
    """Per column of ``[n, c]``: the mean of the beta values closest to the column's median (Bulyan).

    The n - beta values left out are always taken from the ends of the sorted column: repeatedly drop the
    current lowest or highest value, whichever is farther from the median (the highest on a tie, so with
    beta = 1 and n even the lower middle value is kept). With s dropped from below and t from above, the
    kept values are the sorted window ``[a, b]`` and their sum is ``Σ clamp(x, a, b) - s*a - t*b`` (no
    dropped outlier enters the arithmetic). Depends on the values only, not on the order of the rows.
    """
    n, c = int(x.shape[0]), int(x.shape[1])
    if not 1 <= beta <= n:
        raise ValueError(f"need 1 <= beta <= n, got beta={beta}, n={n}")
    drop = n - beta
    if drop == 0:
        return x.mean(dim=0)
    low_pos = list(range(drop + 1))
    high_pos = [n - 1 - j for j in range(drop + 1)]
    mid = [n // 2] if n % 2 else [n // 2 - 1, n // 2]
    stats = order_statistics(x, low_pos + high_pos + mid)
    low = torch.stack(stats[: drop + 1])  # low[s] = (s+1)-th smallest
    high = torch.stack(stats[drop + 1 : 2 * drop + 2])  # high[t] = (t+1)-th largest
    med = stats[-1] if n % 2 else stats[-2] * 0.5 + stats[-1] * 0.5
    s = torch.zeros(1, c, dtype=torch.long)
    t = torch.zeros(1, c, dtype=torch.long)
    for _ in range(drop):
        take_low = (med - low.gather(0, s)[0]) > (high.gather(0, t)[0] - med)
        s += take_low
        t += ~take_low
    a, b = low.gather(0, s)[0], high.gather(0, t)[0]
    total = clamped_sum(x, a, b)
    total.sub_(a.double() * s[0]).sub_(b.double() * t[0])
    return total.div_(beta).to(x.dtype)
