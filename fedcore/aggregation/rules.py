"""Aggregation rules over a stacked ``[n, P]`` float32 tensor of (possibly clipped) updates.

A rule is a small frozen dataclass holding its parameters; calling it with the stacked updates and their
weights returns the aggregate step (a ``[P]`` float32 vector that is added to ``w^{r-1}``, before noise)
and what it excluded. Rules never modify their input. Rules plug in by name through :func:`register_rule`;
:func:`build_rule` turns an :class:`~fedcore.aggregation.config.AggregationConfig` into a rule.

Coordinate-wise rules (median, trimmed mean, Bulyan's second phase) and Krum's distance computation walk
the ``P`` coordinates in column chunks, so that their working memory is bounded by the chunk and not by
``n*P``; within a chunk all work is vectorized over the columns (order statistics: see
:mod:`fedcore.aggregation.order`; distances: ``torch.cdist``).

Weights: ``fedavg``, ``multi_krum`` and ``knorm`` average (the kept) updates with the weights they are
given (the sample counts n_i when ``config.weighted``, ones otherwise); ``median``, ``trimmed_mean``,
``krum`` and ``bulyan`` are unweighted by definition and ignore them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fedcore.aggregation.config import AggregationConfig
from fedcore.aggregation.config import KNormOptions as KNormOptions  # re-exported: the options live beside RULES
from fedcore.aggregation.config import KrumOptions as KrumOptions  # re-exported
from fedcore.aggregation.config import MultiKrumOptions as MultiKrumOptions  # re-exported
from fedcore.aggregation.config import Rule as Rule  # re-exported: the protocol lives beside the registry
from fedcore.aggregation.config import RuleOutput as RuleOutput  # re-exported
from fedcore.aggregation.config import TrimmedMeanOptions as TrimmedMeanOptions  # re-exported
from fedcore.aggregation.config import build_rule as build_rule  # re-exported: the registry's old home
from fedcore.aggregation.config import register_rule as register_rule  # re-exported
from fedcore.aggregation.config import rule_names as rule_names  # re-exported
from fedcore.aggregation.config import unregister_rule as unregister_rule  # re-exported
from fedcore.aggregation.order import (
    closest_to_median_mean,
    coordinate_median,
    order_chunk_cols,
    order_workspace,
    trimmed_sum,
)
from fedcore.registry import options_as

# Elements ([n, c] values) per column chunk of Krum's distance computation.
CHUNK_ELEMS = 1 << 20
# Upper bound on the transient bytes per chunk element there (centred copy, cdist's norms and products);
# used by the memory check. The order-statistic rules have their own bound (order.order_workspace).
CHUNK_BYTES_PER_ELEM = 40


def _check_input(updates: torch.Tensor, weights: torch.Tensor) -> int:
    if updates.dim() != 2:
        raise ValueError(f"expected a stacked [n, P] tensor, got shape {tuple(updates.shape)}")
    n = int(updates.shape[0])
    if weights.shape != (n,):
        raise ValueError(f"expected {n} weights, got shape {tuple(weights.shape)}")
    if n == 0:
        raise ValueError("no updates to aggregate")
    return n


def column_chunks(n: int, num_params: int, chunk_elems: int | None = None) -> Iterator[slice]:
    """Column slices of width about ``chunk_elems / n`` (default :data:`CHUNK_ELEMS`) covering ``range(num_params)``."""
    width = max(1, (CHUNK_ELEMS if chunk_elems is None else chunk_elems) // max(n, 1))
    for start in range(0, num_params, width):
        yield slice(start, min(start + width, num_params))


def _chunk_workspace(n: int, num_params: int) -> tuple[int, str]:
    elems = min(n * max(num_params, 1), max(CHUNK_ELEMS, n))
    return elems * CHUNK_BYTES_PER_ELEM, f"{elems}*{CHUNK_BYTES_PER_ELEM} B for chunk temporaries"


def weighted_mean_rows(updates: torch.Tensor, weights: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """``Σ_i w_i u_i / Σ_i w_i`` over ``rows`` (all rows if None), without copying the selected rows."""
    n = int(updates.shape[0])
    idx = list(range(n)) if rows is None else rows
    w = weights.to(torch.float64)[idx]
    total = float(w.sum())
    if not total > 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    coeffs = (w / total).to(updates.dtype)
    if rows is None:
        return torch.mv(updates.t(), coeffs)
    out = torch.zeros(updates.shape[1], dtype=updates.dtype)
    for j, i in enumerate(idx):
        out.add_(updates[i], alpha=float(coeffs[j]))
    return out


# ---- rules ----


@dataclass(frozen=True)
class FedAvg:
    """Weighted mean ``Σ w_i u_i / Σ w_i`` (weights n_i, or ones for the plain mean)."""

    name: str = "fedavg"
    streamable: bool = True

    def check(self, n: int) -> None:
        return None

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        return 0, "no temporaries"

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        _check_input(updates, weights)
        return RuleOutput(weighted_mean_rows(updates, weights))


@dataclass(frozen=True)
class Median:
    """Coordinate-wise median (FedMedian; Yin et al. 2018)."""

    name: str = "median"
    streamable: bool = False

    def check(self, n: int) -> None:
        return None

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        return order_workspace(n, num_params)

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        n = _check_input(updates, weights)
        num_params = int(updates.shape[1])
        out = torch.empty(num_params, dtype=updates.dtype)
        for cols in column_chunks(n, num_params, order_chunk_cols(n, num_params) * n):
            out[cols] = coordinate_median(updates[:, cols])
        return RuleOutput(out, num_trimmed_per_coord=n - 1 if n % 2 else n - 2)


@dataclass(frozen=True)
class TrimmedMean:
    """Coordinate-wise trimmed mean: per coordinate drop the m largest and m smallest values, average the
    remaining n - 2m (Yin et al. 2018). m is ``trim_m``, or ``floor(trim_fraction * n)`` when it is None."""

    trim_m: int | None = None
    trim_fraction: float = 0.1
    name: str = "trimmed_mean"
    streamable: bool = False

    def m(self, n: int) -> int:
        return self.trim_m if self.trim_m is not None else int(self.trim_fraction * n)

    def check(self, n: int) -> None:
        m = self.m(n)
        if 2 * m >= n:
            field = "trim_m" if self.trim_m is not None else "trim_fraction"
            raise ValueError(f"{field}: trimmed_mean drops m={m} values per side, which needs m < n/2 "
                             f"(2*m < n), got n={n}")

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        return order_workspace(n, num_params)

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        n = _check_input(updates, weights)
        self.check(n)
        m = self.m(n)
        num_params = int(updates.shape[1])
        if m == 0:
            return RuleOutput(updates.mean(dim=0))
        out = torch.empty(num_params, dtype=updates.dtype)
        for cols in column_chunks(n, num_params, order_chunk_cols(n, num_params) * n):
            out[cols] = trimmed_sum(updates[:, cols], m).div_(n - 2 * m)
        return RuleOutput(out, num_trimmed_per_coord=2 * m)


def pairwise_sq_dists(updates: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances between the rows of ``[n, P]`` as float64 ``[n, n]``.

    Computed chunk by chunk with ``torch.cdist`` on mean-centred column chunks (centring keeps the
    matrix-product formulation accurate when rows are close), accumulated in float64.
    """
    n, num_params = int(updates.shape[0]), int(updates.shape[1])
    d2 = torch.zeros(n, n, dtype=torch.float64)
    for cols in column_chunks(n, num_params):
        chunk = updates[:, cols]
        centred = chunk - chunk.mean(dim=0, keepdim=True)
        d = torch.cdist(centred, centred, compute_mode="use_mm_for_euclid_dist")
        d2.add_(d.to(torch.float64).square_())
    d2 = d2.add_(d2.t().clone()).mul_(0.5)  # exactly symmetric, so mutual-nearest ties are exact
    d2.fill_diagonal_(0.0)
    return d2


def krum_scores(d2: torch.Tensor, f: int, among: list[int] | None = None) -> torch.Tensor:
    """Krum score of each row in ``among``: the sum of squared distances to its ``r - f - 2`` nearest other
    rows (r = len(among); at least 1 and at most r - 1 neighbours)."""
    idx = list(range(int(d2.shape[0]))) if among is None else among
    r = len(idx)
    if r == 1:
        return torch.zeros(1, dtype=torch.float64)
    sub = d2[idx][:, idx].clone()
    sub.fill_diagonal_(float("inf"))
    q = min(max(r - f - 2, 1), r - 1)
    return torch.sort(sub, dim=1).values[:, :q].sum(dim=1)


def krum_order(d2: torch.Tensor, f: int, among: list[int] | None = None) -> list[int]:
    """Positions in ``among`` (all rows if None) from best to worst Krum score.

    Exact ties (e.g. two mutually nearest rows when one neighbour is counted) are broken by the sum of
    squared distances to all the other rows in ``among``, and only then by position, so that the choice
    does not depend on the order in which updates arrived.
    """
    idx = list(range(int(d2.shape[0]))) if among is None else among
    scores = krum_scores(d2, f, idx)
    total = d2[idx][:, idx].sum(dim=1)
    by_total = torch.sort(total, stable=True).indices
    by_score = torch.sort(scores[by_total], stable=True).indices
    return [int(by_total[int(i)]) for i in by_score]


def _check_krum(name: str, n: int, f: int) -> None:
    if n <= 2 * f + 2:
        raise ValueError(f"krum_f: {name} needs n > 2*krum_f + 2 updates, got n={n}, krum_f={f} "
                         f"(2*{f} + 2 = {2 * f + 2})")


@dataclass(frozen=True)
class Krum:
    """Krum (Blanchard et al. 2017): the single update with the smallest sum of squared distances to its
    n - f - 2 nearest neighbours. Needs n > 2f + 2. Ties: see :func:`krum_order`."""

    f: int = 1
    name: str = "krum"
    streamable: bool = False

    def check(self, n: int) -> None:
        _check_krum(self.name, n, self.f)

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        b, s = _chunk_workspace(n, num_params)
        return b + n * n * 8, f"{s} + {n}*{n}*8 B for the distance matrix"

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        n = _check_input(updates, weights)
        self.check(n)
        best = krum_order(pairwise_sq_dists(updates), self.f)[0]
        return RuleOutput(updates[best].clone(), num_excluded=n - 1, selected=(best,))


@dataclass(frozen=True)
class MultiKrum:
    """Multi-Krum: average of the m updates with the best (smallest) Krum scores, scores computed once over
    all n updates (as in Flower's implementation); m = n - f when None. Needs n > 2f + 2 and m <= n - f."""

    f: int = 1
    m: int | None = None
    name: str = "multi_krum"
    streamable: bool = False

    def keep(self, n: int) -> int:
        return self.m if self.m is not None else n - self.f

    def check(self, n: int) -> None:
        _check_krum(self.name, n, self.f)
        if self.keep(n) > n - self.f:
            raise ValueError(f"multi_krum_m: must be <= n - krum_f = {n} - {self.f} = {n - self.f}, "
                             f"got multi_krum_m={self.m}")

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        b, s = _chunk_workspace(n, num_params)
        return b + n * n * 8, f"{s} + {n}*{n}*8 B for the distance matrix"

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        n = _check_input(updates, weights)
        self.check(n)
        m = self.keep(n)
        rows = sorted(krum_order(pairwise_sq_dists(updates), self.f)[:m])
        return RuleOutput(weighted_mean_rows(updates, weights, rows), num_excluded=n - m, selected=tuple(rows))


@dataclass(frozen=True)
class Bulyan:
    """Bulyan (El Mhamdi et al. 2018). Selection: theta = n - 2f updates chosen by applying Krum repeatedly
    to the remaining set (each time the best-scored update is moved to the selection). Aggregation: per
    coordinate, the mean of the beta = theta - 2f selected values closest to their median. Needs
    n >= 4f + 3. In the repeated Krum the neighbour count r - f - 2 is kept >= 1."""

    f: int = 1
    name: str = "bulyan"
    streamable: bool = False

    def check(self, n: int) -> None:
        if n < 4 * self.f + 3:
            raise ValueError(f"krum_f: bulyan needs n >= 4*krum_f + 3 updates, got n={n}, krum_f={self.f} "
                             f"(4*{self.f} + 3 = {4 * self.f + 3})")

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        b, s = _chunk_workspace(n, num_params)
        b2, s2 = order_workspace(n, num_params)
        return max(b, b2) + n * n * 8, f"max({s}, {s2}) + {n}*{n}*8 B for the distance matrix"

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        n = _check_input(updates, weights)
        self.check(n)
        theta = n - 2 * self.f
        beta = theta - 2 * self.f
        d2 = pairwise_sq_dists(updates)
        remaining = list(range(n))
        chosen: list[int] = []
        for _ in range(theta):
            best = remaining[krum_order(d2, self.f, remaining)[0]]
            chosen.append(best)
            remaining.remove(best)
        rows = sorted(chosen)
        sel = torch.tensor(rows, dtype=torch.long)
        num_params = int(updates.shape[1])
        out = torch.empty(num_params, dtype=updates.dtype)
        for cols in column_chunks(theta, num_params, order_chunk_cols(theta, num_params) * theta):
            out[cols] = closest_to_median_mean(updates[:, cols].index_select(0, sel), beta)
        return RuleOutput(out, num_excluded=n - theta, num_trimmed_per_coord=theta - beta, selected=tuple(rows))


@dataclass(frozen=True)
class KNorm:
    """Discard the k updates with the largest L2 norms (of the rows as given, i.e. after clipping), then
    average the rest with their weights. Ties keep the earlier rows. Needs k < n."""

    k: int = 1
    name: str = "knorm"
    streamable: bool = False

    def check(self, n: int) -> None:
        if self.k >= n:
            raise ValueError(f"knorm_k: knorm discards knorm_k updates and needs knorm_k < n, "
                             f"got knorm_k={self.k}, n={n}")

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        return 0, "no temporaries"

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
        n = _check_input(updates, weights)
        self.check(n)
        norms = torch.linalg.vector_norm(updates, dim=1).to(torch.float64)
        keep = torch.sort(norms, stable=True).indices[: n - self.k]
        rows = sorted(int(i) for i in keep)
        return RuleOutput(weighted_mean_rows(updates, weights, rows), num_excluded=self.k, selected=tuple(rows))


# ---- registrations ----

def _trimmed(c: AggregationConfig) -> Rule:
    o = options_as(c.options, TrimmedMeanOptions, "aggregation.options")
    if o.trim_m is not None:
        return TrimmedMean(trim_m=o.trim_m)
    return TrimmedMean(trim_fraction=0.1 if o.trim_fraction is None else o.trim_fraction)


def _krum(c: AggregationConfig) -> Rule:
    return Krum(f=options_as(c.options, KrumOptions, "aggregation.options").krum_f)


def _multi_krum(c: AggregationConfig) -> Rule:
    o = options_as(c.options, MultiKrumOptions, "aggregation.options")
    return MultiKrum(f=o.krum_f, m=o.multi_krum_m)


def _bulyan(c: AggregationConfig) -> Rule:
    return Bulyan(f=options_as(c.options, KrumOptions, "aggregation.options").krum_f)


def _knorm(c: AggregationConfig) -> Rule:
    return KNorm(k=options_as(c.options, KNormOptions, "aggregation.options").knorm_k)


# The built-in rules are declared, with their options and one line, in fedcore.aggregation.config (RULES).
register_rule("fedavg", lambda c: FedAvg())
register_rule("median", lambda c: Median())
register_rule("trimmed_mean", _trimmed)
register_rule("krum", _krum)
register_rule("multi_krum", _multi_krum)
register_rule("bulyan", _bulyan)
register_rule("knorm", _knorm)
