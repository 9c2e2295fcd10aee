"""Aggregation pipeline: server-side DP (LINDT Eq. 4), w_div / Delta (Eq. 5, 7), validation, the incremental
aggregators, config validation and the memory check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.aggregation import (
    AggregationConfig,
    Aggregator,
    BufferedAggregator,
    MemoryBudgetError,
    StreamingFedAvg,
    TooFewUpdatesError,
    aggregate,
    check_memory,
    estimate_memory,
    fixedpoint,
    make_aggregator,
)
from fedcore.aggregation.metrics import CountSketch
from fedcore.aggregation.steps import Clip, GaussianNoise, Validate


def _rows(seed: int, n: int, p: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, p, generator=torch.Generator().manual_seed(seed)) * scale


def _feed(config: AggregationConfig, rows: torch.Tensor, weights: list[float], k: int | None = None) -> Aggregator:
    agg = make_aggregator(config, num_params=int(rows.shape[1]), k=k or int(rows.shape[0]))
    for r, w in zip(rows, weights, strict=True):
        agg.add(r, w)
    return agg


# ---- server-side DP ----


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("exact", [True, False])
def test_dp_with_zero_sigma_and_huge_clip_equals_fedavg(weighted: bool, exact: bool) -> None:
    x, w = _rows(0, 6, 50), [3.0, 1.0, 7.0, 2.0, 2.0, 9.0]
    glob = _rows(1, 1, 50)[0]
    plain = _feed(AggregationConfig(weighted=weighted), x, w).finalize(glob).new_global
    dp_cfg = AggregationConfig(weighted=weighted, clip_norm=1e9, noise_sigma=0.0, exact_metrics=exact)
    res = _feed(dp_cfg, x, w).finalize(glob, torch.Generator().manual_seed(0))
    torch.testing.assert_close(res.new_global, plain)
    assert res.metrics["num_clipped"] == 0 and res.metrics["noise_norm"] == 0.0


def test_lindt_eq4_by_hand() -> None:
    # w^r = w^{r-1} + (1/K) Σ Clip(u_i, S) + N(0, σ² I), plain mean
    glob = torch.tensor([1.0, 2.0, 3.0])
    u = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.3, 0.4], [0.0, 0.0, -10.0]])
    S, sigma = 1.0, 0.01
    clipped = torch.stack([u[0] / 5, u[1], u[2] / 10])
    noise = torch.randn(3, generator=torch.Generator().manual_seed(42)) * sigma
    expected = glob + clipped.mean(dim=0) + noise
    for exact in (False, True):
        cfg = AggregationConfig(weighted=False, clip_norm=S, noise_sigma=sigma, exact_metrics=exact)
        res = _feed(cfg, u, [5.0, 6.0, 7.0]).finalize(glob, torch.Generator().manual_seed(42))
        torch.testing.assert_close(res.new_global, expected)
        assert res.metrics["num_clipped"] == 2
        assert res.metrics["noise_norm"] == pytest.approx(float(noise.norm()), rel=1e-6)
        assert res.metrics["update_norm_max"] == pytest.approx(10.0)  # raw norms, before clipping


def test_clipping_scales_exactly_to_s() -> None:
    u = torch.tensor([[6.0, 8.0]])  # norm 10
    res = aggregate(AggregationConfig(clip_norm=2.5), u, [1.0], torch.zeros(2))
    assert float(res.new_global.norm()) == pytest.approx(2.5, rel=1e-6)
    torch.testing.assert_close(res.new_global, torch.tensor([1.5, 2.0]))
    clipped, report = Clip(2.5)(torch.tensor([[6.0, 8.0], [0.3, 0.4]]))
    torch.testing.assert_close(clipped.norm(dim=1), torch.tensor([2.5, 0.5]))
    assert report.num_clipped == 1


def test_clip_then_robust_rule_then_noise() -> None:
    # LINDT-TM order: the huge row is clipped to S before the trimmed mean sees it, then noise is added.
    u = torch.tensor([[1.0], [2.0], [3.0], [1000.0]])
    cfg = AggregationConfig(rule="trimmed_mean", options={"trim_m": 1}, clip_norm=2.5, noise_sigma=0.1)
    res = aggregate(cfg, u, [1.0] * 4, torch.zeros(1), torch.Generator().manual_seed(3))
    noise = torch.randn(1, generator=torch.Generator().manual_seed(3)) * 0.1
    # clipped: 1, 2, 2.5, 2.5 -> trimmed mean of 2, 2.5
    torch.testing.assert_close(res.new_global, torch.tensor([2.25]) + noise)
    assert res.metrics["num_clipped"] == 2


def test_noise_norm_is_about_sigma_sqrt_p_and_deterministic() -> None:
    p, sigma = 1_000_000, 0.001
    noise = GaussianNoise(sigma)
    step = torch.zeros(p)
    a, ra = noise(step, torch.Generator().manual_seed(7))
    b, rb = noise(step, torch.Generator().manual_seed(7))
    c, _ = noise(step, torch.Generator().manual_seed(8))
    assert ra.noise_norm == pytest.approx(sigma * math.sqrt(p), rel=0.01)
    assert ra.noise_norm == pytest.approx(float(a.norm()), rel=1e-5)
    assert torch.equal(a, b) and rb.noise_norm == ra.noise_norm
    assert not torch.equal(a, c)
    assert float(a.std()) == pytest.approx(sigma, rel=0.01)


# ---- w_div and delta ----


def test_w_div_and_delta_by_hand_with_clipping() -> None:
    # u1 = (3, 4) clipped to (1.5, 2) by S = 2.5; u2 = 0. g = (0.75, 1).
    # w_div uses the raw updates: (||(3,4) - g|| + ||0 - g||)/2 = (3.75 + 1.25)/2 = 2.5
    u = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    for exact in (True, False):
        cfg = AggregationConfig(weighted=False, clip_norm=2.5, exact_metrics=exact, max_update_norm=math.inf)
        res = _feed(cfg, u, [1.0, 1.0]).finalize(torch.zeros(2))
        assert res.metrics["w_div"] == pytest.approx(2.5, rel=1e-6)
        assert res.metrics["delta"] == pytest.approx(2.5, rel=1e-6)
        assert res.metrics["w_div_exact"] == (1.0 if exact else 0.0)


def test_w_div_includes_the_noise_in_w_r() -> None:
    u = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    sigma = 0.5
    res = aggregate(AggregationConfig(weighted=False, noise_sigma=sigma), u, [1.0] * 3, torch.zeros(3),
                    torch.Generator().manual_seed(11))
    g = u.mean(dim=0) + torch.randn(3, generator=torch.Generator().manual_seed(11)) * sigma
    w_div = float(sum((u[i] - g).norm() for i in range(3))) / 3
    noise_norm = float((g - u.mean(dim=0)).norm())
    assert res.metrics["w_div"] == pytest.approx(w_div, rel=1e-5)
    assert res.metrics["noise_norm"] == pytest.approx(noise_norm, rel=1e-5)
    assert res.metrics["delta"] == pytest.approx(w_div - noise_norm, rel=1e-5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(["median", "krum", "knorm", "fedavg"]))
def test_w_div_matches_a_direct_computation(seed: int, rule: str) -> None:
    x = _rows(seed, 7, 20, scale=2.0)
    glob = _rows(seed + 1, 1, 20)[0]
    cfg = AggregationConfig(rule=rule, clip_norm=8.0, noise_sigma=0.05, exact_metrics=True)
    res = _feed(cfg, x, [1.0] * 7).finalize(glob, torch.Generator().manual_seed(seed))
    g = res.new_global - glob
    direct = float((x - g).norm(dim=1).mean())
    assert res.metrics["w_div"] == pytest.approx(direct, rel=1e-4)
    assert res.metrics["delta"] == pytest.approx(direct - res.metrics["noise_norm"], rel=1e-4, abs=1e-5)


def test_streaming_sketch_estimates_w_div_within_a_few_percent() -> None:
    p, n = 200_003, 10
    common = _rows(5, 1, p)[0]
    x = common + _rows(6, n, p, scale=0.5)
    cfg = AggregationConfig(weighted=False, noise_sigma=0.001, max_update_norm=math.inf)
    streaming = _feed(cfg, x, [1.0] * n).finalize(torch.zeros(p), torch.Generator().manual_seed(0))
    exact = _feed(AggregationConfig(weighted=False, noise_sigma=0.001, exact_metrics=True,
                                    max_update_norm=math.inf), x, [1.0] * n).finalize(
        torch.zeros(p), torch.Generator().manual_seed(0))
    torch.testing.assert_close(streaming.new_global, exact.new_global, rtol=1e-5, atol=1e-6)
    assert streaming.metrics["w_div_exact"] == 0.0 and exact.metrics["w_div_exact"] == 1.0
    assert streaming.metrics["w_div"] == pytest.approx(exact.metrics["w_div"], rel=0.03)
    assert streaming.metrics["noise_norm"] == exact.metrics["noise_norm"]


def test_count_sketch_is_linear_and_norm_preserving_on_average() -> None:
    sk = CountSketch(10_007, 101, seed=1)
    a, b = _rows(1, 1, 10_007)[0], _rows(2, 1, 10_007)[0]
    torch.testing.assert_close(sk(a) - sk(b), sk(a - b), rtol=1e-5, atol=1e-4)
    ratios = [float(CountSketch(10_007, 101, seed=s)(a).norm()) / float(a.norm()) for s in range(30)]
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, abs=0.03)


def test_streaming_without_sketch_does_not_report_w_div() -> None:
    res = _feed(AggregationConfig(sketch_dim=0), _rows(0, 3, 5), [1.0] * 3).finalize(torch.zeros(5))
    assert "w_div" not in res.metrics and "delta" not in res.metrics
    assert isinstance(StreamingFedAvg(5), StreamingFedAvg)


def test_metrics_norm_statistics_and_counts() -> None:
    u = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 2.0], [100.0, 0.0], [0.0, -1.0]])
    cfg = AggregationConfig(rule="knorm", options={"knorm_k": 1}, clip_norm=3.0)
    res = _feed(cfg, u, [1.0] * 5).finalize(torch.zeros(2))
    m = res.metrics
    assert (m["update_norm_min"], m["update_norm_max"]) == (1.0, 100.0)
    assert m["update_norm_mean"] == pytest.approx((5 + 1 + 2 + 100 + 1) / 5)
    assert m["num_clipped"] == 2 and m["num_excluded"] == 1 and m["num_updates"] == 5


# ---- validation ----


def test_non_finite_and_oversized_updates_are_rejected_never_averaged() -> None:
    for cfg in (AggregationConfig(max_update_norm=10.0), AggregationConfig(rule="median", max_update_norm=10.0)):
        agg = make_aggregator(cfg, num_params=2, k=4)
        assert agg.check(torch.tensor([float("nan"), 0.0])) == "update has 1 non-finite value(s)"
        with pytest.raises(ValueError, match="non-finite"):
            agg.add(torch.tensor([float("inf"), 0.0]), 1.0)
        with pytest.raises(ValueError, match="exceeds the ceiling max_update_norm=10"):
            agg.add(torch.tensor([30.0, 40.0]), 1.0)
        with pytest.raises(ValueError, match=r"shape \(3,\)"):
            agg.add(torch.zeros(3), 1.0)
        with pytest.raises(ValueError, match="weight"):
            agg.add(torch.zeros(2), 0.0)
        agg.add(torch.tensor([1.0, 1.0]), 1.0)
        agg.add(torch.tensor([3.0, 3.0]), 1.0)
        agg.add(torch.tensor([2.0, 2.0]), 1.0)
        assert agg.count == 3
        res = agg.finalize(torch.zeros(2))
        torch.testing.assert_close(res.new_global, torch.tensor([2.0, 2.0]))
        assert res.metrics["num_rejected"] == 4 and len(res.rejected) == 4


def test_float64_values_that_overflow_float32_are_rejected() -> None:
    reason = Validate(2, math.inf).check(torch.tensor([1e39, 0.0], dtype=torch.float64))[1]
    assert reason is not None and "non-finite" in reason


def test_validate_step_reports_rows_and_reasons() -> None:
    x = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [100.0, 0.0]])
    report = Validate(2, max_norm=50.0)(x)
    assert [i for i, _ in report.rejected] == [1, 2] and report.accepted == [0]
    res = aggregate(AggregationConfig(max_update_norm=50.0), x, [1.0, 1.0, 1.0], torch.zeros(2))
    torch.testing.assert_close(res.new_global, torch.tensor([1.0, 0.0]))
    assert res.rejected[0].startswith("update 1:") and res.metrics["num_rejected"] == 2


def test_buffer_holds_at_most_k_updates_and_is_written_in_place() -> None:
    agg = make_aggregator(AggregationConfig(rule="median"), num_params=3, k=2)
    assert isinstance(agg, BufferedAggregator)
    agg.add(torch.ones(3), 1.0)
    agg.add(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="K=2"):
        agg.add(torch.ones(3), 1.0)


# ---- fewer updates than K at finalize ----


def test_finalize_with_too_few_updates_for_the_rule_is_a_clear_error() -> None:
    agg = _feed(AggregationConfig(rule="krum", options={"krum_f": 2}), _rows(0, 5, 4), [1.0] * 5, k=10)
    with pytest.raises(TooFewUpdatesError, match=r"krum_f: .*n=5.*closed with 5 of K=10"):
        agg.finalize(torch.zeros(4))
    with pytest.raises(TooFewUpdatesError, match="no updates"):
        make_aggregator(AggregationConfig(), 4, 3).finalize(torch.zeros(4))


def test_trim_fraction_adapts_to_the_actual_count() -> None:
    agg = _feed(AggregationConfig(rule="trimmed_mean", options={"trim_fraction": 0.2}),
                torch.tensor([[1.0], [2.0], [9.0]]),
                [1.0] * 3, k=10)
    res = agg.finalize(torch.zeros(1))  # floor(0.2 * 3) = 0: plain mean
    torch.testing.assert_close(res.new_global, torch.tensor([4.0]))


# ---- config validation ----


@pytest.mark.parametrize(
    ("config", "k", "field"),
    [
        (AggregationConfig(rule="nope"), 10, "rule"),
        (AggregationConfig(rule="trimmed_mean", options={"trim_m": 5}), 10, "options.trim_m"),
        (AggregationConfig(rule="trimmed_mean", options={"trim_m": -1}), 10, "options.trim_m"),
        (AggregationConfig(rule="trimmed_mean", options={"trim_m": 1, "trim_fraction": 0.1}), 10, "options.trim_m"),
        (AggregationConfig(rule="trimmed_mean", options={"trim_fraction": 0.5}), 10, "options.trim_fraction"),
        (AggregationConfig(rule="krum", options={"krum_f": 4}), 10, "options.krum_f"),
        (AggregationConfig(rule="multi_krum", options={"krum_f": 1, "multi_krum_m": 10}), 10, "options.multi_krum_m"),
        (AggregationConfig(rule="multi_krum", options={"multi_krum_m": 0}), 10, "options.multi_krum_m"),
        (AggregationConfig(rule="bulyan", options={"krum_f": 2}), 10, "options.krum_f"),
        (AggregationConfig(rule="knorm", options={"knorm_k": 10}), 10, "options.knorm_k"),
        (AggregationConfig(clip_norm=0.0), 10, "clip_norm"),
        (AggregationConfig(clip_norm=-1.0), 10, "clip_norm"),
        (AggregationConfig(noise_sigma=-0.1), 10, "noise_sigma"),
        (AggregationConfig(noise_sigma=math.nan), 10, "noise_sigma"),
        (AggregationConfig(max_update_norm=0.0), 10, "max_update_norm"),
        (AggregationConfig(sketch_dim=-1), 10, "sketch_dim"),
        (AggregationConfig(memory_budget_bytes=-1), 10, "memory_budget_bytes"),
        (AggregationConfig(), 0, "k"),
    ],
)
def test_impossible_parameters_are_refused_naming_the_field(config: AggregationConfig, k: int, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        config.validate(k)
    with pytest.raises(ValueError, match=rf"^{field}: "):
        make_aggregator(config, num_params=4, k=k)


def test_possible_parameters_pass() -> None:
    for cfg, k in [
        (AggregationConfig(rule="trimmed_mean", options={"trim_m": 4}), 10),
        (AggregationConfig(rule="krum", options={"krum_f": 3}), 9),
        (AggregationConfig(rule="bulyan", options={"krum_f": 2}), 11),
        (AggregationConfig(rule="knorm", options={"knorm_k": 9}), 10),
        (AggregationConfig(clip_norm=15.0, noise_sigma=0.001), 1),
    ]:
        assert cfg.validate(k) is cfg


def test_validate_against_min_updates() -> None:
    cfg = AggregationConfig(rule="krum", options={"krum_f": 2})
    cfg.validate(10)
    with pytest.raises(ValueError, match=r"krum_f: .*min_updates=6"):
        cfg.validate(10, min_updates=6)


def test_server_config_refuses_an_impossible_aggregation() -> None:
    from fedcore.config import ConfigError, ServerConfig

    cfg = ServerConfig()
    cfg.aggregation = AggregationConfig(rule="krum", options={"krum_f": 4})
    with pytest.raises(ConfigError, match=r"^aggregation\.options\.krum_f: "):
        cfg.validate()


# ---- memory ----


def test_memory_check_message_contains_the_arithmetic() -> None:
    cfg = AggregationConfig(rule="krum")
    with pytest.raises(MemoryBudgetError) as e:
        check_memory(cfg, k=10, num_params=10_000_000, budget_bytes=256_000_000)
    msg = str(e.value)
    assert "krum" in msg and "K*P*4 = 10*10000000*4 B = 400.0 MB for the update buffer" in msg
    assert "> budget 256.0 MB" in msg and msg.startswith("memory_budget_bytes: ")
    with pytest.raises(MemoryBudgetError):
        make_aggregator(AggregationConfig(rule="krum", memory_budget_bytes=256_000_000), 10_000_000, 10)


def test_streaming_fedavg_memory_does_not_grow_with_k() -> None:
    small = estimate_memory(AggregationConfig(), 10, 1_000_000).total_bytes
    large = estimate_memory(AggregationConfig(), 1000, 1_000_000).total_bytes
    assert large - small == 990 * 4093 * 8  # only the per-update sketches (d float64 each)
    # two int64 accumulators (the exact sum), cache-sized float64 scratch, three float32 finalize vectors
    scratch = fixedpoint.SCRATCH_VECTORS * fixedpoint.CHUNK * 8
    no_sketch = estimate_memory(AggregationConfig(sketch_dim=0), 1000, 1_000_000).total_bytes
    assert no_sketch == 2 * 8 * 1_000_000 + scratch + 3 * 4 * 1_000_000
    est = check_memory(AggregationConfig(), 100, 10_000_000, budget_bytes=1_000_000_000)
    assert est.streaming and est.total_bytes < 1_000_000_000
    buffered = estimate_memory(AggregationConfig(exact_metrics=True), 100, 1_000_000)
    assert not buffered.streaming and buffered.total_bytes >= 100 * 1_000_000 * 4
