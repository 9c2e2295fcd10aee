"""The client's connection (fedclient.connection) without a server: retries, refusals, stops, heartbeats."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from fedclient.connection import Connection
from fedclient.errors import FedClientError, FedClientRefused, SessionLost, Stopped
from fedclient.heartbeats import HEARTBEATS, Heartbeats
from fedcore.config import ClientConfig
from fedcore.log import get_logger


class RpcError(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _conn(**cfg: Any) -> tuple[Connection, list[float]]:
    retries: list[float] = []
    conn = Connection(ClientConfig(insecure=True, **cfg), "c0", get_logger("test"), threading.Event(),
                      on_retry=lambda: retries.append(1.0))
    slept: list[float] = []
    conn.sleep = slept.append  # type: ignore[method-assign,assignment]
    return conn, slept


def _failing(*errors: grpc.RpcError) -> Any:
    left = list(errors)

    def fn() -> str:
        if left:
            raise left.pop(0)
        return "ok"

    return fn


def test_transient_errors_are_retried_with_backoff_and_counted() -> None:
    conn, slept = _conn(backoff_initial_s=0.5, backoff_max_s=1.0)
    fn = _failing(RpcError(grpc.StatusCode.UNAVAILABLE, "Connection refused"),
                  RpcError(grpc.StatusCode.DEADLINE_EXCEEDED), RpcError(grpc.StatusCode.UNAVAILABLE))
    assert conn.retrying("pull", fn) == "ok"
    assert len(slept) == 3 and 0 <= slept[0] <= 0.5 and all(0 <= s <= 1.0 for s in slept)


def test_a_lost_session_a_refusal_and_a_non_retryable_error() -> None:
    conn, _ = _conn()
    with pytest.raises(SessionLost):
        conn.retrying("pull", _failing(RpcError(grpc.StatusCode.UNAUTHENTICATED, "unknown session")))
    with pytest.raises(FedClientRefused, match="bad token"):
        conn.retrying("join", _failing(RpcError(grpc.StatusCode.UNAUTHENTICATED, "bad join token")))
    with pytest.raises(FedClientRefused, match="unknown CA"):
        conn.retrying("join", _failing(RpcError(grpc.StatusCode.UNAVAILABLE,
                                                "unable to get local issuer certificate")))
    with pytest.raises(RpcError):
        conn.retrying("push", _failing(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad tensor")))


def test_a_server_unreachable_too_long_is_given_up() -> None:
    conn, slept = _conn(give_up_after_s=1e-6)
    fn = _failing(*[RpcError(grpc.StatusCode.UNAVAILABLE, "Connection refused")] * 5)
    with pytest.raises(FedClientError, match=r"unreachable for 0 s \(pull: .*UNAVAILABLE: Connection refused\)"):
        conn.retrying("pull", fn)
    assert 1 <= len(slept) < 5  # the first failure starts the clock; given up before the calls ran out


def test_resending_an_unacknowledged_update_backs_off_and_gives_up() -> None:
    """An update whose acknowledgement never comes (the stream broke, the server went away) is sent again: each
    resend waits the retry backoff (a server that is gone is not hammered: thousands of resends a second before),
    an answer ends the row, and a row longer than give_up_after_s gives up, naming the last error."""
    conn, slept = _conn(backoff_initial_s=0.5, backoff_max_s=2.0, give_up_after_s=60.0)
    for _ in range(7):
        conn.resend_pause("resend", "StatusCode.UNAVAILABLE: Socket closed")
    # the first resend of a row goes at once (a stream replaced); the next six wait
    assert len(slept) == 6 and all(0 <= s <= 2.0 for s in slept) and sum(slept) > 0
    conn.resend_done()
    conn.resend_pause("resend", "StatusCode.UNAVAILABLE: Socket closed")
    assert len(slept) == 6  # a new row: its first resend at once again
    conn.resend_pause("resend", "StatusCode.UNAVAILABLE: Socket closed")
    assert 0 <= slept[-1] <= 0.5  # ... and its backoff starts from the initial one
    quick, _ = _conn(give_up_after_s=1e-6)
    quick.resend_pause("resend", "x")
    time.sleep(0.01)
    with pytest.raises(FedClientError, match=r"unreachable for 0 s \(resend: StatusCode.UNAVAILABLE: gone\)"):
        quick.resend_pause("resend", "StatusCode.UNAVAILABLE: gone")


def test_a_cancel_the_client_did_not_make_is_retried_its_own_stop_is_not() -> None:
    """gRPC cancels a few percent of first calls when thousands of channels connect at once: a device retries a
    CANCELLED it did not cause; a stopping client's own cancel ends the call (Stopped, no retry)."""
    conn, slept = _conn(backoff_initial_s=0.5, backoff_max_s=1.0)
    assert conn.retrying("join", _failing(RpcError(grpc.StatusCode.CANCELLED, "CANCELLED"))) == "ok"
    assert len(slept) == 1

    def cancelled_by_stop() -> str:
        conn.stop_event.set()  # what FedClient.stop does before it cancels the call in flight
        raise RpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    with pytest.raises(Stopped):
        conn.retrying("pull", cancelled_by_stop)
    assert len(slept) == 1


def test_a_stop_ends_the_retries() -> None:
    conn, _ = _conn()
    conn.stop_event.set()
    with pytest.raises(Stopped):
        conn.retrying("pull", _failing())


class _Beats:
    """A transport that records the heartbeats it is asked to send."""

    def __init__(self) -> None:
        self.at: list[float] = []

    def call(self, method: str, request: Any, timeout: float) -> Any:
        assert method == "Heartbeat" and request.session_id == "s1"
        self.at.append(time.monotonic())

    def close(self) -> None:
        pass


def test_keep_alive_beats_every_interval_inside_a_block_and_starts_no_thread_for_a_short_one() -> None:
    conn, _ = _conn()
    beats = _Beats()
    conn.transport, conn.session = beats, "s1"  # type: ignore[assignment]
    conn.set_heartbeat_interval(0.1)
    with conn.keep_alive():  # the process's heartbeat thread exists from here on
        pass
    threads, started = threading.active_count(), HEARTBEATS.beats_started
    for _ in range(50):  # short blocks (a round each): no thread, no beat
        with conn.keep_alive():
            assert threading.active_count() == threads
        time.sleep(0.002)
    assert HEARTBEATS.beats_started == started and beats.at == []
    began = time.monotonic()
    with conn.keep_alive(), conn.keep_alive():  # re-entrant: one client's beats, not two
        time.sleep(0.55)
    # Beats ~0.1 s apart from the block's start (a loaded machine may send one late, never early), one at a time.
    assert 2 <= len(beats.at) <= 5, [b - began for b in beats.at]
    assert all(b - began >= 0.1 * (i + 1) - 0.01 for i, b in enumerate(beats.at)), [b - began for b in beats.at]
    n = len(beats.at)
    time.sleep(0.3)  # after the block: silence
    assert len(beats.at) == n
    conn.set_heartbeat_interval(float("nan"))
    assert conn.heartbeat_s == 5.0
    conn.set_heartbeat_interval(0.01)
    assert conn.heartbeat_s == 0.1
    conn.set_heartbeat_interval(1e9)
    assert conn.heartbeat_s == 600.0


def test_the_inflight_call_is_the_one_cancelled() -> None:
    conn, _ = _conn()

    class Call:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    call = Call()
    with conn.inflight(call):
        conn.cancel_inflight()
    assert call.cancelled
    after = Call()
    conn.cancel_inflight()  # nothing in flight: nothing cancelled
    assert not after.cancelled


def test_a_channel_pool_shares_one_channel_among_a_hosts_clients() -> None:
    """A host's virtual clients share one channel (one completion-queue thread) per server and TLS settings; a
    client with its own certificate gets its own; the last client to leave closes the shared channel."""
    from fedclient.transport import ChannelPool, Transport

    pool = ChannelPool()
    cfg = ClientConfig(server="127.0.0.1:1", insecure=True)
    a, b = Transport(cfg, "a", channels=pool), Transport(cfg, "b", channels=pool)
    other = Transport(ClientConfig(server="127.0.0.1:2", insecure=True), "c", channels=pool)
    alone = Transport(cfg, "d")
    assert a.channel is b.channel and other.channel is not a.channel and alone.channel is not a.channel
    key = ("127.0.0.1:1", "True", "", "")
    assert pool._shared[key][2] == 2
    a.close()
    assert pool._shared[key][2] == 1
    b.close()
    assert key not in pool._shared
    with pytest.raises(ValueError):  # closed with its last client
        b.channel.unary_unary("/x/y")(b"", timeout=0.1)
    for t in (other, alone):
        t.close()
    assert ChannelPool._key(ClientConfig(server="s:1", ca_cert="ca.pem", cert="c.pem", key="c.key")) is None


def test_a_leave_after_the_end_is_waited_for_longer_than_one_on_a_stop() -> None:
    """After "finished" the Leave is the acknowledgement the server lingers for (up to LEAVE_TIMEOUT_S); a stop
    before the end keeps the short wait, so an app is not held up by a server that does not answer. A failed Leave
    forgets the session all the same."""
    from fedclient.connection import LEAVE_TIMEOUT_S, STOP_LEAVE_TIMEOUT_S

    class _Transport:
        def __init__(self) -> None:
            self.calls: list[tuple[str, float]] = []

        def call(self, name: str, request: Any, timeout: float) -> None:
            self.calls.append((name, timeout))
            raise RpcError(grpc.StatusCode.CANCELLED, "CANCELLED")

    conn, _ = _conn()
    transport = _Transport()
    conn.transport = transport  # type: ignore[assignment]
    conn.session = "s1"
    conn.leave(finished=True)
    conn.session = "s2"
    conn.leave()
    assert transport.calls == [("Leave", LEAVE_TIMEOUT_S), ("Leave", STOP_LEAVE_TIMEOUT_S)]
    assert LEAVE_TIMEOUT_S > STOP_LEAVE_TIMEOUT_S and conn.session == ""
    conn.leave()  # no session: nothing to say
    assert len(transport.calls) == 2


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_heartbeats_one_thread_for_every_block_a_beat_only_when_a_block_outlasts_its_interval() -> None:
    clock = _Clock()
    hb = Heartbeats(clock)
    sent: list[str] = []
    gate = threading.Event()

    def beat(name: str) -> Any:
        def send() -> None:
            sent.append(name)
            gate.wait(5.0)  # a beat that hangs
        return send

    with hb.armed(lambda: 1.0, beat("a")), hb.armed(lambda: 2.0, beat("b")):
        assert hb.beats_started == 0
        clock.t = 1.5  # a is due, b not yet
        with hb._cond:
            hb._cond.notify()
        _until(lambda: sent == ["a"])
        clock.t = 2.6  # a due again while its beat still hangs: not sent twice; b is due
        with hb._cond:
            hb._cond.notify()
        _until(lambda: sorted(sent) == ["a", "b"])
        time.sleep(0.05)
        assert sorted(sent) == ["a", "b"] and hb.beats_started == 2
        gate.set()
    clock.t = 10.0  # both blocks ended: nothing more is sent
    with hb._cond:
        hb._cond.notify()
    time.sleep(0.05)
    assert sorted(sent) == ["a", "b"] and hb._heap == []


def _until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()
