"""Aggregation rules: hand-computed examples and invariants (fedcore.aggregation.rules)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.aggregation import AggregationConfig, aggregate, make_aggregator, order, register_rule, rules
from fedcore.aggregation.order import (
    closest_to_median_mean,
    coordinate_median,
    extreme_values,
    order_statistics,
    sorting_network,
)
from fedcore.aggregation.rules import (
    Bulyan,
    FedAvg,
    KNorm,
    Krum,
    Median,
    MultiKrum,
    RuleOutput,
    TrimmedMean,
    column_chunks,
    pairwise_sq_dists,
)

rows_strategy = st.integers(min_value=0, max_value=2**31 - 1)

ALL_RULES = {
    "fedavg": {},
    "median": {},
    "trimmed_mean": {"trim_m": 1},
    "krum": {"krum_f": 1},
    "multi_krum": {"krum_f": 1, "multi_krum_m": 3},
    "bulyan": {"krum_f": 1},
    "knorm": {"knorm_k": 2},
}


def _run(rule: str, rows: Sequence[Sequence[float]], weights: list[float] | None = None, weighted: bool = True,
         **options: object) -> torch.Tensor:
    x = torch.tensor(rows, dtype=torch.float32)
    w = weights if weights is not None else [1.0] * len(rows)
    cfg = AggregationConfig(rule=rule, weighted=weighted, options=options)
    return aggregate(cfg, x, w, torch.zeros(x.shape[1])).new_global


# ---- hand-computed examples ----


def test_fedavg_weighted_and_plain() -> None:
    rows = [[1.0, 0.0], [4.0, 3.0]]
    torch.testing.assert_close(_run("fedavg", rows, [1.0, 2.0]), torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(_run("fedavg", rows, [1.0, 2.0], weighted=False), torch.tensor([2.5, 1.5]))


def test_median_odd_and_even() -> None:
    torch.testing.assert_close(_run("median", [[1, 10], [2, 20], [100, -5]]), torch.tensor([2.0, 10.0]))
    # even n: the mean of the two middle values, as np.median
    torch.testing.assert_close(_run("median", [[1, 0], [2, 0], [3, 1], [10, 1]]), torch.tensor([2.5, 0.5]))


def test_trimmed_mean_by_count_and_fraction() -> None:
    rows = [[1, -50], [2, 0], [3, 1], [100, 2], [4, 3]]
    # m = 1: coordinate 0 keeps 2,3,4; coordinate 1 keeps 0,1,2
    expected = torch.tensor([3.0, 1.0])
    torch.testing.assert_close(_run("trimmed_mean", rows, trim_m=1), expected)
    torch.testing.assert_close(_run("trimmed_mean", rows, trim_fraction=0.2), expected)  # floor(0.2*5) = 1
    # fraction 0.1 of 5 -> m = 0: plain mean
    torch.testing.assert_close(_run("trimmed_mean", rows, trim_fraction=0.1), torch.tensor([22.0, -8.8]))


def test_krum_hand_example() -> None:
    # n=5, f=1 -> 2 nearest neighbours; scores 5, 2, 5, 65, 82 -> row 1
    rows = [[0.0], [1.0], [2.0], [10.0], [11.0]]
    cfg = AggregationConfig(rule="krum", options={"krum_f": 1})
    res = aggregate(cfg, torch.tensor(rows), [1.0] * 5, torch.zeros(1))
    torch.testing.assert_close(res.new_global, torch.tensor([1.0]))
    assert res.selected == (1,)
    assert res.metrics["num_excluded"] == 4


def test_multi_krum_hand_example() -> None:
    rows = [[0.0], [1.0], [2.0], [10.0], [11.0]]
    # best three scores: rows 1 (2), 0 (5), 2 (5) -> weighted mean with weights 1, 1, 2
    res = aggregate(AggregationConfig(rule="multi_krum", options={"krum_f": 1, "multi_krum_m": 3}), torch.tensor(rows),
                    [1.0, 1.0, 2.0, 1.0, 1.0], torch.zeros(1))
    assert res.selected == (0, 1, 2)
    torch.testing.assert_close(res.new_global, torch.tensor([(0 + 1 + 4) / 4]))
    assert res.metrics["num_excluded"] == 2


def test_bulyan_hand_example() -> None:
    # n=7, f=1: theta=5 chosen by repeated Krum = rows 0..4; beta=3 closest to the median 2 -> {1,2,3}
    rows = [[0.0, 5.0], [1.0, 5.0], [2.0, 5.0], [3.0, 5.0], [4.0, 5.0], [100.0, 5.0], [-100.0, 5.0]]
    cfg = AggregationConfig(rule="bulyan", options={"krum_f": 1})
    res = aggregate(cfg, torch.tensor(rows), [1.0] * 7, torch.zeros(2))
    torch.testing.assert_close(res.new_global, torch.tensor([2.0, 5.0]))
    assert res.selected == (0, 1, 2, 3, 4)
    assert res.metrics["num_excluded"] == 2 and res.metrics["num_trimmed_per_coord"] == 2


def test_knorm_hand_example() -> None:
    res = aggregate(AggregationConfig(rule="knorm", options={"knorm_k": 1}, weighted=False),
                    torch.tensor([[1.0, 0.0], [0.0, 2.0], [10.0, 10.0]]), [1.0] * 3, torch.zeros(2))
    torch.testing.assert_close(res.new_global, torch.tensor([0.5, 1.0]))
    assert res.selected == (0, 1) and res.metrics["num_excluded"] == 1


def test_rules_are_added_to_the_previous_global() -> None:
    glob = torch.tensor([10.0, -10.0])
    res = aggregate(AggregationConfig(rule="median"), torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]),
                    [1.0] * 3, glob)
    torch.testing.assert_close(res.new_global, torch.tensor([12.0, -8.0]))


@pytest.mark.parametrize("n", [5, 6, 129, 130])
@pytest.mark.parametrize("m", [1, 2, 64])
def test_chunked_rules_match_numpy_across_chunk_boundaries(
    n: int, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = 601
    monkeypatch.setattr(rules, "CHUNK_ELEMS", 250 * n)  # 3 chunks
    monkeypatch.setattr(order, "ORDER_CHUNK_ELEMS", 250 * n)
    monkeypatch.setattr(order, "ORDER_CHUNK_MIN_COLS", 1)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, p, generator=g)
    assert len(list(column_chunks(n, p))) > 1
    np.testing.assert_allclose(Median()(x, torch.ones(n)).step.numpy(), np.median(x.numpy(), axis=0), rtol=1e-6)
    if 2 * m < n:
        s = np.sort(x.numpy(), axis=0)[m : n - m].mean(axis=0)
        got = TrimmedMean(trim_m=m)(x, torch.ones(n)).step.numpy()
        np.testing.assert_allclose(got, s, rtol=1e-4, atol=1e-5)
    if n < 10:
        d = ((x.unsqueeze(0) - x.unsqueeze(1)) ** 2).sum(-1).double()
        torch.testing.assert_close(pairwise_sq_dists(x), d, rtol=1e-5, atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(seed=rows_strategy, n=st.integers(1, 12), k=st.integers(1, 12), largest=st.booleans())
def test_extreme_values_equal_sorted_values_with_ties(seed: int, n: int, k: int, largest: bool) -> None:
    k = min(k, n)
    x = torch.randint(-3, 4, (n, 50), generator=torch.Generator().manual_seed(seed)).to(torch.float32)
    regs = extreme_values(x, k, largest=largest)
    ordered = torch.sort(x, dim=0, descending=largest).values
    for j in range(k):
        assert torch.equal(regs[j], ordered[j])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 17, 33, 100])
def test_sorting_network_sorts(n: int) -> None:
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        for x in (torch.randn(n, 64, generator=g), torch.randint(-2, 3, (n, 64), generator=g).to(torch.float32)):
            rows = list(x.clone().unbind(0))
            for i, j in sorting_network(n):
                lo, hi = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
                rows[i], rows[j] = lo, hi
            assert torch.equal(torch.stack(rows), torch.sort(x, dim=0).values)


@settings(max_examples=40, deadline=None)
@given(seed=rows_strategy, n=st.integers(1, 40), data=st.data())
def test_order_statistics_equal_sorted_values(seed: int, n: int, data: st.DataObject) -> None:
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
    x = torch.randint(-3, 4, (n, 30), generator=torch.Generator().manual_seed(seed)).to(torch.float32)
    x += torch.randn(n, 30, generator=torch.Generator().manual_seed(seed)) * (seed % 2)
    ordered = torch.sort(x, dim=0).values
    for p, v in zip(positions, order_statistics(x, positions), strict=True):
        assert torch.equal(v, ordered[p])


@pytest.mark.parametrize("n, positions, schedule", [
    (10, [0, 9], "insertion"), (30, [1, 28], "insertion"), (10, [5], "network"), (10, [1, 8], "network"),
    (100, [1, 98], "insertion"),
    (120, [60], "sort"), (120, [59, 60], "sort"), (150, [15, 134], "sort"), (150, [1, 148], "insertion"),
])
def test_each_order_statistic_schedule_equals_sorting(n: int, positions: list[int], schedule: str) -> None:
    assert order.schedule(n, tuple(sorted(positions))) == schedule
    g = torch.Generator().manual_seed(n)
    for x in (torch.randn(n, 40, generator=g), torch.randint(-2, 3, (n, 40), generator=g).to(torch.float32),
              torch.randn(n, 300, generator=g)[:, 7:47]):  # ties; a strided column slice, as the rules pass
        ordered = torch.sort(x, dim=0).values
        for p, v in zip(positions, order.order_statistics(x, positions), strict=True):
            assert torch.equal(v, ordered[p])
    if schedule == "sort" and positions[-1] == n - 1 - positions[0]:  # the trimmed sum sorts too
        m = positions[0]
        expected = ordered[m : n - m].to(torch.float64).sum(dim=0)
        torch.testing.assert_close(order.trimmed_sum(x, m), expected)


@settings(max_examples=30, deadline=None)
@given(seed=rows_strategy, n=st.integers(1, 15), data=st.data())
def test_closest_to_median_mean_matches_brute_force(seed: int, n: int, data: st.DataObject) -> None:
    beta = data.draw(st.integers(1 if n % 2 else min(2, n), n))  # beta = 1, n even: a tie of the two middles
    x = torch.randn(n, 25, generator=torch.Generator().manual_seed(seed))
    col = x.numpy().astype(np.float64)
    med = np.median(col, axis=0)
    idx = np.argsort(np.abs(col - med), axis=0, kind="stable")[:beta]
    expected = np.take_along_axis(col, idx, axis=0).mean(axis=0)
    np.testing.assert_allclose(closest_to_median_mean(x, beta).numpy(), expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=rows_strategy, n=st.integers(3, 12), m=st.integers(1, 5))
def test_trimmed_mean_with_ties_matches_sorting(seed: int, n: int, m: int) -> None:
    if 2 * m >= n:
        m = (n - 1) // 2
    x = torch.randint(-3, 4, (n, 40), generator=torch.Generator().manual_seed(seed)).to(torch.float32)
    expected = torch.sort(x, dim=0).values[m : n - m].mean(dim=0)
    torch.testing.assert_close(TrimmedMean(trim_m=m)(x, torch.ones(n)).step, expected)
    np.testing.assert_allclose(Median()(x, torch.ones(n)).step.numpy(), np.median(x.numpy(), axis=0))


def test_coordinate_median_even_count() -> None:
    x = torch.tensor([[4.0], [1.0], [3.0], [2.0]])
    torch.testing.assert_close(coordinate_median(x), torch.tensor([2.5]))


# ---- invariants ----

def _random_rows(seed: int, n: int, p: int) -> torch.Tensor:
    return torch.randn(n, p, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=15, deadline=None)
@given(seed=rows_strategy, rule=st.sampled_from(sorted(ALL_RULES)))
def test_permutation_invariance(seed: int, rule: str) -> None:
    x = _random_rows(seed, 7, 5)
    w = torch.rand(7, generator=torch.Generator().manual_seed(seed)) + 0.5
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(seed + 1))
    cfg = AggregationConfig(rule=rule, options=ALL_RULES[rule])
    a = aggregate(cfg, x, w, torch.zeros(5)).new_global
    b = aggregate(cfg, x[perm], w[perm], torch.zeros(5)).new_global
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(seed=rows_strategy, rule=st.sampled_from(sorted(ALL_RULES)), n=st.integers(7, 9))
def test_identical_updates_return_that_update(seed: int, rule: str, n: int) -> None:
    u = _random_rows(seed, 1, 6)[0] * 3
    x = u.repeat(n, 1)
    cfg = AggregationConfig(rule=rule, options=ALL_RULES[rule])
    res = aggregate(cfg, x, [float(i + 1) for i in range(n)], torch.zeros(6))
    torch.testing.assert_close(res.new_global, u, rtol=1e-6, atol=1e-6)
    assert res.metrics["w_div"] == pytest.approx(0.0, abs=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=rows_strategy, m=st.integers(1, 3), scale=st.sampled_from([1e3, 1e15, 1e30, -1e30]),
       rule=st.sampled_from(["median", "trimmed_mean"]))
def test_median_and_trimmed_mean_unmoved_by_m_outliers(seed: int, m: int, scale: float, rule: str) -> None:
    n = 2 * m + 3
    honest = _random_rows(seed, n - m, 8)
    outliers = _random_rows(seed + 7, m, 8) * scale
    x = torch.cat([honest, outliers])
    cfg = AggregationConfig(rule=rule, options={"trim_m": m} if rule == "trimmed_mean" else None,
                            max_update_norm=math.inf)
    out = aggregate(cfg, x, [1.0] * n, torch.zeros(8)).new_global
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    assert bool((out >= lo - 1e-6).all()) and bool((out <= hi + 1e-6).all())


@settings(max_examples=15, deadline=None)
@given(seed=rows_strategy, f=st.integers(1, 3), extra=st.integers(0, 3), spread=st.sampled_from([10.0, 1e6]))
def test_krum_picks_from_the_honest_cluster(seed: int, f: int, extra: int, spread: float) -> None:
    n = 2 * f + 3 + extra  # f < n/2 - 1
    honest = _random_rows(seed, n - f, 10) * 0.1
    # colluding attackers: identical (mutual distance 0) and far away
    attackers = (_random_rows(seed + 3, 1, 10) * spread).repeat(f, 1)
    x = torch.cat([attackers, honest])
    for rule in ("krum", "multi_krum"):
        cfg = AggregationConfig(rule=rule, options={"krum_f": f}, max_update_norm=math.inf)
        res = aggregate(cfg, x, [1.0] * n, torch.zeros(10))
        assert res.selected is not None and all(i >= f for i in res.selected), (rule, res.selected)


@pytest.mark.parametrize("f", [1, 2])
def test_bulyan_output_stays_in_the_honest_range(f: int) -> None:
    # Colluding identical attackers can enter Bulyan's selection late (the repeated Krum counts a single
    # neighbour on small sets), but the coordinate-wise phase keeps the output inside the honest range.
    n = 4 * f + 3
    honest = _random_rows(0, n - f, 10) * 0.1
    attackers = (_random_rows(1, 1, 10) * 100).repeat(f, 1)
    res = aggregate(AggregationConfig(rule="bulyan", options={"krum_f": f}), torch.cat([attackers, honest]), [1.0] * n,
                    torch.zeros(10))
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    assert bool((res.new_global >= lo).all()) and bool((res.new_global <= hi).all())


def test_rules_do_not_modify_their_input() -> None:
    x = _random_rows(3, 7, 4)
    before = x.clone()
    for rule in (FedAvg(), Median(), TrimmedMean(trim_m=2), Krum(f=1), MultiKrum(f=1), Bulyan(f=1), KNorm(k=2)):
        out = rule(x, torch.ones(7))
        assert isinstance(out, RuleOutput) and out.step.shape == (4,)
        assert torch.equal(x, before), rule.name


def test_custom_rule_plugs_in_by_name() -> None:
    class FirstRow:
        name = "test_first_row"
        streamable = False

        def check(self, n: int) -> None:
            return None

        def workspace(self, n: int, num_params: int) -> tuple[int, str]:
            return 0, "none"

        def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput:
            return RuleOutput(updates[0].clone(), num_excluded=int(updates.shape[0]) - 1, selected=(0,))

    register_rule("test_first_row", lambda c: FirstRow(), replace=True)
    try:
        agg = make_aggregator(AggregationConfig(rule="test_first_row"), num_params=2, k=3)
        agg.add(torch.tensor([1.0, 2.0]), 1)
        agg.add(torch.tensor([5.0, 5.0]), 1)
        res = agg.finalize(torch.zeros(2))
        torch.testing.assert_close(res.new_global, torch.tensor([1.0, 2.0]))
        assert res.selected == (0,)
    finally:  # the registry is process-wide: later tests compare it with the help texts' lists
        rules.unregister_rule("test_first_row")
    assert "test_first_row" not in rules.rule_names()
