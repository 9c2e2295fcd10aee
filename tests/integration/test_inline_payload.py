"""A model or an update that fits one chunk rides inside its header (issue 30): ``TaskHeader.data`` for a pull that
says ``inline_ok``, ``UpdateHeader.data`` for an update. One message instead of a header and chunks each way; the
bytes are the same, the checks are the same, and a payload too big for one chunk still goes in chunks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedcore.serialization import Reassembler, pack
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import OPERATOR_MD, join_session, mark_ready, server_config, stub, update_messages

TOKEN = "s3cret"


def _serve(tmp_path: Path, chunk_bytes: int, num_rounds: int = 1) -> ServerThread:
    cfg = server_config(tmp_path, server={"token": TOKEN, "chunk_bytes": chunk_bytes},
                        rounds={"num_rounds": num_rounds, "clients_per_round": 2, "min_updates": 2,
                                "round_timeout_s": 30.0})
    return ServerThread(cfg, linger_s=0.5).start()


@pytest.fixture
def small_chunks(tmp_path: Path) -> Iterator[tuple[ServerThread, Any]]:
    srv = _serve(tmp_path, 4096)  # smaller than the test model (~18 kB): a task never fits one chunk
    ch, s = stub(srv.address)
    yield srv, s
    ch.close()
    srv.stop()


@pytest.fixture
def big_chunks(tmp_path: Path) -> Iterator[tuple[ServerThread, Any]]:
    srv = _serve(tmp_path, 1 << 20)
    ch, s = stub(srv.address)
    yield srv, s
    ch.close()
    srv.stop()


def _pull(s: Any, session: str, inline_ok: bool) -> list[pb.TaskMessage]:
    return list(s.PullTask(pb.PullTaskRequest(session_id=session, max_wait_s=10.0, inline_ok=inline_ok),
                           timeout=20))


def _model(messages: list[pb.TaskMessage]) -> bytes:
    h = messages[0].header
    return h.data if h.data else b"".join(m.chunk.data for m in messages[1:])


def _inline_update(session: str, round_: int, state: dict[str, torch.Tensor], data: bytes | None = None,
                   then: list[pb.UpdateMessage] | None = None) -> Iterator[pb.UpdateMessage]:
    manifest, payload = pack(state)
    yield pb.UpdateMessage(header=pb.UpdateHeader(
        session_id=session, round=round_, num_samples=10, train_loss=0.5, kind=pb.WEIGHTS,
        tensors=wire.metas_to_pb(manifest), total_bytes=len(payload),
        data=bytes(payload) if data is None else data))
    yield from then or []


def _state(messages: list[pb.TaskMessage]) -> dict[str, torch.Tensor]:
    h = messages[0].header
    asm = Reassembler(wire.metas_from_pb(h.tensors), h.total_bytes)
    asm.feed(0, _model(messages))
    return asm.finish()


def test_a_small_model_and_its_update_ride_in_their_headers(big_chunks) -> None:  # type: ignore[no-untyped-def]
    """The same round's model: one message to the pull that said inline_ok, header and chunks to the one that did
    not, the same bytes; an update inside its header is accepted like one in chunks, and the round aggregates."""
    _, s = big_chunks
    a, b = join_session(s, "a", TOKEN), join_session(s, "b", TOKEN)
    mark_ready(s, [a, b])
    inline, chunked = _pull(s, a, inline_ok=True), _pull(s, b, inline_ok=False)
    assert len(inline) == 1 and inline[0].header.data  # the task is one message
    assert len(chunked) >= 2 and not chunked[0].header.data
    assert _model(inline) == _model(chunked)
    assert len(inline[0].header.data) == inline[0].header.total_bytes
    state = {k: v + 0.01 for k, v in _state(inline).items()}
    assert s.PushUpdate(_inline_update(a, 1, state), timeout=10).accepted
    assert s.PushUpdate(update_messages(b, 1, state), timeout=10).accepted
    for _ in range(100):
        status = s.GetStatus(pb.StatusRequest(), metadata=OPERATOR_MD, timeout=10)
        if status.history:
            break
        time.sleep(0.05)
    assert status.history[0].accepted == 2 and status.history[0].rejected == 0


def test_each_round_hands_out_its_own_model_and_each_client_its_own_deadline(tmp_path: Path) -> None:
    """The task header is serialized once per round and model (FederationServicer._task_header) and each client's
    deadline spliced in: round 2's tasks carry round 2's model (the mean of round 1's updates), inline and chunked
    alike, and a later hand-out carries a shorter deadline."""
    srv = _serve(tmp_path, 1 << 20, num_rounds=2)
    ch, s = stub(srv.address)
    try:
        a, b = join_session(s, "a", TOKEN), join_session(s, "b", TOKEN)
        mark_ready(s, [a, b])
        first = _pull(s, a, inline_ok=True)
        time.sleep(0.05)
        later = _pull(s, b, inline_ok=True)
        assert first[0].header.round == later[0].header.round == 1 and _model(first) == _model(later)
        assert 0.0 < later[0].header.deadline_s < first[0].header.deadline_s <= 30.0
        base = _state(first)
        for session, shift in ((a, 0.25), (b, 0.75)):
            state = {k: v + shift if v.is_floating_point() else v for k, v in base.items()}
            assert s.PushUpdate(update_messages(session, 1, state), timeout=10).accepted
        inline, chunked = _pull(s, a, inline_ok=True), _pull(s, b, inline_ok=False)
        assert inline[0].header.round == chunked[0].header.round == 2
        assert len(inline) == 1 and len(chunked) >= 2 and _model(inline) == _model(chunked) != _model(first)
        for name, t in _state(inline).items():  # FedAvg of equal weights: base + 0.5, up to float32 rounding
            if t.is_floating_point():
                torch.testing.assert_close(t, base[name] + 0.5, rtol=0.0, atol=1e-6)
    finally:
        ch.close()
        srv.stop()


def test_inline_data_must_be_the_whole_announced_update(big_chunks) -> None:  # type: ignore[no-untyped-def]
    """Data that disagrees with total_bytes, or a chunk after a whole inline update: refused, with the reason."""
    _, s = big_chunks
    a, b = join_session(s, "a", TOKEN), join_session(s, "b", TOKEN)
    mark_ready(s, [a, b])
    state = _state(_pull(s, a, inline_ok=True))
    _pull(s, b, inline_ok=True)
    _, payload = pack(state)
    with pytest.raises(grpc.RpcError) as short:
        s.PushUpdate(_inline_update(a, 1, state, data=bytes(payload)[:-4]), timeout=10)
    assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header's data holds" in (short.value.details() or "")
    extra = [pb.UpdateMessage(chunk=pb.Chunk(offset=len(payload), data=b"\0" * 4))]
    with pytest.raises(grpc.RpcError) as more:
        s.PushUpdate(_inline_update(b, 1, state, then=extra), timeout=10)
    assert more.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def test_a_model_bigger_than_a_chunk_goes_in_chunks(small_chunks) -> None:  # type: ignore[no-untyped-def]
    _, s = small_chunks
    a, b = join_session(s, "a", TOKEN), join_session(s, "b", TOKEN)
    mark_ready(s, [a, b])
    task = _pull(s, a, inline_ok=True)
    assert not task[0].header.data and len(task) >= 2  # inline_ok asks; the size decides


@pytest.mark.parametrize("deadline", [0.0, 12.5, 1e-300, 3600.0])
@pytest.mark.parametrize("data", [b"", b"\x01" * 300])
def test_a_spliced_deadline_parses_as_the_serialized_header_with_it(deadline: float, data: bytes) -> None:
    metas = wire.metas_to_pb(pack({"w": torch.zeros(3, 5), "b": torch.zeros(5)})[0])
    header = pb.TaskHeader(round=7, tensors=metas, total_bytes=len(data), recovery=True, learning_rate=0.05,
                           data=data)
    whole = pb.TaskHeader()
    whole.CopyFrom(header)
    whole.deadline_s = deadline
    frame = wire.task_header_frame(header.SerializeToString(), deadline)
    assert pb.TaskMessage.FromString(frame) == pb.TaskMessage(header=whole)
    assert pb.SessionReply.FromString(frame) == pb.SessionReply(header=whole)  # the same field numbers
    assert len(frame) <= len(pb.TaskMessage(header=header).SerializeToString()) + wire.DEADLINE_BYTES + 1


def test_fits_inline_counts_the_header_and_framing() -> None:
    assert wire.fits_inline(100, 1000, 1116)
    assert not wire.fits_inline(100, 1000, 1115)
    assert not wire.fits_inline(10, 0, 1 << 20)  # nothing to carry: no data field


def test_a_client_inlines_its_update_only_when_asked_and_when_it_fits() -> None:
    from fedclient.transport import update_frames

    manifest, payload = pack({"w": torch.arange(1000, dtype=torch.float32)})
    def header() -> pb.UpdateHeader:
        return pb.UpdateHeader(session_id="s", round=1, tensors=wire.metas_to_pb(manifest), total_bytes=len(payload))
    first, chunks = update_frames(header(), payload, 1 << 20, pb.UpdateMessage, inline=True)
    assert pb.UpdateMessage.FromString(first).header.data == bytes(payload) and not list(chunks)
    for inline, chunk_bytes in ((False, 1 << 20), (True, 2048)):  # not asked; too big for one chunk
        first, chunks = update_frames(header(), payload, chunk_bytes, pb.UpdateMessage, inline=inline)
        assert not pb.UpdateMessage.FromString(first).header.data
        assert b"".join(pb.UpdateMessage.FromString(c).chunk.data for c in chunks) == bytes(payload)


def test_an_update_carries_its_payloads_sha256_when_it_is_signed_only() -> None:
    """UpdateHeader.payload_sha256 binds the chunks to the header a signature covers: a signed update's header has
    the SHA-256 of its tensor bytes (inline or chunked); an unsigned one (a Session stream's, which carries no
    signature) goes without, and the transport's own integrity covers its bytes."""
    import hashlib

    from fedclient.transport import update_frames

    manifest, payload = pack({"w": torch.arange(1000, dtype=torch.float32)})
    for inline, chunk_bytes in ((True, 1 << 20), (False, 2048)):
        for signed in (True, False):
            header = pb.UpdateHeader(session_id="s", round=1, tensors=wire.metas_to_pb(manifest),
                                     total_bytes=len(payload))
            first, _ = update_frames(header, payload, chunk_bytes, pb.SessionRequest, inline=inline, signed=signed)
            sent = pb.SessionRequest.FromString(first).header.payload_sha256
            assert sent == (hashlib.sha256(bytes(payload)).digest() if signed else b""), (inline, signed)
