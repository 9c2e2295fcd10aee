"""Adaptive clipping (fedcore.adaptive_clip; Andrew et al., NeurIPS 2021): the clip norm converges to the target
quantile of the update norms, the noise split against a hand computation, the state's round trip, validation naming
the field, the aggregators' per-round clip norm and scaled noise, and the accountant's charge."""

from __future__ import annotations

import json
import math
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest
import torch

from fedcore import adaptive_clip as ac
from fedcore import privacy
from fedcore.aggregation import AggregationConfig, make_aggregator
from fedcore.config import ConfigError, ServerConfig, build_config

# ---- convergence to the target quantile ----

M, ETA = 100, 0.2  # updates per round, the paper's eta_C
SIGMA_B = M / 20  # the paper's count noise
MU, S = 0.0, 1.0  # log ||u|| ~ N(MU, S^2): lognormal update norms
BURN_IN, WINDOW = 500, 1500


def _tolerance(gamma: float) -> tuple[float, float, float]:
    """The stationary spread of log C and the tolerance on its mean over WINDOW rounds, derived from eta_C, sigma_b.

    With x = log C and x* = log q_gamma, the update is x' = x - eta (b~ - gamma) and, linearised at x*,
    E[b~] - gamma = F(e^x) - gamma ~ a (x - x*), a = f(x*) the density of log ||u|| at the quantile
    (phi(z_gamma) / S). b~ - E[b~] has variance v = gamma (1 - gamma) / m (the binomial count) + sigma_b^2 / m^2
    (the noise), so d = x - x* is AR(1) with rho = 1 - eta a: stationary sd = eta sqrt(v / (1 - rho^2)), and the mean
    of N consecutive values has sd ~ sd * sqrt((1 + rho) / ((1 - rho) N)). The curvature of F biases the mean by
    about z_gamma sd^2 / (2 S) (zero at the median). Returns (stationary sd, bias, tolerance = bias + 5 sd of the
    mean)."""
    z = NormalDist().inv_cdf(gamma)
    a = NormalDist().pdf(z) / S
    v = gamma * (1 - gamma) / M + SIGMA_B**2 / M**2
    rho = 1 - ETA * a
    sd = ETA * math.sqrt(v / (1 - rho**2))
    sd_mean = sd * math.sqrt((1 + rho) / ((1 - rho) * WINDOW))
    bias = abs(z) * sd**2 / (2 * S)
    return sd, bias, bias + 5 * sd_mean


@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_the_clip_norm_converges_to_the_target_quantile(gamma: float) -> None:
    config = ac.AdaptiveClipConfig(enabled=True, target_quantile=gamma, learning_rate=ETA, count_noise_std=SIGMA_B)
    norms_rng = np.random.default_rng([2021, int(gamma * 100), 1])  # the update norms
    count_rng = np.random.default_rng([2021, int(gamma * 100), 2])  # the count's noise
    state = ac.init(config)
    assert state.clip_norm == 0.1
    logs = []
    for _ in range(BURN_IN + WINDOW):
        norms = np.exp(norms_rng.normal(MU, S, size=M))
        unclipped = int((norms <= state.clip_norm).sum())
        state, _ = ac.update(state, config, unclipped, M, float(count_rng.standard_normal()))
        logs.append(math.log(state.clip_norm))
    assert state.rounds == BURN_IN + WINDOW
    target = MU + S * NormalDist().inv_cdf(gamma)  # log of the quantile of the norm distribution
    window = np.array(logs[BURN_IN:])
    sd, _, tol = _tolerance(gamma)
    assert abs(window.mean() - target) < tol, (window.mean(), target, tol)
    # the spread the tolerance was derived from is the one observed (within the linearisation's error)
    assert 0.7 * sd < window.std() < 1.4 * sd, (window.std(), sd)
    # and a single late round is near the quantile too (5 stationary sds)
    assert abs(logs[-1] - target) < 5 * sd


def test_the_tolerances_are_a_few_percent() -> None:
    # eta_C = 0.2, sigma_b = m / 20, m = 100: C's mean is pinned to within ~2% (median) and ~4.5% (0.9 quantile).
    assert _tolerance(0.5)[2] < 0.025 and _tolerance(0.9)[2] < 0.05
    assert _tolerance(0.5)[1] == 0.0


# ---- the pure update and the noise split, by hand ----

def test_one_update_by_hand() -> None:
    config = ac.AdaptiveClipConfig(enabled=True, target_quantile=0.5, learning_rate=0.2, count_noise_std=2.0)
    state, fraction = ac.update(ac.AdaptiveClipState(1.0, 3), config, 6, 10, 0.5)
    assert fraction == (6 + 2.0 * 0.5) / 10 == 0.7
    assert state == ac.AdaptiveClipState(math.exp(-0.2 * (0.7 - 0.5)), 4)
    # more unclipped than the target: C shrinks; fewer: it grows
    assert ac.update(ac.AdaptiveClipState(1.0), config, 10, 10, 0.0)[0].clip_norm < 1.0
    assert ac.update(ac.AdaptiveClipState(1.0), config, 0, 10, 0.0)[0].clip_norm > 1.0
    with pytest.raises(ValueError, match="unclipped_count"):
        ac.update(ac.AdaptiveClipState(1.0), config, 11, 10, 0.0)
    with pytest.raises(ValueError, match="count_noise_std is unset"):
        ac.update(ac.AdaptiveClipState(1.0), ac.AdaptiveClipConfig(), 1, 1, 0.0)


def test_the_noise_split_against_a_hand_computation() -> None:
    # z = 1, sigma_b = 1: z_D = (1 - 1/4)^-1/2 = 2 / sqrt(3)
    assert ac.update_noise_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3), rel=1e-15)
    # the paper's setting: m = 100, sigma_b = m / 20 = 5, z = 1: z_D = (1 - 1/100)^-1/2 = 1.00503781525921...
    assert ac.update_noise_multiplier(1.0, 5.0) == pytest.approx(1.0050378152592121, rel=1e-15)
    # z = 0.5, sigma_b = 0.3: (4 - 1/0.36)^-1/2 = (4 - 2.7777...)^-1/2 = 1.1^-1/2 / ... by the formula itself
    assert ac.update_noise_multiplier(0.5, 0.3) == pytest.approx((0.5**-2 - 0.6**-2) ** -0.5, rel=1e-14)
    assert ac.update_noise_multiplier(0.0, 0.0) == 0.0
    for z, sb in ((1.0, 1.0), (0.8, 0.5), (2.0, 5.0), (0.1, 0.2)):
        # the inverse: the update and the count together are one mechanism of multiplier z (Thm 1)
        assert ac.combined_noise_multiplier(ac.update_noise_multiplier(z, sb), sb) == pytest.approx(z, rel=1e-14)
    with pytest.raises(ValueError, match=r"^count_noise_std: must exceed noise_multiplier / 2 = 0.5"):
        ac.update_noise_multiplier(1.0, 0.5)


def test_the_state_round_trips_through_json_bit_for_bit() -> None:
    config = ac.AdaptiveClipConfig(enabled=True, count_noise_std=1.0)
    state = ac.init(config)
    rng = np.random.default_rng(7)
    for _ in range(5):
        state, _ = ac.update(state, config, int(rng.integers(0, 11)), 10, float(rng.standard_normal()))
    back = ac.AdaptiveClipState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert back == state and back.clip_norm == state.clip_norm and back.rounds == 5
    # carrying on from the restored state is the same fold
    assert ac.update(back, config, 4, 10, 0.3) == ac.update(state, config, 4, 10, 0.3)
    for bad in ({"clip_norm": 0.0}, {"clip_norm": float("inf")}, {}, {"clip_norm": 1.0, "rounds": -1}):
        with pytest.raises(ValueError, match="adaptive_clip: the stored"):
            ac.AdaptiveClipState.from_dict(bad)


# ---- validation names the field ----

@pytest.mark.parametrize(("field", "value"), [
    ("initial_clip_norm", 0.0), ("initial_clip_norm", float("nan")), ("target_quantile", 1.0),
    ("target_quantile", 0.0), ("learning_rate", -0.1), ("count_noise_std", -1.0), ("noise_multiplier", -1.0),
    ("enabled", "yes"),
])
def test_validation_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^adaptive_clip\.{field}: "):
        ac.AdaptiveClipConfig(**{field: value}).validate()


def _server(**sections: dict[str, Any]) -> ServerConfig:
    overrides: list[tuple[list[str], Any]] = [(["security", "insecure"], True)]
    overrides += [([s, k], v) for s, values in sections.items() for k, v in values.items()]
    return build_config(ServerConfig, None, overrides)


@pytest.mark.parametrize(("sections", "field"), [
    ({"aggregation": {"rule": "median"}}, "adaptive_clip.enabled"),
    ({"aggregation": {"clip_norm": 1.0}}, "aggregation.clip_norm"),
    ({"aggregation": {"noise_sigma": 0.1}}, "aggregation.noise_sigma"),
    ({"distfl": {"enabled": True}}, "adaptive_clip.enabled"),
    # K = 10: sigma_b = 10 / 20 = 0.5, so z must stay below 1
    ({"adaptive_clip": {"noise_multiplier": 1.0}}, "adaptive_clip.count_noise_std"),
    ({"adaptive_clip": {"noise_multiplier": 1.0, "count_noise_std": 0.4}}, "adaptive_clip.count_noise_std"),
])
def test_the_server_configuration_refuses_what_adaptive_clipping_cannot_run_with(sections: dict[str, Any],
                                                                                  field: str) -> None:
    ad = {"enabled": True, **sections.pop("adaptive_clip", {})}
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}: "):
        _server(adaptive_clip=ad, **sections).validate()


def test_off_by_default_and_a_valid_configuration_passes() -> None:
    assert _server().adaptive_clip == ac.AdaptiveClipConfig() and not ac.AdaptiveClipConfig().enabled
    cfg = _server(adaptive_clip={"enabled": True, "noise_multiplier": 0.9}).validate()
    assert ac.resolved(cfg.adaptive_clip, 10).count_noise_std == 0.5
    # a budget is accepted where an epsilon is computed (Opacus installed), refused without update noise
    if privacy.available():
        _server(adaptive_clip={"enabled": True, "noise_multiplier": 0.9}, dp={"max_epsilon": 8.0}).validate()
    with pytest.raises(ConfigError, match=r"^dp\.max_epsilon: .*adaptive_clip\.noise_multiplier = 0"):
        _server(adaptive_clip={"enabled": True}, dp={"max_epsilon": 8.0}).validate()
    # a fixed-clip configuration with adaptive clipping off is untouched by it
    _server(aggregation={"clip_norm": 1.0, "noise_sigma": 0.1}, adaptive_clip={"target_quantile": 0.9}).validate()


# ---- the aggregators: the round's clip norm and the scaled noise ----

def _updates(n: int, p: int) -> tuple[torch.Tensor, list[float]]:
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(n, p, generator=g) * torch.linspace(0.2, 3.0, n).unsqueeze(1) / math.sqrt(p)
    return rows, [float(w) for w in range(3, 3 + n)]


def _run(config: AggregationConfig, rows: torch.Tensor, weights: list[float],
         noise_multiplier: float | None) -> Any:
    agg = make_aggregator(config, rows.shape[1], rows.shape[0], noise_multiplier=noise_multiplier)
    for i in range(rows.shape[0]):
        agg.add(rows[i].clone(), weights[i], key=f"c{i}")
    return agg.finalize(torch.zeros(rows.shape[1]), torch.Generator().manual_seed(5))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_an_aggregator_clips_to_the_round_norm_and_scales_its_noise(exact: bool, weighted: bool) -> None:
    rows, weights = _updates(8, 64)
    clip, z = 1.0, 0.7
    cfg = AggregationConfig(clip_norm=clip, weighted=weighted, exact_metrics=exact)
    res = _run(cfg, rows, weights, z)
    m = res.metrics
    norms = torch.linalg.vector_norm(rows, dim=1)
    assert m["clip_norm"] == clip and m["num_unclipped"] == float(int((norms <= clip).sum()))
    assert 0 < m["num_unclipped"] < 8 and m["num_unclipped"] + m["num_clipped"] == 8
    share = max(weights) / sum(weights) if weighted else 1 / 8
    assert m["max_weight_share"] == pytest.approx(share, rel=1e-15)
    assert m["noise_sigma"] == z * clip * m["max_weight_share"]
    # the same round with the fixed noise std it computed: bit for bit the same model
    fixed = _run(AggregationConfig(clip_norm=clip, weighted=weighted, exact_metrics=exact,
                                   noise_sigma=m["noise_sigma"]), rows, weights, None)
    assert torch.equal(fixed.new_global, res.new_global)
    assert {"clip_norm", "num_unclipped", "noise_sigma"}.isdisjoint(fixed.metrics)  # the fixed path reports as before
    assert fixed.metrics == {k: v for k, v in m.items() if k not in ("clip_norm", "num_unclipped", "noise_sigma")}


def test_a_noise_multiplier_needs_a_clip_norm_and_no_fixed_noise() -> None:
    with pytest.raises(ValueError, match=r"^noise_multiplier: needs clip_norm"):
        make_aggregator(AggregationConfig(), 4, 2, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"^noise_multiplier: needs clip_norm"):
        make_aggregator(AggregationConfig(clip_norm=1.0, noise_sigma=0.1), 4, 2, noise_multiplier=1.0)


# ---- the accountant charges the combined mechanism ----

def test_the_accountant_charges_the_combined_noise_multiplier() -> None:
    adaptive = ac.resolved(ac.AdaptiveClipConfig(enabled=True, noise_multiplier=0.9), 10)  # sigma_b = 0.5
    agg = AggregationConfig()
    assert privacy.not_accounted(agg, False, adaptive) is None
    assert "adaptive_clip.noise_multiplier = 0" in str(privacy.not_accounted(agg, False, ac.AdaptiveClipConfig(
        enabled=True)))
    assert "rule" in str(privacy.not_accounted(AggregationConfig(rule="median"), False, adaptive))
    z_update = ac.update_noise_multiplier(0.9, 0.5)
    clip, share = 0.37, 0.125
    metrics = {"clip_norm": clip, "noise_sigma": z_update * clip * share, "max_weight_share": share}
    mech = privacy.round_mechanism(agg, metrics, 10, 100, adaptive)
    assert mech == privacy.RoundMechanism(0.9, 0.1)
    with pytest.raises(ValueError, match="is not z_D"):
        privacy.round_mechanism(agg, {**metrics, "noise_sigma": 2 * metrics["noise_sigma"]}, 10, 100, adaptive)
    with pytest.raises(ValueError, match="must hold clip_norm"):
        privacy.round_mechanism(agg, {"max_weight_share": share}, 10, 100, adaptive)
