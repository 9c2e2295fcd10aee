"""The ``Session`` stream (issue 30): PullTask and PushUpdate as exchanges on one long-lived call per device. It
carries the same messages through the same checks; a refusal ends the stream with its status; the stream ends when
idle for longer than a round; clients fall back to the unary calls against a server without it; and the transport
changes no number a federation computes."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedcore.serialization import Reassembler
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import join_session, mark_ready, server_config, stub, update_messages

TOKEN = "s3cret"


class Exchange:
    """A raw Session call driven by the test: ``send`` messages, read ``replies``."""

    def __init__(self, s: Any) -> None:
        self.q: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self.call = s.Session(iter(self.q.get, None), timeout=60)
        self.replies: Iterator[pb.SessionReply] = iter(self.call)

    def send(self, *messages: pb.SessionRequest) -> None:
        for m in messages:
            self.q.put(m)

    def pull(self, session: str, max_wait: float = 5.0) -> tuple[pb.TaskHeader | pb.Wait, Any]:
        self.send(pb.SessionRequest(pull=pb.PullTaskRequest(session_id=session, max_wait_s=max_wait)))
        first = next(self.replies)
        if first.WhichOneof("kind") == "wait":
            return first.wait, None
        h = first.header
        asm = Reassembler(wire.metas_from_pb(h.tensors), h.total_bytes)
        while asm.received < asm.expected:
            m = next(self.replies)
            asm.feed(m.chunk.offset, m.chunk.data)
        return h, asm.finish()

    def push(self, messages: Iterator[pb.UpdateMessage]) -> pb.SessionReply:
        # UpdateMessage and SessionRequest share the header and chunk field numbers: the same bytes.
        self.send(*(pb.SessionRequest.FromString(m.SerializeToString()) for m in messages))
        return next(self.replies)

    def close(self) -> None:
        self.q.put(None)


@pytest.fixture
def federation(tmp_path: Path):  # type: ignore[no-untyped-def]
    cfg = server_config(tmp_path, server={"token": TOKEN, "chunk_bytes": 4096},
                        rounds={"num_rounds": 2, "clients_per_round": 2, "min_updates": 1, "round_timeout_s": 30.0})
    srv = ServerThread(cfg, linger_s=0.1).start()
    ch, s = stub(srv.address)
    yield srv, s
    ch.close()
    srv.stop()


def _join(s: Any, name: str) -> str:
    return join_session(s, name, TOKEN)


def test_one_stream_carries_every_round_of_a_device(federation) -> None:  # type: ignore[no-untyped-def]
    """Two rounds, each a pull and an update, on one stream per client; the task is byte for byte PullTask's."""
    srv, s = federation
    streams = {name: Exchange(s) for name in ("a", "b")}
    sessions = {name: _join(s, name) for name in streams}
    for round_ in (1, 2):
        tasks: dict[str, Any] = {}
        deadline = time.monotonic() + 20
        while len(tasks) < 2 and time.monotonic() < deadline:  # short polls, taking turns on the two streams
            for name, ex in streams.items():
                if name not in tasks:
                    header, state = ex.pull(sessions[name], max_wait=0.1)
                    if isinstance(header, pb.TaskHeader):
                        assert header.round == round_, header
                        tasks[name] = state
        assert set(tasks) == {"a", "b"}, tasks
        for name, ex in streams.items():
            reply = ex.push(update_messages(sessions[name], round_, {k: v + 0.01 for k, v in tasks[name].items()}))
            assert reply.WhichOneof("kind") == "pushed" and reply.pushed.accepted
        srv.wait_for_round(round_, timeout=20)
    assert [(r.round, r.accepted, r.rejected) for r in srv.status().history] == [(1, 2, 0), (2, 2, 0)]
    for name, ex in streams.items():
        # The federation finished: that answer is the stream's last, and the server ends the stream (OK) itself,
        # so the device's close finds it done instead of resetting it (no cancelled call per device on the server).
        wait, _ = ex.pull(sessions[name])
        assert isinstance(wait, pb.Wait) and wait.finished
        assert next(ex.replies, None) is None and ex.call.code() == grpc.StatusCode.OK
        ex.close()


def test_a_pull_can_go_with_the_update(federation) -> None:  # type: ignore[no-untyped-def]
    """SessionRequest.then_pull: the update is answered with ``pushed``, then the pull that came with it is served
    as the stream's next exchange: round 2's task arrives with no message sent after round 1's update."""
    srv, s = federation
    replies = {name: s.Join(pb.JoinRequest(client_id=name, token=TOKEN), timeout=5) for name in ("a", "b")}
    assert all(r.then_pull for r in replies.values())  # the server says it reads the field
    sessions = {name: r.session_id for name, r in replies.items()}
    streams = {name: Exchange(s) for name in sessions}
    tasks: dict[str, Any] = {}
    deadline = time.monotonic() + 20
    while len(tasks) < 2 and time.monotonic() < deadline:
        for name, ex in streams.items():
            if name not in tasks:
                header, state = ex.pull(sessions[name], max_wait=0.1)
                if isinstance(header, pb.TaskHeader):
                    tasks[name] = state
    assert set(tasks) == {"a", "b"}
    for name, ex in streams.items():
        frames = list(update_messages(sessions[name], 1, {k: v + 0.01 for k, v in tasks[name].items()}))
        first = pb.SessionRequest(header=frames[0].header,
                                  then_pull=pb.PullTaskRequest(session_id=sessions[name], max_wait_s=10.0))
        ex.send(first, *(pb.SessionRequest.FromString(m.SerializeToString()) for m in frames[1:]))
        reply = next(ex.replies)
        assert reply.WhichOneof("kind") == "pushed" and reply.pushed.accepted
    srv.wait_for_round(1, timeout=20)
    for ex in streams.values():  # nothing more sent: the pull that went with the update is answered
        first_reply = next(ex.replies)
        assert first_reply.WhichOneof("kind") == "header" and first_reply.header.round == 2
        ex.close()


def _tasks(streams: dict[str, Exchange], sessions: dict[str, str]) -> dict[str, Any]:
    """Round 1's task for each stream (short polls, taking turns)."""
    tasks: dict[str, Any] = {}
    deadline = time.monotonic() + 20
    while len(tasks) < len(streams) and time.monotonic() < deadline:
        for name, ex in streams.items():
            if name not in tasks:
                header, state = ex.pull(sessions[name], max_wait=0.1)
                if isinstance(header, pb.TaskHeader):
                    tasks[name] = state
    assert set(tasks) == set(streams), tasks
    return tasks


def _with_pull(session: str, frames: list[pb.UpdateMessage], max_wait: float = 10.0,
               pushed_with_answer: bool = True) -> list[pb.SessionRequest]:
    """An update's frames as a Session stream's, its header carrying the next pull."""
    first = pb.SessionRequest(header=frames[0].header, pushed_with_answer=pushed_with_answer,
                              then_pull=pb.PullTaskRequest(session_id=session, max_wait_s=max_wait))
    return [first, *(pb.SessionRequest.FromString(m.SerializeToString()) for m in frames[1:])]


def test_an_update_is_acknowledged_by_the_answer_to_its_pull(federation) -> None:  # type: ignore[no-untyped-def]
    """SessionRequest.pushed_with_answer: no ``pushed`` message; the first reply after the update is the answer to
    the pull sent with it (round 2's task), which says the update was taken: one message each way per round."""
    srv, s = federation
    replies = {name: s.Join(pb.JoinRequest(client_id=name, token=TOKEN), timeout=5) for name in ("a", "b")}
    assert all(r.pushed_with_answer for r in replies.values())  # the server says it reads the field
    sessions = {name: r.session_id for name, r in replies.items()}
    streams = {name: Exchange(s) for name in sessions}
    tasks = _tasks(streams, sessions)
    for name, ex in streams.items():
        ex.send(*_with_pull(sessions[name], list(update_messages(sessions[name], 1,
                                                                 {k: v + 0.01 for k, v in tasks[name].items()}))))
    srv.wait_for_round(1, timeout=20)
    assert [(r.round, r.accepted, r.rejected) for r in srv.status().history] == [(1, 2, 0)]
    for ex in streams.values():
        first_reply = next(ex.replies)
        assert first_reply.WhichOneof("kind") == "header" and first_reply.header.round == 2, first_reply
        ex.close()


def test_a_pull_refused_after_its_update_was_taken_is_preceded_by_pushed(federation) -> None:  # type: ignore[no-untyped-def]
    """The stream ends before the answer that was to acknowledge the update (its pull is refused): the server says
    ``pushed`` first, then the refusal, so the device knows its update counted and need not send it again."""
    srv, s = federation
    sessions = {name: _join(s, name) for name in ("a", "b")}
    streams = {name: Exchange(s) for name in sessions}
    tasks = _tasks(streams, sessions)
    ex = streams["a"]
    ex.send(*_with_pull(sessions["a"], list(update_messages(sessions["a"], 1, tasks["a"])), max_wait=-1.0))
    first = next(ex.replies)
    assert first.WhichOneof("kind") == "pushed" and first.pushed.accepted, first
    with pytest.raises(grpc.RpcError) as e:
        next(ex.replies)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_wait_s" in (e.value.details() or "")
    assert srv.call(lambda: list(srv.coordinator.state.accepted)) == ["a"]
    # Sent again on a new stream (a device that did not hear back): ALREADY_EXISTS, and nothing recorded against it.
    again = Exchange(s)
    with pytest.raises(grpc.RpcError) as e:
        again.push(update_messages(sessions["a"], 1, tasks["a"]))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
    state = srv.call(lambda: (list(srv.coordinator.state.accepted), dict(srv.coordinator.state.rejected)))
    assert state == (["a"], {}), state
    for x in (*streams.values(), again):
        x.close()


@pytest.mark.parametrize(("case", "code", "text"), [
    ("wrong_shape", grpc.StatusCode.INVALID_ARGUMENT, "has shape [3, 3], expected"),
    ("nan", grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
    ("extra_bytes", grpc.StatusCode.INVALID_ARGUMENT, "more bytes than announced"),
    ("missing_bytes", grpc.StatusCode.INVALID_ARGUMENT, "announced bytes"),
    ("chunk_first", grpc.StatusCode.INVALID_ARGUMENT, "starts with a pull or an update header, not chunk"),
    ("other_session", grpc.StatusCode.UNAUTHENTICATED, ""),
])
def test_a_refusal_ends_the_stream_with_its_status_and_is_recorded(federation: Any, case: str,
                                                                    code: grpc.StatusCode, text: str) -> None:
    srv, s = federation
    sid = _join(s, "a")
    sid_b = _join(s, "b")
    ex = Exchange(s)
    mark_ready(s, [sid, sid_b])
    header, state = ex.pull(sid, max_wait=10.0)
    assert isinstance(header, pb.TaskHeader)
    bad = {k: v.clone() for k, v in state.items()}
    first = next(iter(bad))
    messages = list(update_messages(sid, 1, bad))
    if case == "wrong_shape":
        bad[first] = torch.zeros(3, 3)
        messages = list(update_messages(sid, 1, bad))
    elif case == "nan":
        bad[first].view(-1)[3] = float("nan")
        messages = list(update_messages(sid, 1, bad))
    elif case == "extra_bytes":
        messages = list(update_messages(sid, 1, bad, extra_bytes=b"\0" * 8))
    elif case == "missing_bytes":
        messages = messages[:-1]
    elif case == "chunk_first":
        messages = messages[1:]
    elif case == "other_session":
        messages = list(update_messages("f" * 32, 1, bad))
    ex.send(*(pb.SessionRequest.FromString(m.SerializeToString()) for m in messages))
    if case == "missing_bytes":
        ex.close()  # the stream ends inside the update
    with pytest.raises(grpc.RpcError) as e:
        next(ex.replies)
    assert e.value.code() == code, (case, e.value.details())
    assert text in (e.value.details() or ""), (case, e.value.details())
    rejected = srv.call(lambda: dict(srv.coordinator.state.rejected))
    if case in ("chunk_first", "other_session"):  # no update of "a" was read: nothing counts against it
        assert "a" not in rejected
        again = Exchange(s)
        assert again.push(update_messages(sid, 1, state)).pushed.accepted  # a new stream goes on
    else:  # the refusal is recorded against a's update for the round, as PushUpdate's
        assert "a" in rejected, rejected
        again = Exchange(s)
        header, state = again.pull(sid_b, max_wait=10.0)
        assert isinstance(header, pb.TaskHeader)
        assert again.push(update_messages(sid_b, 1, state)).pushed.accepted
    again.close()


def test_a_stream_idle_for_longer_than_a_round_is_ended(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, server={"token": TOKEN, "long_poll_s": 0.3, "stream_idle_timeout_s": 0.3},
                        rounds={"num_rounds": 1, "clients_per_round": 2, "round_timeout_s": 0.5})
    with ServerThread(cfg, linger_s=0.1) as srv:
        ch, s = stub(srv.address)
        ex = Exchange(s)
        sid = _join(s, "a")
        wait, _ = ex.pull(sid, max_wait=0.1)  # nothing to do yet: one round of two clients, one joined
        assert isinstance(wait, pb.Wait)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            next(ex.replies)  # the stream is then idle: 0.5 + 0.3 s later the server ends it
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "stream idle" in (e.value.details() or "")
        assert 0.6 < time.monotonic() - started < 10
        ch.close()


def _federation(tmp_path: Path, session_stream: bool) -> tuple[torch.Tensor, list[Any]]:
    from fedclient import ClientConfig, FedClient

    cfg = server_config(tmp_path, server={"framed_address": ""},  # gRPC's Session stream, not the framed port
                        rounds={"num_rounds": 3, "clients_per_round": 3, "seed": 5})
    with ServerThread(cfg, linger_s=0.5) as srv:
        clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                          long_poll_s=5.0, session_stream=session_stream)).start()
                   for i in range(3)]
        status = srv.wait(90)
        assert status is not None and status.outcome == "completed", status
        summaries = [c.join(30) for c in clients]
        flat = torch.cat([t.reshape(-1) for t in srv.global_model().state_dict().values()])
    return flat, summaries


def test_the_transport_changes_no_number(tmp_path: Path) -> None:
    """The same federation over Session streams and over the unary calls: bit-identical global models."""
    streamed, summaries = _federation(tmp_path / "stream", True)
    unary, _ = _federation(tmp_path / "unary", False)
    assert all(s.finished and s.rounds_trained == 3 for s in summaries), summaries
    assert torch.equal(streamed.view(torch.int32), unary.view(torch.int32))


def test_a_client_falls_back_to_the_unary_calls_against_a_server_without_the_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that predates ``Session`` answers UNIMPLEMENTED: the client says so once and pulls and pushes with
    the unary calls; the federation completes."""
    from fedclient import ClientConfig, FedClient
    from fedserver.servicer import FederationServicer

    handlers = FederationServicer.handlers
    monkeypatch.setattr(FederationServicer, "handlers",
                        lambda self: {k: v for k, v in handlers(self).items() if k != "Session"})
    events: list[str] = []
    cfg = server_config(tmp_path, server={"framed_address": ""},  # a server that predates Session has no framed port
                        rounds={"num_rounds": 2, "clients_per_round": 2})
    with ServerThread(cfg, linger_s=0.5) as srv:
        clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                          long_poll_s=5.0)) for i in range(2)]
        for c in clients:
            c.connection.log = _Recorder(c.connection.log, events)
            c.start()
        status = srv.wait(60)
        assert status is not None and status.outcome == "completed", status
        assert all(c.join(30).rounds_trained == 2 for c in clients)
    assert events.count("client.session_stream_off") == 2  # once per client


class _Recorder:
    """A logger that records event names and passes everything on."""

    def __init__(self, log: Any, events: list[str]) -> None:
        self._log, self._events = log, events

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._log, name)

        def record(event: str, *args: Any, **kw: Any) -> Any:
            self._events.append(event)
            return method(event, *args, **kw)

        return record


def test_a_stream_ended_while_the_device_worked_is_replaced_at_once(tmp_path: Path) -> None:
    """A straggler trains for longer than the stream may sit idle (a round + stream_idle_timeout_s): the server ends
    its stream meanwhile, and the client sends its update on a new one at once, not after a back-off counted as a
    reconnect (its late update is then refused as late, like any straggler's)."""
    from fedclient import ClientConfig, FedClient
    from fedcore.simulation import SimulationConfig

    cfg = server_config(tmp_path, server={"long_poll_s": 0.3, "stream_idle_timeout_s": 0.3},
                        rounds={"num_rounds": 3, "clients_per_round": 2, "min_updates": 1, "round_timeout_s": 1.0,
                                "min_available": 2})
    with ServerThread(cfg, linger_s=4.0) as srv:  # the straggler's last update still gets its answer
        fast = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="fast", data_index=0,
                                      long_poll_s=0.3)).start()
        slow = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="slow", data_index=1,
                                      long_poll_s=0.3, simulation=SimulationConfig(straggler_delay_s=2.0))).start()
        status = srv.wait(60)
        assert status is not None and status.outcome == "completed", status
        fast.join(30)
        summary = slow.join(30)
    assert summary.finished and summary.updates_rejected >= 1, summary  # late, refused as late
    assert summary.reconnects == 0, summary  # the idle-ended stream was replaced without a retry


def test_a_stream_that_never_speaks_is_ended_within_the_stream_idle_timeout(tmp_path: Path) -> None:
    """Before its first message a stream gets stream_idle_timeout_s, not a round's length: a peer that opens streams
    and says nothing holds none of them long."""
    cfg = server_config(tmp_path, server={"token": TOKEN, "stream_idle_timeout_s": 0.3},
                        rounds={"num_rounds": 1, "clients_per_round": 2, "round_timeout_s": 60.0})
    with ServerThread(cfg, linger_s=0.1) as srv:
        ch, s = stub(srv.address)
        ex = Exchange(s)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            next(ex.replies)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
        assert time.monotonic() - started < 10  # 0.3 s, not the 60 s round
        ch.close()
