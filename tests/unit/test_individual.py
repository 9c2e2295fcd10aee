from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from fedcore.nfl.individual import (
    INDIVIDUAL_STATE_FILE,
    STARTED,
    STOPPED,
    Event,
    IndividualState,
    Observation,
    RecoveryStarted,
    RecoveryStopped,
    load_individual_state,
    save_individual_state,
    step,
)

NR, C = 3, 2


def _run(betas: Sequence[float | None], state: IndividualState | None = None, first_round: int = 1,
         reported: Sequence[bool] = (), opt_out: bool = False, nr: int = NR, c: int = C) -> tuple[
    IndividualState, list[Event]
]:
    s = state or IndividualState()
    events: list[Event] = []
    for i, b in enumerate(betas):
        rep = reported[i] if i < len(reported) else False
        s, ev = step(s, Observation(first_round + i, b, rep), nr, c, opt_out)
        events.extend(ev)
    return s, events


def test_starts_exactly_after_nr_plus_one_negative_rounds_not_necessarily_consecutive() -> None:
    betas = [-0.1, 0.2, -0.3, 0.0, -0.2]  # three negatives: NR=3 not exceeded
    s, ev = _run(betas)
    assert ev == [] and not s.adapting and s.negative_count == 3
    s, ev = step(s, Observation(6, -0.05, False), NR, C)
    assert s.adapting and s.started_round == 6 and s.consecutive_ok == 0
    assert ev == [RecoveryStarted(6, "β̂ᵢ < 0 in 4 rounds > NR=3 while NFL is not reported", 4, -0.05)]
    assert ev[0].kind == STARTED and ev[0].to_dict()["scope"] == "individual"
    s0, ev0 = _run([-1.0], nr=0)  # NR = 0: the first negative round starts it
    assert s0.adapting and len(ev0) == 1


def test_stops_after_c_consecutive_non_negative_rounds_and_keeps_the_adapted_model() -> None:
    s, _ = _run([-1.0] * (NR + 1))
    assert s.adapting
    s, ev = _run([0.1, -0.2, 0.0], state=s, first_round=5)  # a negative resets the run of non-negatives
    assert s.adapting and s.consecutive_ok == 1 and ev == []
    s, ev = step(s, Observation(8, 0.3, False), NR, C)
    assert not s.adapting and s.stopped_round == 8 and s.negative_count == 0 and s.consecutive_ok == 0
    assert ev == [RecoveryStopped(8, "β̂ᵢ >= 0 for 2 consecutive rounds (c=2)", 2, 0.3, keep_adapted=True)]
    assert ev[0].kind == STOPPED
    # counting restarts from 0: it takes NR+1 new negatives to start again
    s, ev = _run([-1.0] * NR, state=s, first_round=9)
    assert not s.adapting and ev == []
    s, ev = step(s, Observation(12, -1.0, False), NR, C)
    assert s.adapting and s.started_round == 12 and s.stopped_round == 8


def test_opt_out_client_never_adapts() -> None:
    s, ev = _run([-1.0] * 20, opt_out=True)
    assert not s.adapting and ev == [] and s.negative_count == 20
    adapting, _ = _run([-1.0] * (NR + 1))
    s, ev = step(adapting, Observation(NR + 2, -1.0, False), NR, C, opt_out=True)  # restarted with --opt-out
    assert not s.adapting and [e.kind for e in ev] == [STOPPED] and "opt-out" in ev[0].reason


def test_the_individual_machine_is_suspended_while_the_system_reports_nfl() -> None:
    s, ev = _run([-1.0] * 10, reported=[True] * 10)
    assert ev == [] and s == IndividualState(last_round=10)
    adapting, _ = _run([-1.0] * (NR + 1))
    s, ev = _run([0.5] * 5, state=adapting, first_round=NR + 2, reported=[True] * 5)
    assert s.adapting and s.consecutive_ok == 0 and ev == []  # not stopped by its own rule meanwhile
    s, ev = _run([0.5] * C, state=s, first_round=NR + 7)  # report cancelled: its own stop rule applies again
    assert not s.adapting and [e.kind for e in ev] == [STOPPED]


def test_duplicate_rounds_and_missing_beta_change_nothing() -> None:
    s, _ = _run([-1.0, -1.0])
    again, ev = step(s, Observation(2, -1.0, False), NR, C)
    assert again == s and ev == []
    s2, ev = step(s, Observation(5, None, False), NR, C)
    assert ev == [] and s2 == IndividualState(negative_count=2, last_round=5)
    s3, _ = step(s2, Observation(6, float("nan"), False), NR, C)
    assert s3.negative_count == 2 and s3.last_round == 6


def test_step_does_not_modify_its_input_and_validates_thresholds() -> None:
    s = IndividualState(negative_count=NR)
    s2, _ = step(s, Observation(1, -1.0, False), NR, C)
    assert s == IndividualState(negative_count=NR) and s2.adapting
    with pytest.raises(ValueError, match=r"^nr: must be an integer >= 0"):
        step(s, Observation(1, -1.0, False), -1, C)
    with pytest.raises(ValueError, match=r"^c: must be an integer >= 1"):
        step(s, Observation(1, -1.0, False), NR, 0)


def test_counters_survive_a_client_restart(tmp_path: Path) -> None:
    betas: list[float | None] = [-1.0, 0.2, -0.5, -0.1, 0.3, -0.2, 0.1, 0.4, -0.3, 0.0, 0.0, -1.0]
    whole, whole_ev = _run(betas)
    assert load_individual_state(tmp_path) == IndividualState()  # nothing saved yet
    events: list[Event] = []
    for i, b in enumerate(betas):  # save after every round, "restart" (load) before the next
        s = load_individual_state(tmp_path)
        s, ev = step(s, Observation(i + 1, b, False), NR, C)
        events.extend(ev)
        save_individual_state(tmp_path, s)
    assert load_individual_state(tmp_path) == whole and events == whole_ev
    assert [e.kind for e in whole_ev] == [STARTED, STOPPED]
    assert IndividualState.from_dict(whole.to_dict()) == whole


def test_corrupt_state_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / INDIVIDUAL_STATE_FILE
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"individual_nfl\.json: unreadable individual-measure state"):
        load_individual_state(tmp_path)
    save_individual_state(tmp_path, IndividualState(negative_count=2))
    doc = json.loads(path.read_text())
    doc["state"]["negative_count"] = "two"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="negative_count: expected an integer"):
        load_individual_state(tmp_path)
    with pytest.raises(ValueError, match="adapting: expected true or false"):
        IndividualState.from_dict({"adapting": 1})
    with pytest.raises(ValueError, match="bogus: unknown field"):
        IndividualState.from_dict({"bogus": 1})
