"""Update intake: admission of an update header, validation of the received tensors, and folding them into
the round's aggregator with the sender's client id (the aggregator orders by it, so arrival order never
changes the result).

The intake owns the round's :class:`~fedcore.aggregation.Aggregator` and :class:`RoundLog` between a
:class:`~fedcore.rounds.RoundStarted` and the round's close; :meth:`UpdateIntake.take` hands both to the
finalisation. Every refusal is recorded with the round machine (an ``UpdateRejected`` observation) and raised
as a :class:`~fedserver.errors.ProtocolError` with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedcore import buffered as bf
from fedcore import rounds as rm
from fedcore.aggregation import AggregationConfig, Aggregator, make_aggregator
from fedcore.compression.codecs import Decoder, layout
from fedcore.compression.config import NONE
from fedcore.config import ServerConfig, effective_aggregation
from fedcore.log import get_logger
from fedcore.nfl import OFF
from fedcore.secagg.aggregate import NUM_EXTRAS, SecureFedAvg
from fedcore.secagg.config import MASKED_TENSOR
from fedcore.serialization import TensorMeta
from fedcore.update_report import UpdateReport
from fedserver.buffered_rounds import BufferedUpdate, BufferJournal, version_id
from fedserver.clusters import UpdateBuffer
from fedserver.errors import ProtocolError
from fedserver.global_models import GlobalModels
from fedserver.secure_round import SecureRounds
from fedserver.stage import RoundAggregation
from fedserver.store import StoreError


@dataclass(frozen=True)
class UpdateTicket:
    """An update whose header passed admission; its tensors are being received."""

    client_id: str
    round: int
    is_delta: bool
    report: UpdateReport
    model_id: str
    # The attempt of the round the update was admitted in: a round restarted meanwhile is another attempt.
    attempt: int = 0
    # A secure-aggregation masked input (fedserver.secure_round), not an update the server can read.
    masked: bool = False
    # How the update is encoded (the announced compression.kind; "none": the tensors as they are) ...
    compression: str = NONE
    # ... and its tensor payload's bytes (counted in the round's bytes_received once it is taken).
    nbytes: int = 0


@dataclass
class RoundLog:
    """The accepted clients' reports of the round in progress (what each sent besides its tensors), keyed by
    client id."""

    round: int
    started_at: float
    selected: int = 0
    attempt: int = 0
    reports: dict[str, UpdateReport] = field(default_factory=dict)
    # The tensor payload bytes of the updates taken (RoundReport.bytes_received).
    bytes_received: int = 0
    # Buffered rounds: each accepted update's staleness (rounds between its base model and this buffer).
    staleness: dict[str, int] = field(default_factory=dict)


class UpdateIntake:
    def __init__(self, config: ServerConfig, models: GlobalModels, state: Callable[[], rm.RoundState],
                 observe: Callable[[rm.Observation], None], clock: Callable[[], float],
                 model_id_for: Callable[[str], str],
                 keep_updates: Callable[[Aggregator], UpdateBuffer] | None = None,
                 round_aggregation: Callable[[AggregationConfig], RoundAggregation] | None = None,
                 secure: SecureRounds | None = None, limits: rm.Limits | None = None) -> None:
        self.config = config
        # Buffered rounds (rounds.mode = "buffered"): admission by the version a device trained from, staleness.
        self._buffered = config.rounds.buffered
        self._limits = limits if limits is not None else rm.Limits(config.server.heartbeat_patience_s)
        self.models = models
        self._state = state
        self._observe = observe
        self._clock = clock
        self._model_id_for = model_id_for
        # DistFL: the round's updates are kept whole (grouped into clusters when the round closes).
        self._keep_updates = keep_updates
        # How a round opened now aggregates: the pipeline's aggregation stages (adaptive clipping); None: as configured.
        self._round_aggregation = round_aggregation
        # Secure aggregation: devices upload masked inputs, summed by the protocol (None or disabled: plain updates).
        self.secure = secure if secure is not None and secure.enabled else None
        self.aggregator: Aggregator | UpdateBuffer | SecureFedAvg | None = None
        self.round_log: RoundLog | None = None
        self.log = get_logger("fedserver")
        # Buffered rounds with persistence: each update taken into the open buffer is written to the state store
        # before it is folded and acknowledged (fedserver.buffered_rounds.BufferJournal; set by the coordinator).
        self.journal: BufferJournal | None = None

    def open_round(self, round_: int, attempt: int, selected: int, now: float) -> None:
        """A round (or a new attempt of it) started: a fresh aggregator and log; the start time is kept."""
        started = self.round_log.started_at if self.round_log and self.round_log.round == round_ else now
        self.round_log = RoundLog(round_, started, selected, attempt)
        config, noise_multiplier = self.round_aggregation()
        if self.secure is not None:
            self.aggregator = SecureFedAvg(self.models.num_params, config.weighted, noise_sigma=config.noise_sigma)
            return
        agg = make_aggregator(config, self.models.num_params, self.config.rounds.clients_per_round,
                              noise_multiplier=noise_multiplier)
        self.aggregator = agg if self._keep_updates is None else self._keep_updates(agg)

    def round_aggregation(self) -> tuple[AggregationConfig, float | None]:
        """The aggregation a round opened now runs, and its noise multiplier (None: the noise is ``noise_sigma``):
        the server's effective ``[aggregation]`` through the pipeline's aggregation stages."""
        config = effective_aggregation(self.config)
        if self._round_aggregation is None:
            return config, None
        setup = self._round_aggregation(config)
        return setup.config, setup.noise_multiplier

    def take(self) -> tuple[Aggregator | UpdateBuffer | SecureFedAvg, RoundLog]:
        """Hand the closed round's aggregator and log to the finalisation."""
        assert self.aggregator is not None and self.round_log is not None
        agg, log = self.aggregator, self.round_log
        self.aggregator = None
        return agg, log

    def finished_round(self) -> None:
        self.aggregator, self.round_log = None, None

    def begin(self, client_id: str, round_: int, report: UpdateReport, is_delta: bool, manifest: list[TensorMeta],
              announced_bytes: int, masked: bool = False, compression: str = NONE) -> UpdateTicket:
        """Admission of an update header; raises :class:`ProtocolError` (and records the rejection). ``report``'s
        numbers are bounded here (:meth:`UpdateReport.bounds_error`), after the round's admission. ``compression``:
        the encoding the header names, which must be the announced one (``compression.kind``); a compressed update
        is a DELTA whose tensors are the encoding's layout for this model (:func:`fedcore.compression.codecs.layout`),
        so every length is known before its bytes arrive."""
        model_id = self._model_id_for(client_id)
        if self._buffered:  # the version the device claims it trained from is checked against its task
            self._buffered_admission(client_id, round_)
            model_id = version_id(round_)
        else:
            reason = rm.admission(self._state(), client_id, round_)
            if reason is not None:
                self._refuse_admission(client_id, round_, reason)
        limit = self.config.server.max_update_bytes
        if announced_bytes > limit:
            self.reject(client_id, round_, "RESOURCE_EXHAUSTED",
                        f"update of {announced_bytes} bytes exceeds the limit of {limit}")
        if masked != (self.secure is not None):
            self.reject(client_id, round_, "FAILED_PRECONDITION",
                        "this server runs secure aggregation: send the masked input (kind MASKED)" if not masked else
                        "a masked input, but this server does not run secure aggregation")
        announced = self.config.compression
        if compression != announced.kind:
            self.reject(client_id, round_, "FAILED_PRECONDITION",
                        f"this federation's updates are encoded as {announced.kind!r} (compression.kind, announced "
                        f"at join), this one as {compression!r}")
        if masked:
            want = self.masked_manifest()
        elif announced.compressed:
            if not is_delta:
                self.reject(client_id, round_, "INVALID_ARGUMENT",
                            f"a {announced.kind} update is the encoded difference u_i: its kind must be DELTA")
            want = layout(announced, self.models.num_params)
        else:
            want = self.models.manifest
        if manifest != want:
            self.reject(client_id, round_, "INVALID_ARGUMENT", manifest_mismatch(manifest, want))
        out_of_bounds = report.bounds_error()
        if out_of_bounds is not None:
            self.reject(client_id, round_, "INVALID_ARGUMENT", out_of_bounds)
        if report.beta_hat is None and self.config.nfl.mode != OFF:
            self.log.debug("update.no_beta_hat", client_id=client_id, round=round_,
                           reason="update without beta_hat: aggregated, not counted for the NFL detector")
        return UpdateTicket(client_id, round_, is_delta, report, model_id,
                            self._state().attempt, masked, compression, announced_bytes)

    def _buffered_admission(self, client_id: str, base: int) -> None:
        """Buffered rounds' admission of an update trained from round ``base``'s model (raises
        :class:`ProtocolError`): UNAVAILABLE (not recorded: the device sends it again) while the buffer is being
        aggregated, ALREADY_EXISTS for an update the buffer holds, else a refusal recorded with the round machine."""
        state = self._state()
        if state.buffered is not None and [client_id, base] in state.buffered.buffer:
            raise ProtocolError("ALREADY_EXISTS", f"round {state.round}'s buffer already holds this update")
        refusal = rm.buffered_admission(state, client_id, base, self.config.rounds, self._limits)
        if refusal is None:
            return
        code, reason = refusal
        if code == bf.RETRY:
            self.log.info("update.deferred", client_id=client_id, base=base, round=state.round, reason=reason)
            raise ProtocolError(code, reason)
        self.reject(client_id, base, code, reason)

    def decoder(self, ticket: UpdateTicket) -> Decoder | None:
        """The streaming decoder of a compressed update (None for any other): it writes the decoded float32 [P]
        update as the bytes arrive (:class:`fedcore.compression.codecs.Decoder`; its refusals are
        :class:`fedcore.serialization.SerializationError`)."""
        if ticket.masked or ticket.compression == NONE:
            return None
        return Decoder(self.config.compression, self.models.num_params, ticket.nbytes)

    def masked_manifest(self) -> list[TensorMeta]:
        """What a masked input must be: one int64 tensor of 2N words (N = P + the extra scalars)."""
        return [TensorMeta(MASKED_TENSOR, "int64", (2 * (self.models.num_params + NUM_EXTRAS),))]

    def closed(self, ticket: UpdateTicket) -> str | None:
        """Why an update being received can no longer be taken (its round or attempt is over), or None."""
        state = self._state()
        if self._buffered:  # a buffer being aggregated defers the update at submit (UNAVAILABLE), not here
            refusal = rm.buffered_admission(state, ticket.client_id, ticket.round, self.config.rounds, self._limits)
            return None if refusal is None or refusal[0] == bf.RETRY else refusal[1]
        if state.attempt != ticket.attempt and state.round == ticket.round:
            return f"round {ticket.round} was restarted while the update was being received"
        return rm.admission(state, ticket.client_id, ticket.round)

    def reject_ticket(self, ticket: UpdateTicket, code: str, reason: str) -> None:
        """Refuse an admitted update; recorded against the round only if its attempt is still the current one
        (an upload begun before the round restarted must not count against the new attempt)."""
        state = self._state()
        if not self._buffered and (state.round, state.attempt) != (ticket.round, ticket.attempt):
            self.log.warning("update.rejected", client_id=ticket.client_id, round=ticket.round, code=code,
                             reason=reason, note="admitted in an earlier attempt of the round; not recorded")
            raise ProtocolError(code, reason)
        self.reject(ticket.client_id, ticket.round, code, reason)

    def _refuse_admission(self, client_id: str, round_: int, reason: str, ticket: UpdateTicket | None = None) -> None:
        """Refuse an update its round cannot take (raises :class:`ProtocolError`). A second copy of an update the
        round already holds (a device that resent it, not knowing it had arrived) is ALREADY_EXISTS and recorded
        nowhere: it is not a refused update; anything else is FAILED_PRECONDITION, recorded against the round."""
        if rm.holds_update(self._state(), client_id, round_):
            self.log.info("update.duplicate", client_id=client_id, round=round_,
                          reason="the round already holds this client's update: refused as ALREADY_EXISTS")
            raise ProtocolError("ALREADY_EXISTS", reason)
        if ticket is not None:
            self.reject_ticket(ticket, "FAILED_PRECONDITION", reason)
        self.reject(client_id, round_, "FAILED_PRECONDITION", reason)

    def reject(self, client_id: str, round_: int, code: str, reason: str) -> None:
        """Record a refusal with the round machine and raise it."""
        self.log.warning("update.rejected", client_id=client_id, round=round_, code=code, reason=reason)
        self._observe(rm.UpdateRejected(client_id, round_, reason, self._clock()))
        raise ProtocolError(code, reason)

    def submit(self, ticket: UpdateTicket, tensors: Mapping[str, torch.Tensor] | torch.Tensor) -> None:
        """Validate the received tensors (or a compressed update's decoded float32 [P] vector: :meth:`decoder`) and
        fold them into the round (raises :class:`ProtocolError`). The bounds are the same for both: checked on the
        decoded update."""
        cid, round_ = ticket.client_id, ticket.round
        if self._buffered:
            self._buffered_admission(cid, round_)
        else:
            reason = rm.admission(self._state(), cid, round_)
            if reason is not None:
                self._refuse_admission(cid, round_, reason, ticket)
        if isinstance(tensors, torch.Tensor):  # a compressed update, decoded
            if ticket.compression == NONE or ticket.masked or tuple(tensors.shape) != (self.models.num_params,):
                self.reject_ticket(ticket, "INVALID_ARGUMENT", "a decoded update for an update that is not compressed")
            flat = tensors
            if not bool(np.isfinite(flat.numpy()).all()):
                bad_at = int(np.argmax(~np.isfinite(flat.numpy())))
                self.reject_ticket(ticket, "INVALID_ARGUMENT",
                                   f"the decoded {ticket.compression} update has non-finite values (coordinate "
                                   f"{bad_at})")
        elif ticket.masked:
            self._take_masked(ticket, tensors)
            return
        elif ticket.compression != NONE:
            self.reject_ticket(ticket, "INVALID_ARGUMENT", f"a {ticket.compression} update must be decoded")
        else:
            # The upload is the intake's (the servicer drops it): u_i is computed in its buffer where it can be.
            flat = self.models.flatten_update(tensors, ticket.is_delta, ticket.model_id, consume=True)
            if not bool(np.isfinite(flat.numpy()).all()):  # numpy's: a fifth of torch's call cost on a small model
                bad = next(k for k in self.models.float_names if not bool(torch.isfinite(tensors[k]).all()))
                self.reject_ticket(ticket, "INVALID_ARGUMENT", f"tensor {bad!r} has non-finite values")
        assert self.aggregator is not None and self.round_log is not None
        row: int | None = None
        if self._buffered:  # FedBuff: the update scaled by its staleness weight w(s) before it is aggregated
            r = self.config.rounds
            staleness = self.round_log.round - round_
            weight = bf.staleness_weight(r.staleness, staleness, r.staleness_a, r.staleness_b)
            if weight != 1.0:
                flat = flat * weight
            if self.journal is not None:  # durable before it is folded and acknowledged
                try:
                    row = self.journal.record(self.round_log.round, self.round_log.attempt,
                                              BufferedUpdate(cid, round_, flat, ticket.report, ticket.nbytes,
                                                             staleness))
                except StoreError as e:  # not stored, so not taken: the device sends it again
                    self.log.error("update.not_stored", client_id=cid, round=round_, reason=str(e))
                    raise ProtocolError("UNAVAILABLE", "the server cannot store the update now; send it again") \
                        from None
            self.round_log.staleness[cid] = staleness
        try:
            self.aggregator.add(flat, float(ticket.report.num_samples), key=cid)
        except ValueError as e:
            if row is not None:
                assert self.journal is not None
                self.journal.forget(row)
            self.reject_ticket(ticket, "INVALID_ARGUMENT", str(e))
        self.round_log.reports[cid] = ticket.report
        self.round_log.bytes_received += ticket.nbytes
        # Debug-level: at a fleet's scale a line per client-round costs a tenth of the server's CPU; the round's
        # row counts the acceptances and times their spread (timing_seconds: first_update, median_update).
        self.log.debug("update.accepted", client_id=cid, round=round_, num_samples=ticket.report.num_samples,
                       train_loss=round(ticket.report.train_loss, 5))
        self._observe(rm.UpdateAccepted(cid, round_, self._clock()))

    def refold(self, updates: list[BufferedUpdate]) -> None:
        """A resumed server's open buffer takes the updates its store kept (the round machine took them already,
        :func:`fedcore.rounds.restore_buffer`), in arrival order, exactly as :meth:`submit` folded them."""
        assert self.aggregator is not None and self.round_log is not None
        for u in updates:
            self.aggregator.add(u.flat, float(u.report.num_samples), key=u.client_id)
            self.round_log.staleness[u.client_id] = u.staleness
            self.round_log.reports[u.client_id] = u.report
            self.round_log.bytes_received += u.nbytes

    def _take_masked(self, ticket: UpdateTicket, tensors: Mapping[str, torch.Tensor]) -> None:
        """A masked input into the protocol's running sum; counted as the device's update for the round."""
        assert self.secure is not None and self.round_log is not None
        words = tensors[MASKED_TENSOR].numpy().view(np.uint64)
        try:
            self.secure.take_masked(ticket.client_id, ticket.round, ticket.attempt, words)
        except ProtocolError as e:
            self.reject_ticket(ticket, e.code, e.message)
        self.round_log.reports[ticket.client_id] = ticket.report
        self.round_log.bytes_received += ticket.nbytes
        self.log.debug("update.accepted", client_id=ticket.client_id, round=ticket.round, masked=True)
        self._observe(rm.UpdateAccepted(ticket.client_id, ticket.round, self._clock()))


def manifest_mismatch(got: list[TensorMeta], want: list[TensorMeta]) -> str:
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
