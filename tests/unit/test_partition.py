from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.data import DataError
from fedcore.data.partition import (
    client_types,
    dirichlet_partition,
    distribution_types_partition,
    iid_partition,
    make_partition,
    mixed_class_counts,
    natural_partition,
    noniid_mixed_partition,
    noniid_partition,
    split_indices,
    type_classes,
)

# A CIFAR-10-like pool: 10 classes x 600 samples, in an arbitrary order.
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(10), 600))


def _disjoint(parts: list[np.ndarray]) -> bool:
    allidx = np.concatenate(parts)
    return len(allidx) == len(np.unique(allidx))


def _classes(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> list[set[int]]:
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_iid_equal_sizes_disjoint_and_deterministic() -> None:
    parts = iid_partition(LABELS, 7, seed=3)
    assert [len(p) for p in parts] == [len(LABELS) // 7] * 7
    assert _disjoint(parts)
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted indices
    assert _same(parts, iid_partition(LABELS, 7, seed=3))
    assert not _same(parts, iid_partition(LABELS, 7, seed=4))
    # every client sees (almost) every class
    assert min(len(c) for c in _classes(parts)) == 10


def test_noniid_k_classes_sizes_and_min_size() -> None:
    parts = noniid_partition(LABELS, 30, 2, seed=0, sigma=2.0, min_size=20)
    assert len(parts) == 30 and _disjoint(parts)
    assert all(len(c) == 2 for c in _classes(parts))
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 20
    # log-normal(0, 2^2) sizes are very uneven
    assert sizes.max() > 5 * np.median(sizes)
    assert sizes.sum() <= len(LABELS)
    assert _same(parts, noniid_partition(LABELS, 30, 2, seed=0))
    assert not _same(parts, noniid_partition(LABELS, 30, 2, seed=1))


def test_noniid_per_client_class_counts_and_even_class_shares() -> None:
    ks = [1, 3, 5, 10]
    parts = noniid_partition(LABELS, 4, ks, seed=5, sigma=0.0, min_size=20)
    assert [len(c) for c in _classes(parts)] == ks
    # sigma = 0 and supply = demand: 150 samples per client, 15 of each class
    even = noniid_partition(LABELS, 40, 10, seed=5, sigma=0.0, min_size=20)
    assert all(np.bincount(LABELS[p], minlength=10).tolist() == [15] * 10 for p in even)


def test_noniid_oversubscribed_class_scales_down_but_keeps_min_size() -> None:
    # every client wants 600 samples of 1 class: classes chosen twice are shared
    parts = noniid_partition(LABELS, 10, 1, seed=2, sigma=0.0, min_size=50)
    assert _disjoint(parts)
    assert min(len(p) for p in parts) >= 50
    for cls in range(10):
        owners = [p for p, c in zip(parts, _classes(parts), strict=True) if c == {cls}]
        assert sum(len(p) for p in owners) <= 600


def test_noniid_rejects_impossible_requests() -> None:
    with pytest.raises(DataError, match="classes per client"):
        noniid_partition(LABELS, 5, 11, seed=0)
    with pytest.raises(DataError, match="at least"):
        noniid_partition(LABELS[:100], 10, 2, seed=0, min_size=20)


def test_mixed_group_proportions_50_30_20() -> None:
    ks = mixed_class_counts(100, seed=0)
    assert sorted(np.bincount(ks, minlength=11)[[10, 5, 2]].tolist()) == [20, 30, 50]
    assert (np.bincount(ks, minlength=11)[[10, 5, 2]] == [50, 30, 20]).all()
    # largest remainder for a count that does not divide: 7 -> 4/2/1 (3.5, 2.1, 1.4)
    assert sorted(mixed_class_counts(7, seed=1).tolist()) == [2, 5, 5, 10, 10, 10, 10]
    # the assignment is shuffled, not contiguous, and seeded
    assert not (ks[:50] == 10).all()
    assert np.array_equal(ks, mixed_class_counts(100, seed=0))
    parts = noniid_mixed_partition(LABELS, 100, seed=0, min_size=20)
    held = [len(c) for c in _classes(parts)]
    assert held == ks.tolist()


def test_dirichlet_covers_everything_with_min_size_and_skew() -> None:
    skewed = dirichlet_partition(LABELS, 20, alpha=0.1, seed=0, min_size=10)
    flat = dirichlet_partition(LABELS, 20, alpha=100.0, seed=0, min_size=10)
    for parts in (skewed, flat):
        assert _disjoint(parts)
        assert sum(len(p) for p in parts) == len(LABELS)
        assert min(len(p) for p in parts) >= 10

    def top_class_share(parts: list[np.ndarray]) -> float:
        return float(np.mean([np.bincount(LABELS[p]).max() / len(p) for p in parts]))

    assert top_class_share(skewed) > 0.5 > top_class_share(flat) + 0.2
    assert _same(skewed, dirichlet_partition(LABELS, 20, alpha=0.1, seed=0, min_size=10))


def test_distribution_types_disjoint_pairs_and_contiguous_clients() -> None:
    parts, types = distribution_types_partition(LABELS, 100, 5, seed=0)
    assert types.tolist() == [t for t in range(5) for _ in range(20)]
    assert np.array_equal(types, client_types(100, 5))
    sets = type_classes(5, 2, 10)
    assert [s.tolist() for s in sets] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    for p, t, cls in zip(parts, types, _classes(parts), strict=True):
        assert cls == set(sets[t].tolist())
        counts = np.bincount(LABELS[p], minlength=10)[sets[t]]
        assert abs(int(counts[0]) - int(counts[1])) <= 1  # a type's classes are dealt evenly
    assert _disjoint(parts)
    assert sum(len(p) for p in parts) == len(LABELS)
    capped, _ = distribution_types_partition(LABELS, 100, 5, seed=0, samples_per_client=40)
    assert {len(p) for p in capped} == {40}
    shuffled = type_classes(5, 2, 10, seed=3)
    assert sorted(np.concatenate(shuffled).tolist()) == list(range(10))
    with pytest.raises(DataError, match="disjoint"):
        distribution_types_partition(LABELS, 10, 6, seed=0)


def test_natural_partition_by_group_with_filter_and_sampling() -> None:
    groups = np.array([5, 5, 1, 9, 9, 9, 1, 5, 7])
    parts, ids = natural_partition(groups, seed=0)
    assert ids.tolist() == [1, 5, 7, 9]
    assert [p.tolist() for p in parts] == [[2, 6], [0, 1, 7], [8], [3, 4, 5]]
    parts, ids = natural_partition(groups, seed=0, min_size=2)
    assert ids.tolist() == [1, 5, 9]
    _, ida = natural_partition(groups, seed=1, num_clients=2)
    _, idb = natural_partition(groups, seed=1, num_clients=2)
    assert ida.tolist() == idb.tolist() and len(ida) == 2 and sorted(ida.tolist()) == ida.tolist()
    with pytest.raises(DataError, match="asked for 5 clients"):
        natural_partition(groups, seed=0, num_clients=5)


def test_make_partition_by_name() -> None:
    assert make_partition("iid", LABELS, 10, 0).num_clients == 10
    p = make_partition("noniid-5", LABELS, 10, 0)
    assert p.classes_per_client is not None and set(p.classes_per_client.tolist()) == {5}
    assert all(len(c) == 5 for c in _classes(list(p.indices)))
    assert make_partition("noniid", LABELS, 10, 0, classes_per_client=3).num_clients == 10
    mixed = make_partition("noniid-mixed", LABELS, 20, 0)
    assert mixed.classes_per_client is not None
    assert make_partition("dirichlet-0.5", LABELS, 10, 0).num_clients == 10
    types = make_partition("types", LABELS, 10, 0, num_types=5)
    assert types.types is not None and types.types.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    nat = make_partition("natural", LABELS, None, 0, groups=LABELS % 3)
    assert nat.groups is not None and nat.groups.tolist() == [0, 1, 2]
    with pytest.raises(DataError, match="unknown partition"):
        make_partition("bogus", LABELS, 10, 0)
    with pytest.raises(DataError, match="no natural clients"):
        make_partition("natural", LABELS, None, 0)


def test_stratified_split_keeps_class_proportions() -> None:
    y = np.repeat([0, 1, 2], [50, 30, 20])
    train, test = split_indices(y, 0.1, np.random.default_rng(0), "stratified")
    assert len(test) == 10 and len(train) == 90
    assert np.bincount(y[test], minlength=3).tolist() == [5, 3, 2]
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(100))
    # rounding with unequal remainders still gives round(n * f) test samples and a similar mix
    y2 = np.repeat([0, 1, 2, 3], [17, 13, 9, 4])
    tr2, te2 = split_indices(y2, 0.1, np.random.default_rng(1), "stratified")
    assert len(te2) == 4 and set(np.unique(y2[tr2]).tolist()) == {0, 1, 2, 3}


def test_contiguous_split_drops_the_overlap_gap() -> None:
    y = np.zeros(1000, dtype=np.int64)
    train, test = split_indices(y, 0.1, np.random.default_rng(0), "contiguous", gap=79)
    assert test.tolist() == list(range(900, 1000))
    assert train.tolist() == list(range(0, 821))
    small_train, small_test = split_indices(y[:20], 0.1, np.random.default_rng(0), "contiguous", gap=79)
    assert len(small_train) == 1 and small_test.tolist() == [18, 19]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.sampled_from(["stratified", "random"]),
       st.floats(0.0, 0.5))
def test_split_is_a_disjoint_cover_with_a_test_sample(labels: list[int], method: str, frac: float) -> None:
    y = np.array(labels)
    train, test = split_indices(y, frac, np.random.default_rng(0), method)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(y)))
    if len(y) > 1 and frac > 0:
        assert 1 <= len(test) <= len(y) - 1
    if len(y) == 1:
        assert len(train) == 1
