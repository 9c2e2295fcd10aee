"""The client's end of the framed Session transport (:mod:`fedguard.framing`): the ``Session`` stream's exchanges
on one TCP (or TLS) connection to the port the server announced at join, on the host the client dialled.

:class:`FramedSession` is a drop-in for :class:`fedclient.stream.SessionStream`: ``send`` writes the frames on the
calling thread (no consumer thread, no gRPC completion queue), ``reply`` reads the next one, ``cancel`` shuts the
socket (which wakes a blocked read: the watchdog's deadline and a stop work as on gRPC). Errors are
:class:`grpc.RpcError` with gRPC's status codes: the server's STATUS frame as it sent it, a connection that fails
or ends without one as UNAVAILABLE, a cancel as CANCELLED; the connection's retries and refusals read them as they
read gRPC's.

TLS verifies the server as gRPC does: the CA of ``ca_cert`` (else the system's roots), the host name of ``server``
(or ``server_name``), the client certificate with mutual TLS.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Iterable
from typing import Any

import grpc

from fedcore.config import ClientConfig
from fedguard import framing

# The largest frame a client accepts from a server (a task's chunk is at most server.max_message_bytes, which the
# gRPC channel bounds at the same 64 MiB).
MAX_FRAME_BYTES = 64 << 20
CONNECT_TIMEOUT_S = 5.0
# Frames up to this size are sent with their header in one write; larger ones as two.
JOIN_BELOW = 256 << 10
RECV_BYTES = 256 << 10


class FramedError(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    """The framed stream's end: ``code()`` a :class:`grpc.StatusCode`, ``details()`` the reason."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self._code = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def client_ssl_context(config: ClientConfig) -> ssl.SSLContext:
    """TLS as the gRPC channel's: the server verified against ``ca_cert`` (else the system's roots) and its host
    name; this client's certificate for mutual TLS."""
    ctx = ssl.create_default_context(cafile=config.ca_cert or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if config.cert:
        ctx.load_cert_chain(config.cert, config.key or None)
    return ctx


# The device's side of a framed connection notices a dead path sooner than the server's KEEPALIVE (a minute): a
# device that changed networks (its old address gone, no reset ever coming) is blocked in a read of its parked pull;
# probes after 15 s idle, 5 s apart, 3 of them, and unacknowledged data given up after 30 s: it reconnects within
# about 30 s, as gRPC's channel does with its keepalive pings (fedclient.transport: 30 s, 10 s to answer). Probes
# are answered by the server's kernel: no wake-up of its event loop.
CLIENT_KEEPALIVE = (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
CLIENT_USER_TIMEOUT_MS = 30_000


def tighten_keepalive(sock: socket.socket) -> None:
    """:data:`CLIENT_KEEPALIVE` and :data:`CLIENT_USER_TIMEOUT_MS` where the platform has them."""
    with contextlib.suppress(OSError, AttributeError):
        for option, value in CLIENT_KEEPALIVE:
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, CLIENT_USER_TIMEOUT_MS)


def server_host(config: ClientConfig) -> str:
    """The host part of ``server`` (``host:port``, ``[v6]:port``)."""
    return config.server.rpartition(":")[0].strip("[]")


class FramedSession:
    """One framed connection carrying a client's Session exchanges (see the module's docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = framing.FrameReader(MAX_FRAME_BYTES)
        self._lock = threading.Lock()
        self.broken = False
        self.cancelled = False
        # A pull went with the last update (SessionRequest.then_pull): its answer is the next reply.
        self.pull_pending = False

    @classmethod
    def connect(cls, config: ClientConfig, port: int, timeout: float = CONNECT_TIMEOUT_S) -> FramedSession:
        """Open the connection to ``port`` on ``server``'s host (raises :class:`OSError` / :class:`ssl.SSLError`
        when it cannot be reached or its TLS does not verify, :class:`FramedError` when it is not a framed port)."""
        host = server_host(config)
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            framing.tune_socket(sock)  # keepalive: a server gone is noticed between exchanges too
            tighten_keepalive(sock)
            if not config.insecure:
                sock = client_ssl_context(config).wrap_socket(sock, server_hostname=config.server_name or host)
            sock.sendall(framing.MAGIC)
            session = cls(sock)
            session._preamble()
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)  # reads block until a reply, the watchdog's cancel, or the connection's end
        return session

    def _preamble(self) -> None:
        got = b""
        while len(got) < len(framing.MAGIC):
            more = self._sock.recv(len(framing.MAGIC) - len(got))
            if not more:
                raise FramedError("UNAVAILABLE", "the framed port closed the connection before its preamble")
            got += more
        if got != framing.MAGIC:
            raise FramedError("UNAVAILABLE", "the server's framed port is not a fedguard framed session")
        self._reader = framing.FrameReader(MAX_FRAME_BYTES, magic=b"")

    def send(self, frames: Iterable[bytes]) -> None:
        """Write ``frames`` (SessionRequest bytes) now, on this thread."""
        try:
            for data in frames:
                n = len(data)
                if n < JOIN_BELOW:
                    self._sock.sendall(framing.frame_header(framing.MESSAGE, n) + data)
                else:
                    self._sock.sendall(framing.frame_header(framing.MESSAGE, n))
                    self._sock.sendall(data)
        except (OSError, ValueError) as e:
            # A server that refused mid-upload has sent its status and closed: read it, else say the connection broke.
            raise self._failure(f"the framed connection failed while sending: {e}") from None

    def reply(self) -> bytes:
        """The next reply (raises :class:`FramedError`)."""
        frames = self._reader.frames
        while not frames:
            try:
                data = self._sock.recv(RECV_BYTES)
            except (OSError, ValueError) as e:
                raise self._failure(f"the framed connection failed: {e}") from None
            if not data:
                raise self._failure("the server closed the framed connection")
            try:
                self._reader.feed(data)
            except framing.FrameError as e:
                self.cancel()
                raise FramedError("INTERNAL", f"the server broke the framed format: {e}") from None
        kind, payload = frames.popleft()
        if kind == framing.STATUS:
            self.broken = True
            code, details = framing.parse_status(payload)
            self._close()
            if code == "OK":
                raise FramedError("UNAVAILABLE", "the server ended the session stream")
            raise FramedError(code, details)
        return payload

    def _failure(self, what: str) -> FramedError:
        """The error for a connection that broke: CANCELLED after :meth:`cancel`, the server's status where it sent
        one before closing, else UNAVAILABLE."""
        self.broken = True
        if self.cancelled:
            return FramedError("CANCELLED", "the exchange was cancelled (deadline or stop)")
        with contextlib.suppress(OSError, ValueError, framing.FrameError):
            self._sock.settimeout(0.5)
            while True:
                for kind, payload in self._reader.frames:
                    if kind == framing.STATUS:
                        self._close()
                        return FramedError(*framing.parse_status(payload))
                self._reader.frames.clear()
                data = self._sock.recv(RECV_BYTES)
                if not data:
                    break
                self._reader.feed(data)
        self._close()
        return FramedError("UNAVAILABLE", what)

    def cancel(self) -> None:
        """End the stream now (any thread): a blocked read returns, the next call fails CANCELLED."""
        self.cancelled = True
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._close()

    def _close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> FramedSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


__all__ = ["FramedError", "FramedSession", "client_ssl_context", "server_host"]
