"""Buffered asynchronous rounds (FedBuff): the staleness weights, the settings' checks, and the round machine's
buffered branch driven observation by observation (like tests/unit/test_rounds.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedcore import buffered as bf
from fedcore import rounds as rm
from fedcore.config import ConfigError, RoundsConfig, ServerConfig, validate_server_config

LIMITS = rm.Limits(heartbeat_patience_s=30.0)


def _cfg(**kw: object) -> RoundsConfig:
    base: dict[str, object] = {"num_rounds": 3, "clients_per_round": 2, "mode": "buffered", "concurrency": 3,
                               "max_staleness": 1, "round_timeout_s": 10.0}
    base.update(kw)
    return RoundsConfig(**base)  # type: ignore[arg-type]


def _fleet(n: int, cfg: RoundsConfig, limits: rm.Limits = LIMITS) -> tuple[rm.RoundState, list[rm.Event]]:
    s, events = rm.RoundState(), []
    for i in range(n):
        s, ev = rm.step_in_place(s, rm.Joined(f"c{i}", 0.0, num_samples=10), cfg, limits)
        events += ev
        s, ev = rm.step_in_place(s, rm.Polled(f"c{i}", 0.0), cfg, limits)
        events += ev
    return s, events


def _deliver(s: rm.RoundState, cfg: RoundsConfig, clients: list[str], now: float = 0.0,
             limits: rm.Limits = LIMITS) -> list[rm.Event]:
    events: list[rm.Event] = []
    for c in clients:
        _, ev = rm.step_in_place(s, rm.TaskDelivered(c, s.round, now), cfg, limits)
        events += ev
    return events


def test_staleness_weights_are_fedbuffs_and_the_registered_options() -> None:
    assert bf.staleness_weight("polynomial", 0, 0.5, 0.0) == 1.0
    assert bf.staleness_weight("polynomial", 3, 0.5, 0.0) == 0.5  # 1/sqrt(1 + 3), exact in binary
    assert bf.staleness_weight("polynomial", 8, 0.5, 0.0) == pytest.approx(1 / 3, rel=1e-15)
    assert bf.staleness_weight("constant", 7, 0.5, 0.0) == 1.0
    assert [bf.staleness_weight("hinge", s, 1.0, 2.0) for s in (0, 2, 3, 6)] == [1.0, 1.0, 0.5, 0.2]
    with pytest.raises(ConfigError, match=r"^rounds\.staleness: unknown"):
        bf.staleness_weight("nope", 1, 0.5, 0.0)


@pytest.mark.parametrize(("field", "value", "where"), [
    ("mode", "async", "rounds.mode"), ("concurrency", 1, "rounds.concurrency"),
    ("max_staleness", -1, "rounds.max_staleness"), ("staleness", "linear", "rounds.staleness"),
    ("staleness_a", math.inf, "rounds.staleness_a")])
def test_settings_are_checked_naming_the_field(field: str, value: object, where: str) -> None:
    c = ServerConfig()
    c.rounds = _cfg(**{field: value})
    with pytest.raises(ConfigError) as e:
        validate_server_config(c)
    assert e.value.field == where


def test_replay_needs_buffered_rounds_and_distfl_is_refused() -> None:
    c = ServerConfig()
    c.rounds = RoundsConfig(replay="arrivals.jsonl")
    with pytest.raises(ConfigError, match=r"^rounds\.replay"):
        validate_server_config(c)
    c = ServerConfig()
    c.rounds = _cfg()
    c.distfl.enabled = True
    with pytest.raises(ConfigError, match=r"^rounds\.mode: buffered rounds do not support distfl"):
        validate_server_config(c)


def test_buffer_fills_with_m_updates_and_devices_in_flight_carry_over() -> None:
    cfg = _cfg(min_available=5)
    s, events = _fleet(5, cfg)
    started = [e for e in events if isinstance(e, rm.RoundStarted)]
    granted = [e for e in events if isinstance(e, rm.TasksGranted)]
    assert len(started) == 1 and s.phase == rm.TRAINING and s.round == 1
    first = list(granted[0].clients)
    assert len(first) == 3 and first == rm.select_clients([f"c{i}" for i in range(5)], 3, 0, 1, 1000)
    assert s.buffered is not None and s.buffered.flight == dict.fromkeys(first, 1)
    assert _deliver(s, cfg, first) == [rm.TaskHanded(c, 1) for c in first]
    a, b, late = first
    _, ev = rm.step_in_place(s, rm.UpdateAccepted(a, 1, 1.0), cfg, LIMITS)
    assert ev[0] == rm.UpdateBuffered(a, 1, 1, 1)
    regrant = [e for e in ev if isinstance(e, rm.TasksGranted)]
    assert len(regrant) == 1 and a not in regrant[0].clients  # a slot freed: someone free is granted it
    _, ev = rm.step_in_place(s, rm.UpdateAccepted(b, 1, 2.0), cfg, LIMITS)
    assert ev == [rm.UpdateBuffered(b, 1, 1, 2), rm.RoundClosed(1, (a, b), "buffer_full")]
    assert s.phase == rm.AGGREGATING
    # while the buffer aggregates an update waits (RETRY); once round 2 is open it is 1 round stale
    assert rm.buffered_admission(s, late, 1, cfg, LIMITS) == (bf.RETRY, "round 1's buffer is being aggregated; "
                                                                        "send the update again")
    _, ev = rm.step_in_place(s, rm.Aggregated(1, 3.0), cfg, LIMITS)
    assert isinstance(ev[0], rm.RoundStarted) and ev[0].round == 2
    assert rm.buffered_admission(s, late, 1, cfg, LIMITS) is None
    _, ev = rm.step_in_place(s, rm.UpdateAccepted(late, 1, 4.0), cfg, LIMITS)
    assert ev[0] == rm.UpdateBuffered(late, 1, 2, 3)  # staleness 1: trained from round 1's model, in round 2's
    assert late not in s.buffered.flight


def test_stale_and_unsolicited_updates_are_refused_with_the_reason() -> None:
    cfg = _cfg(max_staleness=0, min_available=5)
    s, events = _fleet(5, cfg)
    first = [c for e in events if isinstance(e, rm.TasksGranted) for c in e.clients]
    _deliver(s, cfg, first)
    free = next(c for c in s.clients if c not in first)
    refusal = rm.buffered_admission(s, free, 1, cfg, LIMITS)
    assert refusal is not None and refusal[0] == bf.REFUSE
    assert refusal[1].startswith("this client holds no task from round 1's model")
    assert rm.buffered_admission(s, first[0], 0, cfg, LIMITS) is not None  # a base it was not handed
    for c in first[:2]:
        rm.step_in_place(s, rm.UpdateAccepted(c, 1, 1.0), cfg, LIMITS)
    rm.step_in_place(s, rm.Aggregated(1, 2.0), cfg, LIMITS)
    code, reason = rm.buffered_admission(s, first[2], 1, cfg, LIMITS) or ("", "")
    assert code == bf.REFUSE and "rounds.max_staleness = 0" in reason and "1 buffers behind round 2" in reason
    rm.step_in_place(s, rm.UpdateRejected(first[2], 1, reason, 3.0), cfg, LIMITS)
    assert first[2] not in s.buffered.flight or s.buffered.flight[first[2]] == 2  # freed (and maybe granted again)
    assert s.rejected_total == 1 and s.late_total == 1


def test_a_device_that_pulls_again_abandoned_its_task_and_an_expired_task_is_freed() -> None:
    cfg = _cfg(concurrency=2)
    s, events = _fleet(2, cfg)
    first = [c for e in events if isinstance(e, rm.TasksGranted) for c in e.clients]
    assert sorted(first) == ["c0", "c1"]
    _deliver(s, cfg, first)
    _, ev = rm.step_in_place(s, rm.Pulled("c0", 5.0), cfg, LIMITS)  # c0 came back free: its task was dropped
    assert ev == [rm.TasksGranted(1, ("c0",))] and "c0" in s.buffered.undelivered
    _, ev = rm.step_in_place(s, rm.Tick(10.5, liveness=False), cfg, LIMITS)  # c1's task is 10.5 s old
    assert "c1" not in s.buffered.flight or "c1" in s.buffered.undelivered


def test_a_server_stall_does_not_expire_the_tasks_in_flight() -> None:
    """Buffered rounds: a task expires 10 s (round_timeout_s) after delivery. A 30-s stall of the server after
    delivery (Stalled) moves the delivery times on by 30 s, so at 35 s the tasks are 5 s old, not 35."""
    cfg = _cfg(concurrency=2)
    s, events = _fleet(2, cfg)
    first = [c for e in events if isinstance(e, rm.TasksGranted) for c in e.clients]
    _deliver(s, cfg, first)
    assert s.buffered is not None
    s, ev = rm.step_in_place(s, rm.Stalled(35.0, 30.0), cfg, LIMITS)
    assert ev == [] and s.buffered.delivered_at == pytest.approx({c: 30.0 for c in first})
    _, ev = rm.step_in_place(s, rm.Tick(35.0), cfg, LIMITS)
    assert sorted(s.buffered.flight) == sorted(first) and not any(isinstance(e, rm.ClientDropped) for e in ev)
    assert s.buffered.expired(35.0, cfg.round_timeout_s) == [] and s.buffered.expired(40.5, 10.0) == sorted(first)


def test_state_round_trips_through_json_and_resume_keeps_the_devices_in_flight() -> None:
    cfg = _cfg(min_available=4)
    s, events = _fleet(4, cfg)
    first = [c for e in events if isinstance(e, rm.TasksGranted) for c in e.clients]
    _deliver(s, cfg, first)
    rm.step_in_place(s, rm.UpdateAccepted(first[0], 1, 1.0), cfg, LIMITS)
    saved = json.loads(json.dumps(s.to_saved()))
    back = rm.RoundState.from_dict(saved)
    assert back.buffered == s.buffered and back.round == s.round
    resumed = rm.resume_buffered(back, 0, cfg, 50.0)
    assert resumed.phase == rm.SAMPLING and resumed.buffered is not None
    assert resumed.buffered.flight == {c: 1 for c in first[1:]}  # delivered and still training: kept
    assert resumed.buffered.buffer == []  # the buffer since the snapshot is filled again


def test_sync_state_has_no_buffer_and_saves_none() -> None:
    s = rm.RoundState()
    assert s.to_saved()["buffered"] is None and rm.RoundState.from_dict(s.to_saved()).buffered is None


def test_replay_follows_the_logged_order() -> None:
    lines = [bf.hand_line("c0", 1), bf.hand_line("c1", 1), bf.arrive_line("c1", 1, 1, 1),
             bf.hand_line("c1", 2), bf.arrive_line("c0", 1, 2, 2), bf.arrive_line("c1", 2, 2, 3)]
    sched = bf.ReplaySchedule.from_lines(lines, "log")
    assert sched.arrival_round("c0", 1) == 2 and sched.arrival_round("c0", 2) is None
    cfg = _cfg(clients_per_round=1, concurrency=0, max_staleness=5, min_available=3)
    limits = rm.Limits(heartbeat_patience_s=30.0, replay=sched)
    s, events = _fleet(3, cfg, limits)
    granted = [c for e in events if isinstance(e, rm.TasksGranted) for c in e.clients]
    assert granted == ["c0", "c1"]  # only the logged ones, whatever the concurrency
    _deliver(s, cfg, granted, limits=limits)
    # c0's update belongs to round 2's buffer: it waits; c2 was never handed a task
    assert rm.buffered_admission(s, "c0", 1, cfg, limits) == (
        bf.RETRY, "replaying log: this update belongs to round 2's buffer")
    assert rm.buffered_admission(s, "c2", 1, cfg, limits) is not None
    _, ev = rm.step_in_place(s, rm.UpdateAccepted("c1", 1, 1.0), cfg, limits)
    assert rm.RoundClosed(1, ("c1",), "replayed") in ev
    _, ev = rm.step_in_place(s, rm.Aggregated(1, 2.0), cfg, limits)
    assert rm.TasksGranted(2, ("c1",)) in ev
    _deliver(s, cfg, ["c1"], limits=limits)
    _, ev = rm.step_in_place(s, rm.UpdateAccepted("c0", 1, 3.0), cfg, limits)
    assert not any(isinstance(e, rm.RoundClosed) for e in ev)  # c1's logged update is not in yet (M = 1 ignored)
    _, ev = rm.step_in_place(s, rm.UpdateAccepted("c1", 2, 4.0), cfg, limits)
    assert rm.RoundClosed(2, ("c0", "c1"), "replayed") in ev


def test_a_run_directory_keeps_its_mode() -> None:
    from fedserver.persistence import check_identity

    opt = {"server_optimizer": {"name": "", "options": {}}}
    with pytest.raises(ConfigError, match=r"^rounds\.mode"):
        check_identity({"rounds": {"mode": "sync"}, **opt}, {"rounds": {"mode": "buffered"}, **opt})
    check_identity({"rounds": {}, **opt}, {"rounds": {"mode": "sync"}, **opt})  # written before the mode existed


def test_a_resumed_buffer_opens_with_the_updates_the_store_kept() -> None:
    cfg = _cfg(min_available=4)
    s, events = _fleet(4, cfg)
    first = [c for e in events if isinstance(e, rm.TasksGranted) for c in e.clients]
    _deliver(s, cfg, first)
    for c in first[:2]:
        rm.step_in_place(s, rm.UpdateAccepted(c, 1, 1.0), cfg, LIMITS)
    assert s.phase == rm.AGGREGATING  # round 1's snapshot: first[2] in flight, from round 1's model
    saved = json.loads(json.dumps(s.to_saved()))
    resumed = rm.resume_buffered(rm.RoundState.from_dict(saved), 1, cfg, 50.0)
    # round 2's buffer took two updates before the process died: first[2]'s (stale), and one of a device handed
    # round 2's model after the snapshot (its task was lost with the process); the store kept both
    late = next(c for c in resumed.clients if c not in first[2:])
    rm.restore_buffer(resumed, [(first[2], 1), (late, 2)])
    ev: list[rm.Event] = []
    for i in range(4):  # the fleet joins again
        _, e = rm.step_in_place(resumed, rm.Joined(f"c{i}", 51.0, num_samples=10), cfg, LIMITS)
        ev += e
        _, e = rm.step_in_place(resumed, rm.Polled(f"c{i}", 51.0), cfg, LIMITS)
        ev += e
    b = resumed.buffered
    assert b is not None and resumed.round == 2
    assert isinstance(ev[0], rm.RoundStarted) and ev[0].round == 2
    # re-folded in arrival order, as if they had just arrived; M = 2: the buffer is full at once
    assert ev[1:] == [rm.UpdateBuffered(first[2], 1, 2, 3), rm.TaskHanded(late, 2), rm.UpdateBuffered(late, 2, 2, 4),
                      rm.RoundClosed(2, (first[2], late), "buffer_full")]
    assert b.buffer == [[first[2], 1], [late, 2]] and b.arrivals == 4 and b.delivered == 1
    assert first[2] not in b.flight and late not in b.flight
    assert b.restored == [] and "restored" not in b.to_dict()  # applied once, never saved
    assert resumed.phase == rm.AGGREGATING


def test_the_store_keeps_the_open_buffers_updates_bit_for_bit(tmp_path: Path) -> None:
    import torch

    from fedcore.update_report import UpdateReport
    from fedserver.buffered_rounds import BufferedUpdate, BufferJournal
    from fedserver.store import Snapshot, StateStore, StoreError

    store = StateStore(tmp_path / "state")
    journal = BufferJournal(lambda: store)
    assert store.buffered(1, 0) == []  # a store without buffered updates (every sync store) has no table
    g = torch.Generator().manual_seed(0)
    flats = [torch.randn(10, generator=g) * 0.7 for _ in range(3)]
    reports = [UpdateReport(num_samples=10 + i, train_loss=0.1 * i, beta_hat=None if i else 0.25,
                            extras={"kd_ce": 1.5}) for i in range(3)]
    rows = [journal.record(2, 0, BufferedUpdate(f"c{i}", 1 + (i > 0), flats[i], reports[i], 100 + i, 1 - (i > 0)))
            for i in (2, 0, 1)]  # arrival order c2, c0, c1
    journal.record(2, 1, BufferedUpdate("c9", 2, flats[0], reports[0], 1, 0))  # another attempt of round 2
    journal.record(3, 0, BufferedUpdate("c8", 2, flats[0], reports[0], 1, 1))  # a later round
    journal.forget(rows[2])  # c1's was not taken after all
    back = journal.load(2, 0, 10)
    assert [u.client_id for u in back] == ["c2", "c0"] and [u.base for u in back] == [2, 1]
    assert all(torch.equal(u.flat, flats[int(u.client_id[1])]) for u in back)
    assert [u.report for u in back] == [reports[2], reports[0]]
    assert [(u.nbytes, u.staleness) for u in back] == [(102, 0), (100, 1)]
    store.close()
    store = StateStore(tmp_path / "state")  # survives a reopen (a restarted process)
    journal = BufferJournal(lambda: store)
    assert [u.client_id for u in journal.load(2, 0, 10)] == ["c2", "c0"]
    with pytest.raises(StoreError, match=r"state\.db: buffered update \d+ of round 2 does not decode .*Ways on"):
        journal.load(2, 0, 11)  # not this model's size
    # the snapshot of round 2 completes the buffer: its rows go; a later round's row stays, but a server resumes
    # only with the rows written after the snapshot it resumes from (c8's was written before it: another timeline)
    store.save(Snapshot(2, {"round_state": {}}, {}))
    assert journal.load(2, 0, 10) == [] and journal.load(2, 1, 10) == []
    assert store._conn.execute("SELECT client_id FROM buffer_updates").fetchall() == [("c8",)]
    assert journal.load(3, 0, 10) == []
    journal.record(3, 0, BufferedUpdate("c7", 2, flats[1], reports[1], 1, 1))
    assert [u.client_id for u in journal.load(3, 0, 10)] == ["c7"]
    store._conn.execute("UPDATE buffer_updates SET meta = 'not json'")
    with pytest.raises(StoreError, match=r"state\.db: buffered update \d+ of round 3 does not decode .*Ways on"):
        journal.load(3, 0, 10)
    store.close()
    assert BufferJournal(lambda: None).load(2, 0, 10) == []
