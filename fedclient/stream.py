"""The client's end of the ``Session`` stream: PullTask and PushUpdate as exchanges on one long-lived call.

A device's every round is two calls with the unary protocol (its long-poll and its upload), each with its own HTTP/2
stream, headers and status; on one ``Session`` call the same messages cost the server a fraction of that
(``tools/bench/bench_grpc_floor.py``: 0.15-0.21 ms of server CPU per client-round on one open stream vs 0.66-0.84 ms for
the two calls). :class:`SessionStream` is that call: requests are queued (gRPC's consumer thread sends them),
replies are read in order. Any error ends it (the server ends a stream with the status of a refusal); the
connection then opens a new one at the next exchange.

A sync stream's reads have no deadline of their own: :data:`WATCHDOG` (one thread per process, whatever the number
of clients) cancels an exchange that outlives its limit, as the unary calls' timeouts did.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import grpc


class Exchanges(Protocol):
    """A Session stream as the client's round uses it, whatever carries it: gRPC's ``Session`` call
    (:class:`SessionStream`) or the framed transport (:class:`fedclient.framed.FramedSession`)."""

    broken: bool
    pull_pending: bool

    def send(self, frames: Iterable[bytes]) -> None: ...

    def reply(self) -> bytes: ...

    def cancel(self) -> None: ...


class StreamEnded(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    """The server closed the stream without an error status, or answered out of turn: the exchange is retried on
    a new stream."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class SessionStream:
    """One ``Session`` call. ``method``: the channel's stream-stream callable (bytes in, bytes out)."""

    def __init__(self, method: Any) -> None:
        self._requests: queue.SimpleQueue[Iterable[bytes] | None] = queue.SimpleQueue()
        self.call = method(self._frames())
        self._replies: Iterator[bytes] = iter(self.call)
        self.broken = False
        # A pull went with the last update (SessionRequest.then_pull): its answer is the next reply.
        self.pull_pending = False

    def _frames(self) -> Iterator[bytes]:
        """The request stream gRPC's consumer thread sends: what :meth:`send` queued, each iterable taken lazily
        (an update's chunk frames are made as gRPC's flow control asks for them, not all at once)."""
        while (frames := self._requests.get()) is not None:
            yield from frames

    def send(self, frames: Iterable[bytes]) -> None:
        """Queue ``frames`` (a list, or a generator the consumer thread drains; its source must not change until
        the exchange's reply is read)."""
        self._requests.put(frames)

    def reply(self) -> bytes:
        """The next reply (raises the call's :class:`grpc.RpcError`, or :class:`StreamEnded`)."""
        try:
            return next(self._replies)
        except StopIteration:
            self.broken = True
            raise StreamEnded("the server ended the session stream") from None
        except grpc.RpcError:
            self.broken = True
            raise

    def cancel(self) -> None:
        self.broken = True
        self._requests.put(None)  # the request iterator ends: gRPC's consumer thread returns
        self.call.cancel()


class Watchdog:
    """Cancels what outlives its deadline: one thread and a heap of deadlines for all of a process's clients."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def armed(self, seconds: float, cancel: Callable[[], None]) -> Iterator[None]:
        """``cancel`` is called if the block still runs after ``seconds``."""
        with self._cond:
            key = next(self._ids)
            self._armed[key] = cancel
            heapq.heappush(self._heap, (self._clock() + seconds, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fedclient-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == key:
                self._cond.notify()  # an earlier deadline than the one the thread sleeps on
        try:
            yield
        finally:
            with self._cond:
                self._armed.pop(key, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # disarmed
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - self._clock()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, key = heapq.heappop(self._heap)
                cancel = self._armed.pop(key)
                self._cond.release()
                try:
                    with contextlib.suppress(Exception):
                        cancel()
                finally:
                    self._cond.acquire()


WATCHDOG = Watchdog()

__all__ = ["WATCHDOG", "Exchanges", "SessionStream", "StreamEnded", "Watchdog"]
