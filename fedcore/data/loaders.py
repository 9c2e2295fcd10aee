"""Federated datasets over a labelled pool: pool -> partition -> one client's train/test split.

A dataset module builds a :class:`Pool` (labels of every sample, a function that turns pool indices into
model inputs, optional natural group ids) and registers it with :func:`federated_dataset`. That registers a
loader with :func:`fedcore.data.register_dataset`, so ``load_client_data(name, i, seed, options)`` returns
client ``i``'s :class:`ClientData`. The pool, the partition and the raw arrays are cached in-process, so many
virtual clients in one process share one copy; a client's tensors are built on demand.

Options every such dataset takes (besides its own, e.g. ``data_dir``):

- ``partition``: ``auto`` (``natural`` when the data has client ids, else ``iid``), ``iid``, ``noniid-<k>``,
  ``noniid`` + ``classes_per_client``, ``noniid-mixed``,
  ``dirichlet`` (+ ``alpha``, default 0.1) or ``dirichlet-<alpha>``, ``types`` (+ ``num_types``, default 5,
  ``classes_per_type``, default 2, ``samples_per_client``), ``natural`` (by role / by volunteer).
- ``num_clients``: default 100 (natural: every group, or a seeded sample of that many groups).
- ``sigma`` (log-normal sizes, default 2.0), ``min_size`` (default 23 = two batches of 10 after the 90/10 split
  for non-IID, 10 for Dirichlet, 2 for natural), ``mixed_groups`` (default ((0.5, 10), (0.3, 5), (0.2, 2))).
  These belong to the partition kind that reads them: each kind declares its own in an options dataclass
  (:data:`fedcore.data.partition.PARTITION_KINDS`), which checks them, naming the field (``data.options.alpha``);
  an option the chosen kind does not have is refused.
- ``test_fraction`` (default 0.1) and ``split`` (``stratified`` by default; natural partitions of sequence data
  default to the dataset's own, e.g. ``contiguous`` for Shakespeare).
- ``max_samples``: draw this many samples of the pool at random (seeded) before partitioning (for speed);
  ``max_client_samples``: cap each client after partitioning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from fedcore.data.base import (
    DATASETS,
    ClientData,
    DataError,
    SampleDeclaration,
    declare_sample,
    keyword_defaults,
    register_dataset,
)
from fedcore.data.partition import (
    MIXED_GROUPS,
    SPLITS,
    Partition,
    is_natural,
    make_partition,
    parse_partition,
    parse_partition_options,
    split_indices,
)
from fedcore.data.paths import ENV_VAR

_TAG_SUBSET = 0x5B5E7
_TAG_CLIENT = 0xC11E


@dataclass(frozen=True, eq=False)
class Pool:
    """Every sample a federated dataset can hand out, by integer index.

    ``features(idx)`` returns the model inputs of those samples as one tensor (float32 images/signals, int64
    token windows). Identity-hashed so that caches can key on it; pools themselves are cached.
    """

    name: str
    labels: np.ndarray
    num_classes: int
    features: Callable[[np.ndarray], torch.Tensor]
    groups: np.ndarray | None = None
    class_names: tuple[str, ...] = ()
    # label used for a client's natural group in summaries ("role", "volunteer")
    group_kind: str = "group"
    group_names: Mapping[int, str] = field(default_factory=dict)
    # split used for natural partitions (sequence data whose windows overlap use "contiguous")
    natural_split: str = "stratified"
    split_gap: int = 0

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class ShardOptions:
    """The partition/split options shared by every pooled dataset (see the module docstring); the fields that
    belong to one partition kind are declared (and validated) by its options dataclass in
    :data:`fedcore.data.partition.PARTITION_KINDS`, which :func:`split_options` checks them through."""

    partition: str = "iid"
    num_clients: int | None = None
    classes_per_client: int | None = None
    alpha: float = 0.1
    sigma: float = 2.0
    min_size: int | None = None
    num_types: int = 5
    classes_per_type: int = 2
    samples_per_client: int | None = None
    mixed_groups: tuple[tuple[float, int], ...] = MIXED_GROUPS
    test_fraction: float = 0.1
    split: str | None = None
    max_samples: int | None = None
    max_client_samples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.partition, str):
            raise DataError(f"option partition must be a name, got {self.partition!r}")

        def pos(name: str, v: int | None) -> None:
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
                raise DataError(f"option {name} must be a positive integer, got {v!r}")

        # the partition's own options (alpha, sigma, min_size, ...) are checked by its options dataclass
        # (fedcore.data.partition, parse_partition_options) in split_options
        pos("num_clients", self.num_clients)
        pos("max_samples", self.max_samples)
        pos("max_client_samples", self.max_client_samples)
        if not 0.0 <= float(self.test_fraction) < 1.0:
            raise DataError(f"option test_fraction must be in [0, 1), got {self.test_fraction}")
        if self.split is not None and self.split not in SPLITS:
            raise DataError(f"option split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        groups = tuple((float(f), int(k)) for f, k in self.mixed_groups)
        object.__setattr__(self, "mixed_groups", groups)

    def effective_min_size(self) -> int | None:
        if self.min_size is not None:
            return self.min_size
        key = self.partition.lower()
        if key.startswith(("noniid", "non-iid", "mixed")):
            # two training batches of 10 after the test split
            return math.ceil(20 / (1.0 - self.test_fraction))
        if is_natural(key):
            return 2
        return None


SHARD_OPTION_NAMES = frozenset(f.name for f in fields(ShardOptions))

PoolBuilder = Callable[..., Pool]


@dataclass(frozen=True)
class _Entry:
    builder: PoolBuilder
    dataset_options: frozenset[str]
    default_partition: str


_POOLS: dict[str, _Entry] = {}


def federated_dataset(name: str, dataset_options: Collection[str], default_partition: str = "iid",
                      remote_options: Collection[str] = (),
                      sample: SampleDeclaration | None = None) -> Callable[[PoolBuilder], PoolBuilder]:
    """Register ``builder(seed=..., max_samples=..., **dataset_options) -> Pool`` as dataset ``name``.

    ``remote_options``: the dataset options a server may announce (plus every partition option); paths,
    downloads and file formats are left out so that only the client's own configuration sets them. ``sample``:
    what one sample is (:func:`fedcore.data.sample_shape`; a function is given the options with the builder's
    keyword defaults filled in).

    The builder receives ``max_samples`` so that it can avoid decoding what will not be used (CIFAR JPEGs);
    a builder that ignores it gets the pool subsampled afterwards by :func:`subsample_pool`.
    """

    def deco(builder: PoolBuilder) -> PoolBuilder:
        def loader(client_index: int, seed: int, **options: Any) -> ClientData:
            pool, opts = resolve(name, seed, options)
            return client_data(pool, client_index, seed, opts)

        loader.__doc__ = builder.__doc__
        loader.__name__ = f"{name}_shard"
        unknown = set(remote_options) - set(dataset_options)
        if unknown:
            raise ValueError(f"dataset {name!r}: remote options {sorted(unknown)} are not dataset options")
        register_dataset(name, frozenset(remote_options) | SHARD_OPTION_NAMES,
                         check=functools.partial(check_shard_options, name))(loader)
        if sample is not None:
            declare_sample(name, sample, keyword_defaults(builder))
        _POOLS[name] = _Entry(builder, frozenset(dataset_options), default_partition)
        return builder

    return deco


def pooled_datasets() -> list[str]:
    """Every registered dataset built from a pool (the declared ones imported first)."""
    for name in DATASETS.names():
        DATASETS.get(name)
    return sorted(_POOLS)


def _pool(name: str) -> _Entry:
    """The pool entry of dataset ``name`` (a declared dataset's module imported first: it registers the pool)."""
    if name not in _POOLS and name in DATASETS:
        DATASETS.get(name)
    try:
        return _POOLS[name]
    except KeyError:
        raise DataError(f"unknown pooled dataset {name!r}; known: {', '.join(pooled_datasets())}") from None


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def split_options(name: str, options: Mapping[str, Any] | None) -> tuple[dict[str, Any], ShardOptions]:
    """Separate a dataset's own options from the shared partition options; unknown names are errors."""
    entry = _pool(name)
    own: dict[str, Any] = {}
    shard: dict[str, Any] = {"partition": entry.default_partition}
    for k, v in dict(options or {}).items():
        if k in entry.dataset_options:
            own[k] = _freeze(v)
        elif k in SHARD_OPTION_NAMES:
            shard[k] = _freeze(v)
        else:
            known = sorted(entry.dataset_options | SHARD_OPTION_NAMES)
            raise DataError(f"dataset {name!r}: unknown option {k!r}; known: {', '.join(known)}")
    if isinstance(shard["partition"], str):  # the partition's options, validated by its kind (naming the field)
        parse_partition_options(shard["partition"], shard)
    try:
        return own, ShardOptions(**shard)
    except (TypeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"dataset {name!r}: bad options {shard}: {e}") from None


def check_shard_options(name: str, options: Mapping[str, Any] | None) -> int | None:
    """Check the options of pooled dataset ``name`` without loading any data (:class:`DataError` naming the
    option); the number of clients the data will have when the options fix it (None: the data decides)."""
    _, opts = split_options(name, options)
    kind, arg = parse_partition(opts.partition)
    if kind == "noniid" and not arg and opts.classes_per_client is None:
        raise DataError(f"partition {opts.partition!r}: give the classes per client as noniid-<k> or "
                        f"classes_per_client")
    if kind in ("natural", "auto"):
        return opts.num_clients
    return 100 if opts.num_clients is None else opts.num_clients


def resolve(name: str, seed: int, options: Mapping[str, Any] | None) -> tuple[Pool, ShardOptions]:
    """The (cached) pool and the parsed shard options of ``name`` under ``options``."""
    own, opts = split_options(name, options)
    with _POOL_LOCK:  # threads of virtual clients must not decode the same data twice
        # the environment's data dir is part of the key: changing it must not serve the old data
        env = os.environ.get(ENV_VAR, "")
        # the seed only picks the max_samples subset: without one, every seed shares one pool
        pool_seed = int(seed) if opts.max_samples is not None else 0
        pool = _cached_pool(name, tuple(sorted(own.items())), pool_seed, opts.max_samples, env)
    if opts.partition == "auto":
        opts = dataclasses.replace(opts, partition="natural" if pool.groups is not None else "iid")
    return pool, opts


_POOL_LOCK = threading.RLock()


@functools.lru_cache(maxsize=16)
def _cached_pool(name: str, own: tuple[tuple[str, Any], ...], seed: int, max_samples: int | None,
                 env_data_dir: str = "") -> Pool:
    entry = _pool(name)
    try:
        pool = entry.builder(seed=seed, max_samples=max_samples, **dict(own))
    except TypeError as e:
        raise DataError(f"dataset {name!r} rejected its options {dict(own)}: {e}") from None
    if max_samples is not None and len(pool) > max_samples:
        pool = subsample_pool(pool, max_samples, seed)
    return pool


def subsample_positions(n: int, max_samples: int | None, seed: int) -> np.ndarray:
    """Sorted positions of a seeded random subset of ``max_samples`` out of ``n`` (all when fewer)."""
    if max_samples is None or max_samples >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, _TAG_SUBSET])
    return np.sort(rng.choice(n, size=max_samples, replace=False)).astype(np.int64)


def subsample_pool(pool: Pool, max_samples: int, seed: int) -> Pool:
    """A view of ``pool`` restricted to a seeded random subset of ``max_samples`` samples."""
    keep = subsample_positions(len(pool), max_samples, seed)
    base = pool.features

    def features(idx: np.ndarray) -> torch.Tensor:
        return base(keep[np.asarray(idx, dtype=np.int64)])

    groups = None if pool.groups is None else pool.groups[keep]
    return Pool(pool.name, _readonly(pool.labels[keep]), pool.num_classes, features, groups,
                pool.class_names, pool.group_kind, pool.group_names, pool.natural_split, pool.split_gap)


def partition_of(pool: Pool, opts: ShardOptions, seed: int) -> Partition:
    """The partition of ``pool`` under ``opts`` (cached per pool, options and seed)."""
    with _POOL_LOCK:
        return _cached_partition(pool, opts, int(seed))


@functools.lru_cache(maxsize=32)
def _cached_partition(pool: Pool, opts: ShardOptions, seed: int) -> Partition:
    natural = is_natural(opts.partition)
    return make_partition(
        opts.partition, pool.labels, opts.num_clients, seed,
        groups=pool.groups if natural else None, classes_per_client=opts.classes_per_client, alpha=opts.alpha,
        sigma=opts.sigma, min_size=opts.effective_min_size(), num_types=opts.num_types,
        classes_per_type=opts.classes_per_type, samples_per_client=opts.samples_per_client,
        mixed_groups=opts.mixed_groups, num_classes=pool.num_classes)


def client_indices(pool: Pool, client_index: int, seed: int, opts: ShardOptions) -> tuple[np.ndarray, np.ndarray]:
    """Pool indices of client ``client_index``'s train and test samples (no features are built)."""
    part = partition_of(pool, opts, seed)
    if not 0 <= client_index < part.num_clients:
        raise DataError(f"{pool.name}: client index {client_index} out of range; the partition "
                        f"{opts.partition!r} has {part.num_clients} clients (0..{part.num_clients - 1})")
    idx = part.indices[client_index]
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, client_index, _TAG_CLIENT])
    method = opts.split or (pool.natural_split if is_natural(opts.partition) else "stratified")
    if opts.max_client_samples is not None and len(idx) > opts.max_client_samples:
        if method == "contiguous":
            idx = idx[: opts.max_client_samples]
        else:
            idx = np.sort(rng.choice(idx, size=opts.max_client_samples, replace=False))
    train, test = split_indices(pool.labels[idx], opts.test_fraction, rng, method, gap=pool.split_gap)
    # Seeded shuffled order (as split_train_test gives): a prefix of x_train is a random batch, not one class.
    return idx[rng.permutation(train)], idx[rng.permutation(test)]


def client_data(pool: Pool, client_index: int, seed: int, opts: ShardOptions) -> ClientData:
    train, test = client_indices(pool, client_index, seed, opts)
    y = pool.labels
    return ClientData(pool.features(train), torch.from_numpy(y[train].astype(np.int64)),
                      pool.features(test), torch.from_numpy(y[test].astype(np.int64)), pool.num_classes)


# ---- summaries without building features ----

@dataclass(frozen=True)
class ClientSummary:
    index: int
    num_train: int
    num_test: int
    # samples per class, train and test together
    histogram: tuple[int, ...]
    # distribution type ("types" partition), natural group name, or "" when neither applies
    tag: str = ""

    @property
    def num_samples(self) -> int:
        return self.num_train + self.num_test

    @property
    def num_classes_held(self) -> int:
        return sum(1 for c in self.histogram if c > 0)


@dataclass(frozen=True)
class PartitionSummary:
    dataset: str
    partition: str
    num_classes: int
    pool_size: int
    clients: tuple[ClientSummary, ...]
    class_names: tuple[str, ...] = ()
    tag_kind: str = ""

    @property
    def total_samples(self) -> int:
        return sum(c.num_samples for c in self.clients)


def describe_partition(dataset: str, seed: int, options: Mapping[str, Any] | None = None) -> PartitionSummary:
    """Per-client sizes and class histograms of a pooled dataset, from labels only."""
    pool, opts = resolve(dataset, seed, options)
    part = partition_of(pool, opts, seed)
    out = []
    kind = ""
    for i in range(part.num_clients):
        train, test = client_indices(pool, i, seed, opts)
        hist = np.bincount(pool.labels[np.concatenate([train, test])], minlength=pool.num_classes)
        tag = ""
        if part.types is not None:
            tag, kind = f"type{int(part.types[i]) + 1}", "type"
        elif part.groups is not None:
            gid = int(part.groups[i])
            tag, kind = pool.group_names.get(gid, str(gid)), pool.group_kind
        out.append(ClientSummary(i, len(train), len(test), tuple(int(h) for h in hist), tag))
    return PartitionSummary(dataset, opts.partition, pool.num_classes, len(pool), tuple(out), pool.class_names,
                            kind)


def client_types(dataset: str, seed: int, options: Mapping[str, Any] | None = None) -> np.ndarray | None:
    """Ground-truth distribution type of every client (``types`` partition), else ``None``."""
    pool, opts = resolve(dataset, seed, options)
    return partition_of(pool, opts, seed).types


def num_clients_of(dataset: str, seed: int, options: Mapping[str, Any] | None = None) -> int:
    """How many clients the partition of ``dataset`` under ``options`` has."""
    pool, opts = resolve(dataset, seed, options)
    return partition_of(pool, opts, seed).num_clients


# ---- helpers for dataset modules ----

def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def readonly(a: np.ndarray) -> np.ndarray:
    """Mark a cached array read-only so that no client can change what others share."""
    return _readonly(a)


def images_to_tensor(x: np.ndarray, mean: Sequence[float] | None = None,
                     std: Sequence[float] | None = None) -> torch.Tensor:
    """uint8 images [N, H, W, C] (or [N, H, W]) -> float32 [N, C, H, W] in [0, 1], optionally normalised."""
    a = np.asarray(x)
    if a.ndim == 3:
        a = a[:, :, :, None]
    t = torch.from_numpy(np.ascontiguousarray(a)).permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    if mean is not None and std is not None:
        m = torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1)
        s = torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1)
        t = (t - m) / s
    return t.contiguous()


def _check_pool_choice(which: str) -> None:
    if which not in ("all", "train"):
        raise DataError(f"option pool must be 'all' (official train and test pooled) or 'train', got {which!r}")


def pool_labels(train_y: np.ndarray, test_y: np.ndarray, which: str) -> np.ndarray:
    """Labels of an official-split dataset's pool: ``all`` = train then test, ``train`` = train only."""
    _check_pool_choice(which)
    y = train_y if which == "train" else np.concatenate([train_y, test_y])
    return readonly(np.asarray(y, dtype=np.int64).copy())


def pool_features(train_x: np.ndarray, test_x: np.ndarray, which: str,
                  convert: Callable[[np.ndarray], torch.Tensor]) -> Callable[[np.ndarray], torch.Tensor]:
    """``features(idx)`` over train then test without concatenating the (large) raw arrays."""
    _check_pool_choice(which)
    n_train = len(train_x)

    def features(idx: np.ndarray) -> torch.Tensor:
        i = np.asarray(idx, dtype=np.int64)
        out = np.empty((len(i), *train_x.shape[1:]), dtype=train_x.dtype)
        first = i < n_train
        out[first] = train_x[i[first]]
        if which == "all":
            out[~first] = test_x[i[~first] - n_train]
        elif not first.all():
            raise DataError("pool index beyond the training split")
        return convert(out)

    return features


@dataclass(frozen=True, eq=False)
class SplitArrays:
    """A dataset with an official train/test split as raw numpy arrays (images uint8 [N, H, W, C])."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: tuple[str, ...]

    def __post_init__(self) -> None:
        for a in (self.x_train, self.y_train, self.x_test, self.y_test):
            readonly(a)
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise DataError("features and labels differ in length")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def split_train_test(x: torch.Tensor, y: torch.Tensor, num_classes: int, test_fraction: float,
                     generator: torch.Generator) -> ClientData:
    """Shuffle and split so that train and test follow the same distribution."""
    n = len(y)
    perm = torch.randperm(n, generator=generator)
    n_test = max(1, round(n * test_fraction)) if n > 1 else 0
    test, train = perm[:n_test], perm[n_test:]
    return ClientData(x[train], y[train], x[test], y[test], num_classes)
