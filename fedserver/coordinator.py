"""The coordinator: the imperative shell around fedcore's round machine, wiring the server's parts together.

- :mod:`fedserver.membership`: join, sessions, leave (identity);
- :mod:`fedserver.polls`: the long-polls that wait for a task;
- :mod:`fedserver.uploads`: the upload gate in front of :mod:`fedserver.intake` (admission, validation, folding);
- :mod:`fedserver.dispatch`: which task and model a client is handed;
- :mod:`fedserver.round_close`: aggregate a closed round, report, complete, persist and publish it;
- :mod:`fedserver.persistence`: resume from the run directory and snapshot every completed round;
- :mod:`fedserver.round_log`, :mod:`fedserver.final_models`: what the server logs and writes at the end.

The coordinator turns the parts' calls into observations for :func:`fedcore.rounds.step_in_place` and acts on the events
that come back; it calls no server feature by name. What a round's close does -- a server optimizer on the aggregate,
DistFL's cluster sizes, the NFL monitor and the DP accountant completing the typed
:class:`~fedcore.report.RoundReport` before it is persisted, the history, the ``round.completed`` line and the
``rounds.jsonl`` writer reading it afterwards -- is the pipeline's (:mod:`fedserver.pipeline`), composed in one
place from registered stages. Everything runs on one asyncio event loop; aggregation, evaluation and snapshots run
in worker threads so heartbeats and polls keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from fedcore import rounds as rm
from fedcore.buffered import ReplaySchedule
from fedcore.config import (
    ConfigError,
    ServerConfig,
    check_data_config,
    resolved_nfl,
    resolved_rounds,
    secret_token,
)
from fedcore.log import get_logger
from fedcore.models import build_model
from fedcore.preflight import check_aggregation_memory
from fedcore.report import DistflStatus, FederationStatus, RoundReport
from fedcore.serialization import TensorMeta
from fedcore.train import resolve_device
from fedserver.buffered_rounds import ArrivalLog, BufferedUpdate, BufferJournal, ModelVersions, is_version
from fedserver.clusters import ClusterShell
from fedserver.clusters import check_model as check_distfl_model
from fedserver.dispatch import Task, TaskDispatcher
from fedserver.dp_monitor import OUTCOME as DP_BUDGET
from fedserver.dp_monitor import DpMonitor
from fedserver.errors import EXIT_STALLED, ProtocolError
from fedserver.final_models import write_final_models
from fedserver.finalize import RoundFinalizer
from fedserver.global_models import GlobalModels
from fedserver.harness import AdversaryHarness
from fedserver.intake import UpdateIntake
from fedserver.membership import RUN_LOOP_TICK_S, LivenessChecks, Membership, StallWatch
from fedserver.nfl_monitor import NflMonitor
from fedserver.offload import Offload
from fedserver.persistence import Persistence, StoreOpener, open_store
from fedserver.pipeline import ServerParts, compose
from fedserver.polls import LongPolls
from fedserver.round_close import RoundCloser, RoundSubscriber
from fedserver.round_log import WaitingLine, log_event
from fedserver.round_timing import RoundTimer
from fedserver.secure_round import SecureRounds, session_bound
from fedserver.sessions import Sessions
from fedserver.uploads import UploadGate

# ProtocolError and Task: the names fedserver.servicer imports from here.
__all__ = ["Coordinator", "ProtocolError", "Task", "evaluation_device"]


def evaluation_device(config: ServerConfig) -> torch.device:
    """The device of the server's central evaluation; :class:`ConfigError` when this machine lacks it."""
    try:
        return resolve_device(config.evaluation.device)
    except ValueError as e:
        raise ConfigError("evaluation.device", str(e)) from None


class Coordinator:
    """The round machine's state and the wiring of the parts around it (module docstring). ``opener`` opens the
    run directory's state store (the crash tests pass one that dies on cue, tests/crash_server.py)."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic,
                 opener: StoreOpener = open_store) -> None:
        self.config = config
        self.clock = clock
        self.log = get_logger("fedserver")
        check_data_config(config)
        model = build_model(config.model.name, config.model.kwargs, seed=config.rounds.seed)
        self.models = GlobalModels.of(model)
        self.fingerprint: str = self.models.fingerprint
        self.manifest: list[TensorMeta] = self.models.manifest
        check_aggregation_memory(config, self.models.num_params)
        self.limits = rm.Limits(heartbeat_patience_s=config.server.heartbeat_patience_s,
                                poll_grace_s=config.server.poll_grace_s,
                                replay=ReplaySchedule.load(config.rounds.replay) if config.rounds.replay else None)
        # min_updates resolved against the aggregation rule: what the round machine runs
        self.rounds = resolved_rounds(config)
        self.state = rm.RoundState(phase_since=clock())
        self.history: list[RoundReport] = []
        self.run_dir = Path(config.server.run_dir)
        self.resumed_from = 0
        self.stopping = False
        self._wake = asyncio.Event()
        self._agg_task: asyncio.Task[None] | None = None
        self._finished = asyncio.Event()
        self._waiting = WaitingLine(self.log, self.rounds)
        self.stall_watch = StallWatch()

        # ---- the parts; each reads the round state and reports observations through these two ----
        def state() -> rm.RoundState:
            return self.state

        def stopping() -> bool:
            return self.stopping

        sessions = Sessions(secret_token(config.server.token, config.server.token_file),
                            config.security.max_sessions_per_credential)
        self.members = Membership(sessions, self.fingerprint, state, self.observe, self._notify, clock, self.log)
        self.nfl = NflMonitor(resolved_nfl(config))
        check_distfl_model(config, model)
        self.clusters = ClusterShell(config, self.models, model, evaluation_device(config))
        self.dispatch = TaskDispatcher(self.models, config.training, lambda: self.nfl.recovery,
                                       self.clusters.model_id_for, config.rounds.round_timeout_s)
        # The critical path of every round (fedserver.round_timing): the rounds.jsonl row's timing_seconds.
        self.timing = RoundTimer()
        self.polls = LongPolls(config.server, self.members, self.dispatch, state, self.observe, stopping, clock,
                               self.timing)
        self.persistence = Persistence(config, self.models, opener)
        self.dp = DpMonitor(config)
        # What a round's close does, composed in one place (fedserver.pipeline): the stages' hooks and their state.
        self.pipeline = compose(ServerParts(config, self.models, self.nfl, self.dp, self.clusters, self.history,
                                            self.persistence, self.timing, self.run_dir, self.log))
        # Secure aggregation (off unless aggregation.secure): the servicer sets its verifier (enrolled keys).
        self.secure = SecureRounds(config, self.models.num_params, clock, self.log, session_bound, self.observe,
                                   self.notice_stall)
        self.intake = UpdateIntake(config, self.models, state, self.observe, clock, self.dispatch.model_id_for,
                                   self.clusters.make_buffer if self.clusters.enabled else None,
                                   self.pipeline.round_aggregation, self.secure, self.limits)
        self.uploads = UploadGate(self.members, self.intake, stopping, self.timing)
        eval_model = model.to(evaluation_device(config)) if config.evaluation.central else None
        offload = Offload()  # the round close's blocking steps: a worker thread, or the loop when short
        finalizer = RoundFinalizer(config, self.models, eval_model, clock, offload)
        harness = AdversaryHarness(config)  # simulation only; does nothing unless turned on
        # Buffered rounds: the versions devices in flight train from, the arrival log (fedserver.buffered_rounds).
        self.versions = ModelVersions(self.models) if config.rounds.buffered else None
        self.arrivals = ArrivalLog(self.run_dir) if config.rounds.buffered else None
        # ... and the open buffer's updates, durable in the state store before they are acknowledged; a resumed
        # server re-folds them into the buffer it fills again (round, updates) when that buffer opens.
        self.intake.journal = BufferJournal(lambda: self.persistence.store) if config.rounds.buffered else None
        self._refold: tuple[int, list[BufferedUpdate]] | None = None
        self.closer = RoundCloser(self.intake, self.clusters, harness, finalizer, self.persistence, self.history,
                                  state, lambda: DP_BUDGET if self.dp.stop_required else "", clock, self.log,
                                  self.pipeline, self.timing, offload, self.secure)

    @property
    def global_state(self) -> Mapping[str, torch.Tensor]:
        return self.models.get()

    def subscribe(self, fn: RoundSubscriber) -> None:
        """Call ``fn`` with every completed round's report, after the round was persisted."""
        self.closer.subscribe(fn)

    # ---- start: new or resumed federation ----

    def open(self, fresh: bool = False) -> None:
        """Start a new federation in the run directory or resume the one there (before serving).

        ``fresh`` moves an earlier federation's files aside first. Raises :class:`ConfigError` when the
        configuration would change the stored federation.
        """
        if fresh:
            moved = Persistence.start_fresh(self.run_dir)
            if moved is not None:
                self.log.warning("state.moved_aside", to=str(moved), reason="--fresh: starting a new federation")
        restored = self.persistence.restore(self.clock())
        if restored is not None:
            self.state, self.resumed_from = restored.round_state, restored.completed_rounds
            self.history[:] = restored.history
            self.dispatch.invalidate()
            if self.arrivals is not None:  # the buffer lost with the last process leaves the arrival log too
                dropped = self.arrivals.resumed(self.resumed_from)
                if dropped:
                    self.log.info("arrivals.rewound", completed_rounds=self.resumed_from, lines_dropped=dropped)
            if self.intake.journal is not None and self.state.phase != rm.FINISHED:
                kept = self.intake.journal.load(self.state.round, self.state.attempt, self.models.num_params)
                if kept:  # the buffer being filled when the last process died: its updates are taken again
                    rm.restore_buffer(self.state, [(u.client_id, u.base) for u in kept])
                    self._refold = (self.state.round, kept)
            if self.dp.stop_required and self.state.phase != rm.FINISHED:  # the privacy budget is spent
                self.state.phase, self.state.outcome, self.state.round = rm.FINISHED, DP_BUDGET, self.resumed_from
        self.log.info("federation.started", federation_id=self.config.server.federation_id,
                      model=self.config.model.name, params=self.models.num_params, fingerprint=self.fingerprint,
                      rounds=self.config.rounds.num_rounds, k=self.config.rounds.clients_per_round,
                      resumed_from=self.resumed_from)

    # ---- the round machine ----

    def notice_stall(self, now: float) -> None:
        """Before anything is judged against the clock at ``now``: if the server's loop was held up (StallWatch),
        the stall counts against no round, client, task or SecAgg+ phase -- the round machine's deadline and every
        client's last contact (:class:`fedcore.rounds.Stalled`) and the open SecAgg+ phase's start move on by it."""
        stalled = self.stall_watch.stalled(now)
        if not stalled:
            return
        self.state, _ = rm.step_in_place(self.state, rm.Stalled(now, stalled), self.rounds, self.limits)
        self.secure.stalled(stalled)
        self.log.warning("server.stalled", seconds=round(stalled, 2), round=self.state.round,
                         moved="the round's deadline, every client's last contact and the SecAgg+ phase's start, "
                               "by the stall")

    def observe(self, obs: rm.Observation) -> None:
        self.notice_stall(obs.now)
        self.state, events = rm.step_in_place(self.state, obs, self.rounds, self.limits)
        for ev in events:
            self._on_event(ev)
        # Long-polls only care about a task becoming available or the federation ending: a round start wakes the
        # clients it selected, the end every client.
        for ev in events:
            if isinstance(ev, rm.RoundStarted):
                self._notify(ev.selected)
            elif isinstance(ev, rm.TasksGranted):
                self._notify(ev.clients)
            elif isinstance(ev, rm.FederationFinished):
                self._notify()

    def _notify(self, clients: tuple[str, ...] | None = None) -> None:
        """Wake the run loop and the parked long-polls of ``clients`` (None: of every client)."""
        self._wake.set()
        self._wake = asyncio.Event()
        self.polls.wake(clients)

    def _on_event(self, ev: rm.Event) -> None:
        if isinstance(ev, rm.TaskHanded | rm.UpdateBuffered | rm.TasksGranted):  # buffered rounds
            if self.arrivals is not None:
                self.arrivals.write(ev)
            if self.versions is not None and isinstance(ev, rm.UpdateBuffered):
                self.versions.prune(self.state)
            return
        if isinstance(ev, rm.RoundStarted):
            if self.versions is not None:
                self.versions.opened(ev.round, self.state)
            self.intake.open_round(ev.round, ev.attempt, len(ev.selected), self.clock())
            if self._refold is not None and self._refold[0] == ev.round:
                self.intake.refold(self._refold[1])
                self.log.info("buffer.restored", round=ev.round, attempt=ev.attempt, updates=len(self._refold[1]),
                              clients=[u.client_id for u in self._refold[1]])
            self._refold = None
            self.secure.open(ev.round, ev.attempt, ev.selected)
            self.timing.started(ev.round, ev.attempt, len(ev.selected))
        log_event(self.log, ev)
        if isinstance(ev, rm.RoundClosed):
            self._agg_task = asyncio.get_running_loop().create_task(self._close_round(ev.round, ev.reason))
        elif isinstance(ev, rm.RoundAbandoned):
            self.timing.sampling()
            self.persistence.progress(self.state)
        elif isinstance(ev, rm.FederationFinished):
            self._finish(ev.rounds, ev.outcome)

    async def _close_round(self, round_: int, reason: str) -> None:
        closed = await self.closer.close(round_, reason)
        if isinstance(closed, rm.AggregationFailed):  # the round is selected again
            self.timing.sampling()
        self.observe(closed)

    # ---- run loop, stop, end ----

    async def run(self) -> FederationStatus:
        """Drive the federation until it finishes (or :meth:`stop`); returns the final status."""
        if self.state.phase == rm.FINISHED:  # resumed a federation that had already finished
            self.log.info("federation.already_finished", rounds=self.state.completed_rounds,
                          reason="nothing to run; start over with --fresh")
            self._finish(self.state.completed_rounds, self.state.outcome)
        self.timing.sampling()
        self.closer.started_at = self.clock()  # the rows' wall_seconds count from here
        self.stall_watch.arm(self.clock())
        self.observe(rm.Tick(self.clock()))
        # Liveness (O(N): every client's silence, the connected set) a few times per patience and grace, not on
        # every wake-up: a round start wakes the loop K times a second in a busy fleet.
        checks = [self.limits.heartbeat_patience_s / 4, 1.0]
        if self.limits.poll_grace_s:
            checks.append(self.limits.poll_grace_s / 4)
        liveness = LivenessChecks(min(checks), self.clock())
        try:
            await self._loop(liveness)
        finally:
            self.stall_watch.disarm()  # observations after the loop (a lingering server's) are not ticked between
        return self.status()

    async def _loop(self, liveness: LivenessChecks) -> None:
        while not self._finished.is_set() and not self.stopping:
            wake = self._wake
            timeout = RUN_LOOP_TICK_S
            if self.state.phase == rm.TRAINING:
                timeout = min(timeout, max(0.0, self.state.deadline - self.clock()) + 0.001)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=timeout)
            self._reap_close()
            if not self.stopping:
                now = self.clock()
                self.secure.tick(now)
                if liveness.due(now):  # a client parked in a long-poll is connected: alive
                    self.observe(rm.Tick(now, self.polls.connected()))
                else:
                    self.observe(rm.Tick(now, liveness=False))
                self._waiting.maybe_log(self.state, self.clock())

    def _reap_close(self) -> None:
        if self._agg_task is not None and self._agg_task.done():
            exc = self._agg_task.exception()
            self._agg_task = None
            if exc is not None:
                raise exc

    async def stop(self) -> None:
        """Graceful stop: take no more updates, let a round being aggregated complete and persist it, record
        the round machine, and tell polling clients to come back later. The next start resumes."""
        if self.stopping:
            return
        self.stopping = True
        self.log.warning("server.stopping", round=self.state.round, phase=self.state.phase,
                         reason="stop requested; the federation resumes on the next start")
        self._notify()
        if self._agg_task is not None:
            with contextlib.suppress(Exception):
                await self._agg_task
            self._reap_close()
        if self.state.phase != rm.FINISHED:
            self.persistence.progress(self.state)

    def _finish(self, rounds: int, outcome: str) -> None:
        if self.versions is not None:  # buffered rounds: no device trains from a kept version any more
            for model_id in self.models.ids():
                if is_version(model_id):
                    self.models.drop(model_id)
        path = write_final_models(self.config, self.models, rounds, self.log)
        if outcome == "stalled":
            s = self.state
            self.log.error("federation.stalled", rounds=rounds, exit_code=EXIT_STALLED,
                           reason=f"fewer than {self.rounds.effective_min_updates} clients ready within "
                                  f"rounds.sampling_timeout_s = {self.rounds.sampling_timeout_s:g} s "
                                  f"({len(s.available_ids())} ready, {len(s.alive_ids())} alive); the next start "
                                  f"resumes from round {rounds + 1}")
        self.log.info("federation.finished", rounds=rounds, outcome=outcome, model_path=str(path))
        self._finished.set()

    def close(self) -> None:
        self.persistence.close()
        if self.arrivals is not None:
            self.arrivals.close()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    # ---- status ----

    def client_status(self, client_id: str) -> FederationStatus:
        """What a client may see (GetStatus with its session): the federation's progress and its own record (its
        cluster), no other client's id, count or state."""
        s, full = self.state, self.clusters.status([])
        own = full.assignment.get(client_id)
        distfl = DistflStatus(enabled=full.enabled, clustered_round=full.clustered_round,
                              next_clustering=full.next_clustering,
                              assignment={client_id: own} if own is not None else {})
        return FederationStatus(
            federation_id=self.config.server.federation_id, round=s.round, num_rounds=self.config.rounds.num_rounds,
            phase=s.phase, outcome=s.outcome, clients_known=0, clients_alive=0, selected=0, accepted=0, rejected=0,
            rejected_total=0, history=(), finished=s.phase == rm.FINISHED, stopping=self.stopping, distfl=distfl)

    def status(self) -> FederationStatus:
        s = self.state
        return FederationStatus(
            federation_id=self.config.server.federation_id, round=s.round,
            num_rounds=self.config.rounds.num_rounds, phase=s.phase, outcome=s.outcome,
            clients_known=len(s.clients), clients_alive=len(s.alive_ids()), selected=len(s.selected),
            accepted=len(s.accepted), rejected=s.rejected_in_round, rejected_total=s.rejected_total,
            history=tuple(self.history), finished=s.phase == rm.FINISHED, resumed_from=self.resumed_from,
            stopping=self.stopping, nfl=self.nfl.status(), distfl=self.clusters.status(sorted(s.clients)))
