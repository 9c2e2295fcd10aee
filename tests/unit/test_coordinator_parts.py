"""The coordinator's parts (issue 27 item 6): the round closer's order (aggregate -> report -> stages -> persist
-> subscribers), membership, long-polls, the waiting line, the store seam the crash tests use, and the size and
purity of the coordinator itself."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore import rounds as rm
from fedcore.aggregation import AggregationResult
from fedcore.config import RoundsConfig
from fedcore.report import RoundReport
from fedserver.errors import ProtocolError
from fedserver.global_models import GlobalModels
from fedserver.membership import Membership
from fedserver.pipeline import Pipeline, Stage
from fedserver.polls import LongPolls
from fedserver.round_close import RoundCloser
from fedserver.round_log import WAIT_LOG_S, WaitingLine
from fedserver.sessions import Sessions

ROOT = Path(__file__).resolve().parents[2]


# ---- the round closer ----


class _Calls:
    def __init__(self) -> None:
        self.calls: list[str] = []


class _Intake:
    def __init__(self, calls: _Calls) -> None:
        self.c = calls

    def take(self) -> tuple[object, object]:
        self.c.calls.append("take")
        return object(), object()

    def finished_round(self) -> None:
        self.c.calls.append("finished_round")


class _Finalizer:
    def __init__(self, calls: _Calls, fail: bool) -> None:
        self.c, self.fail = calls, fail

    async def aggregate(self, agg: object, round_: int) -> AggregationResult:
        self.c.calls.append("aggregate")
        if self.fail:
            raise ValueError("krum needs 5 updates")
        return AggregationResult(torch.zeros(1), {"num_updates": 3.0})

    async def report(self, result: AggregationResult, log: object, state: rm.RoundState,
                     reason: str) -> RoundReport:
        self.c.calls.append("report")
        return RoundReport(round=state.round, outcome=reason, metrics=dict(result.metrics))


class _Persistence:
    def __init__(self, calls: _Calls) -> None:
        self.c = calls
        self.saved: list[RoundReport] = []

    def snapshot(self, state: rm.RoundState, history: list[RoundReport], completed_rounds: int) -> None:
        self.c.calls.append(f"snapshot {completed_rounds}")
        self.saved = history


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    warning = error = debug = info


def _closer(fail: bool = False, ends: str = "", stages: tuple[Stage, ...] = (), calls: _Calls | None = None) -> tuple[
        RoundCloser, _Calls, _Persistence, list[RoundReport]]:
    calls, history = calls or _Calls(), [RoundReport(round=1)]
    persistence = _Persistence(calls)
    state = rm.RoundState(round=2)

    class _Harness:
        enabled = False

    closer = RoundCloser(_Intake(calls), object(), _Harness(), _Finalizer(calls, fail), persistence,  # type: ignore[arg-type]
                         history, lambda: state, lambda: ends, lambda: 7.0, _Log(),
                         Pipeline(list(stages), GlobalModels({})))
    return closer, calls, persistence, history


def test_closer_completes_then_persists_then_publishes_in_pipeline_order() -> None:
    calls = _Calls()

    def stage(name: str) -> Stage:
        def run(r: RoundReport) -> RoundReport:
            calls.calls.append(f"stage {name}")
            return replace(r, nfl_count=r.nfl_count * 10 + len(name))
        return Stage(name, report=run)

    closer, _, persistence, history = _closer(ends="dp_budget", stages=(stage("a"), stage("bb")), calls=calls)
    got: list[RoundReport] = []
    closer.subscribe(lambda r: calls.calls.append(f"subscriber {r.nfl_count}"))
    closer.subscribe(got.append)
    obs = asyncio.run(closer.close(2, "quorum"))
    assert calls.calls == ["take", "aggregate", "report", "stage a", "stage bb", "snapshot 2", "subscriber 12",
                           "finished_round"]
    assert obs == rm.Aggregated(2, 7.0, "dp_budget")
    # the snapshot saves the completed report after the earlier history; subscribers get the same report
    assert persistence.saved[0] is history[0] and persistence.saved[1] == got[0]
    assert got[0].nfl_count == 12 and got[0].outcome == "quorum" and got[0].metrics == {"num_updates": 3.0}


def test_closer_reruns_a_round_the_rule_cannot_aggregate_without_saving_or_publishing() -> None:
    closer, calls, _, _ = _closer(fail=True, stages=(Stage("x", report=lambda r: pytest.fail("a stage ran")),))
    closer.subscribe(lambda r: pytest.fail("a subscriber ran"))
    obs = asyncio.run(closer.close(2, "deadline"))
    assert obs == rm.AggregationFailed(2, "krum needs 5 updates", 7.0)
    assert calls.calls == ["take", "aggregate"]


# ---- membership and long-polls ----


def _members() -> tuple[Membership, list[rm.Observation], list[tuple[str, ...]], dict[str, rm.RoundState]]:
    box = {"s": rm.RoundState()}
    seen: list[rm.Observation] = []
    woken: list[tuple[str, ...]] = []

    def observe(obs: rm.Observation) -> None:
        seen.append(obs)
        box["s"], _ = rm.step_in_place(box["s"], obs, RoundsConfig(num_rounds=1, clients_per_round=2),
                                 rm.Limits(heartbeat_patience_s=60.0))

    members = Membership(Sessions("tok"), "fp1", lambda: box["s"], observe, woken.append, lambda: 1.0, _Log())
    return members, seen, woken, box


def test_join_checks_token_and_fingerprint_then_records_the_client() -> None:
    members, seen, woken, box = _members()
    with pytest.raises(ProtocolError) as e:
        members.join("c0", "tok", 10, False, False, "other-fp")
    assert e.value.code == "FAILED_PRECONDITION" and seen == []
    with pytest.raises(ProtocolError):
        members.join("c0", "wrong", 10, False, False, "fp1")
    res = members.join("c0", "tok", 10, False, False, "fp1")
    assert res.client_index == 0 and woken == [("c0",)]
    assert isinstance(seen[-1], rm.Joined) and box["s"].clients["c0"].num_samples == 10
    assert members.touch(res.session_id) == "c0" and isinstance(seen[-1], rm.Seen)


def test_the_linger_waits_for_leaves_and_a_client_that_rejoins_must_be_told_again() -> None:
    members, _, _, box = _members()
    s1 = members.join("c0", "tok", 1, False, False, "").session_id
    members.join("c1", "tok", 1, False, False, "")
    assert members.not_left() == ([], ["c0", "c1"]) and members.still_here() == 2
    members.told_finished("c0")
    # Told is not enough: the answer may still be in the transport when the server stops; its Leave says it arrived.
    assert members.not_left() == (["c0"], ["c1"]) and members.still_here() == 2
    members.leave(s1, "done")
    assert members.not_left() == ([], ["c1"]) and members.still_here() == 1
    members.join("c0", "tok", 1, False, False, "")
    assert box["s"].clients["c0"].alive and members.not_left() == ([], ["c0", "c1"])


def test_a_poll_is_answered_finished_and_recorded_as_told() -> None:
    members, _, _, box = _members()
    session = members.join("c0", "tok", 1, False, False, "").session_id

    class _Server:
        heartbeat_interval_s, long_poll_s = 5.0, 0.0

    polls = LongPolls(_Server(), members, object(), lambda: box["s"], lambda o: None,  # type: ignore[arg-type]
                      lambda: False, lambda: 1.0)
    box["s"] = replace(box["s"], phase=rm.FINISHED, outcome="completed")
    got = asyncio.run(polls.pull(session, 10.0))
    assert got.finished and got.reason == "federation completed"  # type: ignore[union-attr]
    assert members.not_left() == (["c0"], []) and polls.connected() == frozenset()


def _polls_without_tasks(members: Membership, box: dict[str, rm.RoundState], wait_s: float,
                         observe: Callable[[rm.Observation], None]) -> LongPolls:
    """Long-polls over ``members`` whose dispatcher never has a task (a pull waits, then is answered Wait)."""

    class _Server:
        heartbeat_interval_s, long_poll_s = 5.0, wait_s

    class _NoTask:
        def task_for(self, state: rm.RoundState, cid: str, now: float) -> None:
            return None

    return LongPolls(_Server(), members, _NoTask(), lambda: box["s"], observe,  # type: ignore[arg-type]
                     lambda: False, lambda: 1.0)


def test_a_pull_is_one_observation_of_the_client() -> None:
    """A pull says the client was heard from once: Polled when it becomes ready, Seen when it already was, Declined
    for a decline (not a Seen first and then the poll's own); an unknown session is refused with none."""
    members, seen, _, box = _members()
    session = members.join("c0", "tok", 1, False, False, "").session_id
    polls = _polls_without_tasks(members, box, 0.0, members._observe)

    def kinds(session: str, declined: bool = False) -> list[str]:
        del seen[:]
        asyncio.run(polls.pull(session, 0.0, declined))
        return [type(o).__name__ for o in seen]

    assert kinds(session) == ["Polled"] and box["s"].clients["c0"].ready
    assert kinds(session) == ["Seen"]
    assert kinds(session, declined=True) == ["Declined"] and not box["s"].clients["c0"].ready
    del seen[:]
    with pytest.raises(ProtocolError) as e:
        asyncio.run(polls.pull("not-a-session", 0.0))
    assert e.value.code == "UNAUTHENTICATED" and seen == []
    box["s"] = replace(box["s"], phase=rm.FINISHED, outcome="completed")
    assert kinds(session, declined=True) == ["Seen"]


def test_wake_sets_only_the_parked_polls_it_names() -> None:
    members, _, _, box = _members()
    polls = LongPolls(object(), members, object(), lambda: box["s"], lambda o: None,  # type: ignore[arg-type]
                      lambda: False, lambda: 1.0)
    a, b = asyncio.Event(), asyncio.Event()
    polls._parked.update({"a": a, "b": b})
    polls.wake(("a", "unknown"))
    assert a.is_set() and not b.is_set()
    polls.wake()
    assert b.is_set()


def test_end_parked_answers_a_parked_poll_at_once_with_its_reason() -> None:
    """A poll parked for a 60 s long-poll is answered with a zero wait as soon as end_parked() is called (a changed
    CRL): the client polls again and passes the checks afresh."""
    members, _, _, box = _members()
    session = members.join("c0", "tok", 1, False, False, "").session_id
    polls = _polls_without_tasks(members, box, 60.0, lambda o: None)

    async def go() -> tuple[object, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        parked = asyncio.ensure_future(polls.pull(session, 60.0))
        while "c0" not in polls._parked:
            await asyncio.sleep(0.01)
        polls.end_parked("the certificate revocation list changed: poll again")
        return await asyncio.wait_for(parked, 5.0), loop.time() - t0

    got, seconds = asyncio.run(go())
    assert seconds < 5.0
    assert got.retry_after_s == 0.0 and not got.finished  # type: ignore[attr-defined]
    assert got.reason == "the certificate revocation list changed: poll again"  # type: ignore[attr-defined]
    assert polls.connected() == frozenset()


def test_waiting_line_says_it_at_most_every_wait_log_s() -> None:
    log = _Log()
    line = WaitingLine(log, RoundsConfig(clients_per_round=2, sampling_timeout_s=100.0))
    s = rm.RoundState(phase=rm.SAMPLING, phase_since=0.0)
    line.maybe_log(s, WAIT_LOG_S - 1)
    line.maybe_log(s, WAIT_LOG_S)
    line.maybe_log(s, WAIT_LOG_S + 1)
    line.maybe_log(s, 2 * WAIT_LOG_S)
    assert [kw["gives_up_in_s"] for _, kw in log.lines] == [100 - WAIT_LOG_S, 100 - 2 * WAIT_LOG_S]
    assert log.lines[0][1]["status"] == "waiting: 0 of 2 ready"


# ---- the coordinator ----


def _coordinator_class() -> ast.ClassDef:
    tree = ast.parse((ROOT / "fedserver" / "coordinator.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Coordinator")


def test_the_coordinator_stays_small() -> None:
    methods = [n for n in _coordinator_class().body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) <= 20, [m.name for m in methods]


def test_no_server_module_holds_test_only_fault_injection() -> None:
    for path in sorted((ROOT / "fedserver").glob("*.py")):
        text = path.read_text()
        assert "FEDGUARD_CRASH" not in text and "SIGKILL" not in text and "os.kill" not in text, path.name


# ---- the store seam of the crash tests (tests/crash_server.py) ----


@pytest.mark.parametrize(("point", "rounds_kept"), [("saving", [1]), ("files_written", [1]), ("committed", [1, 2])])
def test_crashing_store_dies_at_its_point(tmp_path: Path, point: str, rounds_kept: list[int]) -> None:
    code = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        from fedcore.config import PersistenceConfig
        from fedserver.store import Snapshot
        from tests.crash_server import CrashingStore
        s = CrashingStore(Path(sys.argv[1]), PersistenceConfig(), {point!r}, 2)
        for r in (1, 2, 3):
            s.save(Snapshot(r, {{"r": r}}, {{"global": {{"w": torch.full((2,), float(r))}}}}, history_len=0))
        print("not reached")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "state")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == -9, res.stderr
    from fedserver.store import StateStore

    with StateStore(tmp_path / "state") as store:
        loaded = store.load()
        assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == rounds_kept[-1]
        leftovers = store.clean_pending()
    assert len(leftovers) == (1 if point == "files_written" else 0)  # the uncommitted save's model file


def test_liveness_is_checked_every_interval_not_on_every_wake_up() -> None:
    from fedserver.membership import LivenessChecks

    checks = LivenessChecks(every=1.0, now=0.0)
    passes = [0.25 * i for i in range(1, 9)]  # a loop that runs: a pass every 0.25 s, a check every second
    assert [i for i, t in enumerate(passes) if checks.due(t)] == [3, 7]  # at 1 s and 2 s
    # after a 30-s stall the pass checks (StallWatch moved every client's last contact on first), then every second
    assert [i for i, t in enumerate((32.0, 32.25, 32.5, 32.75, 33.0)) if checks.due(t)] == [0, 4]


def test_stall_watch_measures_a_held_up_loop_between_two_observations() -> None:
    from fedserver.membership import LOOP_STALL_S, RUN_LOOP_TICK_S, StallWatch

    watch = StallWatch()
    assert not watch.stalled(100.0)  # not armed (before the run loop starts, after it ends): nothing to measure
    watch.arm(0.0)
    # a running loop observes at least every RUN_LOOP_TICK_S; late by up to LOOP_STALL_S is scheduling, not a stall
    assert not any(watch.stalled(t) for t in (0.1, 0.35, 0.35 + RUN_LOOP_TICK_S + LOOP_STALL_S))
    last = 0.35 + RUN_LOOP_TICK_S + LOOP_STALL_S
    assert watch.stalled(last + 30.0) == pytest.approx(30.0 - RUN_LOOP_TICK_S)  # held up 30 s
    assert watch.stalls == 1
    assert not watch.stalled(last + 29.0)  # an observation stamped before the latest one is no stall
    assert not watch.stalled(last + 30.1)
    watch.disarm()
    assert not watch.stalled(last + 100.0) and watch.stalls == 1
