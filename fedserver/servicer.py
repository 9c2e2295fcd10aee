"""gRPC servicer: protobuf in, coordinator calls, protobuf out. No federation logic lives here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedcore.config import FederationInfo
from fedcore.serialization import Reassembler, SerializationError
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedguard.v1 import fedguard_pb2_grpc as pb_grpc
from fedserver.coordinator import Coordinator, ProtocolError, Task

SERVICE_NAME = "fedguard.v1.Federation"


class FederationServicer(pb_grpc.FederationServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coord = coordinator
        cfg = coordinator.config
        self._join_config = wire.federation_to_pb(FederationInfo(
            federation_id=cfg.server.federation_id, model_name=cfg.model.name, model_kwargs=cfg.model.kwargs,
            model_fingerprint=coordinator.fingerprint, model_spec=tuple(coordinator.manifest),
            training=cfg.training, dataset=cfg.data.dataset, data_options=cfg.data.options,
            num_rounds=cfg.rounds.num_rounds, seed=cfg.rounds.seed, nfl_mode=cfg.nfl.mode,
            chunk_bytes=cfg.server.chunk_bytes, nfl_nr=cfg.nfl.nr, nfl_c=cfg.nfl.c))

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        caps = request.capabilities
        try:
            res = self.coord.join(request.client_id, request.token, int(caps.num_train_samples), caps.opt_out,
                                  caps.attacker, request.model_fingerprint)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.JoinReply(session_id=res.session_id, config=self._join_config,
                            heartbeat_interval_s=self.coord.config.server.heartbeat_interval_s,
                            client_index=res.client_index)

    async def PullTask(self, request: pb.PullTaskRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[
        pb.TaskMessage
    ]:
        try:
            res = await self.coord.pull(request.session_id, request.max_wait_s)
        except ProtocolError as e:
            await _abort(context, e)
        if not isinstance(res, Task):
            yield pb.TaskMessage(wait=pb.Wait(retry_after_s=res.retry_after_s, finished=res.finished,
                                              reason=res.reason))
            return
        total = len(res.payload)
        yield pb.TaskMessage(header=pb.TaskHeader(round=res.round, deadline_s=res.deadline_s,
                                                  tensors=wire.metas_to_pb(res.manifest), total_bytes=total,
                                                  recovery=res.recovery, learning_rate=res.learning_rate))
        for frame in wire.chunk_frames(res.payload, pb.TaskMessage, self.coord.config.server.chunk_bytes):
            yield frame

    async def PushUpdate(self, request_iterator: AsyncIterator[pb.UpdateMessage],
                         context: grpc.aio.ServicerContext) -> pb.PushReply:
        ticket = None
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ProtocolError("INVALID_ARGUMENT", "an update stream must start with its header")
            h = first.header
            try:
                manifest = wire.metas_from_pb(h.tensors)
            except SerializationError as e:
                self.coord.reject_header(h.session_id, int(h.round), "INVALID_ARGUMENT", str(e))
            kind = h.kind if h.kind != pb.UPDATE_KIND_UNSPECIFIED else pb.WEIGHTS
            ticket = self.coord.begin_update(
                h.session_id, int(h.round), int(h.num_samples), kind == pb.DELTA, h.train_loss,
                h.beta_hat if h.HasField("beta_hat") else None, dict(h.metrics), manifest, int(h.total_bytes))
            try:
                asm = Reassembler(manifest, int(h.total_bytes), self.coord.config.server.max_update_bytes)
                async for msg in request_iterator:
                    if msg.WhichOneof("kind") != "chunk":
                        raise SerializationError("a second header inside one update stream")
                    asm.feed(int(msg.chunk.offset), msg.chunk.data)
                tensors = asm.finish()
            except SerializationError as e:
                self.coord.reject_ticket(ticket, "INVALID_ARGUMENT", str(e))
            self.coord.submit_update(ticket, tensors)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.PushReply(accepted=True)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        try:
            self.coord.touch(request.session_id)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.HeartbeatReply(round=self.coord.state.round, finished=self.coord.finished)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        try:
            self.coord.leave(request.session_id, request.reason)
        except ProtocolError as e:
            await _abort(context, e)
        return pb.LeaveReply()

    async def GetStatus(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return wire.status_to_pb(self.coord.status())


async def _abort(context: grpc.aio.ServicerContext, e: ProtocolError) -> Any:
    await context.abort(getattr(grpc.StatusCode, e.code), e.message)


def add_to_server(server: grpc.aio.Server, coordinator: Coordinator) -> health.aio.HealthServicer:
    """Register the federation service and the standard gRPC health service on ``server``."""
    pb_grpc.add_FederationServicer_to_server(FederationServicer(coordinator), server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
