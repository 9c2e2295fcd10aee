"""The coordinator: the imperative shell around fedcore's round machine, wiring the server's parts together.

- :mod:`fedserver.sessions`: sessions and join authentication;
- :mod:`fedserver.dispatch`: which task and model a client is handed;
- :mod:`fedserver.intake`: update admission, validation, and folding into the round's aggregator;
- :mod:`fedserver.finalize`: aggregate a closed round and build its :class:`~fedcore.report.RoundReport`;
- :mod:`fedserver.persistence`: resume from the run directory and snapshot every completed round.

The coordinator turns protocol calls into observations for :func:`fedcore.rounds.step` and acts on the events
that come back. A completed round goes aggregate -> report -> persist -> subscribers (the ``rounds.jsonl``
writer, the status history, the log), in that order; the NFL monitor (:mod:`fedserver.nfl_monitor`) completes
the report before it is persisted, so the detector's state is saved with the round that moved it, at one point
(:meth:`Coordinator._finalize`). Everything runs on one asyncio event loop; aggregation, evaluation and
snapshots run in worker threads so heartbeats and polls keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from fedcore import outputs
from fedcore import rounds as rm
from fedcore.config import (
    ConfigError,
    ServerConfig,
    check_aggregation_memory,
    check_data_config,
    redacted,
    resolved_rounds,
    secret_token,
)
from fedcore.log import get_logger
from fedcore.models import build_model
from fedcore.report import DistflStatus, FederationStatus, RoundReport
from fedcore.serialization import TensorMeta, save_state
from fedcore.train import resolve_device
from fedserver.clusters import SLOT as DISTFL_SLOT
from fedserver.clusters import ClusterShell, UpdateBuffer
from fedserver.clusters import check_model as check_distfl_model
from fedserver.dispatch import Task, TaskDispatcher, WaitInfo
from fedserver.dp_monitor import OUTCOME as DP_BUDGET
from fedserver.dp_monitor import SLOT as DP_SLOT
from fedserver.dp_monitor import DpMonitor
from fedserver.errors import EXIT_STALLED, ProtocolError
from fedserver.finalize import RoundFinalizer
from fedserver.global_models import GLOBAL, GlobalModels
from fedserver.harness import AdversaryHarness
from fedserver.intake import UpdateIntake, UpdateTicket
from fedserver.nfl_monitor import SLOT as NFL_SLOT
from fedserver.nfl_monitor import NflMonitor
from fedserver.persistence import Persistence, crash_point, write_round
from fedserver.sessions import Sessions

__all__ = ["Coordinator", "JoinResult", "ProtocolError", "Task", "UpdateTicket", "WaitInfo", "evaluation_device"]

Subscriber = Callable[[RoundReport], None]
# Seconds between two "round.waiting" lines while a round waits for clients.
WAIT_LOG_S = 10.0


def evaluation_device(config: ServerConfig) -> torch.device:
    """The device of the server's central evaluation; :class:`ConfigError` when this machine lacks it."""
    try:
        return resolve_device(config.evaluation.device)
    except ValueError as e:
        raise ConfigError("evaluation.device", str(e)) from None


class JoinResult:
    def __init__(self, session_id: str, client_index: int) -> None:
        self.session_id, self.client_index = session_id, client_index


class Coordinator:
    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.log = get_logger("fedserver")
        check_data_config(config)
        model = build_model(config.model.name, config.model.kwargs, seed=config.rounds.seed)
        self.models = GlobalModels.of(model)
        check_aggregation_memory(config, self.models.num_params)
        self.limits = rm.Limits(heartbeat_patience_s=config.server.heartbeat_patience_s,
                                poll_grace_s=config.server.poll_grace_s)
        # min_updates resolved against the aggregation rule: what the round machine runs
        self.rounds = resolved_rounds(config)
        self.state = rm.RoundState(phase_since=clock())
        self.history: list[RoundReport] = []
        self.sessions = Sessions(secret_token(config.server.token, config.server.token_file),
                                 config.security.max_sessions_per_credential)
        self.nfl = NflMonitor(config.nfl)
        check_distfl_model(config, model)
        self.clusters = ClusterShell(config, self.models, model, evaluation_device(config))
        self.dispatch = TaskDispatcher(self.models, config.training, lambda: self.nfl.recovery,
                                       self.clusters.model_id_for)
        self.intake = UpdateIntake(config, self.models, lambda: self.state, self.observe, clock,
                                   self.dispatch.model_id_for,
                                   self.clusters.make_buffer if self.clusters.enabled else None)
        eval_model = model.to(evaluation_device(config)) if config.evaluation.central else None
        self.finalizer = RoundFinalizer(config, self.models, eval_model, clock)
        self.harness = AdversaryHarness(config)  # simulation only; does nothing unless turned on
        self.persistence = Persistence(config, self.models)
        self.persistence.register_slot(NFL_SLOT, self.nfl.save, self.nfl.load)
        self.dp = DpMonitor(config)
        self.persistence.register_slot(DP_SLOT, self.dp.save, self.dp.load)
        if self.clusters.enabled:
            self.persistence.register_slot(DISTFL_SLOT, self.clusters.save, self.clusters.load)
        self.run_dir = Path(config.server.run_dir)
        self.resumed_from = 0
        self.stopping = False
        self._subscribers: list[Subscriber] = [self.history.append, self._log_round, self._write_round]
        self._wake = asyncio.Event()
        # One event per client with a long-poll parked: a round start wakes only the clients it selected.
        self._parked: dict[str, asyncio.Event] = {}
        self._agg_task: asyncio.Task[None] | None = None
        self._finished = asyncio.Event()
        self._told_finished: set[str] = set()
        self._polling: dict[str, int] = {}
        self._waiting_logged = -math.inf

    @property
    def manifest(self) -> list[TensorMeta]:
        return self.models.manifest

    @property
    def fingerprint(self) -> str:
        return self.models.fingerprint

    @property
    def global_state(self) -> Mapping[str, torch.Tensor]:
        return self.models.get()

    def subscribe(self, fn: Subscriber) -> None:
        """Call ``fn`` with every completed round's report, after the round was persisted."""
        self._subscribers.append(fn)

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
            if self.dp.stop_required and self.state.phase != rm.FINISHED:  # the privacy budget is spent
                self.state.phase, self.state.outcome, self.state.round = rm.FINISHED, DP_BUDGET, self.resumed_from
        self.log.info("federation.started", federation_id=self.config.server.federation_id,
                      model=self.config.model.name, params=self.models.num_params, fingerprint=self.fingerprint,
                      rounds=self.config.rounds.num_rounds, k=self.config.rounds.clients_per_round,
                      resumed_from=self.resumed_from)

    # ---- state machine plumbing ----

    def observe(self, obs: rm.Observation) -> None:
        self.state, events = rm.step(self.state, obs, self.rounds, self.limits)
        for ev in events:
            self._on_event(ev)
        # Long-polls only care about a task becoming available or the federation ending; waking them for
        # every accepted update would cost O(K^2) wake-ups per round, and waking every parked client at a round
        # start O(N): a round start wakes the clients it selected.
        for ev in events:
            if isinstance(ev, rm.RoundStarted):
                self._notify(ev.selected)
            elif isinstance(ev, rm.FederationFinished):
                self._notify()

    def _notify(self, clients: tuple[str, ...] | None = None) -> None:
        """Wake the run loop and the parked long-polls of ``clients`` (None: of every client)."""
        self._wake.set()
        self._wake = asyncio.Event()
        for cid in self._parked if clients is None else clients:
            parked = self._parked.get(cid)
            if parked is not None:
                parked.set()

    def _on_event(self, ev: rm.Event) -> None:
        if isinstance(ev, rm.RoundStarted):
            self.intake.open_round(ev.round, ev.attempt, len(ev.selected), self.clock())
            self.log.info("round.started", round=ev.round, attempt=ev.attempt, selected=len(ev.selected),
                          clients=list(ev.selected))
        elif isinstance(ev, rm.RoundClosed):
            self.log.info("round.closed", round=ev.round, accepted=len(ev.accepted), reason=ev.reason)
            self._agg_task = asyncio.get_running_loop().create_task(self._finalize(ev.round, ev.reason))
        elif isinstance(ev, rm.RoundAbandoned):
            self.log.warning("round.abandoned", round=ev.round, attempt=ev.attempt, accepted=ev.accepted,
                             needed=ev.needed, reason=ev.reason)
            self.persistence.progress(self.state)
        elif isinstance(ev, rm.ClientDropped):
            self.log.warning("client.dropped", client_id=ev.client_id, silent_for_s=round(ev.silent_for, 1))
        elif isinstance(ev, rm.FederationFinished):
            self._finish(ev.rounds, ev.outcome)

    # ---- protocol ----

    def join(self, client_id: str, token: str, num_samples: int, opt_out: bool, attacker: bool,
             model_fingerprint: str, credential: str = "") -> JoinResult:
        self.sessions.authenticate(client_id, token)
        self.sessions.check_room(client_id, credential)
        if model_fingerprint and model_fingerprint != self.fingerprint:
            self.log.warning("client.join_refused", client_id=client_id, reason="model fingerprint mismatch")
            raise ProtocolError("FAILED_PRECONDITION", f"model fingerprint {model_fingerprint} does not match "
                                                       f"the federation's {self.fingerprint}")
        session = self.sessions.open(client_id, credential)
        self._notify((client_id,))  # a poll of a replaced session returns
        rejoin = client_id in self.state.clients
        self.observe(rm.Joined(client_id, self.clock(), num_samples, opt_out, attacker))
        index = self.state.clients[client_id].index
        self.log.info("client.joined", client_id=client_id, index=index, rejoin=rejoin, num_samples=num_samples)
        return JoinResult(session, index)

    def client_of(self, session: str) -> str:
        return self.sessions.client_of(session)

    def touch(self, session: str) -> str:
        """The client behind ``session`` was heard from (raises UNAUTHENTICATED for an unknown session)."""
        cid = self.sessions.client_of(session)
        self.observe(rm.Seen(cid, self.clock()))
        return cid

    def leave(self, session: str, reason: str) -> None:
        cid = self.sessions.close(session)
        self._told_finished.discard(cid)
        self._notify((cid,))  # a poll of the ended session returns
        self.observe(rm.Left(cid, self.clock()))
        self.log.info("client.left", client_id=cid, reason=reason)

    async def pull(self, session: str, max_wait_s: float, declined: bool = False) -> Task | WaitInfo:
        cid = self.touch(session)
        if declined:
            return self._declined(cid)
        if not self.state.clients[cid].ready and not self.stopping:
            self.observe(rm.Polled(cid, self.clock()))
        self._polling[cid] = self._polling.get(cid, 0) + 1
        try:
            return await self._pull(session, cid, max_wait_s)
        finally:
            self._polling[cid] -= 1
            if not self._polling[cid]:
                del self._polling[cid]
                self._parked.pop(cid, None)

    def _declined(self, cid: str) -> WaitInfo:
        """The client declines work now (its device is not eligible): unavailable, not failed (rm.Declined).
        It is told to check again within a heartbeat interval (its decline poll keeps it alive)."""
        if self.state.phase == rm.FINISHED:
            self._told_finished.add(cid)
            return WaitInfo(0.0, True, f"federation {self.state.outcome}")
        rec = self.state.clients.get(cid)
        if rec is not None and (rec.ready or (cid in self.state.selected and cid not in self.state.declined)):
            self.log.info("client.declined", client_id=cid, round=self.state.round,
                          selected=cid in self.state.selected)
        self.observe(rm.Declined(cid, self.clock()))
        return WaitInfo(self.config.server.heartbeat_interval_s, False, "declined: not selectable until it polls")

    async def _pull(self, session: str, cid: str, max_wait_s: float) -> Task | WaitInfo:
        wait = min(max(max_wait_s, 0.0), self.config.server.long_poll_s)
        deadline = self.clock() + wait
        while True:
            if self.state.phase == rm.FINISHED:
                self._told_finished.add(cid)
                return WaitInfo(0.0, True, f"federation {self.state.outcome}")
            if self.stopping:
                return WaitInfo(1.0, False, "server stopping; the federation resumes when it restarts")
            task = self.dispatch.task_for(self.state, cid, self.clock())
            if task is not None:
                self.log.debug("task.sent", client_id=cid, round=task.round, model_id=task.model_id)
                self.observe(rm.Seen(cid, self.clock()))  # it came for its task: pending (poll grace)
                return task
            remaining = deadline - self.clock()
            if remaining <= 0:
                return WaitInfo(0.0, False, "no task for this client yet")
            parked = self._parked.setdefault(cid, asyncio.Event())
            parked.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(parked.wait(), timeout=remaining)
            if session not in self.sessions:  # it left or re-joined meanwhile
                return WaitInfo(0.0, False, "session ended")

    def begin_update(self, session: str, round_: int, num_samples: int, is_delta: bool, train_loss: float,
                     beta_hat: float | None, metrics: dict[str, float], manifest: list[TensorMeta],
                     announced_bytes: int) -> UpdateTicket:
        """Admission of an update header; raises :class:`ProtocolError` (and records the rejection)."""
        cid = self.touch(session)
        if self.stopping:
            raise ProtocolError("UNAVAILABLE", "server stopping; send the update again after it restarts")
        return self.intake.begin(cid, round_, num_samples, is_delta, train_loss, beta_hat, metrics, manifest,
                                 announced_bytes)

    def reject_header(self, session: str, round_: int, code: str, reason: str) -> None:
        """Refuse an update whose header could not even be read (raises :class:`ProtocolError`)."""
        self.intake.reject(self.touch(session), round_, code, reason)

    def upload_closed(self, ticket: UpdateTicket) -> str | None:
        """Why an update still being received can no longer be taken, or None."""
        return self.intake.closed(ticket)

    def reject_ticket(self, ticket: UpdateTicket, code: str, reason: str) -> None:
        self.intake.reject_ticket(ticket, code, reason)

    def submit_update(self, ticket: UpdateTicket, tensors: dict[str, torch.Tensor]) -> None:
        if self.stopping:
            raise ProtocolError("UNAVAILABLE", "server stopping; send the update again after it restarts")
        self.intake.submit(ticket, tensors)

    # ---- round finalisation: aggregate -> report -> persist -> subscribers ----

    async def _finalize(self, round_: int, reason: str) -> None:
        agg, log = self.intake.take()
        crash_point("aggregate", round_)
        try:
            if isinstance(agg, UpdateBuffer):  # DistFL: cluster, then aggregate per cluster
                result = await self.clusters.aggregate(agg, round_)
            else:
                crafted = (await asyncio.to_thread(self.harness.apply, agg, self.state, round_)
                           if self.harness.enabled else {})
                result = await self.finalizer.aggregate(agg, round_)
                result.metrics.update(crafted)
        except ValueError as e:  # the rule cannot work with what arrived: re-run the round
            self.log.warning("round.aggregation_failed", round=round_, reason=str(e))
            self.observe(rm.AggregationFailed(round_, str(e), self.clock()))
            return
        report = self.clusters.complete(await self.finalizer.report(result, log, self.state, reason))
        report, _ = self.nfl.observe(report)  # moves the detector before the snapshot that saves it
        report, budget_spent = await asyncio.to_thread(self.dp.observe, report)  # (epsilon, delta) so far
        await asyncio.to_thread(self.persistence.snapshot, self.state, [*self.history, report], round_)
        crash_point("persisted", round_)
        for fn in self._subscribers:
            fn(report)
        self.intake.finished_round()
        self.observe(rm.Aggregated(round_, self.clock(), DP_BUDGET if budget_spent else ""))

    def _log_round(self, r: RoundReport) -> None:
        self.log.info("round.completed", round=r.round, outcome=r.outcome, **r.scalars(), **r.metrics,
                      snapshot_s=round(self.persistence.last_save_seconds, 5))

    def _write_round(self, r: RoundReport) -> None:
        write_round(self.run_dir, r)

    # ---- run loop, stop, status ----

    async def run(self) -> FederationStatus:
        """Drive the federation until it finishes (or :meth:`stop`); returns the final status."""
        if self.state.phase == rm.FINISHED:  # resumed a federation that had already finished
            self.log.info("federation.already_finished", rounds=self.state.completed_rounds,
                          reason="nothing to run; start over with --fresh")
            self._finish(self.state.completed_rounds, self.state.outcome)
        self.observe(rm.Tick(self.clock()))
        while not self._finished.is_set() and not self.stopping:
            wake = self._wake
            timeout = 0.25
            if self.state.phase == rm.TRAINING:
                timeout = min(timeout, max(0.0, self.state.deadline - self.clock()) + 0.001)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=timeout)
            self._reap_finalize()
            if not self.stopping:
                # A client parked in a long-poll is connected, hence alive.
                self.observe(rm.Tick(self.clock(), frozenset(self._polling)))
                self._log_waiting()
        return self.status()

    def _log_waiting(self) -> None:
        """While a round waits for clients, say so every WAIT_LOG_S seconds: how many are ready of how many it
        needs, and how long until the federation gives up (a silent wait looks like a hang)."""
        s, now = self.state, self.clock()
        if s.phase != rm.SAMPLING or now - s.phase_since < WAIT_LOG_S or now - self._waiting_logged < WAIT_LOG_S:
            return
        self._waiting_logged = now
        ready, needed = len(s.available_ids()), rm.start_needs(s, self.rounds)
        self.log.info("round.waiting", round=s.round, status=f"waiting: {ready} of {needed} ready", ready=ready,
                      needed=needed, alive=len(s.alive_ids()),
                      gives_up_in_s=round(max(0.0, s.phase_since + self.rounds.sampling_timeout_s - now)))

    def _reap_finalize(self) -> None:
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
            self._reap_finalize()
        if self.state.phase != rm.FINISHED:
            self.persistence.progress(self.state)

    def _finish(self, rounds: int, outcome: str) -> None:
        path = self.run_dir / "final_model.fgt"
        save_state(path, self.models.get(), {"rounds": rounds, "fingerprint": self.fingerprint,
                                             "model": self.config.model.name})
        self._write_outputs(rounds)
        if outcome == "stalled":
            s = self.state
            self.log.error("federation.stalled", rounds=rounds, exit_code=EXIT_STALLED,
                           reason=f"fewer than {self.rounds.effective_min_updates} clients ready within "
                                  f"rounds.sampling_timeout_s = {self.rounds.sampling_timeout_s:g} s "
                                  f"({len(s.available_ids())} ready, {len(s.alive_ids())} alive); the next start "
                                  f"resumes from round {rounds + 1}")
        self.log.info("federation.finished", rounds=rounds, outcome=outcome, model_path=str(path))
        self._finished.set()

    def _write_outputs(self, rounds: int) -> None:
        """The final global model and each DistFL cluster's as safetensors + JSON sidecar (fedcore.outputs)."""
        sha = outputs.config_hash(redacted(self.config))
        for model_id in self.models.ids():
            try:
                path = outputs.write_model(self.run_dir, self.models.get(model_id), model_name=self.config.model.name,
                                           model_kwargs=self.config.model.kwargs, round_=rounds, config_sha=sha,
                                           cluster=None if model_id == GLOBAL else model_id)
            except (OSError, ValueError) as e:  # final_model.fgt and the state store have the model already
                self.log.error("outputs.write_failed", model_id=model_id, reason=str(e))
                continue
            self.log.info("outputs.written", model_id=model_id, path=str(path))

    def close(self) -> None:
        self.persistence.close()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def all_told_finished(self) -> bool:
        """Every live client has been told that the federation finished (or has left)."""
        return all(cid in self._told_finished for cid in self.state.alive_ids())

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
