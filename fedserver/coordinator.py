"""The coordinator: the imperative shell around fedcore's round machine.

It owns the global model, the sessions and the per-round aggregator; it turns protocol calls into
observations for :func:`fedcore.rounds.step` and acts on the events that come back. Everything runs on
one asyncio event loop; long-polls wait on a wake-up event that every state change sets. Aggregation
itself runs in a worker thread so heartbeats and polls keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedcore import rounds as rm
from fedcore.aggregation import Aggregator, make_aggregator
from fedcore.config import ConfigError, ServerConfig, check_aggregation_memory, to_dict
from fedcore.data import load_client_data
from fedcore.log import get_logger
from fedcore.metrics import central_accuracy, performance_gain, pooled_test_set
from fedcore.models import build_model
from fedcore.serialization import TensorMeta, fingerprint, manifest_of, pack, save_state
from fedcore.train import resolve_device


def evaluation_device(config: ServerConfig) -> torch.device:
    """The device of the server's central evaluation; :class:`ConfigError` when this machine lacks it."""
    try:
        return resolve_device(config.evaluation.device)
    except ValueError as e:
        raise ConfigError("evaluation.device", str(e)) from None


class ProtocolError(Exception):
    """A call the coordinator refuses; ``code`` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Task:
    round: int
    deadline_s: float
    manifest: list[TensorMeta]
    payload: bytearray
    learning_rate: float
    recovery: bool = False


@dataclass(frozen=True)
class WaitInfo:
    retry_after_s: float
    finished: bool
    reason: str


@dataclass(frozen=True)
class JoinResult:
    session_id: str
    client_index: int


@dataclass(frozen=True)
class UpdateTicket:
    """An update whose header passed admission; its tensors are being received."""

    client_id: str
    round: int
    num_samples: int
    is_delta: bool
    train_loss: float
    beta_hat: float | None
    metrics: dict[str, float]


@dataclass
class _RoundLog:
    started_at: float
    selected: int = 0
    losses: list[tuple[float, int]] = field(default_factory=list)
    accuracies: dict[str, float] = field(default_factory=dict)
    private: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    betas: list[float] = field(default_factory=list)

    def clear(self) -> None:
        for part in (self.losses, self.accuracies, self.private, self.sizes, self.betas):
            part.clear()


class Coordinator:
    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.log = get_logger("fedserver")
        model = build_model(config.model.name, config.model.kwargs, seed=config.rounds.seed)
        self.global_state: dict[str, torch.Tensor] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.manifest = manifest_of(self.global_state)
        self.fingerprint = fingerprint(self.manifest)
        self._float_names = [k for k, v in self.global_state.items() if v.is_floating_point()]
        self.num_params = sum(self.global_state[k].numel() for k in self._float_names)
        check_aggregation_memory(config, self.num_params)
        self.limits = rm.Limits(heartbeat_patience_s=config.server.heartbeat_patience_s)
        self.state = rm.RoundState(phase_since=clock())
        self.sessions: dict[str, str] = {}
        self._session_of: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task_cache: tuple[int, list[TensorMeta], bytearray] | None = None
        self._aggregator: Aggregator | None = None
        self._round_log: _RoundLog | None = None
        self._agg_task: asyncio.Task[None] | None = None
        self._finished = asyncio.Event()
        self._told_finished: set[str] = set()
        self._polling: dict[str, int] = {}
        self.run_dir = Path(config.server.run_dir)
        self._eval_model = model
        self._central: tuple[torch.Tensor, torch.Tensor] | None = None
        if config.evaluation.central:
            self._eval_model = model.to(evaluation_device(config))
            self._central = self._load_central_test_set()

    # ---- state machine plumbing ----

    def observe(self, obs: rm.Observation) -> None:
        self.state, events = rm.step(self.state, obs, self.config.rounds, self.limits)
        for ev in events:
            self._on_event(ev)
        # Long-polls only care about a task becoming available or the federation ending; waking them for
        # every accepted update would cost O(K^2) wake-ups per round.
        if any(isinstance(ev, (rm.RoundStarted, rm.FederationFinished)) for ev in events):
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def _on_event(self, ev: rm.Event) -> None:
        now = self.clock()
        if isinstance(ev, rm.RoundStarted):
            if self._round_log is None:
                self._round_log = _RoundLog(started_at=now)
            self._round_log.selected = len(ev.selected)
            self._aggregator = make_aggregator(self.config.aggregation, self.num_params,
                                               self.config.rounds.clients_per_round)
            self._round_log.clear()
            self.log.info("round.started", round=ev.round, attempt=ev.attempt, selected=len(ev.selected),
                          clients=list(ev.selected))
        elif isinstance(ev, rm.RoundClosed):
            self.log.info("round.closed", round=ev.round, accepted=len(ev.accepted), reason=ev.reason)
            self._agg_task = asyncio.get_running_loop().create_task(self._aggregate(ev.round, ev.reason))
        elif isinstance(ev, rm.RoundAbandoned):
            self.log.warning("round.abandoned", round=ev.round, attempt=ev.attempt, accepted=ev.accepted,
                             needed=ev.needed, reason=ev.reason)
        elif isinstance(ev, rm.ClientDropped):
            self.log.warning("client.dropped", client_id=ev.client_id, silent_for_s=round(ev.silent_for, 1))
        elif isinstance(ev, rm.FederationFinished):
            self._finish(ev)

    # ---- protocol ----

    def join(self, client_id: str, token: str, num_samples: int, opt_out: bool, attacker: bool,
             model_fingerprint: str) -> JoinResult:
        if self.config.server.token and not secrets.compare_digest(token, self.config.server.token):
            self.log.warning("client.join_refused", client_id=client_id, reason="bad token")
            raise ProtocolError("UNAUTHENTICATED", "bad join token")
        if not client_id or len(client_id) > 128 or not client_id.isprintable():
            raise ProtocolError("INVALID_ARGUMENT", "client_id must be 1-128 printable characters")
        if model_fingerprint and model_fingerprint != self.fingerprint:
            self.log.warning("client.join_refused", client_id=client_id, reason="model fingerprint mismatch")
            raise ProtocolError("FAILED_PRECONDITION",
                                f"model fingerprint {model_fingerprint} does not match the federation's "
                                f"{self.fingerprint}")
        old = self._session_of.pop(client_id, None)
        if old is not None:  # a re-join replaces the client's previous session
            self.sessions.pop(old, None)
        session = secrets.token_hex(16)
        self.sessions[session] = client_id
        self._session_of[client_id] = session
        rejoin = client_id in self.state.clients
        self.observe(rm.Joined(client_id, self.clock(), num_samples, opt_out, attacker))
        index = self.state.clients[client_id].index
        self.log.info("client.joined", client_id=client_id, index=index, rejoin=rejoin, num_samples=num_samples)
        return JoinResult(session, index)

    def client_of(self, session: str) -> str:
        cid = self.sessions.get(session)
        if cid is None:
            raise ProtocolError("UNAUTHENTICATED", "unknown session; join first")
        return cid

    def touch(self, session: str) -> str:
        """The client behind ``session`` was heard from (raises UNAUTHENTICATED for an unknown session)."""
        cid = self.client_of(session)
        self.observe(rm.Seen(cid, self.clock()))
        return cid

    def leave(self, session: str, reason: str) -> None:
        cid = self.client_of(session)
        del self.sessions[session]
        self._session_of.pop(cid, None)
        self._told_finished.discard(cid)
        self.observe(rm.Left(cid, self.clock()))
        self.log.info("client.left", client_id=cid, reason=reason)

    def _task_for(self, cid: str) -> Task | None:
        s = self.state
        if s.phase != rm.TRAINING or cid not in s.selected or cid in s.accepted or cid in s.rejected:
            return None
        if self._task_cache is None or self._task_cache[0] != s.round:
            manifest, payload = pack(self.global_state)
            self._task_cache = (s.round, manifest, payload)
        _, manifest, payload = self._task_cache
        lr = self.config.training.learning_rate * self.config.training.lr_decay ** (s.round - 1)
        return Task(s.round, max(0.0, s.deadline - self.clock()), manifest, payload, lr)

    async def pull(self, session: str, max_wait_s: float) -> Task | WaitInfo:
        cid = self.touch(session)
        if not self.state.clients[cid].ready:
            self.observe(rm.Polled(cid, self.clock()))
        self._polling[cid] = self._polling.get(cid, 0) + 1
        try:
            return await self._pull(session, cid, max_wait_s)
        finally:
            self._polling[cid] -= 1
            if not self._polling[cid]:
                del self._polling[cid]

    async def _pull(self, session: str, cid: str, max_wait_s: float) -> Task | WaitInfo:
        wait = min(max(max_wait_s, 0.0), self.config.server.long_poll_s)
        deadline = self.clock() + wait
        while True:
            if self.state.phase == rm.FINISHED:
                self._told_finished.add(cid)
                return WaitInfo(0.0, True, f"federation {self.state.outcome}")
            task = self._task_for(cid)
            if task is not None:
                self.log.debug("task.sent", client_id=cid, round=task.round)
                return task
            remaining = deadline - self.clock()
            if remaining <= 0:
                return WaitInfo(0.0, False, "no task for this client yet")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=remaining)
            if session not in self.sessions:  # it left or re-joined meanwhile
                return WaitInfo(0.0, False, "session ended")

    def begin_update(self, session: str, round_: int, num_samples: int, is_delta: bool, train_loss: float,
                     beta_hat: float | None, metrics: dict[str, float], manifest: list[TensorMeta],
                     announced_bytes: int) -> UpdateTicket:
        """Admission of an update header; raises :class:`ProtocolError` (and records the rejection)."""
        cid = self.touch(session)
        reason = rm.admission(self.state, cid, round_)
        if reason is not None:
            self._reject(cid, round_, "FAILED_PRECONDITION", reason)
        if announced_bytes > self.config.server.max_update_bytes:
            self._reject(cid, round_, "RESOURCE_EXHAUSTED",
                         f"update of {announced_bytes} bytes exceeds the limit of "
                         f"{self.config.server.max_update_bytes}")
        if manifest != self.manifest:
            self._reject(cid, round_, "INVALID_ARGUMENT", _manifest_mismatch(manifest, self.manifest))
        if num_samples < 1:
            self._reject(cid, round_, "INVALID_ARGUMENT", f"num_samples must be >= 1, got {num_samples}")
        if not math.isfinite(train_loss) or (beta_hat is not None and not math.isfinite(beta_hat)):
            self._reject(cid, round_, "INVALID_ARGUMENT", "train_loss and beta_hat must be finite")
        bad_metric = next((k for k, v in metrics.items() if not math.isfinite(v)), None)
        if bad_metric is not None:
            self._reject(cid, round_, "INVALID_ARGUMENT", f"metric {bad_metric!r} is not finite")
        return UpdateTicket(cid, round_, num_samples, is_delta, train_loss, beta_hat, dict(metrics))

    def reject_header(self, session: str, round_: int, code: str, reason: str) -> None:
        """Refuse an update whose header could not even be read (raises :class:`ProtocolError`)."""
        self._reject(self.touch(session), round_, code, reason)

    def reject_ticket(self, ticket: UpdateTicket, code: str, reason: str) -> None:
        self._reject(ticket.client_id, ticket.round, code, reason)

    def _reject(self, cid: str, round_: int, code: str, reason: str) -> None:
        self.log.warning("update.rejected", client_id=cid, round=round_, code=code, reason=reason)
        self.observe(rm.UpdateRejected(cid, round_, reason, self.clock()))
        raise ProtocolError(code, reason)

    def submit_update(self, ticket: UpdateTicket, tensors: dict[str, torch.Tensor]) -> None:
        """Validate the received tensors and fold them into the round (raises :class:`ProtocolError`)."""
        reason = rm.admission(self.state, ticket.client_id, ticket.round)
        if reason is not None:
            self._reject(ticket.client_id, ticket.round, "FAILED_PRECONDITION", reason)
        flat = self._flatten_update(tensors, ticket.is_delta)
        if not bool(torch.isfinite(flat).all()):
            bad = next(k for k in self._float_names if not bool(torch.isfinite(tensors[k]).all()))
            self._reject(ticket.client_id, ticket.round, "INVALID_ARGUMENT", f"tensor {bad!r} has non-finite values")
        assert self._aggregator is not None
        try:
            self._aggregator.add(flat, float(ticket.num_samples))
        except ValueError as e:
            self._reject(ticket.client_id, ticket.round, "INVALID_ARGUMENT", str(e))
        if self._round_log is not None:
            rl, cid = self._round_log, ticket.client_id
            rl.losses.append((ticket.train_loss, ticket.num_samples))
            rl.sizes[cid] = ticket.num_samples
            if "test_accuracy" in ticket.metrics:
                rl.accuracies[cid] = ticket.metrics["test_accuracy"]
            if "private_accuracy" in ticket.metrics:
                rl.private[cid] = ticket.metrics["private_accuracy"]
            if ticket.beta_hat is not None:
                rl.betas.append(ticket.beta_hat)
        self.log.info("update.accepted", client_id=ticket.client_id, round=ticket.round,
                      num_samples=ticket.num_samples, train_loss=round(ticket.train_loss, 5))
        self.observe(rm.UpdateAccepted(ticket.client_id, ticket.round, self.clock()))

    def _flatten_update(self, tensors: dict[str, torch.Tensor], is_delta: bool) -> torch.Tensor:
        parts = []
        for name in self._float_names:
            t = tensors[name].reshape(-1).to(torch.float32)
            parts.append(t if is_delta else t - self.global_state[name].reshape(-1).to(torch.float32))
        return torch.cat(parts) if parts else torch.zeros(0)

    def _global_flat(self) -> torch.Tensor:
        parts = [self.global_state[k].reshape(-1).to(torch.float32) for k in self._float_names]
        return torch.cat(parts) if parts else torch.zeros(0)

    async def _aggregate(self, round_: int, reason: str) -> None:
        agg = self._aggregator
        assert agg is not None and self._round_log is not None
        gen = torch.Generator().manual_seed((self.config.rounds.seed * 1_000_003 + round_) & 0x7FFF_FFFF_FFFF)
        try:
            result = await asyncio.to_thread(agg.finalize, self._global_flat(), gen)
        except ValueError as e:  # the rule cannot work with what arrived: re-run the round
            self.log.warning("round.aggregation_failed", round=round_, reason=str(e))
            self._aggregator = None
            self.observe(rm.AggregationFailed(round_, str(e), self.clock()))
            return
        offset = 0
        new_state = dict(self.global_state)
        for name in self._float_names:
            old = self.global_state[name]
            n = old.numel()
            new_state[name] = result.new_global[offset : offset + n].reshape(old.shape).to(old.dtype)
            offset += n
        self.global_state = new_state
        self._aggregator = None
        rl = self._round_log
        central = await asyncio.to_thread(self._central_accuracy) if self._central is not None else None
        now = self.clock()
        n_total = sum(n for _, n in rl.losses)
        attackers = {c for c in rl.accuracies if self.state.clients[c].attacker}
        benign_acc = [a for c, a in rl.accuracies.items() if c not in attackers]
        summary: dict[str, Any] = {
            "round": round_,
            "selected": rl.selected,
            "accepted": len(self.state.accepted),
            "rejected": self.state.rejected_in_round,
            "mean_train_loss": sum(loss * n for loss, n in rl.losses) / n_total if n_total else NAN,
            "mean_test_accuracy": _mean(list(rl.accuracies.values())),
            "test_accuracy_benign": _mean(benign_acc),
            "central_accuracy": NAN if central is None else central,
            **self._betas(rl, attackers),
            "beta_hat_median": _median(rl.betas),
            "seconds": now - rl.started_at,
            "outcome": reason,
            "metrics": {k: float(v) for k, v in result.metrics.items()},
        }
        self.history.append(summary)
        self._round_log = None
        self._write_round(summary)
        self.log.info("round.completed", **{k: v for k, v in summary.items() if k != "metrics"},
                      **summary["metrics"])
        self.observe(rm.Aggregated(round_, self.clock()))

    @staticmethod
    def _betas(rl: _RoundLog, attackers: set[str]) -> dict[str, float]:
        """FL-GUARD Eq. 1-2 over this round's participants that report P_i: beta_i = V_i - P_i."""
        both = {c: v for c, v in rl.accuracies.items() if c in rl.private}
        if not both:
            return dict.fromkeys(BETA_KEYS, NAN)
        rep = performance_gain(both, rl.private, rl.sizes, exclude=attackers)
        return {"beta": rep.beta, "beta_weighted": rep.beta_weighted, "beta_benign": rep.beta_benign,
                "beta_benign_weighted": rep.beta_benign_weighted}

    def _load_central_test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        n = cfg.evaluation.central_clients or int(cfg.data.options.get("num_clients", 100))
        shards = (load_client_data(cfg.data.dataset, i, cfg.rounds.seed, cfg.data.options) for i in range(n))
        return pooled_test_set(shards)

    def _central_accuracy(self) -> float:
        assert self._central is not None
        self._eval_model.load_state_dict(self.global_state)
        return central_accuracy(self._eval_model, *self._central)

    # ---- run loop, persistence, status ----

    async def run(self) -> dict[str, Any]:
        """Drive the federation until it finishes; returns the final status."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.config), indent=2))
        # A new federation starts a new per-round record (an earlier run in the same directory is replaced).
        (self.run_dir / "rounds.jsonl").write_text("")
        self.log.info("federation.started", federation_id=self.config.server.federation_id,
                      model=self.config.model.name, params=self.num_params, fingerprint=self.fingerprint,
                      rounds=self.config.rounds.num_rounds, k=self.config.rounds.clients_per_round)
        self.observe(rm.Tick(self.clock()))
        while not self._finished.is_set():
            wake = self._wake
            timeout = 0.25
            if self.state.phase == rm.TRAINING:
                timeout = min(timeout, max(0.0, self.state.deadline - self.clock()) + 0.001)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=timeout)
            if self._agg_task is not None and self._agg_task.done():
                exc = self._agg_task.exception()
                self._agg_task = None
                if exc is not None:
                    raise exc
            self._tick()
        return self.status()

    def _tick(self) -> None:
        # A client parked in a long-poll is connected, hence alive.
        self.observe(rm.Tick(self.clock(), frozenset(self._polling)))

    def _finish(self, ev: rm.FederationFinished) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_state(self.run_dir / "final_model.fgt", self.global_state,
                   {"rounds": ev.rounds, "fingerprint": self.fingerprint, "model": self.config.model.name})
        self.log.info("federation.finished", rounds=ev.rounds, outcome=ev.outcome,
                      model_path=str(self.run_dir / "final_model.fgt"))
        self._finished.set()

    def _write_round(self, summary: dict[str, Any]) -> None:
        with open(self.run_dir / "rounds.jsonl", "a") as f:
            f.write(json.dumps(summary) + "\n")

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def all_told_finished(self) -> bool:
        """Every live client has been told that the federation finished (or has left)."""
        return all(cid in self._told_finished for cid in self.state.alive_ids())

    def status(self) -> dict[str, Any]:
        s = self.state
        return {
            "federation_id": self.config.server.federation_id,
            "round": s.round,
            "num_rounds": self.config.rounds.num_rounds,
            "phase": s.phase,
            "outcome": s.outcome,
            "clients_known": len(s.clients),
            "clients_alive": len(s.alive_ids()),
            "selected": len(s.selected),
            "accepted": len(s.accepted),
            "rejected": s.rejected_in_round,
            "rejected_total": s.rejected_total,
            "history": list(self.history),
            "finished": s.phase == rm.FINISHED,
        }


NAN = float("nan")
BETA_KEYS = ("beta", "beta_weighted", "beta_benign", "beta_benign_weighted")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else NAN


def _median(values: list[float]) -> float:
    if not values:
        return float("nan")
    return float(torch.tensor(values, dtype=torch.float64).median())


def _manifest_mismatch(got: list[TensorMeta], want: list[TensorMeta]) -> str:
    got_by_name = {m.name: m for m in got}
    want_by_name = {m.name: m for m in want}
    for m in want:
        g = got_by_name.get(m.name)
        if g is None:
            return f"tensor {m.name!r} is missing"
        if g.dtype != m.dtype:
            return f"tensor {m.name!r} has dtype {g.dtype}, expected {m.dtype}"
        if g.shape != m.shape:
            return f"tensor {m.name!r} has shape {list(g.shape)}, expected {list(m.shape)}"
    extra = [m.name for m in got if m.name not in want_by_name]
    if extra:
        return f"unexpected tensor {extra[0]!r}"
    return "tensors are not in the model's order"
