"""The client's Session-stream parts that need no server: the watchdog that gives a stream's exchanges their
deadlines (one thread for a whole process) and the stream's request queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from fedclient.stream import SessionStream, StreamEnded, Watchdog


def test_the_watchdog_cancels_what_outlives_its_deadline_and_nothing_else() -> None:
    dog = Watchdog()
    fired: list[str] = []
    done = threading.Event()
    with dog.armed(0.05, lambda: (fired.append("late"), done.set())):
        assert done.wait(5)  # the block outlives 50 ms: cancelled
    with dog.armed(0.05, lambda: fired.append("disarmed")):
        pass  # over in time: never called
    early = threading.Event()
    with dog.armed(30.0, lambda: fired.append("far")), dog.armed(0.05, early.set):
        assert early.wait(5)  # an earlier deadline wakes the thread sleeping on a later one
    time.sleep(0.15)
    assert fired == ["late"]
    threads = [t for t in threading.enumerate() if t.name == "fedclient-watchdog"]
    assert len(threads) >= 1 and dog._thread in threads and not dog._armed


def test_many_clients_share_one_watchdog_thread() -> None:
    dog = Watchdog()
    before = threading.active_count()
    calls = []
    for i in range(200):
        with dog.armed(60.0, lambda i=i: calls.append(i)):
            pass
    assert threading.active_count() <= before + 1 and calls == []


class _FakeCall:
    """A stream-stream call: echoes each request until the request iterator ends; cancel ends it with CANCELLED."""

    def __init__(self, requests: Iterator[bytes]) -> None:
        self.requests = requests
        self.cancelled = False

    def __iter__(self) -> Iterator[bytes]:
        for r in self.requests:
            yield b"echo:" + r

    def cancel(self) -> None:
        self.cancelled = True


def test_a_stream_sends_what_is_queued_lazily_and_ends_when_the_server_does() -> None:
    made: list[int] = []

    def frames() -> Iterator[bytes]:
        for i in range(3):
            made.append(i)
            yield b"chunk%d" % i

    calls: list[Any] = []
    stream = SessionStream(lambda reqs: calls.append(_FakeCall(reqs)) or calls[-1])
    stream.send([b"header"])
    stream.send(frames())
    assert made == []  # the generator is drained by the call's consumer, not by send
    assert [stream.reply() for _ in range(4)] == [b"echo:header", b"echo:chunk0", b"echo:chunk1", b"echo:chunk2"]
    stream.cancel()  # ends the request iterator: the (fake) server ends the stream
    assert calls[0].cancelled and stream.broken
    with pytest.raises(StreamEnded) as e:
        stream.reply()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
