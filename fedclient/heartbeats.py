"""A process's heartbeats: one thread and a heap of due times for every client of the process.

A client tells the server it is alive while a block runs that keeps it from polling (training, the private model, a
straggler's delay: :meth:`fedclient.connection.Connection.keep_alive`). Most blocks are shorter than a heartbeat
interval (a round of a small model, a no-op trainer): such a block costs a heap entry and no thread at all, where a
thread started per block made every round wait until the new thread was scheduled, and a thread kept per client
made a host of 10,000 virtual clients hold 10,000 more threads (the process's thread limit; one round stalled ~40 s,
docs/benchmarks.md). A block that outlasts an interval gets its beat from a short-lived thread of its own (a beat
that hangs must not hold up another client's), and the next one an interval later; a beat still in flight is not
sent twice. The thread sleeps while nothing is due: an idle client has no thread that wakes.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class _Armed:
    beat: Callable[[], None]
    interval: Callable[[], float]
    in_flight: bool = False


class Heartbeats:
    """``armed(interval, beat)``: ``beat()`` every ``interval()`` seconds while the block runs (the first one an
    interval after it began)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, _Armed] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._sleeping_until = float("inf")  # when the thread wakes by itself (inf: only when notified)
        self.beats_started = 0  # beats sent, for tests and benchmarks

    @contextlib.contextmanager
    def armed(self, interval: Callable[[], float], beat: Callable[[], None]) -> Iterator[None]:
        with self._cond:
            key = next(self._ids)
            self._armed[key] = _Armed(beat, interval)
            due = self._clock() + interval()
            heapq.heappush(self._heap, (due, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fedclient-heartbeats", daemon=True)
                self._thread.start()
            elif due < self._sleeping_until:  # else the thread wakes before it is due and finds it
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                del self._armed[key]
                while self._heap and self._heap[0][1] not in self._armed:  # disarmed: no wake-up for it later
                    heapq.heappop(self._heap)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._sleeping_until = float("inf")
                    self._cond.wait()
                    continue
                due, key = self._heap[0]
                wait = due - self._clock()
                if wait > 0:
                    self._sleeping_until = due
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                armed = self._armed[key]
                heapq.heappush(self._heap, (self._clock() + armed.interval(), key))
                if armed.in_flight:
                    continue
                armed.in_flight = True
                self.beats_started += 1
                threading.Thread(target=self._send, args=(armed,), name="fedclient-heartbeat", daemon=True).start()

    def _send(self, armed: _Armed) -> None:
        try:
            armed.beat()
        finally:
            with self._cond:
                armed.in_flight = False


HEARTBEATS = Heartbeats()

__all__ = ["HEARTBEATS", "Heartbeats"]
