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
import torch
from google.protobuf.message import DecodeError
from torch import nn

from fedclient.connection import Connection
from fedclient.embed import EmbeddingApi
from fedclient.errors import FedClientError, SessionLost
from fedclient.local_round import LocalRound, LocalRoundError
from fedclient.mods import CallNext, ModContext, RoundReply, RoundTask, chain, client_mods
from fedclient.setup import ClientSetup
from fedclient.simulation import DeviceSimulation
from fedclient.stream import Exchanges, StreamEnded
from fedclient.transport import update_frames
from fedcore.client_state import ClientRoundReport
from fedcore.config import ClientConfig, FederationInfo
from fedcore.models import model_fingerprint, model_manifest
from fedcore.serialization import DEFAULT_CHUNK_BYTES, Reassembler, SerializationError, TensorMeta, payload_of
from fedcore.update_report import UpdateReport
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
        self.conn.set_heartbeat_interval(reply.heartbeat_interval_s)
        self.setup.prepare(fed, int(reply.client_index), self.local, self.conn.keep_alive)
        assert self.setup.model is not None and self.setup.data is not None
        self.api.published.set_template(self.setup.model)
        if self._round is None:
            self._round = chain(client_mods(self.config.attack, self.setup.data), self._train)
        self.log.info("client.joined", client_id=self.client_id, federation=reply.config.federation_id,
                      index=reply.client_index, num_train=self.setup.data.num_train)

    # ---- the loop ----

    def loop(self) -> None:
        """Work until the federation finishes (returns) or the client stops (:class:`fedclient.errors.Stopped`)."""
        while True:
            self.conn.check_stop()
            # A pull sent with the last update was sent because the device was online and eligible then.
            pending = self.conn.pull_pending()
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
            if stream.pull_pending:
                stream.pull_pending = False  # it went with the last update: its answer is the next reply
            else:
                stream.send([pb.SessionRequest(pull=req).SerializeToString()])
            return self._read_task(stream.reply, pb.SessionReply)

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

    def _read_task(self, frame: Callable[[], bytes], message: type[pb.TaskMessage] | type[pb.SessionReply]) -> (
        pb.Wait | tuple[pb.TaskHeader, dict[str, torch.Tensor]]
    ):
        """A pull's answer from its frames (``frame()``: the next one): a Wait, or a task's header and its model
        (each chunk's bytes copied once, from the frame into its tensor)."""
        try:
            try:
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
        task = RoundTask(round_, state, bool(header.recovery), header.learning_rate or None, self.setup.data)
        reply = self._round(task, self._context())
        out = reply.outcome
        if out is None:
            return
        sent = dataclasses.replace(out.report, train_seconds=time.monotonic() - started)
        self.summary.rounds_trained += 1
        self.summary.last_round = round_
        self.summary.history.append(ClientRoundReport(round_, sent, out.beta_hat_measured).history_row())
        # A server that sent the model inside its header reads an update sent the same way.
        accepted = self._push(round_, sent, inline=bool(header.data))
        self.api._reported(ClientRoundReport(round_, sent, out.beta_hat_measured, accepted))

    def _train(self, task: RoundTask, ctx: ModContext) -> RoundReply:
        """The innermost step of the chain: the local round on the task, heartbeating, the app told of the new
        global model before and of vᵢ after."""
        model, fed = ctx.model, ctx.fed
        model.load_state_dict(task.weights)
        with self.conn.keep_alive():
            try:
                self.api._task_received(task.round, task.weights, task.recovery, fed, model)
                out = self.local.run(model, ctx.data, task.train_data, fed, task.round, task.recovery,
                                     task.learning_rate, self.setup.private_accuracy, batches=task.batches,
                                     local_epochs=task.local_epochs)
            except LocalRoundError as e:
                raise FedClientError(str(e)) from None
            self.api._trained(out.beta_hat_measured)
        return RoundReply(out)

    def _push(self, round_: int, report: UpdateReport, inline: bool = False) -> bool:
        assert self.setup.model is not None
        manifest, payload = payload_of(self.setup.model.state_dict())  # views of the weights, no copy
        chunk_bytes = (self.fed.chunk_bytes if self.fed is not None else 0) or DEFAULT_CHUNK_BYTES

        def do_push() -> pb.PushReply:
            header = pb.UpdateHeader(
                session_id=self.conn.session, round=round_, report=wire.update_report_to_pb(report), kind=pb.WEIGHTS,
                tensors=wire.metas_to_pb(manifest), total_bytes=len(payload))
            def on_stream(stream: Exchanges) -> pb.PushReply:
                # The next pull goes with the update when the device could send it now (online and eligible, as
                # the loop would check before it): one message per round instead of two.
                then = self._pull_request() if self._then_pull and self.sim.online() and self._eligible_now() \
                    else None
                first, chunks = update_frames(header, payload, chunk_bytes, pb.SessionRequest, inline, then)
                stream.send(itertools.chain([first], chunks))  # drained by gRPC while this thread waits
                answer = pb.SessionReply.FromString(stream.reply())
                if answer.WhichOneof("kind") != "pushed":
                    raise StreamEnded("the server answered an update with something other than its reply")
                stream.pull_pending = then is not None
                return answer.pushed

            streamed = self._on_stream(on_stream, 120.0)
            if streamed is not None:
                return streamed.value
            reply: pb.PushReply = self.conn.tracked(self.conn.require().push(header, payload, chunk_bytes,
                                                                             timeout=120.0, inline=inline))
            return reply

        try:
            self.conn.retrying("push", do_push)
            self.summary.updates_accepted += 1
            self.log.info("update.sent", client_id=self.client_id, round=round_,
                          train_loss=round(report.train_loss, 5),
                          test_accuracy=None if report.test_accuracy is None else round(report.test_accuracy, 4),
                          beta_hat=None if report.beta_hat is None else round(report.beta_hat, 4),
                          adapting=report.adapting)
            return True
        except grpc.RpcError as e:
            self.summary.updates_rejected += 1
            self.log.warning("update.refused", client_id=self.client_id, round=round_, code=str(e.code()),
                             reason=e.details())
            return False


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
