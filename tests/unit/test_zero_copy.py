"""Zero-copy weights (issue 30, item 4): a sender's payload is views of the tensors' storage, chunk frames are
written by hand byte for byte as protobuf writes them, the receiver reads each chunk's data in place and copies it
once into one ``torch.empty`` per tensor. Old-format bytes (protobuf's own frames) are read identically, and the
new frames are what the previous release's receiver parses."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.serialization import (
    DTYPES,
    Payload,
    Reassembler,
    ReceivedTensors,
    SerializationError,
    TensorMeta,
    iter_chunks,
    pack,
    payload_of,
    roundtrip_chunks,
    unpack,
)
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from tests.unit.test_serialization import _random_tensor as _tensor

MESSAGES = [pb.TaskMessage, pb.UpdateMessage]


def _bits(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _assert_bit_identical(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert _bits(a[k]) == _bits(b[k]), k


def _every_dtype_state() -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for i, (name, dt) in enumerate(sorted(DTYPES.items())):
        state[f"{name}.vec"] = _tensor(dt, (7, 3), i)
        state[f"{name}.scalar"] = _tensor(dt, (), 100 + i)
        state[f"{name}.empty"] = torch.empty((0, 4), dtype=dt)
    state["float32.special"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    return state


def _send(state: dict[str, torch.Tensor], message: type[wire.M], chunk: int) -> tuple[list[TensorMeta], list[bytes]]:
    manifest, payload = payload_of(state)
    return manifest, list(wire.chunk_frame_bytes(payload, message, chunk))


def _receive(manifest: list[TensorMeta], frames: list[bytes], message: type[wire.M]) -> dict[str, torch.Tensor]:
    asm = Reassembler(manifest, sum(m.nbytes for m in manifest))
    for f in frames:
        got = wire.read_chunk(f, message)
        assert got is not None
        asm.feed(*got)
    return asm.finish()


@pytest.mark.parametrize("message", MESSAGES)
@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 64, 1 << 20])  # 3, 5, 7: boundaries inside 2-, 4-, 8-byte elements
def test_every_dtype_round_trips_bit_for_bit_over_the_frames(message: type[wire.M], chunk: int) -> None:
    state = _every_dtype_state()
    manifest, frames = _send(state, message, chunk)
    out = _receive(manifest, frames, message)
    _assert_bit_identical(state, out)


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)),
                                st.lists(st.integers(0, 6), max_size=3).map(tuple), st.integers(0, 2**31)),
                      max_size=5),
       chunk=st.integers(1, 200))
def test_any_state_round_trips_and_frames_equal_protobufs(specs: list[tuple[str, tuple[int, ...], int]],
                                                          chunk: int) -> None:
    state = {f"t{i}": _tensor(DTYPES[d], shape, seed) for i, (d, shape, seed) in enumerate(specs)}
    manifest, payload = payload_of(state)
    _, packed = pack(state)
    assert payload.tobytes() == bytes(packed)
    for message in MESSAGES:
        new = list(wire.chunk_frame_bytes(payload, message, chunk))
        old = [m.SerializeToString() for m in wire.chunk_frames(packed, message, chunk)]
        assert new == old  # the same bytes on the wire as the previous release
        _assert_bit_identical(state, _receive(manifest, old, message))  # old-format bytes read identically
    _assert_bit_identical(state, roundtrip_chunks(state, chunk))


@pytest.mark.parametrize("message", MESSAGES)
def test_the_previous_receiver_reads_the_new_frames(message: type[wire.M]) -> None:
    """The previous release parsed every frame with protobuf and fed ``msg.chunk.data`` into one buffer."""
    state = _every_dtype_state()
    manifest, frames = _send(state, message, 5)
    buf = bytearray()
    for f in frames:
        msg = message.FromString(f)
        assert msg.WhichOneof("kind") == "chunk" and msg.chunk.offset == len(buf)
        buf += msg.chunk.data
    _assert_bit_identical(state, unpack(manifest, buf))


def test_the_payload_views_the_tensors_storage_and_the_receiver_allocates_one_tensor_each() -> None:
    state = {"w": torch.randn(64, 3), "b": torch.zeros(0), "c": torch.ones(5, dtype=torch.float64)}
    _, payload = payload_of(state)
    addresses = [np.frombuffer(seg, dtype=np.uint8).ctypes.data for seg in payload.segments]
    assert addresses == [state["w"].data_ptr(), state["c"].data_ptr()]  # no copy of the weights to send them
    out = roundtrip_chunks(state, chunk_bytes=100)
    ptrs = [out["w"].untyped_storage().data_ptr(), out["c"].untyped_storage().data_ptr()]
    assert ptrs[0] != ptrs[1] and out["w"].untyped_storage().nbytes() == 64 * 3 * 4  # its own allocation


def test_a_non_contiguous_tensor_is_sent_by_value() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    _assert_bit_identical({"t": t.contiguous()}, roundtrip_chunks({"t": t}, chunk_bytes=7))


def _manifest() -> list[TensorMeta]:
    return [TensorMeta("a", "float32", (3,)), TensorMeta("b", "int16", (3,))]  # 12 + 6 bytes


def test_truncated_stream_is_refused() -> None:
    asm = Reassembler(_manifest(), 18)
    asm.feed(0, b"\0" * 13)  # ends inside b's first element
    with pytest.raises(SerializationError, match="received 13 of 18 announced bytes"):
        asm.finish()


def test_oversized_stream_is_refused() -> None:
    asm = Reassembler(_manifest(), 18)
    asm.feed(0, b"\0" * 10)
    with pytest.raises(SerializationError, match=r"received more bytes than announced \(19 > 18\)"):
        asm.feed(10, b"\0" * 9)
    assert asm.received == 10  # nothing of the refused chunk was taken


def test_out_of_order_announced_and_limit_are_refused() -> None:
    with pytest.raises(SerializationError, match="announced 17 bytes but the manifest describes 18"):
        Reassembler(_manifest(), 17)
    with pytest.raises(SerializationError, match="exceeds the limit of 16"):
        Reassembler(_manifest(), 18, max_bytes=16)
    asm = Reassembler(_manifest(), 18)
    with pytest.raises(SerializationError, match="chunk at offset 4, expected offset 0"):
        asm.feed(4, b"\0" * 4)


def test_a_huge_declared_manifest_is_refused_before_any_allocation() -> None:
    with pytest.raises(SerializationError, match="exceeds the limit"):
        Reassembler([TensorMeta("w", "float64", (1 << 40,))], None, max_bytes=1 << 30)


@pytest.mark.parametrize("message", MESSAGES)
def test_read_chunk_takes_only_the_canonical_layout(message: type[wire.M]) -> None:
    good = next(wire.chunk_frame_bytes(Payload([b"x" * 300]), message, 200))
    assert wire.read_chunk(good, message) is not None
    second = list(wire.chunk_frame_bytes(Payload([b"x" * 300]), message, 200))[1]
    off, data = wire.read_chunk(second, message) or (None, b"")
    assert (off, bytes(data)) == (200, b"x" * 100)
    wrong_field = (next(wire.chunk_frame_bytes(Payload([b"xyz"]), pb.UpdateMessage, 200)) if message is pb.TaskMessage
                   else next(wire.chunk_frame_bytes(Payload([b"xyz"]), pb.TaskMessage, 200)))
    bad = [
        good[:-1],  # truncated
        good + b"\0",  # trailing bytes
        good[:1] + b"\xff" * 11,  # a varint longer than 64 bits
        message(chunk=pb.Chunk(offset=5)).SerializeToString(),  # an empty chunk
        message(chunk=pb.Chunk(offset=1, data=b"ab")).SerializeToString() + good,  # the field twice
        wrong_field,  # the other message's chunk field
        b"",
    ]
    for frame in bad:
        assert wire.read_chunk(frame, message) is None, frame[:20]
    # Fields in the other order are valid protobuf: not read in place, and protobuf's parser reads them.
    inner = b"\x12\x02ab\x08\x05"
    reordered = bytes([good[0], len(inner)]) + inner
    assert wire.read_chunk(reordered, message) is None
    parsed = message.FromString(reordered).chunk
    assert (parsed.offset, parsed.data) == (5, b"ab")
    header = (pb.TaskMessage(header=pb.TaskHeader(round=3)) if message is pb.TaskMessage
              else pb.UpdateMessage(header=pb.UpdateHeader(round=3)))
    assert wire.read_chunk(header.SerializeToString(), message) is None


def test_chunks_span_tensors_and_cover_the_payload_exactly() -> None:
    payload = Payload([b"abc", b"", bytearray(b"defgh"), memoryview(b"ij")])
    assert len(payload) == 10
    chunks = [(off, b"".join(bytes(p) for p in pieces)) for off, pieces in payload.chunks(4)]
    assert chunks == [(0, b"abcd"), (4, b"efgh"), (8, b"ij")]
    assert list(Payload([]).chunks(4)) == [] and list(iter_chunks(b"", 4)) == []
    with pytest.raises(ValueError):
        list(payload.chunks(0))


@pytest.mark.parametrize("is_delta", [False, True])
def test_the_update_is_flattened_in_place_bit_for_bit(is_delta: bool) -> None:
    """The intake's [P] vector is written in place (no per-tensor difference, no concatenation): the same bits
    as the concatenation of the differences."""
    from fedserver.global_models import GlobalModels

    g = torch.Generator().manual_seed(3)
    init = {"w": torch.randn(50, 3, generator=g), "steps": torch.tensor(4), "h": torch.randn(9, generator=g).half(),
            "d": torch.randn(6, generator=g, dtype=torch.float64), "e": torch.empty(0)}
    models = GlobalModels(init)
    upd = {k: (v + torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
           for k, v in init.items()}
    got = models.flatten_update(upd, is_delta)
    want = torch.cat([upd[k].reshape(-1).float() - (0 if is_delta else init[k].reshape(-1).float())
                      for k in models.float_names])
    assert got.dtype == torch.float32 and _bits(got) == _bits(want)


def test_the_server_reads_update_chunks_in_place_and_parses_every_other_frame() -> None:
    from fedserver.servicer import _decoder, _message, _serialize_task

    decode = _decoder(pb.UpdateMessage)
    frame = list(wire.chunk_frame_bytes(Payload([b"abcdef"]), pb.UpdateMessage, 4))[1]
    item = decode(frame)
    assert item.chunk is not None and item.chunk[0] == 4 and bytes(item.chunk[1]) == b"ef"
    assert item.message is None and _message(item).chunk.data == b"ef"  # parsed on demand (a stream's first frame)
    header = decode(pb.UpdateMessage(header=pb.UpdateHeader(round=2)).SerializeToString())
    assert header.chunk is None and header.message.header.round == 2
    inner = b"\x12\x02ab\x08\x05"  # a chunk with its fields in the other order: protobuf's parser reads it
    reordered = decode(b"\x12" + bytes([len(inner)]) + inner)
    assert reordered.chunk is None and (reordered.message.chunk.offset, reordered.message.chunk.data) == (5, b"ab")
    assert decode(b"\x12\xff").message is None and decode(b"\x12\xff").error.startswith("undecodable UpdateMessage")
    task = pb.TaskMessage(header=pb.TaskHeader(round=1))
    assert _serialize_task(task) == task.SerializeToString() and _serialize_task(b"\x1a\x00") == b"\x1a\x00"


def test_one_buffer_lays_the_tensors_back_to_back_and_falls_back_when_misaligned() -> None:
    """``one_buffer``: every tensor views one byte buffer at its payload offset (same bits as the per-tensor
    path); a tensor whose offset is not a multiple of its item size makes the receiver allocate per tensor."""
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(5, 3, generator=g), "e": torch.empty(0), "b": torch.randn(7, generator=g),
             "i": torch.arange(4, dtype=torch.int64)}  # 88 bytes of float32 before it: aligned to 8
    out = roundtrip_chunks(state, chunk_bytes=13, one_buffer=True)
    _assert_bit_identical(state, out)
    assert isinstance(out, ReceivedTensors)
    base = out.buffer.data_ptr()
    assert out.buffer.numel() == 15 * 4 + 7 * 4 + 4 * 8  # one allocation for the payload ...
    assert [out[k].data_ptr() - base for k in ("w", "b", "i")] == [0, 60, 88]  # ... that every tensor views
    out.buffer[88] += 1  # the int64's lowest byte: the view sees the buffer change
    assert int(out["i"][0]) == int(state["i"][0]) + 1
    odd = {"w": torch.randn(3, generator=g), "i": torch.arange(2, dtype=torch.int64)}  # int64 at offset 12
    got = roundtrip_chunks(odd, chunk_bytes=5, one_buffer=True)
    _assert_bit_identical(odd, got)
    assert got["w"].untyped_storage().data_ptr() != got["i"].untyped_storage().data_ptr()


def test_received_tensors_are_views_made_when_asked_and_the_float32_run_needs_none() -> None:
    """The one-buffer receiver hands out a mapping over its buffer: a tensor's view is made on first access (and
    kept), iteration is in manifest order, and the float32 run of named tensors is read off the manifest's layout:
    back to back float32 in the order named (empty tensors anywhere), else None."""
    g = torch.Generator().manual_seed(9)
    state = {"a": torch.randn(4, 4, generator=g), "e": torch.empty(0), "b": torch.randn(6, generator=g),
             "i": torch.arange(3, dtype=torch.int64), "c": torch.randn(2, generator=g)}  # i at byte 88: aligned
    got = roundtrip_chunks(state, chunk_bytes=11, one_buffer=True)
    assert isinstance(got, ReceivedTensors) and list(got) == list(state) and len(got) == 5
    run = got.float32_run(("a", "e", "b"))
    assert run is not None and run.dtype == torch.float32 and run.shape == (22,)
    assert got._made == {}  # the run made no per-tensor view
    assert _bits(run) == _bits(torch.cat([state["a"].reshape(-1), state["b"]]))
    assert run.data_ptr() == got.buffer.data_ptr()
    assert got.float32_run(("b", "a")) is None  # not in payload order
    assert got.float32_run(("a", "b", "c")) is None  # the int64 tensor lies between b and c
    assert got.float32_run(("a", "i")) is None  # not float32
    assert got.float32_run(("a", "nope")) is None
    assert got.float32_run(("c",)) is not None
    _assert_bit_identical(state, got)
    assert got["a"] is got["a"] and got["a"].data_ptr() == got.buffer.data_ptr()
    with pytest.raises(KeyError):
        got["nope"]
    # The layout remembers at most 16 name lists, whatever a caller asks.
    for k in range(40):
        got.float32_run(("a",) * (k + 1))
    assert len(got._layout.runs) <= 16


@pytest.mark.parametrize("is_delta", [False, True])
def test_a_consumed_float32_upload_becomes_the_update_without_a_second_copy(is_delta: bool) -> None:
    """Item 4's second half: the server's upload of a float32 model arrives in one buffer, and u_i is computed in
    that buffer (no second [P] vector), bit for bit what the copying path computes."""
    from fedserver.global_models import GlobalModels

    g = torch.Generator().manual_seed(7)
    init = {"0.weight": torch.randn(40, 6, generator=g), "0.bias": torch.randn(40, generator=g),
            "empty": torch.empty(0), "1.weight": torch.randn(3, 40, generator=g)}
    models = GlobalModels(init)
    sent = {k: v + torch.randn(v.shape, generator=g) for k, v in init.items()}
    want = models.flatten_update(roundtrip_chunks(sent), is_delta)  # the copying path
    received = roundtrip_chunks(sent, chunk_bytes=97, one_buffer=True)
    got = models.flatten_update(received, is_delta, consume=True)
    assert _bits(got) == _bits(want) and got.shape == (models.num_params,)
    assert got.data_ptr() == received["0.weight"].data_ptr()  # the received buffer itself
    assert _bits(models.get()["0.weight"]) == _bits(init["0.weight"])  # the global model is untouched
    # Not consumed, or not one float32 run (per-tensor buffers, a float64 tensor): a new vector, same bits.
    again = roundtrip_chunks(sent, chunk_bytes=97, one_buffer=True)
    kept = models.flatten_update(again, is_delta)
    assert kept.data_ptr() != again["0.weight"].data_ptr() and _bits(kept) == _bits(want)
    apart = roundtrip_chunks(sent, chunk_bytes=97)
    assert models.flatten_update(apart, is_delta, consume=True).data_ptr() != apart["0.weight"].data_ptr()
    mixed = GlobalModels({**init, "d": torch.randn(2, generator=g, dtype=torch.float64)})
    upd = roundtrip_chunks({**sent, "d": torch.randn(2, generator=g, dtype=torch.float64)}, one_buffer=True)
    flat = mixed.flatten_update(upd, is_delta, consume=True)
    assert flat.data_ptr() != upd["0.weight"].data_ptr() and flat.shape == (mixed.num_params,)
