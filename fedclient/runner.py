"""The round runner: join, then pull -> local round (through the client mods) -> push until the federation ends;
declines while the app says the device cannot train; re-joins when the server forgot the session.

It owns the protocol's order and nothing else: the connection (:mod:`fedclient.connection`) answers how to call,
the setup (:mod:`fedclient.setup`) what the device trains with, the mods (:mod:`fedclient.mods`) what wraps a
round, :class:`fedclient.local_round.LocalRound` what a round computes, and the embedding half
(:class:`fedclient.embed.EmbeddingApi`) what the app is told.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
import torch
from google.protobuf.message import DecodeError
from torch import nn

from fedclient.connection import RETRYABLE, Connection
from fedclient.embed import EmbeddingApi
from fedclient.errors import FedClientError, SessionLost
from fedclient.local_round import LocalRound, LocalRoundError
from fedclient.mods import CallNext, ModContext, RoundReply, RoundTask, chain, client_mods
from fedclient.secure import SecureClient, SecureRound, SecureRoundAbandoned
from fedclient.setup import ClientSetup
from fedclient.simulation import DeviceSimulation
from fedclient.stream import Exchanges, StreamEnded
from fedclient.transport import update_frames
from fedcore.client_state import ClientRoundReport
from fedcore.compression.codecs import Encoded, flat_update
from fedcore.compression.device import DeviceCompressor
from fedcore.config import ClientConfig, FederationInfo
from fedcore.models import load_weights, model_fingerprint, model_manifest
from fedcore.secagg.config import MASKED_TENSOR
from fedcore.serialization import DEFAULT_CHUNK_BYTES, Payload, Reassembler, SerializationError, TensorMeta, payload_of
from fedcore.update_report import BetaHat, UpdateReport
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb

VERSION = "0.1.0"

# The longest a server's "come back later" makes the client wait (a server cannot park a client forever).
MAX_RETRY_AFTER_S = 60.0


@dataclass
class ClientSummary:
    client_id: str
    rounds_trained: int = 0
    updates_accepted: int = 0
    updates_rejected: int = 0
    reconnects: int = 0
    # Joins after the first one (the server had forgotten the session, e.g. it restarted).
    rejoins: int = 0
    last_round: int = 0
    finished: bool = False
    # The simulated device left for good (a dropout that never returns, or its last availability window ended).
    vanished: bool = False
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SentUpdate:
    """A round's update as sent: what the app is told once its fate is known."""

    round: int
    report: UpdateReport
    beta_hat_measured: BetaHat
    inline: bool  # the model came inside its task's header: the update goes the same way
    # Secure aggregation: the masked input sent instead of the weights (fedclient.secure), or None.
    masked: npt.NDArray[np.uint64] | None = None
    # Compressed updates: the encoded u_i sent instead of the weights (fedcore.compression), or None.
    encoded: Encoded | None = None


class UpdateUnsettled(Exception):
    """The exchange that was to acknowledge an update (the answer to the pull sent with it) failed with ``error``
    before saying anything: the update's fate is for the round runner to settle (not a pull to retry)."""

    def __init__(self, error: grpc.RpcError | None) -> None:
        super().__init__(str(error))
        self.error = error


class RoundRunner:
    """One client's protocol loop (:meth:`join`, then :meth:`loop`); ``api`` is the client's embedding half."""

    def __init__(self, config: ClientConfig, client_id: str, log: Any, token: str, connection: Connection,
                 setup: ClientSetup, local: LocalRound, sim: DeviceSimulation, api: EmbeddingApi,
                 summary: ClientSummary) -> None:
        self.config, self.client_id, self.log, self.token = config, client_id, log, token
        self.conn, self.setup, self.local, self.sim, self.api = connection, setup, local, sim, api
        self.summary = summary
        self.fed: FederationInfo | None = None
        self._round: CallNext | None = None  # the mods around the local round, built at the first join
        self._ineligible_since: float | None = None
        self._manifest: tuple[nn.Module, list[TensorMeta]] | None = None  # the model's, worked out once
        self._then_pull = False
        self._pushed_with_answer = False
        # An update whose acknowledgement is the answer to the pull sent with it (SessionRequest.pushed_with_answer).
        self._unsettled: SentUpdate | None = None
        self._secure: SecureClient | None = None  # secure aggregation, when the server runs it
        self._compressor: DeviceCompressor | None = None  # compressed updates, when the server announces them
        self._accepted_last = False  # the fate of the last update settled

    # ---- join ----

    def join(self) -> None:
        """Join (retrying), take the federation's announcement and set the device up for it."""
        def do_join() -> pb.JoinReply:
            transport = self.conn.require()
            model, data = self.setup.model, self.setup.data
            req = pb.JoinRequest(client_id=self.client_id, token=self.token,
                                 model_fingerprint=model_fingerprint(model) if model is not None else "",
                                 capabilities=pb.Capabilities(
                                     num_train_samples=data.num_train if data else 0,
                                     attacker=self.config.attack.active, opt_out=self.config.opt_out,
                                     version=VERSION))
            reply: pb.JoinReply = self.conn.tracked(transport.future("Join", req, timeout=30.0))
            return reply

        try:
            reply = self.conn.retrying("join", do_join)
        except grpc.RpcError as e:
            raise FedClientError(f"join refused: {e.code()}: {e.details()}") from None
        try:
            fed = wire.federation_from_pb(reply.config)
        except SerializationError as e:
            raise FedClientError(f"the server announced a malformed federation: {e}") from None
        if self.conn.session or self.fed is not None:
            self.summary.rejoins += 1
        self.conn.session = reply.session_id
        self.conn.set_framed_port(int(reply.framed_port))
        self.fed = fed
        self._then_pull = bool(reply.then_pull)  # the server takes a pull with an update (SessionRequest.then_pull)
        self._pushed_with_answer = bool(reply.pushed_with_answer)  # ... and lets that pull's answer acknowledge it
        self.conn.set_heartbeat_interval(reply.heartbeat_interval_s)
        self.setup.prepare(fed, int(reply.client_index), self.local, self.conn.keep_alive)
        assert self.setup.model is not None and self.setup.data is not None
        self.api.published.set_template(self.setup.model)
        if self._round is None:
            self._round = chain(client_mods(self.config.attack, self.setup.data), self._train)
        self._secure = None if fed.secure is None else SecureClient(
            fed.secure, fed.federation_id, self.client_id, lambda: self.conn.session, self._secagg_exchange,
            lambda message: self.conn.require().sign_advertisement(message), self.log, self.config.long_poll_s)
        self._compressor = self._compressor_for(fed)
        self.log.info("client.joined", client_id=self.client_id, federation=reply.config.federation_id,
                      index=reply.client_index, num_train=self.setup.data.num_train)

    def _compressor_for(self, fed: FederationInfo) -> DeviceCompressor | None:
        """The encoder of the announced ``[compression]`` (None for kind none): the one of the last join when the
        announcement and the model are the same (its residual carries on), else a new one (its residual restored
        from the state dir when saved for this kind and model)."""
        cfg = fed.compression
        model = self.setup.model
        if not cfg.compressed or model is None:
            return None
        fingerprint = model_fingerprint(model)
        old = self._compressor
        if old is not None and old.cfg == cfg and old.key.fingerprint == fingerprint:
            return old
        num_params = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
        return DeviceCompressor(cfg, fingerprint, num_params, self.setup.state, self.log)

    # ---- the loop ----

    def loop(self) -> None:
        """Work until the federation finishes (returns) or the client stops (:class:`fedclient.errors.Stopped`)."""
        while True:
            self.conn.check_stop()
            # A pull sent with the last update was sent because the device was online and eligible then.
            pending = self.conn.pull_pending()
            if self._unsettled is not None and not pending:  # its acknowledgement cannot come any more
                self._settle_or_rejoin(None)
                continue
            if not pending:
                self.sim.wait_online(self.conn.sleep)
            try:
                if not pending and not self._eligible_now():
                    if self._decline():
                        return
                    continue
                task = self.conn.retrying("pull", self._pull)
                if not isinstance(task, pb.Wait) and not self._eligible_now():
                    # The device stopped being eligible while the task was on its way: not trained.
                    if self._decline(int(task[0].round)):
                        return
                    continue
            except SessionLost:
                self.log.info("client.rejoining", client_id=self.client_id, reason="session unknown to server")
                self.join()
                continue
            except UpdateUnsettled as e:
                self._settle_or_rejoin(e.error)
                continue
            if isinstance(task, pb.Wait):
                if task.finished:
                    self._finished(task.reason)
                    return
                if task.retry_after_s > 0:  # NaN is not > 0; the server's hint is capped
                    self.conn.sleep(min(task.retry_after_s, MAX_RETRY_AFTER_S))
                continue
            header, state = task
            try:
                self._work(header, state)
            except SessionLost:
                self.join()

    def _finished(self, reason: str) -> None:
        self.summary.finished = True
        self.log.info("client.finished", client_id=self.client_id, reason=reason,
                      rounds_trained=self.summary.rounds_trained)

    def _eligible_now(self) -> bool:
        ok = self.api._eligible()
        if ok and self._ineligible_since is not None:
            self.log.info("client.eligible", client_id=self.client_id,
                          after_s=round(time.monotonic() - self._ineligible_since, 1))
            self._ineligible_since = None
        elif not ok and self._ineligible_since is None:
            self.log.info("client.ineligible", client_id=self.client_id, reason="can_train() said no: declining work")
            self._ineligible_since = time.monotonic()
        return ok

    def _decline(self, round_: int = 0) -> bool:
        """Tell the server the device declines work now (``PullTaskRequest.declined``; ``round_``: the task it got
        and does not train), then wait a heartbeat interval before asking ``can_train()`` again. True when the
        federation has finished."""

        def do_decline() -> pb.TaskMessage:
            call = self.conn.require().pull(
                pb.PullTaskRequest(session_id=self.conn.session, max_wait_s=0.0, declined=True), timeout=30.0)
            with self.conn.inflight(call):
                first = pb.TaskMessage.FromString(next(iter(call)))
                call.cancel()  # a server that predates ``declined`` may stream a task: not wanted
                return first

        if round_:
            self.log.info("task.declined", client_id=self.client_id, round=round_)
        first = self.conn.retrying("decline", do_decline)
        if first.WhichOneof("kind") == "wait" and first.wait.finished:
            self._finished(first.wait.reason)
            return True
        hint = first.wait.retry_after_s if first.WhichOneof("kind") == "wait" else 0.0
        beat = self.conn.heartbeat_s
        self.conn.sleep(min(hint, beat) if hint > 0 else beat)
        return False

    def _pull_request(self) -> pb.PullTaskRequest:
        return pb.PullTaskRequest(session_id=self.conn.session, max_wait_s=self.config.long_poll_s, inline_ok=True)

    def _pull(self) -> pb.Wait | tuple[pb.TaskHeader, dict[str, torch.Tensor]]:
        req = self._pull_request()
        limit = self.config.long_poll_s + 30.0
        def on_stream(stream: Exchanges) -> pb.Wait | tuple[pb.TaskHeader, dict[str, torch.Tensor]]:
            if not stream.pull_pending:
                stream.send([pb.SessionRequest(pull=req).SerializeToString()])
                return self._read_task(stream.reply, pb.SessionReply)
            stream.pull_pending = False  # it went with the last update: its answer is the next reply
            if self._unsettled is None:
                return self._read_task(stream.reply, pb.SessionReply)
            try:  # ... and acknowledges that update
                return self._read_task(stream.reply, pb.SessionReply, acknowledges=True)
            except grpc.RpcError as e:
                if self._unsettled is not None:  # nothing came: the update's fate is the runner's to settle
                    raise UpdateUnsettled(e) from None
                raise

        streamed = self._on_stream(on_stream, limit)
        if streamed is not None:
            return streamed.value
        call = self.conn.require().pull(req, timeout=limit)
        with self.conn.inflight(call):
            it: Iterator[bytes] = iter(call)
            task = self._read_task(lambda: next(it), pb.TaskMessage)
            for _ in it:  # PullTask ends with the task's last chunk
                raise FedClientError("server sent a malformed model: more frames than the task announced")
        self.conn.want_stream()  # answered once: its update and later polls go on the Session stream
        return task

    def _on_stream(self, exchange: Callable[[Exchanges], T], seconds: float) -> Streamed[T] | None:
        """``exchange`` on the Session stream, or None when there is none (the unary call then). A stream the server
        ended while it sat idle (longer than a round: the device trained long, slept, or was offline) is replaced at
        once, not after a back-off: that is not a failure."""
        for fresh in (False, True):
            stream = self.conn.stream()
            if stream is None:
                return None
            try:
                with self.conn.exchange(stream, seconds):
                    return Streamed(exchange(stream))
            except grpc.RpcError as e:
                if self.conn.stream_refused(e):
                    return None
                if fresh or not _ended_idle(e):
                    raise
        raise AssertionError("unreachable")

    def _read_task(self, frame: Callable[[], bytes], message: type[pb.TaskMessage] | type[pb.SessionReply],
                   acknowledges: bool = False) -> pb.Wait | tuple[pb.TaskHeader, dict[str, torch.Tensor]]:
        """A pull's answer from its frames (``frame()``: the next one): a Wait, or a task's header and its model
        (each chunk's bytes copied once, from the frame into its tensor). ``acknowledges``: the answer (or the
        ``pushed`` a server sends ahead of a status that ends the stream first) says the update sent with the pull
        was taken."""
        try:
            try:
                first = message.FromString(frame())
                kind = first.WhichOneof("kind")
                if acknowledges:
                    self._settle(True)
                    if kind == "pushed":  # the stream ends before the answer: its status follows
                        first = message.FromString(frame())
                        kind = first.WhichOneof("kind")
                if kind == "wait":
                    return first.wait
                if kind != "header":
                    raise SerializationError(f"a pull answered with {kind or 'an empty message'}")
                header = first.header
                manifest = wire.metas_from_pb(header.tensors)
                if manifest != self._model_manifest():
                    raise SerializationError("the task's tensors are not this client's model")
                asm = Reassembler(manifest, int(header.total_bytes), one_buffer=True)
                if header.data:  # the whole model inside the header: no chunks follow
                    if len(header.data) != asm.expected:
                        raise SerializationError(f"the header's data holds {len(header.data)} bytes, its "
                                                 f"total_bytes says {asm.expected}")
                    asm.feed(0, memoryview(header.data))
                while asm.received < asm.expected:
                    raw = frame()
                    chunk = wire.read_chunk(raw, message)
                    if chunk is None:
                        msg = message.FromString(raw)
                        if msg.WhichOneof("kind") != "chunk":
                            raise SerializationError("a message other than a chunk inside the task's model")
                        chunk = int(msg.chunk.offset), memoryview(msg.chunk.data)
                    asm.feed(*chunk)
                return header, dict(asm.finish())  # the round may replace entries
            except StopIteration:
                raise SerializationError("the task ended before its model did") from None
        except (SerializationError, DecodeError) as e:
            raise FedClientError(f"server sent a malformed model: {e}") from None

    def _model_manifest(self) -> list[TensorMeta]:
        model = self.setup.model
        assert model is not None
        if self._manifest is None or self._manifest[0] is not model:
            self._manifest = model, model_manifest(model)
        return self._manifest[1]

    # ---- one task ----

    def _context(self) -> ModContext:
        assert self.fed is not None and self.setup.model is not None and self.setup.data is not None
        return ModContext(self.client_id, self.log, self.fed, self.setup.model, self.setup.data, self.conn, self.sim)

    def _work(self, header: pb.TaskHeader, state: dict[str, torch.Tensor]) -> None:
        assert self._round is not None and self.setup.data is not None
        round_ = int(header.round)
        started = time.monotonic()
        secure: SecureRound | None = None
        if self._secure is not None:  # keys and shares before training: a dropped device does not train
            try:
                with self.conn.keep_alive():  # heartbeats while the other devices advertise and share
                    secure = self._secure.prepare(round_, int(header.attempt))
            except (SecureRoundAbandoned, grpc.RpcError) as e:
                self._secure_skipped(round_, e)
                return
        received = dict(state)  # the model handed out (the round may replace the dict's entries)
        task = RoundTask(round_, state, bool(header.recovery), header.learning_rate or None, self.setup.data)
        reply = self._round(task, self._context())
        out = reply.outcome
        if out is None:
            return
        sent = dataclasses.replace(out.report, train_seconds=time.monotonic() - started)
        masked = None
        if secure is not None and self._secure is not None:
            assert self.setup.model is not None
            try:
                # With compression, the values masked are those the encoding would deliver (docs/security.md).
                # Heartbeats while it masks: seconds of AES-CTR per neighbour on a busy device, during which it
                # sends nothing else (without them the server counted 61-106 of 100 devices silent and dropped).
                with self.conn.keep_alive():
                    masked = self._secure.masked_input(secure, received, self.setup.model.state_dict(),
                                                       float(sent.num_samples),
                                                       self._compressor.roundtrip if self._compressor else None)
            except (SecureRoundAbandoned, ValueError) as e:
                self._secure_skipped(round_, e)
                return
        encoded = None
        if masked is None and self._compressor is not None:  # u_i (+ the residual) encoded as announced
            assert self.setup.model is not None
            encoded = self._compressor.encode(flat_update(received, self.setup.model.state_dict()))
        self.summary.rounds_trained += 1
        self.summary.last_round = round_
        self.summary.history.append(ClientRoundReport(round_, sent, out.beta_hat_measured).history_row())
        # A server that sent the model inside its header reads an update sent the same way.
        update = SentUpdate(round_, sent, out.beta_hat_measured, inline=bool(header.data) and masked is None,
                            masked=masked, encoded=encoded)
        self._send(update)
        if secure is not None and self._secure is not None and self._accepted_last:
            try:
                with self.conn.keep_alive():  # ... and while the round's others upload theirs
                    self._secure.unmask(secure)
            except (SecureRoundAbandoned, grpc.RpcError) as e:
                self._secure_skipped(round_, e)

    def _secure_skipped(self, round_: int, e: Exception) -> None:
        reason = e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else str(e)
        self.log.warning("secagg.left_round", client_id=self.client_id, round=round_, reason=reason)

    def _secagg_exchange(self, request: pb.SecAggRequest) -> pb.SecAggReply:
        """One secure-aggregation exchange, on the Session stream or as the unary call (retried like a pull)."""
        limit = float(request.max_wait_s) + 30.0

        def do_exchange() -> pb.SecAggReply:
            def on_stream(stream: Exchanges) -> pb.SecAggReply:
                stream.send([pb.SessionRequest(secagg=request).SerializeToString()])
                answer = pb.SessionReply.FromString(stream.reply())
                if answer.WhichOneof("kind") != "secagg":
                    raise StreamEnded("the server answered a secure-aggregation message with something else")
                return answer.secagg

            streamed = self._on_stream(on_stream, limit)
            if streamed is not None:
                return streamed.value
            reply: pb.SecAggReply = self.conn.tracked(self.conn.require().future("SecureAggregate", request,
                                                                                   timeout=limit))
            return reply

        return self.conn.retrying("secagg", do_exchange)

    def _train(self, task: RoundTask, ctx: ModContext) -> RoundReply:
        """The innermost step of the chain: the local round on the task, heartbeating, the app told of the new
        global model before and of vᵢ after."""
        model, fed = ctx.model, ctx.fed
        load_weights(model, task.weights)
        with self.conn.keep_alive():
            try:
                self.api._task_received(task.round, task.weights, task.recovery, fed, model)
                out = self.local.run(model, ctx.data, task.train_data, fed, task.round, task.recovery,
                                     task.learning_rate, self.setup.private_accuracy, batches=task.batches,
                                     local_epochs=task.local_epochs, received=task.weights)
            except LocalRoundError as e:
                raise FedClientError(str(e)) from None
            self.api._trained(out.beta_hat_measured)
        return RoundReply(out)

    def _send(self, update: SentUpdate) -> None:
        """Send ``update``; the app is told its fate now, or (acknowledged by the answer to the pull sent with it)
        when that answer comes."""
        try:
            acknowledged = self._push(update)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:  # it had arrived (sent again, not knowing): taken once
                self._settled(update, True)
            else:
                self._settled(update, False, e)
            return
        if acknowledged:
            self._settled(update, True)
        else:
            self._unsettled = update

    def _settle(self, accepted: bool, error: grpc.RpcError | None = None) -> None:
        """The fate of the update sent with the last pull is known."""
        update, self._unsettled = self._unsettled, None
        if update is not None:
            self._settled(update, accepted, error)

    def _settle_failed(self, error: grpc.RpcError | None) -> None:
        """The answer that was to acknowledge the update sent with the last pull never came: the server refused the
        update (it ends the stream with the refusal's status; an update it took is acknowledged first), or the
        connection broke or the server went away (``error`` retryable, or None): then nobody knows, and the update
        is sent again as a push is retried (a server that already has it refuses it); a server without the stream
        never read it: it is sent again with the unary call."""
        update, self._unsettled = self._unsettled, None
        if update is None:
            return
        code = error.code() if error is not None and hasattr(error, "code") else None
        if code == grpc.StatusCode.ALREADY_EXISTS:  # (sent again before this) the round holds it: taken once
            self._settled(update, True)
            return
        if error is None or code in RETRYABLE or self.conn.stream_refused(error):  # (no stream here: unary calls)
            self.log.info("update.resending", client_id=self.client_id, round=update.round, code=str(code),
                          reason="the answer that was to acknowledge it did not come")
            detail = "no answer" if error is None else str(error.details() if hasattr(error, "details") else error)
            self.conn.resend_pause("resend", f"{code}: {detail}")
            self._send(update)
            return
        if code == grpc.StatusCode.UNAUTHENTICATED:  # as a push's: the session is gone, the client joins again
            self._settled(update, False, error)
            raise SessionLost
        self._settled(update, False, error)

    def _settle_or_rejoin(self, error: grpc.RpcError | None) -> None:
        try:
            self._settle_failed(error)
        except SessionLost:
            self.log.info("client.rejoining", client_id=self.client_id, reason="session unknown to server")
            self.join()

    def _settled(self, update: SentUpdate, accepted: bool, error: grpc.RpcError | None = None) -> None:
        self.conn.resend_done()
        self._accepted_last = accepted
        if accepted:
            self.summary.updates_accepted += 1
            report = update.report
            self.log.info("update.sent", client_id=self.client_id, round=update.round,
                          train_loss=round(report.train_loss, 5),
                          test_accuracy=None if report.test_accuracy is None else round(report.test_accuracy, 4),
                          beta_hat=None if report.beta_hat is None else round(report.beta_hat, 4),
                          adapting=report.adapting)
        else:
            self.summary.updates_rejected += 1
            self.log.warning("update.refused", client_id=self.client_id, round=update.round,
                             code=str(error.code()) if error is not None else None,
                             reason=error.details() if error is not None else None)
        self.api._reported(ClientRoundReport(update.round, update.report, update.beta_hat_measured, accepted))

    def _push(self, update: SentUpdate) -> bool:
        """Push ``update`` (retrying; raises the refusal's :class:`grpc.RpcError`): True when the server took it,
        False when its acknowledgement is the answer to the pull sent with it (SessionRequest.pushed_with_answer:
        the device's round is then one message each way). That is asked for unless the app wants to hear of each
        round at once (an ``on_round_end`` callback)."""
        assert self.setup.model is not None
        kind = pb.WEIGHTS
        payload: Any
        if update.masked is not None:  # secure aggregation: the masked words, sent as int64
            manifest = [TensorMeta(MASKED_TENSOR, "int64", (int(update.masked.shape[0]),))]
            payload, kind = Payload([update.masked.data]), pb.MASKED  # sent from the array, no copy
        elif update.encoded is not None:  # compressed: the encoded difference, from its arrays
            manifest, payload, kind = update.encoded.manifest, update.encoded.payload, pb.DELTA
        else:
            manifest, payload = payload_of(self.setup.model.state_dict())  # views of the weights, no copy
        chunk_bytes = (self.fed.chunk_bytes if self.fed is not None else 0) or DEFAULT_CHUNK_BYTES
        # The announced encoding (a masked input's too: its values are the decoded ones); none: the field is unset.
        compression = wire.COMPRESSION_TO_PB[self.fed.compression.kind] if self.fed is not None else pb.COMPRESSION_NONE

        def do_push() -> pb.PushReply | None:
            header = pb.UpdateHeader(
                session_id=self.conn.session, round=update.round, report=wire.update_report_to_pb(update.report),
                kind=kind, tensors=wire.metas_to_pb(manifest), total_bytes=len(payload), compression=compression)
            def on_stream(stream: Exchanges) -> pb.PushReply | None:
                # The next pull goes with the update when the device could send it now (online and eligible, as
                # the loop would check before it): one message per round instead of two. Not with a masked input:
                # its unmasking exchanges follow on the stream.
                then = self._pull_request() if self._then_pull and self.sim.online() and self._eligible_now() \
                    and update.masked is None else None
                deferred = then is not None and self._pushed_with_answer and not self.api.callbacks.wants("round_end")
                first, chunks = update_frames(header, payload, chunk_bytes, pb.SessionRequest, update.inline, then,
                                              deferred)
                stream.send(itertools.chain([first], chunks))  # drained by gRPC while this thread waits
                if deferred:
                    stream.pull_pending = True
                    return None
                answer = pb.SessionReply.FromString(stream.reply())
                if answer.WhichOneof("kind") != "pushed":
                    raise StreamEnded("the server answered an update with something other than its reply")
                stream.pull_pending = then is not None
                return answer.pushed

            streamed = self._on_stream(on_stream, 120.0)
            if streamed is not None:
                return streamed.value
            reply: pb.PushReply = self.conn.tracked(self.conn.require().push(
                header, payload, chunk_bytes, timeout=120.0, inline=update.inline))
            return reply

        return self.conn.retrying("push", do_push) is not None


T = TypeVar("T")


@dataclass(frozen=True)
class Streamed(Generic[T]):
    """What an exchange on the Session stream returned."""

    value: T


def _ended_idle(e: grpc.RpcError) -> bool:
    """Whether the server ended the stream because it sat idle between exchanges (fedserver.servicer)."""
    code = e.code() if hasattr(e, "code") else None
    details = str(e.details() if hasattr(e, "details") else "") or ""
    return code == grpc.StatusCode.DEADLINE_EXCEEDED and details.startswith("stream idle for")


__all__ = ["MAX_RETRY_AFTER_S", "VERSION", "ClientSummary", "RoundRunner"]
