from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from fedcore import rounds as rm
from fedcore.config import RoundsConfig

LIMITS = rm.Limits(heartbeat_patience_s=30.0)


def _machine(n_clients: int, cfg: RoundsConfig, now: float = 0.0) -> rm.RoundState:
    s = rm.RoundState(phase_since=now)
    for i in range(n_clients):
        s, _ = rm.step_in_place(s, rm.Joined(f"c{i}", now, num_samples=10), cfg, LIMITS)
        s, _ = rm.step_in_place(s, rm.Polled(f"c{i}", now), cfg, LIMITS)
    return s


def _events(s: rm.RoundState, obs: rm.Observation, cfg: RoundsConfig) -> list[rm.Event]:
    _, ev = rm.step_in_place(s, obs, cfg, LIMITS)
    return ev


def test_round_starts_when_enough_clients_are_available() -> None:
    cfg = RoundsConfig(num_rounds=2, clients_per_round=3)
    s = rm.RoundState()
    for c in "abc":
        s, ev = rm.step_in_place(s, rm.Joined(c, 0.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Polled("a", 0.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Polled("b", 0.0), cfg, LIMITS)
    assert s.phase == rm.SAMPLING and ev == []  # c joined but is still preparing: not selectable yet
    s, ev = rm.step_in_place(s, rm.Polled("c", 1.0), cfg, LIMITS)
    assert s.phase == rm.TRAINING
    assert ev == [rm.RoundStarted(1, 0, ("a", "b", "c"), 1.0 + cfg.round_timeout_s)]


def test_selection_is_seeded_and_uniform_without_replacement() -> None:
    pool = [f"c{i}" for i in range(100)]
    a = rm.select_clients(pool, 10, seed=7, round_=3, attempt=0)
    assert a == rm.select_clients(list(reversed(pool)), 10, seed=7, round_=3, attempt=0)
    assert len(set(a)) == 10
    assert a != rm.select_clients(pool, 10, seed=7, round_=4, attempt=0)
    assert a != rm.select_clients(pool, 10, seed=8, round_=3, attempt=0)
    counts = dict.fromkeys(pool, 0)
    for r in range(400):
        for c in rm.select_clients(pool, 10, seed=1, round_=r, attempt=0):
            counts[c] += 1
    assert min(counts.values()) > 15 and max(counts.values()) < 70  # mean 40


def test_first_k_updates_close_the_round_and_late_ones_are_refused() -> None:
    cfg = RoundsConfig(num_rounds=3, clients_per_round=2, over_select=2.0, min_available=4)
    s = _machine(4, cfg)
    assert len(s.selected) == 4
    first, second, late = s.selected[0], s.selected[1], s.selected[2]
    s, ev = rm.step_in_place(s, rm.UpdateAccepted(first, 1, 1.0), cfg, LIMITS)
    assert ev == [] and s.phase == rm.TRAINING
    s, ev = rm.step_in_place(s, rm.UpdateAccepted(second, 1, 2.0), cfg, LIMITS)
    assert ev == [rm.RoundClosed(1, (first, second), "quorum")]
    assert rm.admission(s, late, 1) == "round 1 is closed"
    s, ev = rm.step_in_place(s, rm.Aggregated(1, 3.0), cfg, LIMITS)
    assert s.round == 2 and s.phase == rm.TRAINING
    assert isinstance(ev[0], rm.RoundStarted) and ev[0].round == 2
    assert rm.admission(s, late, 1) == "update for round 1, but the current round is 2"


def test_admission_refuses_unselected_and_duplicate_updates() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=2, min_available=3)
    s = _machine(3, cfg)
    outsider = next(c for c in ["c0", "c1", "c2"] if c not in s.selected)
    assert rm.admission(s, outsider, 1) == "client was not selected for round 1"
    c = s.selected[0]
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(c, 1, 1.0), cfg, LIMITS)
    assert "already accepted" in (rm.admission(s, c, 1) or "")


def test_deadline_with_enough_updates_aggregates_otherwise_the_round_is_rerun() -> None:
    cfg = RoundsConfig(num_rounds=2, clients_per_round=3, min_updates=2, round_timeout_s=10.0)
    s = _machine(3, cfg)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[0], 1, 1.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Tick(10.5), cfg, LIMITS)
    assert ev[0] == rm.RoundAbandoned(1, 0, 1, 2)
    assert s.round == 1 and s.attempt == 1 and s.phase == rm.TRAINING  # re-run at once with a fresh draw
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[0], 1, 11.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[1], 1, 12.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Tick(21.0), cfg, LIMITS)
    assert ev == [rm.RoundClosed(1, tuple(s.accepted), "deadline")]


def test_a_server_stall_counts_against_no_round_and_no_client() -> None:
    """A server stopped or starved for 40 s in the middle of a round (10-s deadline, 30-s patience): without
    :class:`Stalled` the first tick after it abandons the round and drops every client; with it the round keeps the
    time it had left, the clients the silence they had, and the uploads that sat unread close it as usual."""
    cfg = RoundsConfig(num_rounds=2, clients_per_round=3, min_updates=2, round_timeout_s=10.0)
    for told in (False, True):
        s = _machine(3, cfg)
        s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[0], 1, 1.0), cfg, LIMITS)
        s, _ = rm.step_in_place(s, rm.Seen(s.selected[1], 2.0), cfg, LIMITS)
        # the loop is held up from 2.0 to 42.0
        if told:
            s, ev = rm.step_in_place(s, rm.Stalled(42.0, 40.0), cfg, LIMITS)
            assert ev == [] and (s.deadline, s.phase_since) == pytest.approx((10.0 + 40.0, 0.0 + 40.0))
            assert [s.clients[c].last_seen for c in s.selected] == pytest.approx([1.0 + 40.0, 2.0 + 40.0, 0.0 + 40.0])
        s, ev = rm.step_in_place(s, rm.Tick(42.0), cfg, LIMITS)
        if not told:
            assert rm.RoundAbandoned(1, 0, 1, 2) in ev
            assert len([e for e in ev if isinstance(e, rm.ClientDropped)]) == 3
            continue
        assert ev == [] and s.phase == rm.TRAINING and s.alive_ids() == ["c0", "c1", "c2"]
        s, ev = rm.step_in_place(s, rm.UpdateAccepted(s.selected[1], 1, 42.1), cfg, LIMITS)
        s, ev = rm.step_in_place(s, rm.UpdateAccepted(s.selected[2], 1, 42.2), cfg, LIMITS)
        assert ev == [rm.RoundClosed(1, tuple(s.selected), "quorum")]
    # nothing to move: a non-positive or non-finite stall changes nothing
    s = _machine(3, cfg)
    before = s.to_dict()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        s, ev = rm.step_in_place(s, rm.Stalled(5.0, bad), cfg, LIMITS)
        assert ev == [] and s.to_dict() == before


def test_rejected_and_dead_clients_do_not_hold_a_round() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=3, min_updates=1)
    s = _machine(3, cfg)
    a, b, c = s.selected
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(a, 1, 1.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.UpdateRejected(b, 1, "bad tensor", 1.0), cfg, LIMITS)
    assert s.rejected_in_round == 1 and s.rejected_total == 1
    s, ev = rm.step_in_place(s, rm.Left(c, 2.0), cfg, LIMITS)
    assert ev == [rm.RoundClosed(1, (a,), "all_responded")]


def test_silent_clients_are_dropped_on_tick_and_come_back_on_join() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=2)
    s = _machine(2, cfg)
    s, _ = rm.step_in_place(s, rm.Seen("c0", 25.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Tick(31.0), cfg, LIMITS)
    assert rm.ClientDropped("c1", 31.0) in ev
    assert s.alive_ids() == ["c0"]
    s, _ = rm.step_in_place(s, rm.Joined("c1", 32.0), cfg, LIMITS)
    assert s.alive_ids() == ["c0", "c1"] and s.available_ids() == ["c0", "c1"]


def test_sampling_timeout_stalls_the_federation_instead_of_waiting_forever() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=5, min_updates=2, sampling_timeout_s=60.0)
    s = _machine(1, cfg)
    s, ev = rm.step_in_place(s, rm.Tick(61.0), cfg, rm.Limits(heartbeat_patience_s=100.0))
    assert s.phase == rm.FINISHED and s.outcome == "stalled"
    assert ev == [rm.FederationFinished(0, "stalled")]


def test_sampling_timeout_starts_a_smaller_round_when_min_updates_are_there() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=5, min_updates=2, sampling_timeout_s=60.0)
    s = _machine(3, cfg)
    assert s.phase == rm.SAMPLING
    s, ev = rm.step_in_place(s, rm.Tick(61.0), cfg, rm.Limits(heartbeat_patience_s=100.0))
    assert isinstance(ev[0], rm.RoundStarted) and len(ev[0].selected) == 3


def test_last_round_finishes_the_federation() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=1)
    s = _machine(1, cfg)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted("c0", 1, 1.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Aggregated(1, 2.0), cfg, LIMITS)
    assert ev == [rm.FederationFinished(1, "completed")]
    assert s.completed_rounds == 1
    assert rm.admission(s, "c0", 1) == "the federation has finished"


def test_state_serializes_to_json_and_back() -> None:
    cfg = RoundsConfig(num_rounds=3, clients_per_round=2)
    s = _machine(3, cfg)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[0], 1, 1.0), cfg, LIMITS)
    again = rm.RoundState.from_dict(json.loads(json.dumps(s.to_dict())))
    assert again == s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_observations_give_same_events(seed: int) -> None:
    cfg = RoundsConfig(num_rounds=3, clients_per_round=2, over_select=1.5, seed=seed)
    runs = []
    for _ in range(2):
        s = _machine(6, cfg)
        log = [tuple(s.selected)]
        for r in (1, 2):
            s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[0], r, r), cfg, LIMITS)
            s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[1], r, r), cfg, LIMITS)
            s, _ = rm.step_in_place(s, rm.Aggregated(r, r + 0.5), cfg, LIMITS)
            log.append(tuple(s.selected))
        runs.append(log)
    assert runs[0] == runs[1]


def test_failed_aggregation_reruns_the_round() -> None:
    cfg = RoundsConfig(num_rounds=2, clients_per_round=2, min_updates=2)
    s = _machine(2, cfg)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted("c0", 1, 1.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted("c1", 1, 1.0), cfg, LIMITS)
    assert s.phase == rm.AGGREGATING
    s, ev = rm.step_in_place(s, rm.AggregationFailed(1, "krum needs more updates", 2.0), cfg, LIMITS)
    assert ev[0] == rm.RoundAbandoned(1, 0, 2, 2, "krum needs more updates")
    assert isinstance(ev[1], rm.RoundStarted) and ev[1].round == 1 and ev[1].attempt == 1
    assert s.round == 1 and s.phase == rm.TRAINING


def test_a_failed_attempt_is_re_run_at_once_not_held_to_its_deadline() -> None:
    cfg = RoundsConfig(num_rounds=2, clients_per_round=2, round_timeout_s=60.0)
    s = _machine(2, cfg)
    assert s.phase == rm.TRAINING and s.attempt == 0
    # another attempt's failure, or one reported while aggregating, changes nothing
    assert rm.step_in_place(s, rm.AttemptFailed(1, 5, "old", 1.0), cfg, LIMITS)[1] == []
    s, ev = rm.step_in_place(s, rm.AttemptFailed(1, 0, "secure aggregation: too_many_dropouts", 2.0), cfg, LIMITS)
    assert ev[0] == rm.RoundAbandoned(1, 0, 0, 1, "secure aggregation: too_many_dropouts")
    assert isinstance(ev[1], rm.RoundStarted) and (ev[1].round, ev[1].attempt) == (1, 1)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted("c0", 1, 3.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted("c1", 1, 3.0), cfg, LIMITS)
    assert s.phase == rm.AGGREGATING
    assert rm.step_in_place(s, rm.AttemptFailed(1, 1, "late", 4.0), cfg, LIMITS)[1] == []
    assert s.phase == rm.AGGREGATING


def test_connected_clients_are_not_dropped_and_contact_revives() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=3)
    s = _machine(2, cfg)
    s, ev = rm.step_in_place(s, rm.Tick(100.0, connected=frozenset({"c0"})), cfg, LIMITS)
    assert ev == [rm.ClientDropped("c1", 100.0)]
    assert s.alive_ids() == ["c0"]
    s, _ = rm.step_in_place(s, rm.Seen("c1", 101.0), cfg, LIMITS)
    assert s.alive_ids() == ["c0", "c1"]


# ---- resume after a restart ----

def _through_json(s: rm.RoundState) -> rm.RoundState:
    return rm.RoundState.from_dict(json.loads(json.dumps(s.to_dict())))


def test_resume_from_a_completed_round_moves_to_the_next_round_with_the_same_selection() -> None:
    # Selection draws from the available clients: the same pool (min_available = the fleet) gives the same draw.
    cfg = RoundsConfig(num_rounds=3, clients_per_round=2, min_available=4)
    s = _machine(4, cfg)
    assert s.phase == rm.TRAINING and s.round == 1
    for c in list(s.selected):
        s, _ = rm.step_in_place(s, rm.UpdateAccepted(c, 1, 1.0), cfg, LIMITS)
    assert s.phase == rm.AGGREGATING
    saved = _through_json(s)  # the snapshot of round 1, taken while it aggregates
    s, _ = rm.step_in_place(s, rm.Aggregated(1, 2.0), cfg, LIMITS)  # the uninterrupted run goes on
    assert s.phase == rm.TRAINING and s.round == 2
    uninterrupted_selection = list(s.selected)

    r = rm.resume(saved, completed_rounds=1, config=cfg, now=500.0)
    assert (r.round, r.attempt, r.phase, r.phase_since) == (2, 0, rm.SAMPLING, 500.0)
    assert r.selected == [] and r.accepted == [] and r.deadline == 0.0
    # Every client must re-join and poll before it can be selected again; their registry entries survive.
    assert sorted(r.clients) == ["c0", "c1", "c2", "c3"] and not any(c.alive or c.ready for c in r.clients.values())
    assert [c.index for c in r.clients.values()] == [0, 1, 2, 3]
    for i in range(4):
        r, _ = rm.step_in_place(r, rm.Joined(f"c{i}", 501.0, num_samples=10), cfg, LIMITS)
        r, _ = rm.step_in_place(r, rm.Polled(f"c{i}", 501.0), cfg, LIMITS)
    assert r.phase == rm.TRAINING and r.selected == uninterrupted_selection


def test_resume_re_runs_an_in_flight_round_with_its_attempt_counter() -> None:
    cfg = RoundsConfig(num_rounds=5, clients_per_round=2, round_timeout_s=10.0)
    s = _machine(3, cfg)
    s, ev = rm.step_in_place(s, rm.Tick(11.0, frozenset({"c0", "c1", "c2"})), cfg, LIMITS)  # attempt 0 times out
    assert any(isinstance(e, rm.RoundAbandoned) for e in ev) and s.attempt == 1 and s.phase == rm.TRAINING
    progress = _through_json(s)
    r = rm.resume(progress, completed_rounds=0, config=cfg, now=0.0)
    assert (r.round, r.attempt, r.phase) == (1, 1, rm.SAMPLING)


def test_resume_of_a_finished_federation_stays_finished_unless_more_rounds_are_asked() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=1)
    s = _machine(1, cfg)
    s, _ = rm.step_in_place(s, rm.UpdateAccepted("c0", 1, 1.0), cfg, LIMITS)
    saved = _through_json(s)
    done = rm.resume(_through_json(saved), completed_rounds=1, config=cfg, now=0.0)
    assert done.phase == rm.FINISHED and done.outcome == "completed" and done.completed_rounds == 1
    more = rm.resume(_through_json(saved), completed_rounds=1, config=RoundsConfig(num_rounds=3, clients_per_round=1),
                     now=0.0)
    assert (more.phase, more.round, more.outcome) == (rm.SAMPLING, 2, "")


def test_resume_ignores_a_progress_record_of_another_round() -> None:
    cfg = RoundsConfig(num_rounds=5, clients_per_round=1)
    s = rm.RoundState(round=4, attempt=2, phase=rm.TRAINING)
    r = rm.resume(s, completed_rounds=1, config=cfg, now=0.0)
    assert (r.round, r.attempt, r.phase) == (2, 0, rm.SAMPLING)


# ---- defaults that survive lost devices (issue 13) ----

def test_default_min_updates_is_half_of_k_rounded_up() -> None:
    assert RoundsConfig(clients_per_round=10).effective_min_updates == 5
    assert RoundsConfig(clients_per_round=3).effective_min_updates == 2
    assert RoundsConfig(clients_per_round=1).effective_min_updates == 1
    assert RoundsConfig(clients_per_round=10, min_updates=10).effective_min_updates == 10


def test_a_lost_client_closes_the_round_and_is_not_waited_for_afterwards() -> None:
    cfg = RoundsConfig(num_rounds=3, clients_per_round=3, round_timeout_s=100.0)
    s = _machine(3, cfg)
    assert s.assembled and s.phase == rm.TRAINING
    lost = s.selected[2]
    for i, c in enumerate(s.selected[:2]):
        s, _ = rm.step_in_place(s, rm.UpdateAccepted(c, 1, 10.0 + i), cfg, LIMITS)
        s, _ = rm.step_in_place(s, rm.Polled(c, 11.0 + i), cfg, LIMITS)
    assert s.phase == rm.TRAINING  # the lost client is still within its heartbeat patience
    s, ev = rm.step_in_place(s, rm.Tick(31.0), cfg, LIMITS)  # silent for 31 s > 30 s: dropped
    assert rm.ClientDropped(lost, 31.0) in ev
    assert rm.RoundClosed(1, tuple(s.accepted), "all_responded") in ev
    s, ev = rm.step_in_place(s, rm.Aggregated(1, 32.0), cfg, LIMITS)
    # the next round starts at once with the two live clients instead of waiting for K = 3 (or stalling)
    assert rm.start_needs(s, cfg) == 2
    assert ev == [rm.RoundStarted(2, 0, tuple(sorted(c for c in ["c0", "c1", "c2"] if c != lost)), 132.0)]


def test_the_first_round_waits_for_the_whole_fleet_to_assemble() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=3)
    s = _machine(2, cfg)  # two of three ready: min_updates (2) is there, but the fleet has not assembled
    assert s.phase == rm.SAMPLING and not s.assembled and rm.start_needs(s, cfg) == 3
    s, _ = rm.step_in_place(s, rm.Tick(5.0), cfg, LIMITS)
    assert s.phase == rm.SAMPLING


def test_a_live_client_still_preparing_is_waited_for() -> None:
    cfg = RoundsConfig(num_rounds=2, clients_per_round=2)
    s = _machine(2, cfg)
    for c in s.selected:
        s, _ = rm.step_in_place(s, rm.UpdateAccepted(c, 1, 1.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.Seen("c0", 20.0), cfg, LIMITS)
    s, ev = rm.step_in_place(s, rm.Tick(31.5), cfg, LIMITS)  # c1 lost while the round aggregates
    assert rm.ClientDropped("c1", 30.5) in ev
    s, _ = rm.step_in_place(s, rm.Joined("c9", 32.0), cfg, LIMITS)  # a new client: alive, still preparing
    s, ev = rm.step_in_place(s, rm.Aggregated(1, 33.0), cfg, LIMITS)
    assert s.phase == rm.SAMPLING and ev == [] and rm.start_needs(s, cfg) == 2
    s, ev = rm.step_in_place(s, rm.Polled("c9", 40.0), cfg, LIMITS)
    assert isinstance(ev[0], rm.RoundStarted) and ev[0].selected == ("c0", "c9")


def test_resume_waits_for_the_fleet_again() -> None:
    cfg = RoundsConfig(num_rounds=3, clients_per_round=2)
    s = _machine(2, cfg)
    assert s.assembled
    s = rm.resume(rm.RoundState.from_dict(s.to_dict()), completed_rounds=0, config=cfg, now=50.0)
    assert not s.assembled and rm.start_needs(s, cfg) == 2


def test_late_uploads_are_counted_apart_from_other_refusals() -> None:
    cfg = RoundsConfig(num_rounds=2, clients_per_round=1, over_select=2.0, min_available=2)
    s = _machine(2, cfg)
    first, late = s.selected
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(first, 1, 1.0), cfg, LIMITS)
    assert s.phase == rm.AGGREGATING
    s, _ = rm.step_in_place(s, rm.UpdateRejected(late, 1, "round 1 is closed", 2.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.Aggregated(1, 3.0), cfg, LIMITS)
    s, _ = rm.step_in_place(s, rm.UpdateRejected(late, 1, "update for round 1, but the current round is 2", 4.0), cfg,
                            LIMITS)
    chosen = s.selected[0]
    s, _ = rm.step_in_place(s, rm.UpdateRejected(chosen, 2, "bad tensor", 5.0), cfg, LIMITS)  # on time: not late
    assert s.late_total == 2 and s.rejected_total == 3
    assert rm.RoundState.from_dict(s.to_dict()).late_total == 2


def test_a_snapshot_keeps_what_a_restart_keeps_and_old_snapshots_still_load() -> None:
    """to_saved() drops each client's liveness (resume resets it): restored from it, or from the full to_dict()
    an older server saved, the resumed state is the same; a registry entry of another shape is refused."""
    cfg = RoundsConfig(num_rounds=3, clients_per_round=2)
    s = _machine(4, cfg)
    s.clients["c1"].opt_out, s.clients["c2"].attacker, s.clients["c3"].num_samples = True, True, 77
    s, _ = rm.step_in_place(s, rm.UpdateAccepted(s.selected[0], 1, 1.0), cfg, LIMITS)
    saved = json.loads(json.dumps(s.to_saved()))
    assert saved["clients"][3] == ["c3", 3, 77, False, False]
    assert {k: v for k, v in saved.items() if k != "clients"} == {
        k: v for k, v in s.to_dict().items() if k != "clients"}
    restored = rm.RoundState.from_dict(saved)
    assert list(restored.clients) == list(s.clients)
    assert not any(r.alive or r.ready for r in restored.clients.values())  # liveness unknown until re-join
    new = rm.resume(restored, completed_rounds=0, config=cfg, now=50.0)
    old = rm.resume(_through_json(s), completed_rounds=0, config=cfg, now=50.0)
    assert new == old
    for bad in ([["c0", 0, 1, False]], [[0, 0, 1, False, False]], "c0"):
        with pytest.raises(ValueError, match=r"round_state\.clients"):
            rm.RoundState.from_dict({**saved, "clients": bad})


def test_to_dict_equals_asdict_and_copies_what_it_returns() -> None:
    import dataclasses

    cfg = RoundsConfig(num_rounds=2, clients_per_round=2)
    s = _machine(3, cfg)
    s, _ = rm.step_in_place(s, rm.UpdateRejected(s.selected[0], 1, "bad", 1.0), cfg, LIMITS)
    d = s.to_dict()
    assert d == {k: v for k, v in dataclasses.asdict(s).items() if k not in rm.DERIVED_FIELDS}
    d["clients"]["c0"]["alive"] = False
    d["selected"].append("x")
    assert s.clients["c0"].alive and "x" not in s.selected


def _fresh_counts(s: rm.RoundState) -> tuple[int, int]:
    alive = [c for c in s.clients.values() if c.alive]
    return len(alive), sum(c.ready for c in alive)


def _random_observation(s: rm.RoundState, rng: Any, ids: list[str], now: float) -> tuple[str, rm.Observation]:
    """The next step of a seeded random history (``rng``: numpy's generator): joins, polls, contacts, declines,
    leaves, uploads of selected clients, ticks with and without liveness, aggregations; and the client it names."""
    cid = ids[int(rng.integers(len(ids)))]
    kind = int(rng.integers(9))
    obs: rm.Observation
    if kind == 0:
        obs = rm.Joined(cid, now, num_samples=5)
    elif kind in (1, 2):
        obs = rm.Polled(cid, now)
    elif kind == 3:
        obs = rm.Seen(cid, now)
    elif kind == 4:
        obs = rm.Declined(cid, now)
    elif kind == 5:
        obs = rm.Left(cid, now)
    elif kind == 6 and s.phase == rm.TRAINING and s.selected:
        obs = rm.UpdateAccepted(s.selected[int(rng.integers(len(s.selected)))], s.round, now)
    elif kind == 7:
        obs = rm.Tick(now, frozenset(ids[:3]), liveness=bool(rng.integers(2)))
    elif s.phase == rm.AGGREGATING:
        obs = rm.Aggregated(s.round, now)
    else:
        obs = rm.Tick(now, liveness=False)
    return cid, obs


def _random_history(s: rm.RoundState, seed: int, steps: int, mean_gap_s: float, clients: int) -> Iterator[
    tuple[str, rm.Observation, float]
]:
    """(client, observation, now) of a seeded random history over ``s``, which the caller steps in place between
    them (``rm.step_in_place`` updates the state it is given); ends early once the federation finished."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = [f"c{i}" for i in range(clients)]
    now = 0.0
    for _ in range(steps):
        now += float(rng.exponential(mean_gap_s))
        cid, obs = _random_observation(s, rng, ids, now)
        yield cid, obs, now
        if s.phase == rm.FINISHED:
            return


def test_counts_kept_by_step_equal_a_fresh_count_through_a_random_history() -> None:
    """The (alive, ready) counts step keeps instead of counting every client per contact stay exact through joins,
    polls, declines, leaves, drops, grace, uploads and round changes (seeded random history of 3,000 steps)."""
    cfg = RoundsConfig(num_rounds=50, clients_per_round=4, min_available=6, round_timeout_s=5.0)
    limits = rm.Limits(heartbeat_patience_s=3.0, poll_grace_s=1.0)
    s, kept = rm.RoundState(), 0
    for _, obs, _ in _random_history(s, seed=7, steps=3000, mean_gap_s=0.2, clients=12):
        rm.step_in_place(s, obs, cfg, limits)
        if s.counts is not None:
            kept += 1
            assert s.counts == _fresh_counts(s), (obs, s.counts)
        assert s.alive_and_available() == _fresh_counts(s)
    assert kept > 1000  # the kept counts were in use, not recounted every step
    assert s.round > 3  # the history went through rounds


def test_joins_keep_the_counts_instead_of_counting_the_fleet() -> None:
    """After the first count, a join or a first poll updates the counts by one: no pass over every client (what
    made a 10,000-client fleet's joins cost 10^8 record visits)."""
    cfg = RoundsConfig(num_rounds=1, clients_per_round=10, min_available=2000)
    s = rm.RoundState()
    s, _ = rm.step_in_place(s, rm.Tick(0.0), cfg, LIMITS)
    assert s.counts == (0, 0)
    for i in range(1500):
        s, _ = rm.step_in_place(s, rm.Joined(f"c{i}", 0.1), cfg, LIMITS)
        s, _ = rm.step_in_place(s, rm.Polled(f"c{i}", 0.2), cfg, LIMITS)
    assert s.counts == (1500, 1500) == _fresh_counts(s)
    s, _ = rm.step_in_place(s, rm.Left("c3", 0.3), cfg, LIMITS)
    assert s.counts == (1499, 1499)
    assert rm.RoundState.from_dict(s.to_dict()).counts is None  # derived: never saved, counted afresh


def test_a_tick_without_liveness_drops_no_one() -> None:
    cfg = RoundsConfig(num_rounds=1, clients_per_round=2, min_available=3)
    s = _machine(2, cfg)
    s, ev = rm.step_in_place(s, rm.Tick(100.0, liveness=False), cfg, LIMITS)
    assert not any(isinstance(e, rm.ClientDropped) for e in ev) and all(c.alive for c in s.clients.values())
    s, ev = rm.step_in_place(s, rm.Tick(100.0), cfg, LIMITS)
    assert sum(isinstance(e, rm.ClientDropped) for e in ev) == 2


def test_a_quiet_contact_skips_only_what_would_change_nothing() -> None:
    """A contact from a client already alive (and ready) skips the round's re-evaluation unless a time-driven step is
    due (``_nothing_due``): through a seeded random history of 4,000 steps, re-evaluating after every skipped
    contact changes neither the state nor the events, and the skip is taken (the O(K) pass is saved)."""
    import copy

    cfg = RoundsConfig(num_rounds=60, clients_per_round=4, min_available=6, round_timeout_s=3.0)
    limits = rm.Limits(heartbeat_patience_s=3.0, poll_grace_s=1.0)
    s, skipped = rm.RoundState(), 0
    for cid, obs, now in _random_history(s, seed=11, steps=4000, mean_gap_s=0.1, clients=10):
        rec = s.clients.get(cid)
        quiet = (isinstance(obs, rm.Seen | rm.Polled) and rec is not None and rec.alive
                 and (rec.ready or isinstance(obs, rm.Seen)))
        skip = quiet and rm._nothing_due(s, now, limits)
        rm.step_in_place(s, obs, cfg, limits)
        if skip:
            skipped += 1
            again = copy.deepcopy(s)
            events: list[rm.Event] = []
            rm._advance(again, now, cfg, limits, events)
            assert events == [] and again.to_dict() == s.to_dict() and again.graced == s.graced, (obs, events)
    assert skipped > 500 and s.round > 5, (skipped, s.round)


def test_the_answered_clients_kept_by_step_decide_as_a_fresh_set_would() -> None:
    """Who answered and who is still waiting are kept from the lists' growth instead of built per observation (O(K)
    each): through a seeded random history of 6,000 steps with refusals and declines of selected clients, a machine
    that keeps them and one made to build them afresh before every step give the same events and states, and the kept
    sets equal fresh ones after every step; they were carried over (not rebuilt) in most steps of a round; admission,
    which reads them, answers every client as the lists alone would."""
    import copy

    import numpy as np

    cfg = RoundsConfig(num_rounds=80, clients_per_round=5, min_available=7, round_timeout_s=3.0)
    limits = rm.Limits(heartbeat_patience_s=3.0, poll_grace_s=1.0)
    kept, fresh = rm.RoundState(), rm.RoundState()
    rng = np.random.default_rng(5)
    carried = 0
    for _, obs, now in _random_history(kept, seed=13, steps=6000, mean_gap_s=0.1, clients=12):
        if kept.phase == rm.TRAINING and kept.selected and rng.random() < 0.04:  # a selected one refused or declining
            cid = kept.selected[int(rng.integers(len(kept.selected)))]
            obs = (rm.UpdateRejected(cid, kept.round, "refused", now) if rng.random() < 0.6
                   else rm.Declined(cid, now))
        before = kept.answered
        fresh.answered = None
        _, ev_kept = rm.step_in_place(kept, obs, cfg, limits)
        _, ev_fresh = rm.step_in_place(fresh, copy.deepcopy(obs), cfg, limits)
        assert ev_kept == ev_fresh, obs
        assert kept.to_dict() == fresh.to_dict() and kept.graced == fresh.graced, obs
        a = kept.answered
        if a is not None and a.selected is kept.selected:
            done = set(kept.accepted) | set(kept.rejected) | set(kept.declined)
            assert a.done == done and a.waiting == set(kept.selected) - done, obs
            carried += a is before
        for cid in (f"c{i}" for i in range(12)):  # admission answers as the lists do, every client, every step
            for r in (kept.round, kept.round - 1):
                by_lists = rm.closed_reason(kept, r) or rm.answered_reason(kept, cid, r)  # no derived sets
                assert rm.admission(kept, cid, r) == by_lists, (cid, r, obs)
    assert kept.round > 8 and kept.rejected_total > 20 and carried > 500, (kept.round, kept.rejected_total, carried)
    s = rm.RoundState.from_dict(kept.to_dict())
    assert s.answered is None and "answered" not in kept.to_dict()  # derived: never saved


def test_a_quiet_contact_takes_the_short_path_to_what_the_general_one_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quiet contact (``_quiet_contact``: a Seen or Polled of a client already alive, and ready for a poll, nothing
    due) returns after moving its client's ``last_seen``: through a seeded random history of 5,000 steps, a machine
    made to take the general path for every observation (the short path off) gives the same events, states, counts
    and derived sets after every step; and the short path was taken for most contacts."""
    import copy

    cfg = RoundsConfig(num_rounds=80, clients_per_round=4, min_available=6, round_timeout_s=3.0)
    limits = rm.Limits(heartbeat_patience_s=3.0, poll_grace_s=1.0)
    short, general = rm.RoundState(), rm.RoundState()
    quiet_contact = rm._quiet_contact
    taken = contacts = 0
    for _, obs, _ in _random_history(short, seed=17, steps=5000, mean_gap_s=0.1, clients=10):
        contacts += isinstance(obs, rm.Seen | rm.Polled)
        taken += quiet_contact(short, obs, limits) is not None
        _, ev_short = rm.step_in_place(short, obs, cfg, limits)
        with monkeypatch.context() as m:
            m.setattr(rm, "_quiet_contact", lambda *_: None)
            _, ev_general = rm.step_in_place(general, copy.deepcopy(obs), cfg, limits)
        assert ev_short == ev_general, obs
        assert short.to_dict() == general.to_dict(), obs
        assert (short.counts, short.graced) == (general.counts, general.graced), obs
    assert short.round > 8 and taken > contacts // 2, (short.round, taken, contacts)
