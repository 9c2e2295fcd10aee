"""The β̂ detector's start-up guards (fedcore.nfl.detectors: beta_hat_warmup, beta_hat_plateau, beta_hat_cusum) as
pure step functions on scripted median sequences, and tools/experiments/nfl_guard.py's table recomputed from committed
rows."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.config import ConfigError, from_dict
from fedcore.nfl import (
    CANCELLED,
    DETECTORS,
    REPORTED,
    SHORT_TERM,
    STOPPED,
    NflConfig,
    NflEvent,
    NflObservation,
    NflState,
    PlateauOptions,
    init,
    step,
)
from fedcore.registry import option_names
from tools.experiments import nfl_guard

ROOT = Path(__file__).resolve().parents[2]


def _own(detector: str, **options: object) -> dict[str, object]:
    """Those of ``options`` that ``detector`` declares (one set of settings shared across detectors)."""
    return {k: v for k, v in options.items() if k in option_names(DETECTORS, detector)}


def _betas(cfg: NflConfig, medians: Sequence[float | None], state: NflState | None = None,
           first_round: int = 1) -> tuple[NflState, list[NflEvent]]:
    s = state if state is not None else init(cfg)
    events: list[NflEvent] = []
    for i, m in enumerate(medians):
        s, ev = step(s, NflObservation(first_round + i, m), cfg)
        events += ev
    return s, events


def _json_trip(s: NflState) -> NflState:
    return NflState.from_dict(json.loads(json.dumps(s.to_dict(), allow_nan=False)))


# A healthy start-up (the global model catches up with the private models, then stays ahead) and an NFL one.
# Values are multiples of 1/8 so that every running mean below is exact in binary floating point.
IDEAL = [-0.75, -0.375, -0.125, -0.125, 0.0, 0.125, 0.125, 0.0, 0.125, 0.125, 0.125, 0.125]
NFL = [-0.75, -0.875, -0.5, -0.125, -0.375, -0.625, -0.5, -0.5, -0.25, -0.5, -0.625, -0.25]


def test_the_papers_rule_reports_the_healthy_start_up_the_guards_do_not() -> None:
    paper = NflConfig(detector="beta_hat", nr=3, c=3)
    _, ev = _betas(paper, IDEAL)
    # running β̂ (mean of the last 3 medians): -0.75, -0.5625, -0.4167, -0.2083 (4th negative) -> reported at round
    # 4; then -0.0833, 0 (ok 1), 0.0833 (ok 2), 0.0833 (ok 3 = c) -> cancelled at round 8: the false alarm
    assert [(e.kind, e.round, e.count) for e in ev] == [(REPORTED, 4, 4), (CANCELLED, 8, 3)]
    for cfg in (NflConfig(detector="beta_hat_warmup", nr=3, c=3, detector_options={"warmup": 3}),
                NflConfig(detector="beta_hat_plateau", nr=3, c=3, detector_options={"plateau_rounds": 2})):
        s, ev = _betas(cfg, IDEAL)
        assert ev == [] and not s.reported and s.count <= 3, cfg.detector
    # ...and all of them report the NFL sequence, the guards later
    rounds = {d: _betas(NflConfig(detector=d, nr=3, c=3, detector_options=_own(d, warmup=3, plateau_rounds=2)),
                        NFL)[1][0].round
              for d in ("beta_hat", "beta_hat_warmup", "beta_hat_plateau")}
    assert rounds == {"beta_hat": 4, "beta_hat_warmup": 7, "beta_hat_plateau": 9}


def test_warmup_skips_w_observed_rounds_then_restarts_the_window() -> None:
    cfg = NflConfig(detector="beta_hat_warmup", nr=1, c=3, detector_options={"warmup": 2})
    s, ev = _betas(cfg, [-1.0, None, -1.0])  # the missing round is not an observation: 2 observed, still warming up
    assert ev == [] and s.armed_round is None and s.startup_seen == 2 and s.count == 0
    assert s.medians == [-1.0, -1.0] and s.beta_hat_avg == -1.0  # the common window still tracks them until arming
    s, ev = _betas(cfg, [0.5], s, first_round=4)
    assert s.armed_round == 4 and s.medians == [0.5] and s.beta_hat_avg == 0.5 and s.count == 0 and ev == []
    s, ev = _betas(cfg, [-0.75, -0.5], s, first_round=5)
    # β̂ after round 5: (0.5 - 0.75)/2 = -0.125 (count 1); after round 6: (0.5 - 0.75 - 0.5)/3 = -0.25 -> count 2 > 1
    assert ev == [NflEvent(REPORTED, 6, -0.25, 2, "beta_hat_warmup")] and s.reported and s.recovery


def test_warmup_zero_is_the_papers_rule() -> None:
    seq = [-0.5, 0.25, -0.25, -0.125, 0.5, 0.5, -1.0, -1.0, 0.25, 0.25, 0.25]
    for nr, c in ((0, 1), (1, 2), (2, 3)):
        paper = _betas(NflConfig(detector="beta_hat", nr=nr, c=c), seq)
        warm = _betas(NflConfig(detector="beta_hat_warmup", nr=nr, c=c, detector_options={"warmup": 0}), seq)
        assert [(e.kind, e.round, e.value, e.count) for e in warm[1]] == \
               [(e.kind, e.round, e.value, e.count) for e in paper[1]]
        assert warm[0].armed_round == 1


def test_plateau_arms_when_the_last_k_medians_are_not_above_the_k_before() -> None:
    cfg = NflConfig(detector="beta_hat_plateau", nr=0, c=5, detector_options={"plateau_rounds": 2})
    s, ev = _betas(cfg, [-0.75, -0.5, -0.25, 0.0, 0.25])
    # round 4: sum(-0.25, 0.0) = -0.25 > sum(-0.75, -0.5); round 5: sum(0.0, 0.25) > sum(-0.5, -0.25): rising
    assert s.armed_round is None and ev == [] and s.startup == [-0.5, -0.25, 0.0, 0.25]  # only the last 2k kept
    s, ev = _betas(cfg, [-0.25], s, first_round=6)
    # round 6: sum(0.25, -0.25) = 0.0 > sum(-0.25, 0.0) = -0.25: still rising
    assert s.armed_round is None
    s, ev = _betas(cfg, [-0.5], s, first_round=7)
    # round 7: sum(-0.25, -0.5) = -0.75 <= sum(0.0, 0.25) = 0.25: armed; the window restarts at -0.5 (< 0):
    # count 1 > NR = 0, reported at once
    assert s.armed_round == 7 and s.startup == [] and s.medians == [-0.5]
    assert ev == [NflEvent(REPORTED, 7, -0.5, 1, "beta_hat_plateau")]


def test_plateau_equal_halves_arm_and_a_rising_start_up_never_does() -> None:
    cfg = NflConfig(detector="beta_hat_plateau", nr=5, c=5, detector_options={"plateau_rounds": 1})
    assert _betas(cfg, [-0.5, -0.5])[0].armed_round == 2  # "not above": equal counts as stopped rising
    s, _ = _betas(cfg, [-1.0 + r / 64 for r in range(60)])  # strictly rising for 60 rounds
    assert s.armed_round is None and s.count == 0 and len(s.startup) == 2 and s.startup_seen == 60


@settings(max_examples=80, deadline=None)
@given(medians=st.lists(st.one_of(st.none(), st.integers(-8, 8).map(lambda i: i / 8)), max_size=30),
       detector=st.sampled_from(["beta_hat_warmup", "beta_hat_plateau"]), nr=st.integers(0, 3),
       c=st.integers(1, 4), w=st.integers(0, 4), k=st.integers(1, 3))
def test_once_armed_a_guard_is_the_papers_rule_on_the_medians_from_the_arming_round(
        medians: list[float | None], detector: str, nr: int, c: int, w: int, k: int) -> None:
    cfg = NflConfig(detector=detector, nr=nr, c=c, detector_options=_own(detector, warmup=w, plateau_rounds=k),
                    recovery=SHORT_TERM)
    s, ev = _betas(cfg, medians)
    if s.armed_round is None:
        assert ev == [] and s.count == 0
        return
    a = s.armed_round
    paper = NflConfig(detector="beta_hat", nr=nr, c=c, recovery=SHORT_TERM)
    _, paper_ev = _betas(paper, medians[a - 1:], first_round=a)
    assert [(e.kind, e.round, e.value, e.count) for e in ev] == [(e.kind, e.round, e.value, e.count)
                                                                  for e in paper_ev]
    assert all(e.detector == detector for e in ev)
    # and the cut-anywhere JSON round trip (a restarted server) changes nothing
    for cut in range(len(medians) + 1):
        s1, ev1 = _betas(cfg, medians[:cut])
        s2, ev2 = _betas(cfg, medians[cut:], _json_trip(s1), first_round=cut + 1)
        assert ev1 + ev2 == ev and s2 == s


def test_cancel_and_short_term_stop_behind_a_guard_are_the_papers() -> None:
    cfg = NflConfig(detector="beta_hat_warmup", nr=0, c=2, detector_options={"warmup": 1}, recovery=SHORT_TERM)
    s, ev = _betas(cfg, [-1.0, -0.5, 1.0, 1.0, 1.0])
    # armed at round 2 (window [-0.5]): reported; β̂ after 3: 0.25, after 4: 1.0 -> cancel at round 4 (c = 2)
    assert [(e.kind, e.round) for e in ev] == [(REPORTED, 2), (CANCELLED, 4), (STOPPED, 4)]
    assert not s.reported and not s.recovery and s.count == 0 and s.armed_round == 2  # the guard does not re-arm


def test_cusum_accumulates_the_shortfall_and_reports_above_h() -> None:
    cfg = NflConfig(detector="beta_hat_cusum", nr=0, c=2, detector_options={"cusum_k": 0.125, "cusum_h": 1.0})
    s, ev = _betas(cfg, [-0.5, 0.25, -0.625, -0.625])
    # S: 0.375, 0 (max(0, 0.375 - 0.375)), 0.5, 1.0 (= h: not above)
    assert ev == [] and s.cusum == 1.0 and s.count == 3
    s, ev = _betas(cfg, [-0.25], s, first_round=5)
    assert ev == [NflEvent(REPORTED, 5, 1.125, 4, "beta_hat_cusum")] and s.recovery
    s, ev = _betas(cfg, [-1.0], s, first_round=6)
    assert ev == [] and s.cusum == 1.125  # frozen while reported
    # running β̂ = mean of the last 2 medians: (-1 + 1)/2 = 0 (ok 1), 1.0 (ok 2) -> cancelled, S and count restart
    s, ev = _betas(cfg, [1.0, 1.0], s, first_round=7)
    assert [(e.kind, e.round, e.count) for e in ev] == [(CANCELLED, 8, 2)]
    assert s.cusum == 0.0 and s.count == 0 and not s.reported and s.recovery  # long-term: recovery stays


def test_new_settings_are_validated_by_name() -> None:
    for field, value in (("warmup", -1), ("plateau_rounds", 0), ("cusum_h", -0.5), ("cusum_k", math.nan),
                         ("cusum_h", math.inf), ("warmup", 1.5)):
        detector = {"warmup": "beta_hat_warmup", "plateau_rounds": "beta_hat_plateau"}.get(field, "beta_hat_cusum")
        for table in ({"detector": detector, "detector_options": {field: value}},
                      {"detector": detector, field: value}):  # the old flat key: read into detector_options
            with pytest.raises(ConfigError) as e:
                from_dict(NflConfig, table, "nfl").validate()
            assert e.value.field == f"nfl.detector_options.{field}"
        if not isinstance(value, float) or field != "warmup":
            with pytest.raises(ConfigError) as e:
                NflConfig(detector=detector, detector_options={field: value}).validate()
            assert e.value.field == f"nfl.detector_options.{field}"


def test_the_default_detector_is_the_plateau_guard_and_the_papers_rule_stays_by_name() -> None:
    c = NflConfig()
    assert (c.detector, c.detector_options) == ("beta_hat_plateau", PlateauOptions(plateau_rounds=2))
    assert init(NflConfig(detector="beta_hat")).detector == "beta_hat"


def test_the_guard_table_is_recomputed_from_its_committed_rows() -> None:
    from tools.experiments import nfl_guard

    res = ROOT / "docs" / "results"
    doc = (res / "nfl_guard.md").read_text()
    committed = doc.split("<!-- summarize: begin -->\n", 1)[1].split("\n<!-- summarize: end -->", 1)[0]
    groups = [(p.name, nfl_guard.vanilla_runs([str(p)])) for p in
              (res / "recovery_methods", res / "nfl_guard", res / "nfl_paper")]
    assert committed == nfl_guard.tables(groups)


def test_the_servers_snapshot_keeps_the_guards_start_up_state() -> None:
    """fedserver's NflMonitor saves the state without its history; a monitor restored mid start-up arms and reports
    in the same rounds as one that never stopped."""
    from fedcore.report import RoundReport
    from fedserver.nfl_monitor import NflMonitor

    cfg = NflConfig(nr=3, c=3)  # the default detector, beta_hat_plateau (k = 2)
    straight = NflMonitor(cfg)
    ev_straight = [straight.observe(RoundReport(round=i + 1, beta_hat=m))[1] for i, m in enumerate(NFL)]
    for cut in range(len(NFL) + 1):
        first = NflMonitor(cfg)
        ev = [first.observe(RoundReport(round=i + 1, beta_hat=m))[1] for i, m in enumerate(NFL[:cut])]
        again = NflMonitor(cfg)
        again.load(first.save())
        ev += [again.observe(RoundReport(round=cut + i + 1, beta_hat=m))[1] for i, m in enumerate(NFL[cut:])]
        assert ev == ev_straight and again.state.armed_round == straight.state.armed_round == 6


# ---- a live detect run against the replay of the same seed's FedAvg run (issue 49) ----

def _write_run(d: Path, name: str, medians: Sequence[float], nfl: Sequence[str], spec: dict[str, object]) -> None:
    rows = [{"round": i + 1, "beta_hat": m, "nfl": s, "metrics": {}} for i, (m, s) in enumerate(zip(medians, nfl,
                                                                                                  strict=True))]
    (d / f"{name}.rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"spec": spec, "finished": True, "target_rounds": len(rows), "sittings": []}
    (d / f"{name}.record.json").write_text(json.dumps(record))


def test_live_report_rounds_are_checked_against_the_fedavg_replay(tmp_path: Path) -> None:
    # FedAvg's recorded medians, negative after a start-up rise: the plateau guard arms, then NR = c = 2 counts.
    medians = [-0.75, -0.5] + [-0.5] * 10
    spec = {"nr": 2, "c": 2}
    cfg = NflConfig(detector="beta_hat_plateau", nr=2, c=2).validate()
    replayed = nfl_guard.replay(nfl_guard.observations(
        [{"round": i + 1, "beta_hat": m} for i, m in enumerate(medians)]), cfg).report
    assert replayed is not None and replayed + 3 <= len(medians)
    n = len(medians)
    _write_run(tmp_path, "nfl-fedavg-s0", medians, ["off"] * n, spec)
    for seed, live in ((0, replayed + 2), (1, replayed + 3)):
        if seed:
            _write_run(tmp_path, f"nfl-fedavg-s{seed}", medians, ["off"] * n, spec)
        states = ["watching" if r + 1 < live else "reported" for r in range(n)]
        _write_run(tmp_path, f"nfl-detect-s{seed}", medians, states, spec)
    rows = nfl_guard.agreement(nfl_guard.load_runs([str(tmp_path)]))
    assert [(a.seed, a.live, a.replayed, a.agrees) for a in rows] == [
        (0, replayed + 2, replayed, True), (1, replayed + 3, replayed, False)]
    table = nfl_guard.agreement_table(rows)
    assert "| nfl | 0 | beta_hat_plateau | 2 |" in table and "**no**" in table
    assert nfl_guard.main([str(tmp_path), "--agreement"]) == 1  # one seed off by more than 2 rounds
    (tmp_path / "nfl-detect-s1.rounds.jsonl").unlink()
    (tmp_path / "nfl-detect-s1.record.json").unlink()
    assert nfl_guard.main([str(tmp_path), "--agreement"]) == 0
