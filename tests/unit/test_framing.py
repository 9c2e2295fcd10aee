"""The framed Session transport's format (fedguard.framing): frames out of a byte stream cut anywhere, the bound
checked on a frame's header before anything is buffered for it, the preamble, status frames."""

from __future__ import annotations

import random

import grpc
import pytest

from fedguard import framing


def _stream(payloads: list[tuple[int, bytes]], magic: bytes = framing.MAGIC) -> bytes:
    return magic + b"".join(framing.frame_header(k, len(p)) + p for k, p in payloads)


def test_frames_come_out_whole_however_the_stream_is_cut() -> None:
    rng = random.Random(7)
    payloads = [(framing.MESSAGE, bytes(rng.randrange(256) for _ in range(n))) for n in (0, 1, 5, 300, 70_000)]
    payloads.append((framing.STATUS, b"\x03bad"))
    data = _stream(payloads)
    for cuts in ([1] * 20, [3, 7, 2], [len(data)], [framing.HEADER_BYTES + 4] * 3):
        reader = framing.FrameReader(1 << 20)
        pos, got, total = 0, [], 0
        steps = iter(cuts)
        while pos < len(data):
            n = next(steps, rng.randrange(1, 9000))
            total += reader.feed(data[pos:pos + n])
            pos += n
            got.extend(reader.frames)
            reader.frames.clear()
        assert got == payloads
        assert total == sum(len(p) for _, p in payloads)
        assert reader.pending == 0


def test_a_frame_over_the_bound_is_refused_on_its_header() -> None:
    reader = framing.FrameReader(1000)
    with pytest.raises(framing.FrameError) as e:
        reader.feed(framing.MAGIC + framing.frame_header(framing.MESSAGE, 1001))  # no payload sent at all
    assert e.value.code == "RESOURCE_EXHAUSTED" and "1001 bytes" in str(e.value) and "1000" in str(e.value)
    reader = framing.FrameReader(1000, magic=b"")  # the fast path (one whole frame per piece) checks it too
    with pytest.raises(framing.FrameError):
        reader.feed(framing.frame_header(framing.MESSAGE, 1001) + bytes(1001))
    assert not reader.frames


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\n", b"PRI * HTTP/2.0\r\n", b"F", b"FGS2"])
def test_anything_but_the_preamble_is_refused(data: bytes) -> None:
    reader = framing.FrameReader(1 << 20)
    if data == b"F":  # a prefix of the preamble is waited on
        assert reader.feed(data) == 0 and not reader.frames
        data = b"X"
    with pytest.raises(framing.FrameError) as e:
        reader.feed(data)
    assert e.value.code == "INVALID_ARGUMENT" and "bad preamble" in str(e.value)


def test_an_unknown_frame_kind_is_refused() -> None:
    with pytest.raises(framing.FrameError, match="unknown frame kind 7"):
        framing.FrameReader(100).feed(framing.MAGIC + framing.frame_header(7, 0))


def test_a_status_frame_round_trips_and_is_bounded() -> None:
    frame = framing.status_frame("PERMISSION_DENIED", "this session belongs to another client")
    reader = framing.FrameReader(1 << 20, magic=b"")
    reader.feed(frame)
    kind, payload = reader.frames.popleft()
    assert kind == framing.STATUS
    assert framing.parse_status(payload) == ("PERMISSION_DENIED", "this session belongs to another client")
    long = framing.status_frame("INTERNAL", "x" * 5000)
    assert len(long) == framing.HEADER_BYTES + 1 + framing.MAX_DETAILS
    assert framing.parse_status(b"\xff?") == ("UNKNOWN", "?")
    assert framing.parse_status(b"")[0] == "UNKNOWN"
    # The numbers are gRPC's own.
    assert [c.name for c in sorted(grpc.StatusCode, key=lambda c: c.value[0])] == list(framing.CODES)


def test_both_ends_tune_their_sockets_alike() -> None:
    import socket

    with socket.socket() as sock:
        framing.tune_socket(sock)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        for option, value in framing.KEEPALIVE:
            if hasattr(socket, option):
                assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, option)) == value
