"""The per-round timing record (fedserver.round_timing): phases are non-negative and sum to at most the round."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from fedcore.report import RoundReport
from fedserver.round_timing import PHASES, RoundTimer, RoundTiming, TimedReport


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.cpu = 5.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float, cpu: float = 0.0) -> None:
        self.t += dt
        self.cpu += cpu


def _check(t: RoundTiming) -> None:
    phases = t.phases()
    assert list(phases) == list(PHASES)
    assert all(v >= 0.0 for v in phases.values()), phases
    assert sum(phases.values()) <= t.round_seconds + 1e-12
    assert t.server_cpu_seconds >= 0.0


def test_a_round_on_the_critical_path_of_its_last_accepted_update() -> None:
    clock = FakeClock()
    timer = RoundTimer(clock, lambda: clock.cpu)
    clock.advance(0.5)
    timer.sampling()                       # serving
    clock.advance(0.01)
    timer.started(1, 0, 2)                 # selection 0.01
    clock.advance(0.002)
    timer.handed_out("a", 1)
    clock.advance(0.003)
    timer.handed_out("b", 1)               # b's task out at +0.005
    timer.upload_began("a", 1, timer.now())
    clock.advance(0.004)
    timer.accepted("a", 1)
    timer.upload_began("b", 1, timer.now())  # b's upload at +0.009: turnaround 0.004
    clock.advance(0.001)
    timer.accepted("b", 1)                 # upload 0.001; b is the critical client
    clock.advance(0.0005)                  # the close task is scheduled
    timer.close_began(1)
    clock.advance(0.006, cpu=0.004)
    timer.aggregated(1)
    clock.advance(0.002)
    timer.reported(1)
    clock.advance(0.003)
    timer.snapshotted(1)
    clock.advance(0.001)
    t = timer.finish(1)
    assert t is not None and (t.round, t.attempt, t.selected) == (1, 0, 2)
    want = {"selection": 0.01, "hand_out": 0.005, "turnaround": 0.004, "upload": 0.001, "aggregation": 0.006,
            "snapshot": 0.003, "report": 0.003}
    assert t.phases() == pytest.approx(want)
    assert t.round_seconds == pytest.approx(0.0325)   # the 0.5 ms wait before the close is in the round only
    assert t.server_cpu_seconds == pytest.approx(0.004)
    _check(t)
    assert list(timer.recent) == [t]
    assert timer.finish(1) is None         # closed once
    # The spread of the acceptances: a at +0.009, b at +0.010 after the start (the median of two: their mean).
    assert (t.first_update_seconds, t.median_update_seconds) == pytest.approx((0.009, 0.0095))
    row = t.row()
    assert set(row) == {*PHASES, "round", "server_cpu", "first_update", "median_update"}
    assert (row["first_update"], row["median_update"]) == pytest.approx((0.009, 0.0095))


def test_a_round_without_an_accepted_update_has_no_spread() -> None:
    clock = FakeClock()
    timer = RoundTimer(clock, lambda: clock.cpu)
    timer.started(1, 0, 3)
    clock.advance(0.5)
    t = timer.finish(1)
    assert t is not None and (t.first_update_seconds, t.median_update_seconds) == (0.0, 0.0)


def test_missing_or_out_of_order_stamps_give_zero_phases_never_negative() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stamps: list[float | None] = [rng.uniform(0, 1)]
        stamps += [None if rng.random() < 0.3 else rng.uniform(0, 2) for _ in range(9)]
        _check(RoundTiming.from_boundaries(3, 0, 10, stamps, rng.uniform(-1, 1)))
    t = RoundTiming.from_boundaries(1, 0, 1, [1.0, *itertools.repeat(None, 9)], 0.0)
    assert t.round_seconds == 0.0 and not any(t.phases().values())
    with pytest.raises(ValueError):
        RoundTiming.from_boundaries(1, 0, 1, [None] * 10, 0.0)


def test_stamps_of_another_round_or_an_untimed_round_are_ignored() -> None:
    clock = FakeClock()
    timer = RoundTimer(clock, lambda: clock.cpu)
    report = RoundReport(round=4, accepted=3)
    assert timer.timed(report) is report   # not started here (a resumed federation's round)
    timer.started(5, 1, 3)
    timer.handed_out("x", 4)
    timer.upload_began("x", 4, 0.0)
    timer.accepted("x", 4)
    clock.advance(0.01)
    timed = timer.timed(RoundReport(round=5, accepted=3))
    assert isinstance(timed, TimedReport)
    row = timed.to_dict()
    assert row["accepted"] == 3 and list(row)[-1] == "timing_seconds"
    assert row["timing_seconds"]["round"] == pytest.approx(0.01)
    assert row["timing_seconds"]["hand_out"] == 0.0
    # Every other value of the row is the plain report's.
    plain = RoundReport(round=5, accepted=3).to_dict()
    assert {k: v for k, v in row.items() if k != "timing_seconds"}.keys() == plain.keys()
    assert [f.name for f in dataclasses.fields(RoundReport)] == list(plain)
