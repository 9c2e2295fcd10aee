"""The DP accountant (fedcore.privacy, fedserver.dp_monitor): the mechanism's (z, q) from a round's numbers, the
cumulative epsilon against Opacus' own published figure, and the budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedcore import privacy
from fedcore.aggregation import AggregationConfig
from fedcore.config import ConfigError, ServerConfig, build_config
from fedcore.jsonio import strict_loads
from fedcore.report import RoundReport

pytest.importorskip("opacus", reason="the dp extra (Opacus) is not installed")

# Opacus 1.6, opacus/tests/accountants_test.py, AccountingTest.test_rdp_accountant: noise multiplier 1.5, sample
# rate 0.04, int(90 / 0.04) = 2250 steps, delta 1e-5 -> assertAlmostEqual(epsilon, 7.32911117143) (7 places).
OPACUS_Z, OPACUS_Q, OPACUS_STEPS, OPACUS_DELTA, OPACUS_EPSILON = 1.5, 0.04, 2250, 1e-5, 7.32911117143


def test_epsilon_matches_opacus_published_figure_through_the_federation_numbers() -> None:
    # A federation that gives the same mechanism: K = 40 of N = 1000 clients per round (q = 0.04), plain mean of
    # updates clipped to S = 10, sigma = z * S / K = 0.375 on the mean (z = 1.5).
    agg = AggregationConfig(weighted=False, clip_norm=10.0, noise_sigma=OPACUS_Z * 10.0 / 40)
    mech = privacy.round_mechanism(agg, {"num_updates": 40.0, "max_weight_share": 1 / 40}, selected=40,
                                   population=1000)
    # z = sigma / (S / K): 0.375 / 0.25 is exact in binary; q = 40 / 1000 rounds to the same double as 0.04
    assert mech == privacy.RoundMechanism(OPACUS_Z, OPACUS_Q)
    eps = privacy.epsilon_after([mech] * OPACUS_STEPS, OPACUS_DELTA)
    assert eps == pytest.approx(OPACUS_EPSILON, abs=5e-8)  # Opacus asserts 7 decimal places


def test_accountant_state_is_a_pure_fold_and_round_trips(tmp_path: Path) -> None:
    m1, m2 = privacy.RoundMechanism(1.0, 0.1), privacy.RoundMechanism(0.8, 0.2)
    s0 = privacy.init()
    s2 = privacy.update(privacy.update(s0, m1), m2)
    assert s0 == privacy.AccountantState() and s2.rounds == 2
    assert privacy.epsilon(s0, 1e-5) == 0.0
    e1, e2 = privacy.epsilon_after([m1], 1e-5), privacy.epsilon(s2, 1e-5)
    assert 0 < e1 < e2  # composition only adds
    text = json.dumps(s2.to_dict(), allow_nan=False)
    assert privacy.AccountantState.from_dict(strict_loads(text)) == s2
    # Opacus' own accountant, stepped the same way, agrees (same RDP orders, same conversion)
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    acc.step(noise_multiplier=0.8, sample_rate=0.2)
    assert e2 == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)


def test_sensitivity_is_the_largest_weight_share_and_q_needs_a_population() -> None:
    agg = AggregationConfig(weighted=True, clip_norm=2.0, noise_sigma=0.1)
    # weights 1, 1, 2: one client moves the mean by at most S * 2/4
    mech = privacy.round_mechanism(agg, {"num_updates": 3.0, "max_weight_share": 0.5}, selected=3, population=30)
    assert mech == privacy.RoundMechanism(0.1 / (2.0 * 0.5), 0.1)
    # unknown population: no amplification by sampling
    assert privacy.round_mechanism(agg, {"max_weight_share": 0.5}, 3, 0).sample_rate == 1.0
    # a plain mean that does not report the share: 1/n
    plain = AggregationConfig(weighted=False, clip_norm=2.0, noise_sigma=0.1)
    assert privacy.round_mechanism(plain, {"num_updates": 4.0}, 4, 8).noise_multiplier == pytest.approx(0.2)
    with pytest.raises(ValueError, match="max_weight_share"):
        privacy.round_mechanism(agg, {"num_updates": 3.0}, 3, 30)


def test_what_is_not_accounted_says_why() -> None:
    assert privacy.not_accounted(AggregationConfig(clip_norm=1.0, noise_sigma=0.1)) is None
    assert "noise_sigma = 0" in str(privacy.not_accounted(AggregationConfig(clip_norm=1.0)))
    assert "clip_norm unset" in str(privacy.not_accounted(AggregationConfig(noise_sigma=0.1)))
    assert "'median'" in str(privacy.not_accounted(AggregationConfig(rule="median", clip_norm=1.0, noise_sigma=0.1)))
    assert "DistFL" in str(privacy.not_accounted(AggregationConfig(clip_norm=1.0, noise_sigma=0.1), distfl=True))


def _config(tmp_path: Path, **dp: object) -> ServerConfig:
    overrides = [(["server", "run_dir"], str(tmp_path)), (["security", "insecure"], True),
                 (["aggregation", "clip_norm"], 1.0), (["aggregation", "noise_sigma"], 0.5),
                 (["aggregation", "weighted"], False), (["data", "options"], {"num_clients": 4})]
    overrides += [(["dp", k], v) for k, v in dp.items()]
    return build_config(ServerConfig, None, overrides)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    for field_name, value, match in [("delta", 0.0, "dp.delta"), ("delta", 1.0, "dp.delta"),
                                     ("on_budget", "halt", "dp.on_budget"), ("max_epsilon", -1.0, "dp.max_epsilon"),
                                     ("population", -1, "dp.population")]:
        with pytest.raises(ConfigError, match=match):
            _config(tmp_path, **{field_name: value})
    with pytest.raises(ConfigError, match=r"dp\.max_epsilon: .*'median'"):
        build_config(ServerConfig, None, [(["security", "insecure"], True), (["aggregation", "rule"], "median"),
                                          (["aggregation", "clip_norm"], 1.0), (["aggregation", "noise_sigma"], 0.1),
                                          (["dp", "max_epsilon"], 5.0)])


def _report(round_: int) -> RoundReport:
    return RoundReport(round=round_, selected=2, accepted=2, metrics={"num_updates": 2.0, "max_weight_share": 0.5})


def test_monitor_fills_the_report_and_stops_at_the_budget(tmp_path: Path) -> None:
    from fedserver.dp_monitor import DpMonitor

    # z = 0.5 / (1.0 * 0.5) = 1, q = 2 / 4
    mech = privacy.RoundMechanism(1.0, 0.5)
    e1, e2 = privacy.epsilon_after([mech], 1e-5), privacy.epsilon_after([mech] * 2, 1e-5)
    budget = (e1 + e2) / 2
    mon = DpMonitor(_config(tmp_path, max_epsilon=budget, on_budget="stop"))
    r1, stop1 = mon.observe(_report(1))
    assert (r1.dp_epsilon, r1.dp_delta, r1.dp_noise_multiplier, r1.dp_sample_rate) == (e1, 1e-5, 1.0, 0.5)
    assert not stop1 and not mon.stop_required
    r2, stop2 = mon.observe(_report(2))
    assert r2.dp_epsilon == e2 and stop2 and mon.stop_required
    # the slot carries it across a restart; a raised budget lets training go on, a lowered one stops at once
    saved = mon.save()
    again = DpMonitor(_config(tmp_path, max_epsilon=budget, on_budget="stop"))
    again.load(strict_loads(json.dumps(saved, allow_nan=False)))
    assert again.stop_required and again.epsilon == e2
    raised = DpMonitor(_config(tmp_path, max_epsilon=2 * e2, on_budget="stop"))
    raised.load(saved)
    assert not raised.stop_required
    r3, _ = raised.observe(_report(3))
    assert r3.dp_epsilon == privacy.epsilon_after([mech] * 3, 1e-5)
    # warn: the same crossing, no stop
    warn = DpMonitor(_config(tmp_path, max_epsilon=budget, on_budget="warn"))
    assert not warn.observe(_report(1))[1] and not warn.observe(_report(2))[1] and not warn.stop_required


def test_monitor_without_dp_leaves_the_report_alone(tmp_path: Path) -> None:
    from fedserver.dp_monitor import DpMonitor

    cfg = build_config(ServerConfig, None, [(["server", "run_dir"], str(tmp_path)), (["security", "insecure"], True)])
    mon = DpMonitor(cfg)
    r, stop = mon.observe(_report(1))
    assert not mon.enabled and not stop and math.isnan(r.dp_epsilon)


def test_a_round_without_a_sensitivity_leaves_no_guarantee(tmp_path: Path) -> None:
    from fedserver.dp_monitor import DpMonitor

    mon = DpMonitor(_config(tmp_path, max_epsilon=100.0, on_budget="stop"))
    mon.observe(_report(1))
    bad = RoundReport(round=2, selected=2, accepted=2, metrics={})  # no max_weight_share, no num_updates
    r, stop = mon.observe(bad)
    assert r.dp_epsilon == math.inf and stop and mon.stop_required
    assert mon.observe(_report(3))[0].dp_epsilon == math.inf  # it never comes back
    assert privacy.AccountantState.from_dict(strict_loads(json.dumps(mon.save()["accountant"]))) == mon.state


def test_experiment_runners_count_a_spent_budget_as_finished(tmp_path: Path) -> None:
    from tools.runs import finished

    (tmp_path / "final_model.fgt").write_bytes(b"x")
    log = tmp_path / "server.log"
    for outcome, done in (("dp_budget", True), ("stalled", False), ("completed", True)):
        log.write_text(json.dumps({"event": "federation.finished", "outcome": outcome}) + "\n")
        assert finished(tmp_path) is done, outcome
