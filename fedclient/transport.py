"""The client's connection to the server: TLS by default (mutual TLS with a client certificate), plaintext only
with an explicit ``insecure`` and a loud warning, and every request signed when the client has an enrolled
Ed25519 key (:mod:`fedguard.signing`).

Requests are serialized here, once: the bytes that are signed are the bytes that are sent (the channel's
multi-callables take bytes as they are). A signed update's header carries the SHA-256 of its tensor bytes, so
signing the header binds the chunks too.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedclient.stream import SessionStream
from fedcore.config import ClientConfig, ConfigError
from fedcore.serialization import Payload
from fedguard import wire
from fedguard.signing import sign_request
from fedguard.v1 import fedguard_pb2 as pb

SERVICE_NAME = "fedguard.v1.Federation"
MAX_MESSAGE_BYTES = 64 << 20
# The client pings its connection this often and fails its calls when a ping goes unanswered this long.
KEEPALIVE_S = 30
KEEPALIVE_TIMEOUT_S = 10

# gRPC's sync API waits for a reply (or the next message of a stream) in slices of
# grpc._common.MAXIMUM_WAIT_TIMEOUT (0.1 s) "so that signal handlers run": every blocked call wakes its thread ten
# times a second for nothing, which for 1,000 idle virtual clients parked in their long-polls is 10,000 wake-ups
# a second (a quarter of a core). The waits are on condition variables that gRPC notifies when a reply, a message
# or the call's end arrives, and on POSIX a timed lock acquisition is interrupted by signals (handlers run at
# once), so a longer slice changes no behaviour, only the idle wake-ups. Deadlines are unaffected (a wait never
# sleeps past its own timeout).
IDLE_WAIT_SLICE_S = 60.0
if getattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", IDLE_WAIT_SLICE_S) < IDLE_WAIT_SLICE_S:
    setattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", IDLE_WAIT_SLICE_S)  # noqa: B010 (a private module's constant)
_REPLIES: dict[str, Any] = {"Join": pb.JoinReply, "Heartbeat": pb.HeartbeatReply, "Leave": pb.LeaveReply,
            "GetStatus": pb.StatusReply, "SecureAggregate": pb.SecAggReply}


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror}") from None


class Refused(Exception):
    """The server (or this client's own configuration) refuses this client for good: retrying cannot help.
    ``check`` names the failing check (unknown CA, expired certificate, hostname mismatch, client certificate
    required, revoked, bad token, clock skew, ...); the message is one line for the operator."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check


def check_own_certificate(pem: bytes, path: str, now: float | None = None) -> None:
    """Refuse locally, before connecting, a client certificate that is expired or not yet valid."""
    import datetime as dt

    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise ConfigError("cert", f"{path}: not a PEM certificate") from None
    t = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC)
    if cert.not_valid_after_utc < t:
        raise Refused("expired certificate", f"this client's certificate {path} expired on "
                                             f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; issue a new one "
                                             "(fedguard-certs client)")
    if cert.not_valid_before_utc > t:
        raise Refused("certificate not yet valid", f"this client's certificate {path} is valid only from "
                                                   f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (check this "
                                                   "machine's clock)")


# What gRPC's UNAVAILABLE details say when the TLS handshake failed, and the check each names. A server that is
# simply down says "Connection refused" / "Failed to connect" / "Deadline Exceeded" and is retried.
_HANDSHAKE = (
    ("Hostname Verification Check failed", "hostname mismatch",
     "the server's certificate does not name the address dialled (--server, or --server-name to check another "
     "name)"),
    ("certificate has expired", "expired certificate", "the server's certificate has expired"),
    ("certificate is not yet valid", "certificate not yet valid",
     "the server's certificate is not valid yet (check the clocks)"),
    ("unable to get local issuer certificate", "unknown CA",
     "the server's certificate is not signed by a CA this client trusts (--ca-cert)"),
    ("self signed certificate", "unknown CA",
     "the server's certificate is not signed by a CA this client trusts (--ca-cert)"),
    ("CERTIFICATE_VERIFY_FAILED", "server certificate not verified", "the server's certificate did not verify"),
    ("WRONG_VERSION_NUMBER", "TLS against a plaintext server",
     "the server does not speak TLS (it runs --insecure); this client uses TLS"),
)


def classify_unavailable(details: str, tls: bool, has_client_cert: bool) -> tuple[Refused | None, bool]:
    """(the refusal an UNAVAILABLE error's ``details`` names, whether it is certain); (None, False) for a server
    that is down or unreachable. A TLS connection the server closes during the handshake ("Socket closed") is
    the server refusing this client's certificate (or its absence); it is counted as such only when it repeats,
    since a server shutting down closes sockets too."""
    for needle, check, text in _HANDSHAKE:
        if needle in details:
            return Refused(check, f"TLS handshake refused: {text}"), True
    if tls and "Socket closed" in details and "failed to connect" in details:
        if not has_client_cert:
            return Refused("client certificate required", "the server closed the TLS handshake: it requires a "
                                                          "client certificate (mutual TLS); give --cert and "
                                                          "--key"), False
        return Refused("client certificate refused", "the server closed the TLS handshake: it does not accept "
                                                     "this client's certificate (not signed by its client CA, "
                                                     "expired, or revoked)"), False
    return None, False


# What a TLS handshake attempt tells of the peer: the OpenSSL reasons a plaintext peer causes.
_NOT_TLS = ("WRONG_VERSION_NUMBER", "record layer failure", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG")
PROBE_TIMEOUT_S = 1.0


def speaks_tls(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the peer at ``host:port`` answers a TLS handshake: True when it does (the handshake completes, or
    the peer refuses it with a TLS alert: it requires a client certificate, say), False when it answers in plaintext,
    None when it cannot tell (unreachable, closed without a word, too slow). Nothing is verified, nothing the peer
    sends is kept or used: the connection is closed at once. For a plaintext client whose calls fail with "Socket
    closed" (:func:`plaintext_mismatch`)."""
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw, server_hostname=host.strip("[]") or None):
            return True
    except ssl.SSLError as e:
        text = f"{e.reason or ''} {e}"
        if any(needle in text for needle in _NOT_TLS):
            return False
        return True if "ALERT" in text.upper() else None
    except (OSError, ValueError):
        return None


def plaintext_mismatch(details: str, address: str) -> Refused | None:
    """The refusal to give a plaintext (``insecure``) client whose call failed with ``details`` (UNAVAILABLE) when
    the server at ``address`` speaks TLS; None when it does not, or when that cannot be told."""
    if not any(needle in details for needle in ("Socket closed", "Connection reset", "failed to connect")):
        return None
    if speaks_tls(address) is not True:
        return None
    return Refused("plaintext against a TLS server", f"the server at {address} speaks TLS and this client runs "
                                                     "--insecure (plaintext): drop --insecure and give --ca-cert "
                                                     "(the CA that signed the server's certificate)")


def classify_unauthenticated(details: str) -> Refused:
    """The check a refused authentication (UNAUTHENTICATED / PERMISSION_DENIED at join) names."""
    d = details.lower()
    if "revoked" in d:
        return Refused("revoked", details)
    if "bad join token" in d:
        return Refused("bad token", "the server refused the join token (--token-file, FEDGUARD_TOKEN)")
    if "the server's clock" in d or "too old for the replay window" in d:
        return Refused("clock skew", details)
    if "signature" in d or "enrolled" in d:
        return Refused("bad signature", details)
    if "certificate" in d:
        return Refused("client certificate refused", details)
    return Refused("authentication refused", details)


def channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials:
    root = _read(config.ca_cert, "ca_cert") if config.ca_cert else None
    key = _read(config.key, "key") if config.key else None
    cert = _read(config.cert, "cert") if config.cert else None
    if cert is not None:
        check_own_certificate(cert, config.cert)
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)


_warned_insecure: set[str] = set()
_warn_lock = threading.Lock()


def _first_insecure(server: str) -> bool:
    """True the first time this process opens a plaintext channel to ``server``: the warning is said once per
    process (a host of 1,000 virtual clients prints it once, not 1,000 times)."""
    with _warn_lock:
        if server in _warned_insecure:
            return False
        _warned_insecure.add(server)
        return True


def open_channel(config: ClientConfig, log: Any = None) -> grpc.Channel:
    opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0),
                                   # A server that stops answering pings (gone without closing the connection)
                                   # fails the client's calls within 40 s, not after its long-poll's deadline.
                                   ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
                                   ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000)]
    if config.insecure:
        if log is not None and _first_insecure(config.server):
            log.warning("security.insecure", server=config.server,
                        warning="PLAINTEXT gRPC: anyone on the network path can read and alter the model and "
                                "this client's updates, or play the server. Use --ca-cert (TLS).")
        return grpc.insecure_channel(config.server, options=opts)
    if config.server_name:
        opts.append(("grpc.ssl_target_name_override", config.server_name))
    return grpc.secure_channel(config.server, channel_credentials(config), options=opts)


def _keep_thread(channel: grpc.Channel) -> Any:
    """A standing Watch on the server's health service for the channel's lifetime. It keeps one call open on the
    channel, so gRPC's sync client keeps its completion-queue thread instead of starting a new one for every call
    (~2 ms each); the call is returned for cancelling."""
    health = health_pb2_grpc.HealthStub(channel)
    return health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))


class ChannelPool:
    """Channels shared by the clients of one process (a host of virtual clients, ``fedlaunch worker``): one channel,
    one standing call and one gRPC completion-queue thread per distinct (server, TLS settings) instead of one per
    client. On the wire nothing changes (gRPC already shares one connection among a process's channels to the same
    target); in the process each virtual client costs one thread instead of two, which is what lets 10,000 of them
    fit under the machine's thread limit (``kernel.pid_max`` 32,768 here). A client with its own certificate (mTLS)
    is given a channel of its own, as its credentials are its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[tuple[str, ...], tuple[grpc.Channel, Any, int]] = {}

    @staticmethod
    def _key(config: ClientConfig) -> tuple[str, ...] | None:
        if config.cert or config.key:
            return None
        return (config.server, str(config.insecure), config.ca_cert, config.server_name)

    def acquire(self, config: ClientConfig, log: Any = None) -> tuple[grpc.Channel, bool]:
        """A channel for ``config``; True when it is shared (give it back with :meth:`release`)."""
        key = self._key(config)
        if key is None:
            return open_channel(config, log), False
        with self._lock:
            held = self._shared.get(key)
            if held is None:
                channel = open_channel(config, log)
                held = (channel, _keep_thread(channel), 0)
            self._shared[key] = (held[0], held[1], held[2] + 1)
            return held[0], True

    def release(self, channel: grpc.Channel) -> None:
        """One client is done with a shared ``channel``: the last one closes it."""
        with self._lock:
            for key, (held, watch, refs) in list(self._shared.items()):
                if held is channel:
                    if refs > 1:
                        self._shared[key] = (held, watch, refs - 1)
                        return
                    del self._shared[key]
                    break
            else:
                return
        watch.cancel()
        channel.close()


def update_frames(header: pb.UpdateHeader, payload: Payload | bytes | bytearray | memoryview, chunk_bytes: int,
                  message: type[pb.UpdateMessage] | type[pb.SessionRequest], inline: bool = False,
                  then_pull: pb.PullTaskRequest | None = None,
                  pushed_with_answer: bool = False, signed: bool = False) -> tuple[bytes, Iterator[bytes]]:
    """An update as ``message`` frames: the header and the chunks, sent from the payload's own storage (each byte
    copied once, into its frame). ``signed``: the header (what a signed request's signature covers) is given the
    payload's SHA-256, which binds the chunks to it (``UpdateHeader.payload_sha256``, which the server requires of a
    signed update and checks whenever present); an unsigned update goes without (the transport's own integrity -- TCP,
    TLS -- covers its bytes as it covers the header's; the hash cost each side ~10 us of an 18 KB update).
    ``inline`` (the server reads ``UpdateHeader.data``): an update that fits one chunk rides in its header, and no
    chunks follow. ``then_pull`` (a ``SessionRequest`` only): the pull that goes with the update
    (``SessionRequest.then_pull``); ``pushed_with_answer``: its answer acknowledges the update
    (``SessionRequest.pushed_with_answer``)."""
    if signed:
        header.payload_sha256 = payload.sha256() if isinstance(payload, Payload) else hashlib.sha256(payload).digest()
    chunks: Iterator[bytes] = iter(())
    if inline and wire.fits_inline(header.ByteSize(), len(payload), chunk_bytes):
        header.data = payload.tobytes() if isinstance(payload, Payload) else bytes(payload)
    else:
        chunks = wire.chunk_frame_bytes(payload, message, chunk_bytes)
    if then_pull is not None:
        if message is not pb.SessionRequest:
            raise ValueError("then_pull goes with a Session stream's update only")
        return pb.SessionRequest(header=header, then_pull=then_pull,
                                 pushed_with_answer=pushed_with_answer).SerializeToString(), chunks
    if pushed_with_answer:
        raise ValueError("pushed_with_answer goes with then_pull only")
    return message(header=header).SerializeToString(), chunks


class Transport:
    """One channel and the federation's calls over it, each request signed when a signing key is set. With a
    :class:`ChannelPool`, the channel is the pool's (shared with the process's other clients)."""

    def __init__(self, config: ClientConfig, client_id: str, log: Any = None,
                 channels: ChannelPool | None = None) -> None:
        self.client_id = client_id
        self._key = None
        if config.signing_key:
            from fedguard.certs import CertError, load_signing_key

            try:
                self._key = load_signing_key(config.signing_key)
            except CertError as e:
                raise ConfigError("signing_key", str(e)) from None
        self._pool = channels
        if channels is not None:
            self.channel, shared = channels.acquire(config, log)
            if not shared:
                self._pool = None
        else:
            self.channel = open_channel(config, log)
        self._unary = {name: self.channel.unary_unary(self.path(name), None, reply.FromString)
                       for name, reply in _REPLIES.items()}
        # PullTask's replies stay bytes: the runner reads chunk frames in place (fedguard.wire.read_chunk).
        self._pull = self.channel.unary_stream(self.path("PullTask"), None, None)
        self._push = self.channel.stream_unary(self.path("PushUpdate"), None, pb.PushReply.FromString)
        self._session = self.channel.stream_stream(self.path("Session"), None, None)  # bytes both ways
        # A channel of its own keeps its completion-queue thread with its own standing call (a pool's has one).
        self._health_watch = _keep_thread(self.channel) if self._pool is None else None

    @staticmethod
    def path(name: str) -> str:
        return f"/{SERVICE_NAME}/{name}"

    def _metadata(self, name: str, body: bytes) -> list[tuple[str, str]] | None:
        if self._key is None:
            return None
        return sign_request(self._key, self.client_id, self.path(name), body, time.time())

    def future(self, name: str, request: Any, timeout: float) -> Any:
        """Start a unary call (Join, Heartbeat, Leave, GetStatus); a future of its reply."""
        body = request.SerializeToString()
        return self._unary[name].future(body, timeout=timeout, metadata=self._metadata(name, body))

    def call(self, name: str, request: Any, timeout: float) -> Any:
        return self.future(name, request, timeout).result()

    def pull(self, request: pb.PullTaskRequest, timeout: float) -> Any:
        """Start a PullTask call: an iterator of serialized TaskMessages (bytes) that can be cancelled."""
        body = request.SerializeToString()
        return self._pull(body, timeout=timeout, metadata=self._metadata("PullTask", body))

    def push(self, header: pb.UpdateHeader, payload: Payload | bytes | bytearray | memoryview, chunk_bytes: int,
             timeout: float, inline: bool = False) -> Any:
        """Start a PushUpdate: the header (with the payload's SHA-256 when signed) then the chunks; a future of the
        reply. A :class:`Payload` is sent from the tensors' own storage (each byte copied once, into its frame)."""
        first, chunks = update_frames(header, payload, chunk_bytes, pb.UpdateMessage, inline, signed=self.signs)

        def frames() -> Iterator[bytes]:
            yield first
            yield from chunks

        return self._push.future(frames(), timeout=timeout, metadata=self._metadata("PushUpdate", first))

    def sign_advertisement(self, message: bytes) -> bytes:
        """A secure-aggregation key advertisement's signature: by the enrolled signing key, else empty (the
        authenticated session binds the keys to this client; docs/security.md)."""
        return b"" if self._key is None else bytes(self._key.sign(message))

    @property
    def signs(self) -> bool:
        """Whether requests are signed (the Session stream does not carry signatures)."""
        return self._key is not None

    def open_session(self) -> SessionStream:
        """Start a ``Session`` call (:mod:`fedclient.stream`)."""
        return SessionStream(self._session)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.release(self.channel)
            self._pool = None
            return
        if self._health_watch is not None:
            self._health_watch.cancel()
        self.channel.close()
