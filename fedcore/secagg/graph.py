"""The SecAgg+ neighbour graph and the choice of its degree k and Shamir threshold t.

Graph: a Harary graph ``H(k, K)`` (k even) over a seeded random permutation of the participants' sorted ids: the
participant at ring position i is a neighbour of those at positions ``i ± 1, ..., i ± k/2`` (mod K). Each participant
Shamir-shares its secrets among its k neighbours only and masks against them only, so a round costs O(K k) instead of
O(K^2). For ``k >= K - 1`` the graph is complete (plain SecAgg). The graph is a deterministic function of the ids,
k and the round seed the caller passes.

Choice of k and t (:func:`choose_parameters`), after Bell et al. (CCS 2020), for K participants of which at most
``D = floor(delta K)`` drop and ``A = floor(gamma K)`` collude with the server (delta = ``max_dropout``, gamma =
``corrupt_fraction``), security sigma and correctness eta bits:

1. *Connected*: the graph minus the ``A + D`` bad nodes stays connected. Removing nodes disconnects ``H(k, K)`` only
   if two disjoint runs of k/2 ring-consecutive nodes are all removed; with the permutation random, a fixed set of k
   nodes is all bad with probability ``C(A+D, k) / C(K, k)``, and there are fewer than ``K (K - k - 1) / 2`` pairs
   of runs: the union bound must be below ``2^-(sigma+1)``.
2. *Secure threshold*: c = the corrupt neighbours of one participant, exceeded with probability at most
   ``2^-(sigma+1) / K`` (hypergeometric tail over the K - 1 others); ``t_min = floor((k + c) / 2) + 1``, so that
   ``2t - k > c``: since an honest client reveals, for each neighbour, the share of its self-mask seed or of its mask
   key but never both, a server (lying about dropouts as it likes) plus c corrupt neighbours cannot collect t shares
   of both secrets of anyone. ``t = max(t_min, ceil(threshold k), 2)``.
3. *Reachable*: d = the dropped neighbours of one participant, exceeded with probability at most ``2^-eta / K``;
   k works if ``t <= k - d``.

The smallest even k meeting 1-3 is taken (an explicit ``neighbours`` is taken as it is, t from rule 2: a round
whose neighbourhoods lose too many is then abandoned ``below_threshold``); none below K - 1 means the complete graph,
where c = A and d = D exactly (every other participant is a neighbour) and t is chosen the same way; if then
``t > k - D`` (few participants) the round tolerates only ``k - t`` dropouts. k grows as O(log K) (the union bounds)
with a large constant when delta = 1/3, since the server may lie about dropouts (t > k/2 while only 2k/3 neighbours
may survive). Defaults (delta = 1/3, gamma = 0, sigma = 40, eta = 20): K = 9 complete (k = 8, t = 5), K = 100
k = 68 and t = 35, K = 1,000 k = 236, K = 100,000 k = 388; with delta = 0.1 these are k = 22, 36 and 46.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from fedcore.secagg.config import MIN_CLIENTS, SecureAggregationConfig

_GRAPH_PURPOSE = 0x5EC_A66  # mixed into the graph seed: the permutation's generator is for this and nothing else


@dataclass(frozen=True)
class GraphParameters:
    """A round's graph: K participants, k neighbours each, Shamir threshold t, the most participants that may
    drop after advertising (``max_dropped``) and whether the graph is complete."""

    num_clients: int
    neighbours: int
    threshold: int
    max_dropped: int
    complete: bool

    @property
    def min_survivors(self) -> int:
        """Fewest participants whose masked inputs a round may sum: ``K - max_dropped``."""
        return self.num_clients - self.max_dropped


def _log_comb(n: int, r: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(r + 1) - math.lgamma(n - r + 1)


def hypergeom_upper(population: int, marked: int, draws: int, limit: float) -> int:
    """The smallest c with ``P[X > c] <= limit`` for X the marked items among ``draws`` drawn without replacement
    from ``population`` items of which ``marked`` are marked."""
    lo, hi = max(0, draws - (population - marked)), min(marked, draws)
    base = _log_comb(population, draws)
    tail, c = 0.0, hi
    while c > lo:
        p = math.exp(_log_comb(marked, c) + _log_comb(population - marked, draws - c) - base)
        if tail + p > limit:
            break
        tail += p
        c -= 1
    return c


def _disconnect_log_prob(k: int, num_clients: int, bad: int) -> float:
    if k > bad:
        return -math.inf
    pairs = num_clients * max(num_clients - k - 1, 1) / 2.0
    return math.log(pairs) + _log_comb(bad, k) - _log_comb(num_clients, k)


def _threshold(k: int, corrupt: int, fraction: float) -> int:
    return max((k + corrupt) // 2 + 1, math.ceil(fraction * k - 1e-12), 2)


@functools.lru_cache(maxsize=64)
def choose_parameters(num_clients: int, config: SecureAggregationConfig) -> GraphParameters:
    """k, t and the dropout tolerance for ``num_clients`` participants (the rule is in the module docstring); an
    explicit ``config.neighbours`` fixes k (the complete graph when it is >= K - 1) and t follows it.
    Raises ValueError below :data:`fedcore.secagg.config.MIN_CLIENTS` participants."""
    n = num_clients
    if n < MIN_CLIENTS:
        raise ValueError(f"secure aggregation needs at least {MIN_CLIENTS} participants, got {n}")
    corrupt = math.floor(config.corrupt_fraction * n + 1e-9)
    dropped = math.floor(config.max_dropout * n + 1e-9)
    sec_limit = 2.0 ** -(config.security_bits + 1) / n
    cor_limit = 2.0 ** -config.correctness_bits / n

    def sparse(k: int) -> tuple[int, bool]:
        c = hypergeom_upper(n - 1, corrupt, k, sec_limit)
        t = _threshold(k, c, config.threshold)
        d = hypergeom_upper(n - 1, dropped, k, cor_limit)
        ok = _disconnect_log_prob(k, n, corrupt + dropped) < -(config.security_bits + 1) * math.log(2) and t <= k - d
        return t, ok

    if 0 < config.neighbours < n - 1:
        t, _ = sparse(config.neighbours)
        return GraphParameters(n, config.neighbours, t, dropped, complete=False)
    if config.neighbours == 0:
        for k in range(2, n - 1, 2):
            t, ok = sparse(k)
            if ok:
                return GraphParameters(n, k, t, dropped, complete=False)
    k = n - 1
    t = _threshold(k, min(corrupt, k), config.threshold)
    return GraphParameters(n, k, t, max(0, min(dropped, k - t)), complete=True)


@functools.lru_cache(maxsize=8)
def _graph(given: tuple[str, ...], neighbours: int, seed: int) -> Mapping[str, tuple[str, ...]]:
    ids = tuple(sorted(given))
    n = len(ids)
    if len(set(ids)) != n:
        raise ValueError("participant ids must be distinct")
    if seed < 0:
        raise ValueError(f"the graph seed must be >= 0, got {seed}")
    if neighbours >= n - 1:
        return MappingProxyType({u: tuple(v for v in ids if v != u) for u in ids})
    if neighbours < 2 or neighbours % 2:
        raise ValueError(f"a sparse neighbour graph needs an even degree >= 2, got {neighbours}")
    rng = np.random.default_rng([_GRAPH_PURPOSE, seed])
    ring = [ids[i] for i in rng.permutation(n).tolist()]
    half = neighbours // 2
    out: dict[str, tuple[str, ...]] = {}
    for i, u in enumerate(ring):
        out[u] = tuple(sorted(ring[(i + j) % n] for j in range(-half, half + 1) if j != 0))
    return MappingProxyType(out)


def neighbour_graph(ids: Sequence[str], neighbours: int, seed: int) -> Mapping[str, tuple[str, ...]]:
    """Each participant's neighbours (sorted) in the Harary graph ``H(neighbours, K)`` over the permutation of the
    sorted ``ids`` drawn from ``seed`` (an integer >= 0 the caller derives for this round); the complete graph for
    ``neighbours >= K - 1``. Deterministic in (the set of ids, neighbours, seed) and symmetric; read-only (the
    last few graphs are cached)."""
    return _graph(tuple(ids), neighbours, seed)
