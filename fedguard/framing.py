"""The framed Session transport's wire format: the ``Session`` stream's messages on a plain TCP (or TLS) connection,
served on the server's event loop thread instead of through gRPC's asyncio server.

Why it exists: gRPC's asyncio server hands every message to a poller thread of its own and back, and on the 2-core
VM waking that thread costs 15-46 µs of CPU each time: a quarter of the server's CPU per client-round
(docs/results/benchmark_history.md, "Under the profile"). The same round on a connection the event loop reads
itself costs the server 17-20 µs instead of 150-207 µs (``tools/bench/bench_grpc_floor.py``, the ``bare`` shape).

The format (both directions, after the preamble):

* the client opens with :data:`MAGIC`; the server answers with :data:`MAGIC` before anything else, so either end
  finds out at once that it reached something else (a gRPC port, an HTTP server);
* then frames: one byte of kind, four bytes of little-endian length, the payload. A :data:`MESSAGE` frame carries
  a serialized ``SessionRequest`` (client to server) or ``SessionReply`` (server to client), byte for byte what the
  gRPC ``Session`` stream carries; a :data:`STATUS` frame ends the stream: one byte of gRPC status code and the
  details in UTF-8 (server to client: the stream's status, as gRPC's trailers; client to server: the client is done).

A receiver bounds a frame's length before it allocates anything (:class:`FrameReader`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections import deque
from typing import Any

MAGIC = b"FGS1"
MESSAGE = 0
STATUS = 1
HEADER = struct.Struct("<BI")
HEADER_BYTES = HEADER.size
# The gRPC status codes by number (the STATUS frame's first byte), as grpc.StatusCode names them.
CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
         "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
         "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
MAX_DETAILS = 1000


# TCP keepalive of a framed connection, both ends: a peer gone without closing is noticed in about a minute.
KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


def tune_socket(sock: Any) -> None:
    """No Nagle delay (one frame is one write), and :data:`KEEPALIVE` where the platform has the options."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in KEEPALIVE:
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class FrameError(Exception):
    """A peer broke the format (a bad preamble, a frame over the bound, an unknown kind); ``code`` is the status the
    receiver answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame_header(kind: int, length: int) -> bytes:
    return HEADER.pack(kind, length)


def message_frame(payload: bytes) -> bytes:
    """One MESSAGE frame as one bytes object (small payloads; large ones go as header and payload)."""
    return HEADER.pack(MESSAGE, len(payload)) + payload


def status_frame(code: str, details: str) -> bytes:
    """A STATUS frame: ``code`` a gRPC status name, ``details`` cut to :data:`MAX_DETAILS` characters."""
    body = bytes([CODES.index(code)]) + details[:MAX_DETAILS].encode("utf-8", "replace")
    return HEADER.pack(STATUS, len(body)) + body


def parse_status(payload: bytes) -> tuple[str, str]:
    """(status name, details) of a STATUS frame's payload; an unknown code reads as UNKNOWN."""
    if not payload:
        return "UNKNOWN", "an empty status frame"
    code = CODES[payload[0]] if payload[0] < len(CODES) else "UNKNOWN"
    return code, payload[1:].decode("utf-8", "replace")


class FrameReader:
    """Frames out of a byte stream that arrives in pieces of any size: :meth:`feed` the pieces, take the complete
    frames from :attr:`frames` as (kind, payload). ``max_frame`` bounds a payload (checked on its header, before
    anything is buffered for it); ``magic``: the preamble expected first (empty: none)."""

    def __init__(self, max_frame: int, magic: bytes = MAGIC) -> None:
        self.max_frame = max_frame
        self.frames: deque[tuple[int, bytes]] = deque()
        self._buf = bytearray()
        self._magic = magic

    @property
    def pending(self) -> int:
        """Bytes received and not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> int:
        """Take ``data``; returns the payload bytes of the frames it completed (raises :class:`FrameError`)."""
        buf = self._buf
        if not buf and not self._magic and len(data) >= HEADER_BYTES:
            kind, n = HEADER.unpack_from(data)
            if len(data) == HEADER_BYTES + n:  # the common case: exactly one whole frame, no copy into the buffer
                self._check(kind, n)
                self.frames.append((kind, data[HEADER_BYTES:]))
                return int(n)
        buf += data
        if self._magic:
            if len(buf) < len(self._magic):
                if not self._magic.startswith(bytes(buf)):
                    raise FrameError("INVALID_ARGUMENT", "not a fedguard framed session (bad preamble)")
                return 0
            if not buf.startswith(self._magic):
                raise FrameError("INVALID_ARGUMENT", "not a fedguard framed session (bad preamble)")
            del buf[:len(self._magic)]
            self._magic = b""
        done = 0
        start = 0
        while len(buf) - start >= HEADER_BYTES:
            kind, n = HEADER.unpack_from(buf, start)
            self._check(kind, n)
            end = start + HEADER_BYTES + n
            if len(buf) < end:
                break
            self.frames.append((kind, bytes(buf[start + HEADER_BYTES:end])))
            done += n
            start = end
        if start:
            del buf[:start]
        return done

    def _check(self, kind: int, n: int) -> None:
        if kind not in (MESSAGE, STATUS):
            raise FrameError("INVALID_ARGUMENT", f"unknown frame kind {kind}")
        if n > self.max_frame:
            raise FrameError("RESOURCE_EXHAUSTED", f"a frame of {n} bytes is over this end's bound of "
                                                   f"{self.max_frame} bytes")


__all__ = ["CODES", "HEADER", "HEADER_BYTES", "KEEPALIVE", "MAGIC", "MESSAGE", "STATUS", "FrameError", "FrameReader",
           "frame_header", "message_frame", "parse_status", "status_frame", "tune_socket"]
