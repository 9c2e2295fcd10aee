"""gRPC servicer: protobuf in, coordinator calls, protobuf out. No federation logic lives here.

Every request passes the same gate before the coordinator sees it: a message that does not decode is answered
``INVALID_ARGUMENT`` (the handlers get the raw bytes, see :func:`_decoder`), its fields are bounded
(:mod:`fedserver.bounds`), the caller is authenticated and held to its identity (:mod:`fedserver.auth`), and
streams are bounded in concurrency, buffered bytes and idle time (:mod:`fedserver.limits`). Every refusal is
answered with its reason and logged as ``rpc.refused``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedcore.compression.codecs import Decoder
from fedcore.config import FederationInfo, resolved_nfl
from fedcore.data import remote_options
from fedcore.identity import shorten
from fedcore.nfl import NflSettings
from fedcore.report import FederationStatus
from fedcore.secagg.crypto import ed25519_verifier
from fedcore.serialization import Reassembler, SerializationError
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import bounds
from fedserver.auth import Authenticator, RefusalLog
from fedserver.coordinator import Coordinator, ProtocolError, Task
from fedserver.dispatch import WaitInfo
from fedserver.idle_limit import IdleLimit
from fedserver.limits import StreamLimits, return_freed_memory
from fedserver.secure_round import settings_of

SERVICE_NAME = "fedguard.v1.Federation"
# A refused or stalled upload at least this large hands its freed memory back to the operating system.
TRIM_AFTER_BYTES = 8 << 20


def method_path(name: str) -> str:
    return f"/{SERVICE_NAME}/{name}"


def process_metadata() -> tuple[tuple[str, str], ...]:
    """The server process as the operator's GetStatus reports it beside the status, in its trailing metadata:
    the event loop's asyncio tasks (``fg-asyncio-tasks``) and the Python threads (``fg-threads``) now, what a
    soak watches for leaks from outside (``tools/bench/soak.py``; RSS and file descriptors are read from /proc)."""
    return (("fg-asyncio-tasks", str(len(asyncio.all_tasks()))), ("fg-threads", str(threading.active_count())))


@dataclass(frozen=True)
class Incoming:
    """A request as received: the decoded message (None if it did not decode) and its exact bytes."""

    message: Any
    raw: bytes
    error: str = ""
    # An update chunk read in place (offset, a view of its data inside ``raw``): ``message`` is then None until
    # :func:`_message` parses ``raw`` as ``kind`` (only a stream that does not start with its header needs that).
    chunk: tuple[int, memoryview] | None = None
    kind: Any = None


# A Session stream's answer to an update taken (the same bytes every time).
_PUSHED = pb.SessionReply(pushed=pb.PushReply(accepted=True)).SerializeToString()
# The stream messages whose chunks are read in place.
_CHUNKED = (pb.UpdateMessage, pb.SessionRequest)


def _decoder(cls: Any) -> Callable[[bytes], Incoming]:
    def decode(data: bytes) -> Incoming:
        if cls in _CHUNKED:
            chunk = wire.read_chunk(data, cls)
            if chunk is not None:
                return Incoming(None, data, chunk=chunk, kind=cls)
        try:
            return Incoming(cls.FromString(data), data)
        except Exception as e:  # DecodeError, or anything else a hostile buffer provokes in the parser
            return Incoming(None, data, f"undecodable {cls.__name__} ({len(data)} bytes): {str(e)[:120]}")

    return decode


def _serialize_task(msg: pb.TaskMessage | pb.SessionReply | bytes) -> bytes:
    """PullTask's and Session's replies: chunk frames arrive serialized (:func:`fedguard.wire.chunk_frame_bytes`)."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _message(item: Incoming) -> Any:
    if item.chunk is not None:
        return item.kind.FromString(item.raw)
    if item.message is None:
        raise ProtocolError("INVALID_ARGUMENT", item.error)
    return item.message


class FederationServicer:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coord = coordinator
        cfg = coordinator.config
        self.auth = Authenticator(cfg.security, run_dir=cfg.server.run_dir)
        if self.auth.revocations is not None:  # a changed CRL ends the parked polls: their clients are re-checked
            self.auth.revocations.on_change = lambda: coordinator.polls.end_parked(
                "the certificate revocation list changed: poll again")
        self.limits = StreamLimits(cfg.server.max_buffered_bytes)
        self.idle_s = cfg.server.stream_idle_timeout_s
        self.log = coordinator.log
        self.refused = 0
        self.framed_port = 0  # the framed Session transport's port, announced at join (fedserver.framed)
        # Per (model id, inline): a task's serialized header without its deadline, and what it was made from.
        self._headers: dict[tuple[str, bool], tuple[object, tuple[int, bool, float, int], bool, bytes]] = {}
        # Refusals are logged rate-limited per peer address and reason: a flood of bad calls cannot flood the log.
        self.refusals = RefusalLog(self.log)
        # Only the options a client accepts from a server are announced (fedcore.trust); the server's own
        # (data_dir, cache_dir, path, source, download: for its central evaluation) stay here.
        allowed = remote_options(cfg.data.dataset)
        announced = {k: v for k, v in cfg.data.options.items() if k in allowed}
        local = sorted(set(cfg.data.options) - set(announced))
        if local:
            self.log.info("federation.local_data_options", options=local,
                          reason="not announced: clients set their own paths, downloads and file formats")
        nfl = resolved_nfl(cfg)  # NR and c fitted to the run when [nfl] leaves them unset
        self._join_config = wire.federation_to_pb(FederationInfo(
            federation_id=cfg.server.federation_id, model_name=cfg.model.name, model_kwargs=cfg.model.kwargs,
            model_fingerprint=coordinator.fingerprint, model_spec=tuple(coordinator.manifest),
            training=cfg.training, dataset=cfg.data.dataset, data_options=announced,
            num_rounds=cfg.rounds.num_rounds, seed=cfg.rounds.seed,
            chunk_bytes=cfg.server.chunk_bytes, nfl=NflSettings(nfl.mode, nfl.nr or 0, nfl.c or 0),
            recovery_method=cfg.recovery.method, recovery_options=cfg.recovery.options, secure=settings_of(cfg),
            compression=cfg.compression))
        if self.auth.keys is not None:  # secure aggregation: advertisements signed by the enrolled keys
            coordinator.secure.verify = ed25519_verifier(self.auth.keys)

    async def watch_revocations(self) -> None:
        """While serving with a CRL: look for a changed list once per ``Revocations.CHECK_EVERY_S`` even when no
        call arrives (every client parked in a long-poll), so a revoked client's parked poll is ended within about
        a second and its next call refused, whatever ``server.long_poll_s``. Returns at once without a CRL."""
        revocations = self.auth.revocations
        if revocations is None:
            return
        while True:
            await asyncio.sleep(revocations.CHECK_EVERY_S)
            revocations.refresh()

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, e: ProtocolError) -> Any:
        self.refused += 1
        self.refusals.event("rpc.refused", context.peer() or "", f"{method}:{e.code}", method=method, code=e.code,
                            reason=shorten(e.message, 300))
        await context.abort(getattr(grpc.StatusCode, e.code), e.message)

    def _session_of(self, identity: str | None, session: str) -> str:
        cid = self.coord.members.client_of(session)
        self.auth.require(identity, cid, "this session")
        return cid

    async def Join(self, item: Incoming, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        try:
            request = _message(item)
            bounds.check_join(request)
            identity = self.auth.identify(method_path("Join"), context, item.raw)
            self.auth.require(identity, request.client_id, "client_id")
            # The credential a join is counted against: the certificate/key identity, else the shared token.
            credential = f"id:{identity}" if identity is not None else "token"
            self.auth.admit_join(credential, context.peer() or "")
            caps = request.capabilities
            res = self.coord.members.join(request.client_id, request.token, int(caps.num_train_samples),
                                          caps.opt_out, caps.attacker, request.model_fingerprint, credential)
        except ProtocolError as e:
            await self._refuse(context, "Join", e)
        return pb.JoinReply(session_id=res.session_id, config=self._join_config,
                            heartbeat_interval_s=self.coord.config.server.heartbeat_interval_s,
                            client_index=res.client_index, then_pull=True, framed_port=self.framed_port,
                            pushed_with_answer=True)

    async def _poll(self, request: pb.PullTaskRequest, raw: bytes, method: str,
                    context: grpc.aio.ServicerContext) -> tuple[str, Any]:
        """A pull's checks, then its long-poll: (client id, a :class:`Task` or the wait)."""
        bounds.check_pull(request)
        cid = self._session_of(self.auth.identify(method_path(method), context, raw), request.session_id)
        with self.limits.pull(request.session_id):
            res = await self.coord.polls.pull(request.session_id, request.max_wait_s, request.declined)
        return cid, res

    def _task_messages(self, res: Any, inline_ok: bool) -> Iterator[pb.TaskMessage | bytes]:
        """A pull's answer as PullTask streams it: one Wait, or the task's header and the model's chunks; for a
        pull that said ``inline_ok``, a model that fits one chunk rides in its header (one message)."""
        if not isinstance(res, Task):
            yield pb.TaskMessage(wait=pb.Wait(retry_after_s=res.retry_after_s, finished=res.finished,
                                              reason=res.reason))
            return
        inline, header = self._task_header(res, inline_ok)
        yield wire.task_header_frame(header, res.deadline_s)  # each client's deadline spliced into the one header
        if not inline:
            # The chunks as serialized frames, each byte copied once from the cached payload into its frame.
            yield from wire.chunk_frame_bytes(res.payload, pb.TaskMessage, self.coord.config.server.chunk_bytes)

    def _task_header(self, res: Task, inline_ok: bool) -> tuple[bool, bytes]:
        """(whether the model rides inside it, the task's serialized header without its deadline): made once per
        model version, not once per client (an inline header carries the whole model). The dispatcher packs each
        round's model once per model id (a restore packs it again), and each pack makes a new manifest object: its
        identity says which pack a header was made from, without holding on to the pack's payload."""
        key = (res.model_id, inline_ok)
        what = (res.round, res.recovery, res.learning_rate, res.attempt)
        made = self._headers.get(key)
        if made is not None and made[0] is res.manifest and made[1] == what:
            return made[2], made[3]
        total = len(res.payload)
        header = pb.TaskHeader(round=res.round, tensors=wire.metas_to_pb(res.manifest), total_bytes=total,
                               recovery=res.recovery, learning_rate=res.learning_rate, attempt=res.attempt)
        inline = inline_ok and wire.fits_inline(header.ByteSize() + wire.DEADLINE_BYTES, total,
                                                self.coord.config.server.chunk_bytes)
        if inline:
            header.data = bytes(res.payload)
        raw = header.SerializeToString()
        self._headers[key] = (res.manifest, what, inline, raw)
        return inline, raw

    async def PullTask(self, item: Incoming, context: grpc.aio.ServicerContext) -> AsyncIterator[
        pb.TaskMessage | bytes
    ]:
        try:
            request = _message(item)
            cid, res = await self._poll(request, item.raw, "PullTask", context)
        except ProtocolError as e:
            await self._refuse(context, "PullTask", e)
        for message in self._task_messages(res, request.inline_ok):
            yield message
        if isinstance(res, Task):
            self.coord.timing.handed_out(cid, res.round)  # the hand-out ends once the model is written out

    async def _next(self, it: AsyncIterator[Incoming], session: str, limit: IdleLimit,
                    idle_s: float | None = None) -> Incoming | None:
        """The stream's next message; a stream idle for ``idle_s`` (``stream_idle_timeout_s``) is cancelled
        (``limit``: the stream's one timer for all its waits, :mod:`fedserver.idle_limit`)."""
        idle_s = self.idle_s if idle_s is None else idle_s
        limit.start(idle_s)
        try:
            return await anext(it, None)
        except asyncio.CancelledError:
            if not limit.stop():
                raise
            if session:
                self.log.warning("update.stalled", session=session[:8], idle_s=idle_s,
                                 reason="no message within stream_idle_timeout_s: upload cancelled, buffer freed")
                raise ProtocolError("DEADLINE_EXCEEDED", f"update stream idle for {idle_s:g} s; its partial "
                                                         "data was dropped, send the update again") from None
            raise ProtocolError("DEADLINE_EXCEEDED", f"stream idle for {idle_s:g} s; open a new one") from None
        finally:
            limit.stop()

    async def PushUpdate(self, request_iterator: AsyncIterator[Incoming],
                         context: grpc.aio.ServicerContext) -> pb.PushReply:
        it = aiter(request_iterator)
        limit = IdleLimit()
        try:
            first = await self._next(it, "", limit)
            if first is None:
                raise ProtocolError("INVALID_ARGUMENT", "an update stream must start with its header")
            await self._update(first, it, "PushUpdate", context, limit, whole_stream=True)
        except ProtocolError as e:
            await self._refuse(context, "PushUpdate", e)
        finally:
            limit.close()
        return pb.PushReply(accepted=True)

    async def _update(self, first: Incoming, it: AsyncIterator[Incoming], method: str,
                      context: grpc.aio.ServicerContext, limit: IdleLimit, whole_stream: bool) -> None:
        """Receive one update, ``first`` its header, the chunks from ``it``, and hand it to the intake; raises
        :class:`ProtocolError`. ``whole_stream``: the update is the whole stream (PushUpdate); otherwise (a Session
        stream) it ends with its announced bytes."""
        asm: Reassembler | Decoder | None = None
        tensors: Mapping[str, torch.Tensor] | torch.Tensor | None = None
        try:
            msg = _message(first)
            if msg.WhichOneof("kind") != "header":
                raise ProtocolError("INVALID_ARGUMENT", "an update stream must start with its header")
            h = msg.header
            bounds.check_session(h.session_id)
            identity = self.auth.identify(method_path(method), context, first.raw)
            self._session_of(identity, h.session_id)
            # From here on the sender is known: a refusal is recorded against its update for the round.
            try:
                bounds.check_update_header(h)
                if self.auth.signed and not h.payload_sha256:
                    raise ProtocolError("INVALID_ARGUMENT", "a signed update must carry payload_sha256")
                manifest = wire.metas_from_pb(h.tensors)
                compression = wire.compression_kind_from_pb(h.compression)
            except SerializationError as e:
                self.coord.uploads.reject_header(h.session_id, int(h.round), "INVALID_ARGUMENT", str(e))
            except ProtocolError as e:
                self.coord.uploads.reject_header(h.session_id, int(h.round), e.code, e.message)
            kind = h.kind if h.kind != pb.UPDATE_KIND_UNSPECIFIED else pb.WEIGHTS
            # Admission first (it refuses an update over max_update_bytes and records it), then the reservation.
            ticket = self.coord.uploads.begin(h.session_id, int(h.round), wire.update_report_from_pb(h),
                                              kind == pb.DELTA, manifest, int(h.total_bytes), kind == pb.MASKED,
                                              compression)
            with self.limits.upload(h.session_id, int(h.total_bytes)):
                digest = hashlib.sha256() if h.payload_sha256 else None
                try:
                    # A compressed update is decoded as it streams in, into a float32 [P] vector: no copy of it.
                    asm = self.coord.uploads.decoder(ticket) or Reassembler(
                        manifest, int(h.total_bytes), self.coord.config.server.max_update_bytes, one_buffer=True)
                    if h.data:  # the whole update inside its header: no chunks follow
                        if len(h.data) != asm.expected:
                            raise SerializationError(f"the header's data holds {len(h.data)} bytes, its "
                                                     f"total_bytes says {asm.expected}")
                        asm.feed(0, memoryview(h.data))
                        if digest is not None:
                            digest.update(h.data)
                    while whole_stream or asm.received < asm.expected:
                        item = await self._next(it, h.session_id, limit)
                        if item is None:
                            break  # finish() says what is missing
                        if item.chunk is not None:  # the common case: the chunk's data read in place
                            offset, data = item.chunk
                        else:
                            part = _message(item)
                            if part.WhichOneof("kind") != "chunk":
                                raise SerializationError("a message other than a chunk inside an update")
                            offset, data = int(part.chunk.offset), part.chunk.data
                        if not data:
                            raise SerializationError("an empty chunk (an upload must make progress)")
                        closed = self.coord.uploads.closed(ticket)
                        if closed is not None:  # a trickle cannot hold its reservation past the round
                            self.coord.uploads.reject_ticket(ticket, "FAILED_PRECONDITION", closed)
                        asm.feed(offset, data)
                        if digest is not None:
                            digest.update(data)
                    tensors = asm.finish()
                except SerializationError as e:
                    self.coord.uploads.reject_ticket(ticket, "INVALID_ARGUMENT", str(e))
                if digest is not None and digest.digest() != h.payload_sha256:
                    self.coord.uploads.reject_ticket(ticket, "INVALID_ARGUMENT",
                                                     "the tensor bytes do not match the header's payload_sha256")
                assert tensors is not None  # reject_ticket raised otherwise
                self.coord.uploads.submit(ticket, tensors)
                asm = tensors = None
        except ProtocolError:
            # The refusal's traceback keeps this frame (and its locals) alive until the cyclic garbage collector
            # runs: drop the partial update's buffer first, so a stalled or refused upload frees it now.
            if asm is not None and asm.expected >= TRIM_AFTER_BYTES:
                asm = tensors = None
                return_freed_memory()
            asm = tensors = None
            raise
        finally:
            asm = tensors = None

    async def Session(self, request_iterator: AsyncIterator[Incoming],
                      context: grpc.aio.ServicerContext) -> AsyncGenerator[pb.TaskMessage | pb.SessionReply | bytes,
                                                                           None]:
        """PullTask and PushUpdate on one stream (``rpc Session``): each exchange is a pull answered with the task
        (or a wait), or an update answered with ``pushed`` (and, when its message carries ``then_pull``, followed
        at once by that pull's exchange: no message in between; with ``pushed_with_answer`` too, that pull's answer is
        the update's only acknowledgement, and ``pushed`` is sent only if the stream ends before it, ahead of the
        status: a device's round is one message each way). Every message passes the checks its unary call's does
        (the identity of the call, the session's owner, the bounds, the limits); a refusal ends the stream with its
        status. Idle between exchanges for longer than a round (``round_timeout_s``, or the long-poll if longer,
        plus ``stream_idle_timeout_s``) the stream is ended (the client opens a new one); its first message must come
        within ``stream_idle_timeout_s``, as a PushUpdate's (a stream that never says who it is holds nothing long).
        """
        it = aiter(request_iterator)
        cfg = self.coord.config
        between = max(cfg.rounds.round_timeout_s, cfg.server.long_poll_s) + self.idle_s
        idle = self.idle_s
        then: tuple[pb.PullTaskRequest, bytes] | None = None  # a pull sent with the last update (then_pull)
        owed = False  # an update taken whose `pushed` rides on the answer to its then_pull (pushed_with_answer)
        limit = IdleLimit()  # one timer for all of the stream's waits
        try:
            while True:
                res: Any = None  # a pull's answer
                inline_ok = False
                pushed = False  # or an update taken
                try:
                    if self.auth.signed:
                        raise ProtocolError("FAILED_PRECONDITION", "this server requires signed requests, which the "
                                                                   "Session stream does not carry: use PullTask and "
                                                                   "PushUpdate (each call signed)")
                    if then is not None:  # the next exchange is the pull that came with the update
                        (pull, raw), then = then, None
                    else:
                        item = await self._next(it, "", limit, idle)
                        if item is None:
                            return
                        idle = between
                        msg = _message(item)
                        kind = msg.WhichOneof("kind")
                        if kind == "header":
                            await self._update(item, it, "Session", context, limit, whole_stream=False)
                            pushed = True
                            if msg.HasField("then_pull"):
                                # A copy: a sub-message keeps its parent (the update, its data) alive while it waits.
                                raw = msg.then_pull.SerializeToString()
                                then = pb.PullTaskRequest.FromString(raw), raw
                                owed = msg.pushed_with_answer
                            item = msg = None  # the update's bytes are not held while the stream waits
                        elif kind == "pull":
                            pull, raw = msg.pull, item.raw
                        elif kind == "secagg":
                            secagg = await self._secagg(msg.secagg, item.raw, "Session", context)
                            item = msg = None
                            yield pb.SessionReply(secagg=secagg).SerializeToString()
                            continue
                        else:
                            raise ProtocolError("INVALID_ARGUMENT", "a Session exchange starts with a pull or an "
                                                                    f"update header, not {kind or 'an empty message'}")
                    if not pushed:
                        cid, res = await self._poll(pull, raw, "Session", context)
                        inline_ok = pull.inline_ok
                except ProtocolError as e:
                    if owed:  # the update was taken: said before the refusal of its pull ends the stream
                        owed = False
                        yield _PUSHED
                    await self._refuse(context, "Session", e)
                except Exception:
                    if owed:  # likewise before a failure of the server's own (the client then knows it need not resend)
                        owed = False
                        yield _PUSHED
                    raise
                if pushed:
                    if not owed:
                        yield _PUSHED
                    continue
                owed = False  # the answer that follows acknowledges the update
                message: pb.TaskMessage | bytes | None = None
                for message in self._task_messages(res, inline_ok):
                    yield message  # TaskMessage's frames are SessionReply's (the same field numbers)
                message = None  # nor is the task's (a model inside its header) while the device trains and polls
                if isinstance(res, Task):
                    self.coord.timing.handed_out(cid, res.round)
                elif isinstance(res, WaitInfo) and res.finished:
                    # Nothing more to exchange: the stream ends here (OK), so the device's close finds it done instead
                    # of resetting it, and the server is spared a cancelled call per device (ten thousand at once).
                    return
        finally:
            limit.close()

    async def _secagg(self, request: pb.SecAggRequest, raw: bytes, method: str,
                      context: grpc.aio.ServicerContext) -> pb.SecAggReply:
        """A secure-aggregation exchange (:meth:`fedserver.secure_round.SecureRounds.exchange`) after its checks;
        raises :class:`ProtocolError`."""
        bounds.check_secagg(request)
        cid = self._session_of(self.auth.identify(method_path(method), context, raw), request.session_id)
        self.coord.members.touch(request.session_id)
        if self.coord.stopping:
            raise ProtocolError("UNAVAILABLE", "the server is stopping")
        reply = await self.coord.secure.exchange(cid, request)
        self.coord.members.touch(request.session_id)  # a device waiting in an exchange is alive, as in a long-poll
        return reply

    async def SecureAggregate(self, item: Incoming, context: grpc.aio.ServicerContext) -> pb.SecAggReply:
        try:
            return await self._secagg(_message(item), item.raw, "SecureAggregate", context)
        except ProtocolError as e:
            await self._refuse(context, "SecureAggregate", e)
        raise AssertionError("unreachable")  # _refuse aborts the call

    async def Heartbeat(self, item: Incoming, context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        try:
            request = _message(item)
            bounds.check_heartbeat(request)
            self._session_of(self.auth.identify(method_path("Heartbeat"), context, item.raw), request.session_id)
            self.coord.members.touch(request.session_id)
        except ProtocolError as e:
            await self._refuse(context, "Heartbeat", e)
        return pb.HeartbeatReply(round=self.coord.state.round, finished=self.coord.finished)

    async def Leave(self, item: Incoming, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        try:
            request = _message(item)
            bounds.check_leave(request)
            self._session_of(self.auth.identify(method_path("Leave"), context, item.raw), request.session_id)
            self.coord.members.leave(request.session_id, request.reason)
        except ProtocolError as e:
            await self._refuse(context, "Leave", e)
        return pb.LeaveReply()

    async def GetStatus(self, item: Incoming, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        """The whole status (client ids, clusters) for the operator credential only; a client that names its
        session sees the federation's progress and its own record; anyone else is refused. The history holds the
        rounds after ``since_round`` only, so a follower's poll does not grow with the federation's age."""
        try:
            request = _message(item)
            if self.auth.operator(context):
                context.set_trailing_metadata(process_metadata())
                return wire.status_to_pb(rounds_after(self.coord.status(), request.since_round))
            if not request.session_id:
                raise ProtocolError("UNAUTHENTICATED", "GetStatus needs the operator credential (metadata "
                                                       "fg-operator: the server's security.operator_token_file or "
                                                       "FEDGUARD_OPERATOR_TOKEN), or a client's own session")
            bounds.check_session(request.session_id)
            cid = self._session_of(self.auth.identify(method_path("GetStatus"), context, item.raw),
                                   request.session_id)
            own = self.coord.client_status(cid)
        except ProtocolError as e:
            await self._refuse(context, "GetStatus", e)
        return wire.status_to_pb(own)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        ser = {name: getattr(pb, name).SerializeToString for name in (
            "JoinReply", "PushReply", "HeartbeatReply", "LeaveReply", "StatusReply", "SecAggReply")}
        ser["TaskMessage"] = _serialize_task  # and the Session stream's replies
        return {
            "Join": grpc.unary_unary_rpc_method_handler(self.Join, _decoder(pb.JoinRequest), ser["JoinReply"]),
            "PullTask": grpc.unary_stream_rpc_method_handler(self.PullTask, _decoder(pb.PullTaskRequest),
                                                             ser["TaskMessage"]),
            "PushUpdate": grpc.stream_unary_rpc_method_handler(self.PushUpdate, _decoder(pb.UpdateMessage),
                                                               ser["PushReply"]),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self.Heartbeat, _decoder(pb.HeartbeatRequest),
                                                             ser["HeartbeatReply"]),
            "Leave": grpc.unary_unary_rpc_method_handler(self.Leave, _decoder(pb.LeaveRequest), ser["LeaveReply"]),
            "GetStatus": grpc.unary_unary_rpc_method_handler(self.GetStatus, _decoder(pb.StatusRequest),
                                                             ser["StatusReply"]),
            "Session": grpc.stream_stream_rpc_method_handler(self.Session, _decoder(pb.SessionRequest),
                                                             ser["TaskMessage"]),
            "SecureAggregate": grpc.unary_unary_rpc_method_handler(
                self.SecureAggregate, _decoder(pb.SecAggRequest), ser["SecAggReply"]),
        }


def rounds_after(status: FederationStatus, since_round: int) -> FederationStatus:
    """``status`` with only the history rounds after ``since_round`` (0: all of them)."""
    if since_round <= 0:
        return status
    return dataclasses.replace(status, history=tuple(r for r in status.history if r.round > since_round))


def add_to_server(server: grpc.aio.Server, coordinator: Coordinator) -> tuple[
    FederationServicer, health.aio.HealthServicer
]:
    """Register the federation service and the standard gRPC health service on ``server``."""
    servicer = FederationServicer(coordinator)
    handlers = servicer.handlers()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return servicer, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
