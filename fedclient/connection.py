"""The client's link to the server above :class:`fedclient.transport.Transport`: the session, retries with
exponential backoff and full jitter, the one call in flight that :meth:`FedClient.stop` cancels, heartbeats while
the device works, and leaving.

Kept apart from the round logic so that every protocol step (join, pull, decline, push) gets the same answers to
"is this error worth a retry?", "is the server refusing this client for good?" and "did the app ask to stop?".
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from fedclient.errors import FedClientError, FedClientRefused, SessionLost, Stopped
from fedclient.framed import FramedError, FramedSession
from fedclient.heartbeats import HEARTBEATS
from fedclient.stream import WATCHDOG, Exchanges
from fedclient.transport import (
    ChannelPool,
    Refused,
    Transport,
    classify_unauthenticated,
    classify_unavailable,
    plaintext_mismatch,
    speaks_tls,
)
from fedcore.config import ClientConfig, ConfigError
from fedcore.identity import shorten
from fedguard.v1 import fedguard_pb2 as pb

# CANCELLED is among them because the client's own cancel (a stop) never gets here (``retrying`` raises Stopped
# first): a CANCELLED it did not cause comes from the transport, e.g. gRPC cancels a few percent of calls when
# thousands of channels connect at once (tools/bench/bench_rounds.py --clients 3000: 40 of 3,000 joins; a bare grpc.aio
# server flooded with 1,000 new channels per process cancels 1-4 % of their first calls), and a device retries it.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}

# The longest a client waits for its Leave to be taken once the federation finished (the Leave then acknowledges
# "finished"): a server telling ten thousand clients at once takes seconds to get through their Leaves, and it lingers
# for them (a server that is gone fails the call at once). Any other Leave (a stop, a vanished device's host ending)
# waits STOP_LEAVE_TIMEOUT_S: an app that stops its client is not kept waiting by a server that does not answer.
LEAVE_TIMEOUT_S = 10.0
STOP_LEAVE_TIMEOUT_S = 2.0

# A handshake the server closes without naming the check ("Socket closed") counts as a refusal when it happens
# this many times in a row (a server shutting down closes sockets too).
HANDSHAKE_CLOSED_REPEATS = 3

T = TypeVar("T")


class Backoff:
    """Exponential backoff with full jitter: sleep U(0, min(max, initial·2^attempt))."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial, self.maximum = initial, maximum
        self.attempt = 0
        self.rng = rng or random.Random()

    def next_delay(self) -> float:
        cap = min(self.maximum, self.initial * (2 ** self.attempt))
        self.attempt += 1
        return self.rng.uniform(0, cap)

    def reset(self) -> None:
        self.attempt = 0


class Connection:
    """One client's connection: :meth:`open` it when the client runs, :meth:`close` it when it ends.

    ``stop``: the event :meth:`FedClient.stop` sets (every wait here ends with :class:`Stopped` when it is set);
    ``on_retry``: called once per retried call (the client counts its reconnects)."""

    def __init__(self, config: ClientConfig, client_id: str, log: Any, stop: threading.Event,
                 on_retry: Callable[[], None] = lambda: None) -> None:
        self.config, self.client_id, self.log = config, client_id, log
        self.stop_event = stop
        self.on_retry = on_retry
        self.transport: Transport | None = None
        # Set by a host of virtual clients before the client starts: the process's shared channels.
        self.channels: ChannelPool | None = None
        self.session = ""
        self.heartbeat_s = 5.0
        # Seeded by the client id: a fleet's clients do not retry in lockstep, and a client's delays repeat.
        self.rng = random.Random(client_id)
        self._call_lock = threading.Lock()
        self._inflight: Any = None
        self._alive_depth = 0
        # The Session stream (pulls and pushes as exchanges on one call), unless configured off, the requests are
        # signed, or the server has none for this client. Opened once the client's first poll is answered (a task,
        # or a wait at the end of its long-poll): a host of thousands of virtual clients does not open thousands of
        # streams, each with a thread of gRPC's, while they join (+40 % join time on 2 cores, docs/benchmarks.md).
        self._stream: Exchanges | None = None
        self._stream_off = not config.session_stream
        self._stream_wanted = False
        # The server's framed Session port (announced at join; 0: none), unless configured off or found unreachable
        # since the last join.
        self._framed_port = 0
        # Resending an update whose acknowledgement never came (the connection broke): backed off as any retried
        # call, and given up after give_up_after_s of failures in a row (resend_pause, resend_done).
        self._resend_backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, self.rng)
        self._resend_since: float | None = None

    # ---- lifecycle ----

    def open(self) -> Transport:
        try:
            self.transport = Transport(self.config, self.client_id, self.log, self.channels)
        except ConfigError as e:
            raise FedClientError(str(e)) from None
        except Refused as e:  # checked locally before connecting (this client's own certificate)
            raise FedClientRefused(e) from None
        return self.transport

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self.transport is not None:
            self.transport.close()

    def require(self) -> Transport:
        if self.transport is None:
            raise FedClientError("not connected: the client is not running")
        return self.transport

    def leave(self, finished: bool = False) -> None:
        """Tell the server this client leaves (best effort); forget the session. After the federation ``finished``
        it is the client's acknowledgement, waited for up to :data:`LEAVE_TIMEOUT_S` (the server lingers until every
        client's Leave arrived, ``fedserver.app.linger``); otherwise up to :data:`STOP_LEAVE_TIMEOUT_S`."""
        if not self.session or self.transport is None:
            return
        try:
            self.transport.call("Leave", pb.LeaveRequest(session_id=self.session, reason="done"),
                                timeout=LEAVE_TIMEOUT_S if finished else STOP_LEAVE_TIMEOUT_S)
        except grpc.RpcError as e:  # after the end the server lingers for it, then names it in linger_ended
            self.log.info("client.leave_failed", client_id=self.client_id, code=str(e.code()),
                          details=shorten(str(e.details()), 200))
        self.session = ""

    def set_heartbeat_interval(self, seconds: float) -> None:
        """The server's heartbeat interval, bounded to [0.1, 600] s (5 s when it says nothing usable)."""
        self.heartbeat_s = min(max(seconds, 0.1), 600.0) if math.isfinite(seconds) and seconds > 0 else 5.0

    # ---- the Session stream ----

    def want_stream(self) -> None:
        """The client's first poll was answered: exchange on the Session stream from now on (where it is used)."""
        self._stream_wanted = True

    def set_framed_port(self, port: int) -> None:
        """The framed Session port the server announced at (re-)join (0: none); a port that could not be reached
        before is tried again."""
        self._framed_port = port if self.config.framed_session and 0 < port < 65536 else 0

    def stream(self) -> Exchanges | None:
        """The Session stream to exchange on (opened at first use and after an error), or None: the unary calls.
        On the server's framed port when it announced one and it can be reached, else on gRPC."""
        transport = self.require()
        if self._stream_off or not self._stream_wanted or transport.signs:
            return None
        if self._stream is None or self._stream.broken:
            self._stream = self._open_framed() or transport.open_session()
        return self._stream

    def _open_framed(self) -> FramedSession | None:
        if not self._framed_port:
            return None
        started = time.monotonic()
        try:
            return FramedSession.connect(self.config, self._framed_port)
        except (OSError, FramedError) as e:  # ssl.SSLError is an OSError
            # Unreachable (a firewall, a proxy in between, a server that stopped): gRPC's Session stream until the
            # next join announces the port again. A refusal of this client's credentials is gRPC's to say.
            # ``seconds``: what finding out cost (a refused port: at once; one that drops or answers nothing: the
            # connect timeout, fedclient.framed.CONNECT_TIMEOUT_S), once per join.
            self.log.warning("client.framed_off", client_id=self.client_id, port=self._framed_port,
                             reason=shorten(f"{type(e).__name__}: {e}", 300),
                             seconds=round(time.monotonic() - started, 3),
                             using="the gRPC Session stream until the next join")
            self._framed_port = 0
            return None

    def pull_pending(self) -> bool:
        """Whether the client's next pull is already on its way (sent with its last update)."""
        return self._stream is not None and not self._stream.broken and self._stream.pull_pending

    def stream_refused(self, e: grpc.RpcError) -> bool:
        """Whether ``e`` says the server has no Session stream for this client (a server that predates it, or one
        that requires signed requests); the unary calls are used from then on."""
        code = e.code() if hasattr(e, "code") else None
        details = str(e.details() if hasattr(e, "details") else "") or ""
        if code == grpc.StatusCode.UNIMPLEMENTED or (code == grpc.StatusCode.FAILED_PRECONDITION
                                                     and "signed requests" in details):
            self._stream_off = True
            self.log.info("client.session_stream_off", client_id=self.client_id, code=str(code),
                          reason=shorten(details, 200))
            return True
        return False

    @contextlib.contextmanager
    def exchange(self, stream: Exchanges, seconds: float) -> Iterator[Exchanges]:
        """One exchange on ``stream``: :meth:`cancel_inflight` (a stop) cancels it, as does a deadline of
        ``seconds``; an exchange that does not complete leaves the stream in no known state: it is ended."""
        with self.inflight(stream), WATCHDOG.armed(seconds, stream.cancel):
            try:
                yield stream
            except BaseException:
                stream.cancel()
                raise

    # ---- waiting and stopping ----

    def check_stop(self) -> None:
        if self.stop_event.is_set():
            raise Stopped

    def sleep(self, seconds: float) -> None:
        """Sleep unless stopped first (then :class:`Stopped`)."""
        if self.stop_event.wait(seconds):
            raise Stopped

    def cancel_inflight(self) -> None:
        with self._call_lock:
            if self._inflight is not None:
                self._inflight.cancel()

    @contextlib.contextmanager
    def inflight(self, call: Any) -> Iterator[Any]:
        """``call`` is the one :meth:`cancel_inflight` cancels while the block runs."""
        with self._call_lock:
            self._inflight = call
        try:
            yield call
        finally:
            with self._call_lock:
                self._inflight = None

    def tracked(self, fut: Any) -> Any:
        """Wait for a call's future that :meth:`cancel_inflight` can cancel."""
        with self.inflight(fut):
            return fut.result()

    # ---- retries ----

    def retrying(self, what: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` until it succeeds, backing off on transient errors; raises after give_up_after_s.

        UNAUTHENTICATED after the join is a lost session (:class:`SessionLost`: join again); at the join, and
        PERMISSION_DENIED anywhere, it is a refusal for good, as is a TLS handshake the server refuses
        (:class:`FedClientRefused`)."""
        cfg = self.config
        backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, self.rng)
        first_failure: float | None = None
        closed_handshakes = 0
        probed_tls = False
        while True:
            self.check_stop()
            try:
                return fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if self.stop_event.is_set():
                    raise Stopped from None
                details = str(e.details() if hasattr(e, "details") else "") or ""
                if code == grpc.StatusCode.UNAUTHENTICATED and what != "join":
                    raise SessionLost from None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise FedClientRefused(classify_unauthenticated(shorten(details, 300))) from None
                if code == grpc.StatusCode.UNAVAILABLE and cfg.insecure and not probed_tls:
                    probed_tls = True  # once per call: a plaintext client against a TLS server is refused for good
                    mismatch = plaintext_mismatch(details, cfg.server)
                    if mismatch is not None:
                        raise FedClientRefused(mismatch) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    refused, certain = classify_unavailable(details, not cfg.insecure, bool(cfg.cert))
                    if refused is not None and not certain and speaks_tls(cfg.server) is not True:
                        # Closed before any TLS was spoken: a proxy or load balancer whose server is not there
                        # (yet), an outage to retry, not this client's certificate refused.
                        refused = None
                    closed_handshakes = closed_handshakes + 1 if refused is not None else 0
                    if refused is not None and (certain or closed_handshakes >= HANDSHAKE_CLOSED_REPEATS):
                        raise FedClientRefused(refused) from None
                if code not in RETRYABLE:
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                if cfg.give_up_after_s and now - first_failure > cfg.give_up_after_s:
                    # The last error's details say why.
                    raise FedClientError(f"server {cfg.server} unreachable for {cfg.give_up_after_s:.0f} s "
                                         f"({what}: {code}: {shorten(details, 300)})") from None
                delay = backoff.next_delay()
                self.on_retry()
                self.log.info("client.retrying", client_id=self.client_id, call=what, code=str(code),
                              delay_s=round(delay, 3))
                self.sleep(delay)

    def resend_pause(self, what: str, details: str) -> None:
        """Wait before sending again what got no answer (an update whose acknowledgement did not come): the first
        resend of a row at once, each further one after the same backoff as a retried call (and counted as one), so
        a server that is gone is not hammered; raises :class:`FedClientError` once ``give_up_after_s`` has passed
        since the first of these failures in a row (:meth:`resend_done` ends a row)."""
        cfg = self.config
        now = time.monotonic()
        if self._resend_since is None:  # the first of a row goes at once (a stream replaced, not a failure yet)
            self._resend_since = now
            return
        if cfg.give_up_after_s and now - self._resend_since > cfg.give_up_after_s:
            raise FedClientError(f"server {cfg.server} unreachable for {cfg.give_up_after_s:.0f} s ({what}: "
                                 f"{shorten(details, 300)})")
        self.on_retry()
        self.sleep(self._resend_backoff.next_delay())

    def resend_done(self) -> None:
        """What was sent again got its answer: the next failure starts a new row."""
        self._resend_since = None
        self._resend_backoff.reset()

    # ---- liveness ----

    @contextlib.contextmanager
    def keep_alive(self) -> Iterator[None]:
        """While the block runs (training, the private model, a straggler's delay), tell the server every heartbeat
        interval that the client is alive. Nothing runs outside it: an idle client's liveness is the long-poll it
        holds (the server counts a parked poll as contact), so no thread wakes while the client waits for work.
        Re-entrant: a block inside another shares its heartbeats (a client mod may keep the device alive around the
        round that keeps it alive itself). The beats come from the process's :data:`fedclient.heartbeats.HEARTBEATS`:
        a block shorter than an interval starts no thread."""
        self._alive_depth += 1
        if self._alive_depth > 1:
            try:
                yield
            finally:
                self._alive_depth -= 1
            return
        try:
            with HEARTBEATS.armed(lambda: self.heartbeat_s, self._beat):
                yield
        finally:
            self._alive_depth -= 1

    def _beat(self) -> None:
        session, transport = self.session, self.transport
        if session and transport is not None and not self.stop_event.is_set():
            # A closed channel (the client ending meanwhile) raises ValueError, not an RpcError.
            with contextlib.suppress(grpc.RpcError, ValueError):
                transport.call("Heartbeat", pb.HeartbeatRequest(session_id=session), timeout=5.0)


__all__ = ["HANDSHAKE_CLOSED_REPEATS", "LEAVE_TIMEOUT_S", "RETRYABLE", "STOP_LEAVE_TIMEOUT_S", "Backoff",
           "Connection"]
