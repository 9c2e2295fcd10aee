"""Partitions of a labelled pool into clients, and each client's train/test split.

Every partitioner is a pure function of the labels (or natural group ids), its parameters and a seed, and
returns one array of pool indices per client (sorted, int64). Same inputs, same output, on every machine.

- :func:`iid_partition`: shuffled, equal sizes.
- :func:`noniid_partition`: non-IID(k) of LINDT/FL-GUARD — sort by label, each client draws from k classes,
  sizes log-normal(0, sigma^2) (sigma = 2), never below ``min_size``.
- :func:`noniid_mixed_partition`: non-IID(mixed) — 50% of clients from 10 classes, 30% from 5, 20% from 2.
- :func:`dirichlet_partition`: per-class proportions ~ Dir(alpha) over clients (HYDRA-FL; NIID-Bench recipe).
- :func:`distribution_types_partition`: DistFL category imbalance — T types, each a disjoint set of classes
  (a pair by default), N/T clients per type; also returns each client's type.
- :func:`natural_partition`: one client per natural group (Shakespeare role, HAR volunteer).

:func:`split_indices` splits one client's samples into train and test with the same distribution.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcore.data.base import DataError
from fedcore.errors import ConfigError
from fedcore.registry import Registry, option_names

IndexList = list[np.ndarray]

# non-IID(mixed): (fraction of clients, classes per client); LINDT/FL-GUARD default for CIFAR-10.
MIXED_GROUPS: tuple[tuple[float, int], ...] = ((0.5, 10), (0.3, 5), (0.2, 2))

_TAG_IID = 0x11D
_TAG_NONIID = 0x401D
_TAG_MIXED = 0x313ED
_TAG_DIRICHLET = 0xD1C
_TAG_TYPES = 0x7E5
_TAG_NATURAL = 0x4A7


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, tag])


def _labels(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"labels must be one-dimensional, got shape {y.shape}")
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0):
        raise DataError("labels must be non-negative integers")
    return y.astype(np.int64, copy=False)


def _num_classes(y: np.ndarray, num_classes: int | None) -> int:
    c = int(y.max()) + 1 if y.size else 0
    if num_classes is None:
        return c
    if num_classes < c:
        raise DataError(f"num_classes={num_classes} but the labels go up to {c - 1}")
    return int(num_classes)


def _check_clients(num_clients: int, available: int, what: str) -> None:
    if num_clients < 1:
        raise DataError(f"{what}: num_clients must be >= 1, got {num_clients}")
    if available < num_clients:
        raise DataError(f"{what}: {available} samples cannot feed {num_clients} clients")


def _sorted(parts: Sequence[np.ndarray]) -> IndexList:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _largest_remainder(total: int, weights: Sequence[float]) -> np.ndarray:
    """Integers proportional to ``weights`` that sum to ``total`` (Hamilton's method, ties to the first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    return np.asarray(counts, dtype=np.int64)


# ---- IID ----

def iid_partition(labels: np.ndarray | Sequence[int], num_clients: int, seed: int) -> IndexList:
    """Shuffle the pool and cut it into ``num_clients`` equal parts (the remainder, < num_clients, is unused)."""
    y = _labels(labels)
    _check_clients(num_clients, len(y), "iid")
    per = len(y) // num_clients
    perm = _rng(seed, _TAG_IID).permutation(len(y))
    return _sorted([perm[i * per : (i + 1) * per] for i in range(num_clients)])


# ---- non-IID(k) and non-IID(mixed) ----

def lognormal_sizes(num_clients: int, total: int, sigma: float, min_size: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Client sizes: ``min_size`` each plus a log-normal(0, sigma^2)-weighted share of the rest of ``total``."""
    if total < num_clients * min_size:
        raise DataError(f"{total} samples cannot give {num_clients} clients at least {min_size} each; "
                        "lower min_size or num_clients, or use more data")
    w = rng.lognormal(0.0, sigma, num_clients) if sigma > 0 else np.ones(num_clients)
    spare = total - num_clients * min_size
    return np.asarray(min_size + np.floor(w / w.sum() * spare), dtype=np.int64)


def _spread(n: int, k: int) -> np.ndarray:
    """n split into k near-equal integer parts, the larger ones first."""
    base = np.full(k, n // k, dtype=np.int64)
    base[: n % k] += 1
    return base


def noniid_partition(labels: np.ndarray | Sequence[int], num_clients: int,
                     classes_per_client: int | Sequence[int] | np.ndarray, seed: int, sigma: float = 2.0,
                     min_size: int = 20, num_classes: int | None = None) -> IndexList:
    """non-IID(k): each client holds samples of k classes only, with log-normal sizes.

    The pool is sorted by label. Client i draws k_i distinct classes at random (among the classes present) and
    a size n_i = min_size + (log-normal(0, sigma^2) share of the rest of the pool), split evenly over its
    classes. A class asked for more samples than it has scales down every client's share of it above the
    guaranteed part, so every client keeps at least ``min_size`` samples; samples nobody asked for stay
    unused (LINDT reports 572 samples per client on average for non-IID(10), of 600).
    ``classes_per_client`` is one k for all or one per client.
    """
    y = _labels(labels)
    c = _num_classes(y, num_classes)
    _check_clients(num_clients, len(y), "non-IID")
    if min_size < 1:
        raise DataError(f"non-IID: min_size must be >= 1, got {min_size}")
    if sigma < 0:
        raise DataError(f"non-IID: sigma must be >= 0, got {sigma}")
    ks = np.broadcast_to(np.asarray(classes_per_client, dtype=np.int64), (num_clients,)).copy()
    present = np.flatnonzero(np.bincount(y, minlength=c) > 0)
    if ks.min() < 1 or ks.max() > len(present):
        raise DataError(f"non-IID: classes per client must be in [1, {len(present)}] (classes present), "
                        f"got {sorted(set(ks.tolist()))}")
    rng = _rng(seed, _TAG_NONIID)
    class_sets = [rng.choice(present, size=int(k), replace=False) for k in ks]
    sizes = lognormal_sizes(num_clients, len(y), sigma, min_size, rng)
    demand = np.zeros((num_clients, c), dtype=np.int64)
    guaranteed = np.zeros((num_clients, c), dtype=np.int64)
    for i, cls in enumerate(class_sets):
        demand[i, cls] = _spread(int(sizes[i]), len(cls))
        guaranteed[i, cls] = _spread(min_size, len(cls))
    supply = np.bincount(y, minlength=c)
    alloc = guaranteed.copy()
    for k in range(c):
        g, extra = int(guaranteed[:, k].sum()), demand[:, k] - guaranteed[:, k]
        if g > supply[k]:
            raise DataError(f"non-IID: class {k} has {supply[k]} samples but its clients need at least {g}; "
                            "lower min_size or num_clients")
        want = int(extra.sum())
        if want:
            scale = min(1.0, (supply[k] - g) / want)
            alloc[:, k] += np.floor(extra * scale).astype(np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k in range(c):
        pool = rng.permutation(np.flatnonzero(y == k))
        cuts = np.cumsum(alloc[:, k])
        for j in np.flatnonzero(alloc[:, k]):
            i = int(j)
            parts[i].append(pool[cuts[i] - alloc[i, k] : cuts[i]])
    return _sorted([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts])


def mixed_class_counts(num_clients: int, seed: int,
                       groups: Sequence[tuple[float, int]] = MIXED_GROUPS,
                       num_classes: int | None = None) -> np.ndarray:
    """Classes per client for non-IID(mixed): group sizes by largest remainder, assigned in a seeded order.

    With fewer than k classes in the data, a group's k is capped at ``num_classes``.
    """
    if num_clients < 1:
        raise DataError(f"non-IID(mixed): num_clients must be >= 1, got {num_clients}")
    fracs = [float(f) for f, _ in groups]
    if not groups or min(fracs) < 0 or sum(fracs) <= 0:
        raise DataError(f"non-IID(mixed): bad groups {list(groups)}")
    counts = _largest_remainder(num_clients, fracs)
    ks = np.concatenate([np.full(n, int(k), dtype=np.int64) for n, (_, k) in zip(counts, groups, strict=True)])
    if num_classes is not None:
        ks = np.minimum(ks, num_classes)
    return _rng(seed, _TAG_MIXED).permutation(ks)


def noniid_mixed_partition(labels: np.ndarray | Sequence[int], num_clients: int, seed: int,
                           groups: Sequence[tuple[float, int]] = MIXED_GROUPS, sigma: float = 2.0,
                           min_size: int = 20, num_classes: int | None = None) -> IndexList:
    """non-IID(mixed): :func:`noniid_partition` with k from :func:`mixed_class_counts`."""
    y = _labels(labels)
    present = int((np.bincount(y) > 0).sum()) if y.size else 0
    ks = mixed_class_counts(num_clients, seed, groups, num_classes=present)
    return noniid_partition(y, num_clients, ks, seed, sigma=sigma, min_size=min_size, num_classes=num_classes)


# ---- Dirichlet ----

def dirichlet_partition(labels: np.ndarray | Sequence[int], num_clients: int, alpha: float, seed: int,
                        min_size: int = 10, balance: bool = True, max_tries: int = 1000,
                        num_classes: int | None = None) -> IndexList:
    """Per class, proportions p ~ Dir(alpha·1_N) over clients (HYDRA-FL; alpha = 0.1 is highly skewed).

    NIID-Bench recipe: with ``balance`` a client already holding N/num_clients samples gets no more; the draw is
    repeated until every client has at least ``min_size`` samples (at most ``max_tries`` times).
    """
    y = _labels(labels)
    c = _num_classes(y, num_classes)
    _check_clients(num_clients, len(y), "dirichlet")
    if not alpha > 0:
        raise DataError(f"dirichlet: alpha must be > 0, got {alpha}")
    if num_clients * min_size > len(y):
        raise DataError(f"dirichlet: {len(y)} samples cannot give {num_clients} clients {min_size} each")
    rng = _rng(seed, _TAG_DIRICHLET)
    cap = len(y) / num_clients
    by_class = [np.flatnonzero(y == k) for k in range(c)]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        held = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            if not len(idx):
                continue
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            if balance:
                q = p * (held < cap)
                p = q if q.sum() > 0 else p
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].append(chunk)
                held[i] += len(chunk)
        if held.min() >= min_size:
            return _sorted([np.concatenate(p) for p in parts])
    raise DataError(f"dirichlet: no draw in {max_tries} tries gave every client >= {min_size} samples; "
                    "raise alpha or lower min_size/num_clients")


# ---- DistFL distribution types ----

def type_classes(num_types: int, classes_per_type: int = 2, num_classes: int = 10,
                 seed: int | None = None) -> list[np.ndarray]:
    """The disjoint class sets of the types: consecutive blocks (0,1), (2,3), ..., or shuffled with a seed."""
    if num_types < 1 or classes_per_type < 1:
        raise DataError("distribution types: need num_types >= 1 and classes_per_type >= 1")
    if num_types * classes_per_type > num_classes:
        raise DataError(f"distribution types: {num_types} disjoint types of {classes_per_type} classes need "
                        f"{num_types * classes_per_type} classes, the data has {num_classes}")
    order = np.arange(num_classes) if seed is None else _rng(seed, _TAG_TYPES + 1).permutation(num_classes)
    return [np.sort(order[t * classes_per_type : (t + 1) * classes_per_type]) for t in range(num_types)]


def client_types(num_clients: int, num_types: int) -> np.ndarray:
    """Type of each client: contiguous blocks of N/T clients (DistFL Table 1: clients 1-20 are Type1, ...)."""
    return (np.arange(num_clients, dtype=np.int64) * num_types) // num_clients


def distribution_types_partition(labels: np.ndarray | Sequence[int], num_clients: int, num_types: int,
                                 seed: int, classes_per_type: int = 2, samples_per_client: int | None = None,
                                 shuffle_classes: bool = False,
                                 num_classes: int | None = None) -> tuple[IndexList, np.ndarray]:
    """DistFL category imbalance: T types of disjoint class sets, N/T clients per type; returns (parts, types).

    Within a type each class's samples are shuffled and dealt evenly to the type's clients, so every client of
    a type has the same class mix. ``samples_per_client`` caps a client's size (DistFL: 4000 samples over 100
    clients, i.e. 40); by default the type's whole pool is used.
    """
    y = _labels(labels)
    c = _num_classes(y, num_classes)
    _check_clients(num_clients, len(y), "distribution types")
    if num_clients < num_types:
        raise DataError(f"distribution types: {num_clients} clients cannot cover {num_types} types")
    sets = type_classes(num_types, classes_per_type, c, seed if shuffle_classes else None)
    types = client_types(num_clients, num_types)
    rng = _rng(seed, _TAG_TYPES)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for t, cls in enumerate(sets):
        members = np.flatnonzero(types == t)
        per_class = None if samples_per_client is None else _spread(samples_per_client, len(cls))
        for j, k in enumerate(cls):
            idx = rng.permutation(np.flatnonzero(y == k))
            if per_class is not None:
                idx = idx[: per_class[j] * len(members)]
            for m, chunk in zip(members, np.array_split(idx, len(members)), strict=True):
                parts[m].append(chunk)
    out = _sorted([np.concatenate(p) for p in parts])
    if min(len(p) for p in out) == 0:
        raise DataError("distribution types: some client got no samples; use fewer clients or more data")
    return out, types


# ---- natural ----

def natural_partition(groups: np.ndarray | Sequence[int], seed: int, num_clients: int | None = None,
                      min_size: int = 1) -> tuple[IndexList, np.ndarray]:
    """One client per natural group (sorted group ids); returns (parts, group id of each client).

    Groups with fewer than ``min_size`` samples are left out. With ``num_clients`` a seeded random subset of
    the remaining groups is kept (FL-GUARD: roles with >= 10,000 samples, then 100 sampled), in id order.
    """
    g = np.asarray(groups)
    if g.ndim != 1:
        raise DataError(f"groups must be one-dimensional, got shape {g.shape}")
    ids, inverse, counts = np.unique(g, return_inverse=True, return_counts=True)
    eligible = np.flatnonzero(counts >= min_size)
    if num_clients is not None:
        if num_clients < 1 or num_clients > len(eligible):
            raise DataError(f"natural partition: asked for {num_clients} clients, {len(eligible)} groups have "
                            f">= {min_size} samples")
        if num_clients < len(eligible):
            eligible = np.sort(_rng(seed, _TAG_NATURAL).choice(eligible, num_clients, replace=False))
    if not len(eligible):
        raise DataError(f"natural partition: no group has >= {min_size} samples")
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)])
    parts = [order[starts[j] : starts[j + 1]] for j in eligible]
    return _sorted(parts), ids[eligible]


# ---- dispatch by name ----

@dataclass(frozen=True, eq=False)
class Partition:
    """Result of :func:`make_partition`: per-client pool indices plus what describes each client."""

    indices: tuple[np.ndarray, ...]
    # distribution type of each client ("types" partition)
    types: np.ndarray | None = None
    # natural group id of each client ("natural" partition)
    groups: np.ndarray | None = None
    # classes each client was asked to draw from (non-IID partitions)
    classes_per_client: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return len(self.indices)


PARTITIONS = ("iid", "noniid-<k>", "noniid-mixed", "dirichlet", "types", "natural")
_NATURAL_NAMES = {"natural", "role", "by-role", "volunteer", "by-volunteer"}


def is_natural(name: str) -> bool:
    return name.lower().replace("_", "-") in _NATURAL_NAMES


@dataclass(frozen=True, eq=False)
class PartitionParams:
    """The parameters a partition kind may read (each reads its own; see :func:`make_partition`)."""

    groups: np.ndarray | None = None
    classes_per_client: int | None = None
    alpha: float = 0.1
    sigma: float = 2.0
    min_size: int | None = None
    num_types: int = 5
    classes_per_type: int = 2
    samples_per_client: int | None = None
    mixed_groups: Sequence[tuple[float, int]] = MIXED_GROUPS
    num_classes: int | None = None


# A partition kind: (name as given, labels, number of clients or None for the default, seed, the name's argument,
# parameters) -> Partition.
PartitionFactory = Callable[[str, np.ndarray, int | None, int, str, PartitionParams], Partition]
# Clients of every partition but the natural one when num_clients is not given.
DEFAULT_CLIENTS = 100


def _clients(num_clients: int | None) -> int:
    return DEFAULT_CLIENTS if num_clients is None else num_clients


def _iid(name: str, labels: np.ndarray, num_clients: int | None, seed: int, arg: str,
         p: PartitionParams) -> Partition:
    n = _clients(num_clients)
    return Partition(tuple(iid_partition(labels, n, seed)))


def _noniid_mixed(name: str, labels: np.ndarray, num_clients: int | None, seed: int, arg: str,
                  p: PartitionParams) -> Partition:
    n = _clients(num_clients)
    y = _labels(labels)
    present = int((np.bincount(y) > 0).sum()) if y.size else 0
    ks = mixed_class_counts(n, seed, p.mixed_groups, num_classes=present)
    parts = noniid_partition(y, n, ks, seed, sigma=p.sigma, min_size=_or(p.min_size, 20), num_classes=p.num_classes)
    return Partition(tuple(parts), classes_per_client=ks)


def _noniid(name: str, labels: np.ndarray, num_clients: int | None, seed: int, arg: str,
            p: PartitionParams) -> Partition:
    n = _clients(num_clients)
    k = int(arg) if arg else p.classes_per_client
    if k is None:
        raise DataError(f"partition {name!r}: give the classes per client as noniid-<k> or classes_per_client")
    ks = np.full(n, k, dtype=np.int64)
    parts = noniid_partition(labels, n, k, seed, sigma=p.sigma, min_size=_or(p.min_size, 20),
                             num_classes=p.num_classes)
    return Partition(tuple(parts), classes_per_client=ks)


def _dirichlet(name: str, labels: np.ndarray, num_clients: int | None, seed: int, arg: str,
               p: PartitionParams) -> Partition:
    n = _clients(num_clients)
    a = float(arg) if arg else p.alpha
    return Partition(tuple(dirichlet_partition(labels, n, a, seed, min_size=_or(p.min_size, 10),
                                               num_classes=p.num_classes)))


def _types(name: str, labels: np.ndarray, num_clients: int | None, seed: int, arg: str,
           p: PartitionParams) -> Partition:
    n = _clients(num_clients)
    parts, types = distribution_types_partition(labels, n, p.num_types, seed, classes_per_type=p.classes_per_type,
                                                samples_per_client=p.samples_per_client, num_classes=p.num_classes)
    return Partition(tuple(parts), types=types)


def _natural(name: str, labels: np.ndarray, num_clients: int | None, seed: int, arg: str,
             p: PartitionParams) -> Partition:
    if p.groups is None:
        raise DataError(f"partition {name!r}: this dataset has no natural clients (no group ids)")
    parts, ids = natural_partition(p.groups, seed, num_clients, min_size=_or(p.min_size, 1))
    return Partition(tuple(parts), groups=ids)


# ---- each kind's options (in data.options beside the dataset's own; see fedcore.data.loaders) ----

def _positive(name: str, v: int | None) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ConfigError(name, f"must be a positive integer, got {v!r}")


def _sigma(sigma: float) -> None:
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ConfigError("sigma", f"must be >= 0, got {sigma}")


@dataclass(frozen=True)
class NonIidOptions:
    """``noniid``: each client draws from k classes."""

    # Classes each client draws from (the k of noniid-<k>, which wins when both are given).
    classes_per_client: int | None = None
    # sigma of the log-normal(0, sigma^2) client sizes.
    sigma: float = 2.0
    # Fewest samples a client gets (unset: 23, two batches of 10 after the 90/10 split).
    min_size: int | None = None

    def validate(self) -> NonIidOptions:
        _positive("classes_per_client", self.classes_per_client)
        _sigma(self.sigma)
        _positive("min_size", self.min_size)
        return self


@dataclass(frozen=True)
class NonIidMixedOptions:
    """``noniid-mixed``: groups of clients with different numbers of classes."""

    # sigma of the log-normal(0, sigma^2) client sizes.
    sigma: float = 2.0
    # Fewest samples a client gets (unset: 23, two batches of 10 after the 90/10 split).
    min_size: int | None = None
    # (fraction of clients, classes per client) per group.
    mixed_groups: tuple[tuple[float, int], ...] = MIXED_GROUPS

    def validate(self) -> NonIidMixedOptions:
        _sigma(self.sigma)
        _positive("min_size", self.min_size)
        return self


@dataclass(frozen=True)
class DirichletOptions:
    """``dirichlet``: per-class shares ~ Dir(alpha)."""

    # Concentration (0.1: highly skewed); the alpha of dirichlet-<alpha> wins when both are given.
    alpha: float = 0.1
    # Fewest samples a client gets (unset: 10).
    min_size: int | None = None

    def validate(self) -> DirichletOptions:
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError("alpha", f"must be > 0, got {self.alpha}")
        _positive("min_size", self.min_size)
        return self


@dataclass(frozen=True)
class TypesOptions:
    """``types``: DistFL distribution types."""

    # Number of types (disjoint class sets); N/T clients each.
    num_types: int = 5
    # Classes per type.
    classes_per_type: int = 2
    # Cap on a client's samples (unset: the type's whole pool is dealt out).
    samples_per_client: int | None = None

    def validate(self) -> TypesOptions:
        _positive("num_types", self.num_types)
        _positive("classes_per_type", self.classes_per_type)
        _positive("samples_per_client", self.samples_per_client)
        return self


@dataclass(frozen=True)
class NaturalOptions:
    """``natural``: one client per natural group."""

    # Groups with fewer samples are left out (unset: 2).
    min_size: int | None = None

    def validate(self) -> NaturalOptions:
        _positive("min_size", self.min_size)
        return self


# The partition kinds by the name parse_partition reads a partition name as, each with its options.
PARTITION_KINDS: Registry[PartitionFactory] = Registry("partition", DataError)
PARTITION_KINDS.add("iid", _iid, summary="shuffled, equal sizes")
PARTITION_KINDS.add("noniid", _noniid, options=NonIidOptions,
                    summary="each client draws from k classes (noniid-k), log-normal sizes")
PARTITION_KINDS.add("noniid-mixed", _noniid_mixed, options=NonIidMixedOptions,
                    summary="50% of clients from 10 classes, 30% from 5, 20% from 2")
PARTITION_KINDS.add("dirichlet", _dirichlet, options=DirichletOptions,
                    summary="per-class shares over the clients ~ Dir(alpha) (dirichlet-alpha)")
PARTITION_KINDS.add("types", _types, options=TypesOptions,
                    summary="DistFL distribution types: num_types disjoint sets of classes")
PARTITION_KINDS.add("natural", _natural, options=NaturalOptions,
                    summary="one client per natural group (Shakespeare role, HAR volunteer)")

# Every option some partition kind declares: in data.options these belong to the partition, the rest to the
# dataset (num_clients, test_fraction, split, max_samples, pool, path, ...).
PARTITION_OPTION_NAMES = frozenset(option for kind in PARTITION_KINDS.names()
                                   for option in option_names(PARTITION_KINDS, kind))


class PartitionOptionError(ConfigError, DataError):
    """A partition option the chosen kind refuses: a :class:`ConfigError` naming the field
    (``data.options.alpha``) that is also a :class:`DataError` (what a dataset loader raises)."""


def parse_partition_options(partition: str, options: Mapping[str, Any] | None, path: str = "data.options") -> Any:
    """The options of partition ``partition`` (a name as :func:`parse_partition` reads it) among ``options`` (a
    whole ``data.options`` table: the keys no partition declares are the dataset's and are skipped), decoded and
    validated by the kind's options dataclass; an option the kind does not have is refused naming it
    (:class:`PartitionOptionError` naming ``path.<field>``). ``auto`` takes the natural partition's options."""
    kind, _ = parse_partition(partition)
    if kind == "auto":
        kind = "natural"
    given = {k: v for k, v in dict(options or {}).items() if k in PARTITION_OPTION_NAMES}
    try:
        if PARTITION_KINDS.plugin(kind).options_type() is None:
            if given:
                key = next(iter(given))
                raise ConfigError(f"{path}.{key}", f"partition {kind!r} has no option {key!r}; it takes none "
                                                   "(besides the dataset's)")
            return None
        return PARTITION_KINDS.parse_options(kind, given, path)
    except PartitionOptionError:
        raise
    except ConfigError as e:
        raise PartitionOptionError(e.field, str(e)[len(e.field) + 2:]) from None


def make_partition(name: str, labels: np.ndarray, num_clients: int | None, seed: int, *,
                   groups: np.ndarray | None = None, classes_per_client: int | None = None,
                   alpha: float = 0.1, sigma: float = 2.0, min_size: int | None = None,
                   num_types: int = 5, classes_per_type: int = 2, samples_per_client: int | None = None,
                   mixed_groups: Sequence[tuple[float, int]] = MIXED_GROUPS,
                   num_classes: int | None = None) -> Partition:
    """Partition by name: ``iid``, ``noniid-<k>`` (or ``noniid`` with ``classes_per_client``), ``noniid-mixed``,
    ``dirichlet`` (or ``dirichlet-<alpha>``), ``types`` (DistFL distribution types), ``natural``.

    ``min_size`` defaults to 20 for non-IID (two batches of 10), 10 for Dirichlet and 1 for natural.
    """
    kind, arg = parse_partition(name)
    if kind not in PARTITION_KINDS:  # "auto" is resolved against the pool before partitioning
        raise DataError(f"partition {name!r}: resolve it against the dataset first")
    params = PartitionParams(groups, classes_per_client, alpha, sigma, min_size, num_types, classes_per_type,
                             samples_per_client, mixed_groups, num_classes)
    return PARTITION_KINDS.get(kind)(name, labels, num_clients, seed, arg, params)


def parse_partition(name: str) -> tuple[str, str]:
    """``(kind, argument)`` of a partition name: kind is ``iid``, ``noniid-mixed``, ``noniid`` (argument: the
    classes per client, may be empty), ``dirichlet`` (argument: alpha, may be empty), ``types`` or ``natural``;
    :class:`DataError` for a name no partition answers to (checked before any data is loaded)."""
    key = name.lower().replace("_", "-")
    if key in ("iid", "auto"):
        return key, ""
    if key in ("noniid-mixed", "mixed", "non-iid-mixed"):
        return "noniid-mixed", ""
    m = re.fullmatch(r"non-?iid(?:-(\d+))?", key)
    if m:
        return "noniid", m.group(1) or ""
    m = re.fullmatch(r"dirichlet(?:-([0-9.eE+-]+))?", key)
    if m:
        try:
            if m.group(1) and not float(m.group(1)) > 0:
                raise ValueError
        except ValueError:
            raise DataError(f"partition {name!r}: the Dirichlet alpha must be a number > 0") from None
        return "dirichlet", m.group(1) or ""
    if key in ("types", "distribution-types", "category-imbalance"):
        return "types", ""
    if is_natural(key):
        return "natural", ""
    raise DataError(f"unknown partition {name!r}; known: {', '.join(PARTITIONS)}")


def _or(v: int | None, default: int) -> int:
    return default if v is None else int(v)


# ---- per-client train/test split ----

SPLITS = ("stratified", "random", "contiguous")


def split_indices(labels: np.ndarray, test_fraction: float, rng: np.random.Generator,
                  method: str = "stratified", gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Positions (into ``labels``) of the train and test samples of one client.

    - ``stratified``: per class, ``test_fraction`` of its samples go to test (largest remainder over classes,
      ties broken at random; a class never gives away its last sample), so train and test share the
      class distribution.
    - ``random``: a shuffled cut, as :func:`fedcore.data.base.split_train_test`.
    - ``contiguous``: the last part is test and ``gap`` samples before it are dropped (overlapping text
      windows; LEAF's Shakespeare split), shrinking the gap when the client is small.
    A client with at least two samples always gets at least one test sample.
    """
    y = np.asarray(labels)
    n = len(y)
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n_test = min(n - 1, max(1, round(n * test_fraction))) if n > 1 and test_fraction > 0 else 0
    if method == "random":
        perm = rng.permutation(n)
        return np.sort(perm[n_test:]), np.sort(perm[:n_test])
    if method == "contiguous":
        g = max(0, min(gap, n - n_test - 1))
        return np.arange(n - n_test - g), np.arange(n - n_test, n)
    if method != "stratified":
        raise DataError(f"unknown split {method!r}; known: {', '.join(SPLITS)}")
    classes, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    exact = counts * (n_test / n) if n else counts * 0.0
    quota = np.floor(exact).astype(np.int64)  # <= counts - 1 since test_fraction < 1
    short = n_test - int(quota.sum())
    # Largest fractional part first, random tie-break; a class keeps its last sample while others can give.
    order = np.lexsort((rng.random(len(classes)), -(exact - quota)))
    for limit in (counts - 1, counts):
        for j in order:
            if short == 0:
                break
            if quota[j] < limit[j]:
                quota[j] += 1
                short -= 1
    test_mask = np.zeros(n, dtype=bool)
    for j in range(len(classes)):
        members = rng.permutation(np.flatnonzero(inverse == j))
        test_mask[members[: quota[j]]] = True
    return np.flatnonzero(~test_mask), np.flatnonzero(test_mask)
