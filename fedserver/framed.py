"""The framed Session transport's server: the ``Session`` stream on connections the event loop serves itself
(:mod:`fedguard.framing`), beside gRPC, with ``server.framed_address``.

Every connection runs :meth:`fedserver.servicer.FederationServicer.Session`, the very handler of the gRPC stream,
with the same checks (the session's owner, the identity of a mutual-TLS certificate, revocation, bounds, limits,
idle time); only the transport differs: TLS from Python's ``ssl`` with the server's certificate and client CA,
frames bounded by ``server.max_message_bytes`` before anything is buffered for them, reading paused while a
connection's unread frames pass a bound, a refusal sent as a STATUS frame (the status gRPC would send) before the
connection closes. A connection that goes away cancels its handler, as a cancelled gRPC call does (a parked
long-poll stops counting as the device's contact).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
from asyncio.sslproto import SSLProtocol  # asyncio's TLS layer, the one create_server(ssl=...) uses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn, cast

from fedcore.config import ConfigError, ServerConfig
from fedcore.identity import shorten
from fedguard import framing
from fedguard.v1 import fedguard_pb2 as pb
from fedserver.corelog import check_named
from fedserver.servicer import FederationServicer, Incoming, _decoder, _serialize_task

# A connection's frames received and not yet read by its handler: reading pauses above this many bytes (and at
# least one whole frame), and resumes once the handler has read them.
READ_AHEAD_BYTES = 1 << 20
# After its STATUS frame a refused connection is read (and discarded) this long before it is closed, so the client
# reads the status instead of a reset (closing with unread data in the socket resets the connection).
LINGER_S = 2.0


# ``server.framed_address`` that asks for the framed port beside ``server.address``: its host, on its port + 1 (port 0:
# a free one as well); "" turns the framed port off.
AUTO = "auto"
# How the refusals name the ways out (``check_port_free``, :meth:`FramedServer.start`).
WAYS_OUT = ('pick another with --framed-address HOST:PORT (port 0 picks a free one), or turn the framed port off '
            'with --framed-address "" (server.framed_address = "": clients then use gRPC\'s Session stream)')


def framed_address(config: ServerConfig) -> str:
    """The ``host:port`` the framed port binds, or "" when it is off: ``server.framed_address`` as it is, or for
    ``"auto"`` the host of ``server.address`` on the port after its (``8470`` -> ``8471``; ``0``, a free port, ->
    ``0``, a free port too). A :class:`ConfigError` naming the field when ``auto`` has no port to derive."""
    value = config.server.framed_address
    if value != AUTO:
        return value
    host, _, port_s = config.server.address.rpartition(":")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError("server.framed_address", f'"auto" derives the port from server.address, which has none: '
                                                   f"{config.server.address!r}") from None
    if port >= 65535:
        raise ConfigError("server.framed_address", f'"auto" is server.address\'s port + 1, and {port} + 1 is no '
                                                   f"port; {WAYS_OUT}")
    return f"{host}:{port + 1 if port else 0}"


class Aborted(Exception):
    """A refusal the handler made (``context.abort``): the connection's STATUS frame."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def peer_string(peername: Any) -> str:
    """gRPC's form of a peer address (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``), which the refusal log and the
    per-address join bounds read."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    return str(peername or "")[:64]


def auth_context_of(der: bytes | None) -> dict[str, list[bytes]]:
    """gRPC's auth context of a verified peer certificate (what :mod:`fedserver.auth` reads): the subject
    alternative names, the common name and the PEM certificate. Empty without a certificate."""
    if not der:
        return {}
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding
    from cryptography.x509.oid import NameOID

    cert = x509.load_der_x509_certificate(der)
    out: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"],
                                   "x509_pem_cert": [cert.public_bytes(Encoding.PEM)]}
    with contextlib.suppress(x509.ExtensionNotFound):
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        out["x509_subject_alternative_name"] = [str(name.value).encode() for name in san]
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if cns:
        out["x509_common_name"] = [str(cns[0].value).encode()]
    return out


class FramedContext:
    """What the servicer reads of a call's context (gRPC's ``ServicerContext``), for one framed connection."""

    def __init__(self, peer: str, ssl_object: Any) -> None:
        self._peer = peer
        self._ssl = ssl_object
        self._auth: dict[str, list[bytes]] | None = None

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        if self._auth is None:
            self._auth = auth_context_of(self._ssl.getpeercert(binary_form=True) if self._ssl is not None else None)
        return self._auth

    def invocation_metadata(self) -> tuple[()]:
        return ()  # no metadata: the Session stream does not carry signed requests

    async def abort(self, code: Any, details: str) -> NoReturn:
        raise Aborted(getattr(code, "name", str(code)), details)


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext:
    """The framed port's TLS: the server's certificate, and with ``security.client_ca`` a client certificate signed
    by it is required (mutual TLS), as on the gRPC port."""
    sec = config.security
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(sec.tls_cert, sec.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError("security.tls_cert", f"cannot load {sec.tls_cert} with {sec.tls_key}: {e}") from None
    if sec.client_ca:
        try:
            ctx.load_verify_locations(cafile=str(Path(sec.client_ca)))
        except (OSError, ssl.SSLError) as e:
            raise ConfigError("security.client_ca", f"cannot load {sec.client_ca}: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx



_DECODE = _decoder(pb.SessionRequest)


class _Connection(asyncio.Protocol):
    """One framed connection: its frames in, the Session handler's replies out."""

    def __init__(self, server: FramedServer) -> None:
        self.server = server
        self.reader = framing.FrameReader(server.max_frame)
        self.queued = 0  # bytes of frames received and not yet read by the handler
        self.eof = False
        self.closing = False
        self.waiter: asyncio.Future[None] | None = None
        self.drain: asyncio.Future[None] | None = None
        self.read_paused = False
        self.task: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = ""

    # ---- asyncio's callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The connection is open (with TLS: its handshake is done; :class:`_Handshake` logs a refused one)."""
        self.transport = t = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        framing.tune_socket(t.get_extra_info("socket"))
        self.peer = peer_string(t.get_extra_info("peername"))
        t.set_write_buffer_limits(high=READ_AHEAD_BYTES)
        t.write(framing.MAGIC)
        bound = self.server.config.server.framed_max_connections
        if len(self.server.connections) >= bound:
            self.fail("RESOURCE_EXHAUSTED", f"the framed port holds {bound} connections "
                                            "(server.framed_max_connections); retry later")
            return
        self.server.connections.add(self)
        self.context = FramedContext(self.peer, t.get_extra_info("ssl_object"))
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # a refused connection's remaining bytes, read so that it closes without a reset
        try:
            self.queued += self.reader.feed(data)
        except framing.FrameError as e:
            self.fail(e.code, str(e))
            return
        if self.reader.frames:
            self._wake()
        if self.queued + self.reader.pending > READ_AHEAD_BYTES and self.reader.frames and not self.read_paused:
            self.read_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # as gRPC cancels the call: a parked poll ends, an upload's reservation is freed
        self._wake()
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)

    def pause_writing(self) -> None:
        if self.drain is None or self.drain.done():
            self.drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # ---- the handler's side ----

    def __aiter__(self) -> AsyncIterator[Incoming]:
        return self

    async def __anext__(self) -> Incoming:
        frames = self.reader.frames
        while not frames:
            if self.eof:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        kind, data = frames.popleft()
        self.queued -= len(data)
        if self.read_paused and self.queued < READ_AHEAD_BYTES and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        if kind == framing.STATUS:  # the client is done with the stream
            self.eof = True
            raise StopAsyncIteration
        return _DECODE(data)

    async def _serve(self) -> None:
        code, details = "OK", ""
        replies = self.server.servicer.Session(self, self.context)
        try:
            async for reply in replies:
                data = _serialize_task(reply)
                assert self.transport is not None
                self.transport.writelines((framing.frame_header(framing.MESSAGE, len(data)), data))
                if self.drain is not None and not self.drain.done():
                    # A peer that stops reading holds its connection no longer than an idle one.
                    idle_s = self.server.config.server.stream_idle_timeout_s
                    try:
                        async with asyncio.timeout(idle_s):
                            await self.drain
                    except TimeoutError:
                        await replies.aclose()  # the handler's own clean-up runs now, not at garbage collection
                        self.refuse("DEADLINE_EXCEEDED", f"the client read nothing for {idle_s:g} s "
                                                         "(server.stream_idle_timeout_s)")
                        return
        except Aborted as e:
            code, details = e.code, e.details
        except asyncio.CancelledError:
            if self.server.stopping and not self.closing:  # the server is going away: the client comes back later
                self._end("UNAVAILABLE", "the server is shutting down; retry")
            return
        except Exception as e:  # a bug must not take the loop down with it; the client sees INTERNAL
            self.server.servicer.log.exception("framed.handler_failed", peer=self.peer,
                                               error=f"{type(e).__name__}: {e}")
            code, details = "INTERNAL", "the server failed this stream (its log says why)"
        self._end(code, details)

    def fail(self, code: str, details: str) -> None:
        """Refuse the connection from outside its handler (it broke the format, or the port is full): its handler
        ended, then :meth:`refuse`."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.refuse(code, details)

    def refuse(self, code: str, details: str) -> None:
        """Logged as ``rpc.refused`` (rate-limited), the status sent, the connection closed."""
        servicer = self.server.servicer
        servicer.refused += 1
        servicer.refusals.event("rpc.refused", self.peer, f"Session:{code}", method="Session", code=code,
                                reason=shorten(details, 300), transport="framed")
        self._end(code, details)

    def _end(self, code: str, details: str) -> None:
        """Send the stream's status and close (lingering while the client may still be sending)."""
        if self.closing or self.transport is None or self.transport.is_closing():
            return
        self.closing = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.transport.write(framing.status_frame(code, details))
        if code == "OK" or self.eof:
            self.transport.close()
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self._close_or_abort)

    def _close_or_abort(self) -> None:
        """The linger's end: closed, or reset if its peer still has not read what was written (a close would wait
        for that forever)."""
        t = self.transport
        if t is None:
            return
        if t.get_write_buffer_size():
            t.abort()
        elif not t.is_closing():
            t.close()


class _Handshake(SSLProtocol):
    """The TLS layer of one connection, in front of its :class:`_Connection` (asyncio's own, as
    ``create_server(ssl=...)`` uses; on uvloop too). Made here rather than by the loop so that a refused handshake
    is logged (``tls.handshake_refused``, with the check it failed and the peer's address): the loops' own TLS
    servers drop it silently."""

    def __init__(self, server: FramedServer, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        super().__init__(loop, _Connection(server), context, waiter, server_side=True,
                         ssl_handshake_timeout=max(1, math.ceil(server.config.server.stream_idle_timeout_s)))
        self.peer = ""
        self.refusals = server.servicer.refusals
        waiter.add_done_callback(self._done)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.peer = peer_string(transport.get_extra_info("peername"))
        framing.tune_socket(transport.get_extra_info("socket"))
        super().connection_made(transport)

    def _done(self, waiter: asyncio.Future[None]) -> None:
        e = None if waiter.cancelled() else waiter.exception()
        if e is None:
            return
        reason = check_named(str(e).encode()) or f"TLS handshake failed ({type(e).__name__}: {shorten(str(e), 160)})"
        self.refusals.event("tls.handshake_refused", self.peer, reason, reason=reason, source="framed port")


class FramedServer:
    """The framed port of one server: :meth:`start` it after the gRPC port, :meth:`close` it before."""

    def __init__(self, servicer: FederationServicer, config: ServerConfig) -> None:
        self.servicer = servicer
        self.config = config
        self.max_frame = config.server.max_message_bytes
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self.ssl = None if config.security.insecure else server_ssl_context(config)

    async def start(self) -> int:
        """Listen on ``server.framed_address`` (:func:`framed_address`); the port bound (a ``ConfigError`` naming the
        field otherwise)."""
        address = framed_address(self.config)
        host, _, port_s = address.rpartition(":")
        try:
            port = int(port_s)
        except ValueError:
            raise ConfigError("server.framed_address", f"{address!r} is not host:port") from None
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._protocol, host.strip("[]") or None, port, backlog=4096, reuse_address=True)
        except OSError as e:
            raise ConfigError("server.framed_address", f"cannot listen on {address}: {e.strerror or e}; "
                                                       f"{WAYS_OUT}") from None
        bound = int(self._server.sockets[0].getsockname()[1])
        self.servicer.framed_port = bound
        return bound

    def _protocol(self) -> asyncio.BaseProtocol:
        return _Connection(self) if self.ssl is None else _Handshake(self, self.ssl)

    async def close(self) -> None:
        """Stop accepting, and end every connection (its client is told UNAVAILABLE: retry)."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.task is not None and not conn.task.done():
                conn.task.cancel()
            else:
                conn._end("UNAVAILABLE", "the server is shutting down; retry")
        await asyncio.sleep(0)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()


__all__ = ["AUTO", "WAYS_OUT", "Aborted", "FramedContext", "FramedServer", "auth_context_of", "framed_address",
           "peer_string", "server_ssl_context"]
