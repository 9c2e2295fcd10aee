"""Arrival-order independence of the aggregators: the same adds in any order give a bit-identical global model
and identical metrics; the exact fixed-point sum of streaming FedAvg (accuracy, range, memory)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from fedcore.aggregation import (
    AggregationConfig,
    AggregationResult,
    BufferedAggregator,
    StreamingFedAvg,
    aggregate,
    estimate_memory,
    fixedpoint,
    make_aggregator,
)
from fedcore.aggregation.base import permute_rows_
from fedcore.aggregation.metrics import CountSketch
from fedcore.aggregation.steps import Clip, Validate

K, P = 9, 257


def _dp(config: AggregationConfig) -> AggregationConfig:
    """``config`` with server-side DP: clip to norm 3, Gaussian noise sigma 0.01."""
    return replace(config, clip_norm=3.0, noise_sigma=0.01)


VARIANTS: dict[str, AggregationConfig] = {
    "fedavg-weighted": AggregationConfig(sketch_dim=31),
    "fedavg-unweighted": AggregationConfig(weighted=False, sketch_dim=31),
    "fedavg-exact": AggregationConfig(exact_metrics=True),
    "median": AggregationConfig(rule="median"),
    "trimmed_mean": AggregationConfig(rule="trimmed_mean", options={"trim_m": 2}),
    "krum": AggregationConfig(rule="krum", options={"krum_f": 1}),
    "multi_krum": AggregationConfig(rule="multi_krum", options={"krum_f": 2}),
    "bulyan": AggregationConfig(rule="bulyan", options={"krum_f": 1}),
    "knorm": AggregationConfig(rule="knorm", options={"knorm_k": 2}),
}
VARIANTS.update({f"{name}+dp": _dp(cfg) for name, cfg in list(VARIANTS.items())})


def _updates(seed: int = 0, k: int = K, p: int = P) -> tuple[list[torch.Tensor], list[float], list[str]]:
    """K updates of very different magnitudes (so float32 sums depend on the order), sample-count weights,
    distinct keys that do not sort like the arrival order."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(p, generator=gen)
    rows = [(common + 0.5 * torch.randn(p, generator=gen)) * 10.0 ** ((i * 7) % 5 - 2) for i in range(k)]
    weights = [float(13 + (i * 37) % 101) for i in range(k)]
    keys = [f"client-{(i * 5) % k:03d}" for i in range(k)]
    return rows, weights, keys


def _orders(k: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(1)
    return [list(range(k)), list(reversed(range(k)))] + [rng.sample(range(k), k) for _ in range(n - 2)]


def _run(config: AggregationConfig, order: list[int], seed: int = 0) -> AggregationResult:
    rows, weights, keys = _updates(seed)
    agg = make_aggregator(config, num_params=P, k=K)
    for i in order:
        agg.add(rows[i], weights[i], key=keys[i])
    glob = torch.randn(P, generator=torch.Generator().manual_seed(99))
    return agg.finalize(glob, torch.Generator().manual_seed(7))


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


# ---- every rule: bit-identical for any arrival order ----


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_result_is_bit_identical_for_any_arrival_order(variant: str) -> None:
    config = VARIANTS[variant]
    results = [_run(config, order) for order in _orders(K)]
    first = results[0]
    for res in results[1:]:
        assert torch.equal(res.new_global, first.new_global), variant
        assert _same_metrics(res.metrics, first.metrics), (variant, res.metrics, first.metrics)
        assert res.metrics["num_updates"] == K
    if config.noise_sigma:
        assert first.metrics["noise_norm"] > 0 and first.metrics["num_clipped"] > 0


def test_the_test_data_is_order_sensitive_without_canonical_order() -> None:
    # Sanity check of the data: a naive float32 running sum, and the pipeline over rows in arrival order,
    # do depend on the order -- so the test above can fail.
    rows, weights, _ = _updates()
    sums = []
    for order in _orders(K, 6):
        acc = torch.zeros(P)
        for i in order:
            acc.add_(rows[i], alpha=weights[i])
        sums.append(acc)
    assert any(not torch.equal(s, sums[0]) for s in sums[1:])
    cfg = VARIANTS["fedavg-exact+dp"]
    outs = [aggregate(cfg, torch.stack([rows[i] for i in o]), [weights[i] for i in o], torch.zeros(P),
                      torch.Generator().manual_seed(7)) for o in _orders(K, 6)]
    assert any(not torch.equal(o.new_global, outs[0].new_global) or o.metrics != outs[0].metrics
               for o in outs[1:])


def test_streaming_result_does_not_depend_on_the_worker_threads() -> None:
    p = 2 * fixedpoint.CHUNK + 3
    rows, weights, keys = _updates(3, k=4, p=p)
    outs = []
    for workers in (1, 2, 3):
        agg = StreamingFedAvg(p, clip_norm=50.0, sketch_dim=101, workers=workers)
        for i in (2, 0, 3, 1):
            agg.add(rows[i], weights[i], key=keys[i])
        outs.append(agg.finalize(torch.zeros(p)))
    for o in outs[1:]:
        assert torch.equal(o.new_global, outs[0].new_global) and _same_metrics(o.metrics, outs[0].metrics)


def test_keys_are_optional_and_ties_keep_the_order_of_addition() -> None:
    rows, weights, _ = _updates(4)
    for name in ("fedavg-exact+dp", "trimmed_mean", "multi_krum"):
        cfg = VARIANTS[name]
        agg = make_aggregator(cfg, num_params=P, k=K)
        for r, w in zip(rows, weights, strict=True):
            agg.add(r, w)  # old positional call: key ""
        res = agg.finalize(torch.zeros(P), torch.Generator().manual_seed(7))
        ref = aggregate(cfg, torch.stack(rows), weights, torch.zeros(P), torch.Generator().manual_seed(7))
        assert torch.equal(res.new_global, ref.new_global) and _same_metrics(res.metrics, ref.metrics)
        assert res.selected == ref.selected


def test_selected_names_the_same_senders_in_any_order() -> None:
    rows, weights, keys = _updates()
    chosen = set()
    for order in _orders(K):
        agg = make_aggregator(VARIANTS["multi_krum"], num_params=P, k=K)
        for i in order:
            agg.add(rows[i], weights[i], key=keys[i])
        res = agg.finalize(torch.zeros(P))
        assert res.selected is not None and isinstance(agg, BufferedAggregator)
        chosen.add(frozenset(keys[order[j]] for j in res.selected))  # positions in order of acceptance
        assert agg.keys == sorted(keys)  # the rows are now in canonical (key) order
    assert len(chosen) == 1


def test_permute_rows_in_place_by_cycles() -> None:
    rng = random.Random(5)
    x = torch.randn(12, 7, generator=torch.Generator().manual_seed(2))
    for n in (1, 2, 5, 12):
        perm = rng.sample(range(n), n)
        y = x.clone()
        permute_rows_(y, perm)
        assert torch.equal(y[:n], x[perm]) and torch.equal(y[n:], x[n:])
    with pytest.raises(ValueError, match="permutation"):
        permute_rows_(x.clone(), [0, 0, 1])


# ---- the exact fixed-point sum ----


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("clip_norm", [None, 3.0])
def test_fixed_point_mean_agrees_with_a_float64_reference(weighted: bool, clip_norm: float | None) -> None:
    rows, weights, keys = _updates(6)
    rows[0][:5] = torch.tensor([1e-12, -3e-30, 0.0, 1e5, -2.5e4])
    agg = StreamingFedAvg(P, weighted=weighted, clip_norm=clip_norm, max_update_norm=math.inf)
    total = torch.zeros(P, dtype=torch.float64)
    wsum = 0.0
    for r, w, key in zip(rows, weights, keys, strict=True):
        agg.add(r, w, key=key)
        norm = Validate(P).check(r)[0]
        w = w if weighted else 1.0
        total += r.double() * (w * Clip(clip_norm).scale(norm))
        wsum += w
    ref = total / wsum
    got = agg.finalize(torch.zeros(P)).new_global.double()
    # float32 rounding of the float64 reference (half an ulp, relative 2^-24), plus the fixed-point resolution
    tol = ref.abs() * 2.0**-24 * (1 + 1e-6) + K * fixedpoint.RESOLUTION
    assert bool(((got - ref).abs() <= tol).all()), float(((got - ref).abs() / tol).max())
    # ... which the old float32 running sum does not meet (the tolerance is tight enough to tell).
    naive = torch.zeros(P)
    for r, w in zip(rows, weights, strict=True):
        naive.add_(r, alpha=(w if weighted else 1.0) * Clip(clip_norm).scale(Validate(P).check(r)[0]))
    assert not bool((((naive / wsum).double() - ref).abs() <= tol).all())


def test_fixed_point_sum_is_exact_to_the_resolution() -> None:
    # Exact rational arithmetic: each term c = float64(u) * m is rounded once (to nearest) to a multiple of
    # 2^-(A+B), and the represented sum is the exact sum of those -- for any order of the adds.
    gen = torch.Generator().manual_seed(8)
    terms = [(torch.randn(16, generator=gen) * 2.0 ** e, m) for e, m in [(-40, 1.0), (0, 37.0), (12, 0.3), (-3, 5e4)]]
    terms[0][0][:3] = torch.tensor([2.0**-126, -(2.0**-149), 0.0])
    q = Fraction(1, 2 ** (fixedpoint.A + fixedpoint.B))
    sums = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        acc = fixedpoint.FixedPointSum(16, workers=1)
        for i in order:
            acc.add(terms[i][0], terms[i][1])
        sums.append([acc.exact(j) for j in range(16)])
    assert sums[0] == sums[1]
    for j in range(16):
        cs = [Fraction(float(u[j].double() * m)) for u, m in terms]
        assert sums[0][j] == sum(round(c / q) for c in cs) * q  # round(): to nearest, ties to even
        assert abs(sums[0][j] - sum(cs)) <= len(cs) * q / 2


def test_an_update_beyond_the_representable_range_is_refused() -> None:
    agg = StreamingFedAvg(4, max_update_norm=math.inf)
    big = torch.tensor([2.0**20, 1.0, 0.0, -1.0])
    with pytest.raises(ValueError, match=r"exact-aggregation range: .* exceeds 2\^30"):
        agg.add(big, 2.0**11, key="a")  # |w u| = 2^31
    agg.add(big, 2.0**10, key="b")  # exactly at the limit: accepted
    agg.add(-big, 2.0**10, key="c")
    assert agg.count == 2
    res = agg.finalize(torch.zeros(4))
    assert res.metrics["num_rejected"] == 1 and "exact-aggregation range" in res.rejected[0]
    assert torch.equal(res.new_global, torch.zeros(4))
    # The norm bounds max|u| from above; an update whose norm alone exceeds the range but whose values
    # do not is accepted (checked with its max-abs).
    spread = StreamingFedAvg(10_000, max_update_norm=math.inf)
    spread.add(torch.ones(10_000), 2.0**24, key="x")  # norm * w = 1.7e9 > 2^30, max|u| * w = 2^24
    assert spread.finalize(torch.zeros(10_000)).new_global[0] == 1.0
    # Through make_aggregator the refusal is a ValueError the coordinator turns into a rejection.
    with pytest.raises(ValueError, match="exact-aggregation range"):
        make_aggregator(AggregationConfig(max_update_norm=math.inf), 4, 3).add(big * 2.0**20, 1.0, key="z")


def test_at_most_max_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixedpoint, "MAX_UPDATES", 2)
    agg = StreamingFedAvg(3)
    agg.add(torch.ones(3), 1.0, key="a")
    agg.add(torch.ones(3), 1.0, key="b")
    with pytest.raises(ValueError, match="at most 2 updates"):
        agg.add(torch.ones(3), 1.0, key="c")
    with pytest.raises(ValueError, match=r"^k: streaming FedAvg sums at most 2"):
        make_aggregator(AggregationConfig(), 3, 3)


def test_streaming_memory_does_not_grow_with_k() -> None:
    shapes, nbytes = set(), set()
    for k in (1, 5, 40):
        agg = StreamingFedAvg(P, sketch_dim=0)
        for i in range(k):
            agg.add(torch.randn(P, generator=torch.Generator().manual_seed(i)), 1.0 + i, key=str(i))
        shapes.add(tuple((tuple(t.shape), t.dtype) for t in agg.accumulators))
        nbytes.add(sum(t.numel() * t.element_size() for t in agg.accumulators))
    assert shapes == {(((P,), torch.int64), ((P,), torch.int64))} and nbytes == {2 * 8 * P}
    est = [estimate_memory(AggregationConfig(sketch_dim=0), k, 10**6).total_bytes for k in (10, 10_000)]
    assert est[0] == est[1]


@pytest.mark.parametrize("p", [4, 257, 4554, 3 * fixedpoint.CHUNK // 4])
def test_a_block_of_adds_leaves_the_accumulators_of_the_adds_one_by_one(p: int) -> None:
    rows, weights, _ = _updates(5, k=fixedpoint.block_rows(p) + 3, p=p)
    multipliers = [w * s for w, s in zip(weights, [1.0, 0.37, 1.0, 2.0**-20] * len(weights), strict=False)]
    one_by_one = fixedpoint.FixedPointSum(p, workers=1)
    for r, m in zip(rows, multipliers, strict=True):
        one_by_one.add(r, m)
    blocks = fixedpoint.FixedPointSum(p, workers=1)
    n = fixedpoint.block_rows(p)
    for start in range(0, len(rows), n):  # full blocks, then a partial one
        blocks.add_rows(torch.stack(rows[start:start + n]), multipliers[start:start + n])
    whole = fixedpoint.FixedPointSum(p, workers=1)
    whole.add_rows(torch.stack(rows), multipliers)  # more than fits the scratch: row by row
    for acc in (blocks, whole):
        assert acc.count == len(rows)
        assert torch.equal(acc.hi, one_by_one.hi) and torch.equal(acc.lo, one_by_one.lo)
        assert torch.equal(acc.value(7.0), one_by_one.value(7.0))
    with pytest.raises(ValueError, match="expected a float32 tensor of shape"):
        blocks.add_rows(torch.stack(rows[:2]).double(), multipliers[:2])


def test_block_rows_fill_one_chunk_and_a_large_model_has_no_block() -> None:
    assert fixedpoint.block_rows(4) == fixedpoint.MAX_BLOCK_ROWS
    assert fixedpoint.block_rows(4554) == fixedpoint.CHUNK // 4554 == 14
    assert fixedpoint.block_rows(fixedpoint.CHUNK // 2 + 1) == 1
    assert fixedpoint.scratch_len(4554) == 14 * 4554 and fixedpoint.scratch_len(10**6) == fixedpoint.CHUNK


@pytest.mark.parametrize(("p", "d"), [(4554, 4093), (20_207, 101), (300_000, 101), (50, 7)])
def test_a_block_of_sketches_is_the_sketches_one_by_one(p: int, d: int) -> None:
    sketch = CountSketch(p, d, seed=3)
    rows, _, _ = _updates(6, k=3, p=p)
    block = sketch.rows(torch.stack(rows))
    assert block.dtype == torch.float64 and block.shape == (3, d)
    for i, r in enumerate(rows):
        assert torch.equal(block[i], sketch(r))  # bit-identical: the same float32 steps in the same order


@pytest.mark.parametrize("p", [257, 4554])
def test_streaming_fedavg_in_blocks_is_bit_identical_to_row_by_row(p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    k = 2 * fixedpoint.block_rows(p) + 5  # two full blocks and a partial one
    rows, weights, keys = _updates(9, k=k, p=p)
    order = random.Random(4).sample(range(k), k)

    def run() -> AggregationResult:
        agg = StreamingFedAvg(p, clip_norm=40.0, noise_sigma=0.01, sketch_dim=101, workers=1)
        for i in order:
            agg.add(rows[i], weights[i], key=keys[i])
        return agg.finalize(torch.zeros(p), torch.Generator().manual_seed(7))

    blocked = run()
    monkeypatch.setattr(fixedpoint, "block_rows", lambda num_params: 1)
    reference = run()
    assert torch.equal(blocked.new_global, reference.new_global)
    assert _same_metrics(blocked.metrics, reference.metrics) and blocked.metrics["num_clipped"] > 0


@pytest.mark.parametrize("k", [10, 15, 2 * 14 + 3])
def test_the_block_is_summed_when_all_but_the_last_expected_update_are_in(k: int) -> None:
    """With the round's K given (``expected``), the block is summed once K - 1 updates are in, so the close sums the
    last row only (it waits for that one): no other block is left for finalize, and the result is bit for bit that of
    an aggregator that sums the block at finalize (``expected`` not given)."""
    p = 4554
    rows, weights, keys = _updates(3, k=k, p=p)

    def run(expected: int) -> tuple[int, AggregationResult]:
        agg = StreamingFedAvg(p, sketch_dim=101, workers=1, expected=expected)
        for i in range(k - 1):
            agg.add(rows[i], weights[i], key=keys[i])
        pending = len(agg._pending)
        agg.add(rows[k - 1], weights[k - 1], key=keys[k - 1])
        return pending, agg.finalize(torch.zeros(p))

    (early_pending, early), (late_pending, late) = run(k), run(0)
    assert early_pending == 0 and late_pending == (k - 1) % fixedpoint.block_rows(p)
    assert late_pending > 0 or k - 1 == fixedpoint.block_rows(p)
    assert torch.equal(early.new_global, late.new_global) and _same_metrics(early.metrics, late.metrics)


@pytest.mark.parametrize(("p", "expected"), [(4554, 0), (4554, 3), (4554, 40), (40_000, 0), (40_000, 40)])
def test_sketches_stored_in_arrival_order_give_the_estimate_of_the_rows_in_key_order(p: int, expected: int) -> None:
    # The store (grown from `expected` rows, or sized by it) keeps S u_i in arrival order; w_div must be the value
    # of the rows stacked in key order (the definition), bit for bit, whatever the arrival order.
    k = 37
    rows, weights, keys = _updates(11, k=k, p=p)
    sketch = CountSketch(p, 101, seed=5)
    by_key = sorted(range(k), key=lambda i: keys[i])
    for order in _orders(k, 3):
        agg = StreamingFedAvg(p, sketch_dim=101, sketch_seed=5, workers=1, expected=expected)
        for i in order:
            agg.add(rows[i], weights[i], key=keys[i])
        res = agg.finalize(torch.zeros(p))
        step = res.new_global  # from a zero global model, the step is the new model
        stacked = torch.stack([sketch(rows[i]) for i in by_key])
        reference = float(torch.linalg.vector_norm(stacked - sketch(step).unsqueeze(0), dim=1).mean())
        assert res.metrics["w_div"] == reference


def test_sketch_rows_write_into_a_given_array_and_refuse_a_wrong_one() -> None:
    sketch = CountSketch(4554, 4093, seed=2)
    rows, _, _ = _updates(3, k=4, p=4554)
    x = torch.stack(rows)
    out = np.full((6, 4093), 7.0)  # stale values: the rows start from zero as np.zeros would
    got = sketch.rows(x, out=out[1:5])
    assert np.shares_memory(got.numpy(), out) and torch.equal(got, sketch.rows(x))
    assert (out[0] == 7.0).all() and (out[5] == 7.0).all()
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous float64 array of shape \(4, 4093\)"):
        sketch.rows(x, out=np.zeros((4, 4093), dtype=np.float32))
    with pytest.raises(ValueError, match="out: expected"):
        sketch.rows(x, out=np.zeros((4, 8186))[:, ::2])
