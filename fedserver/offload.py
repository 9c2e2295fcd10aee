"""Where a round close's blocking steps run: a worker thread, or the event loop itself when the step is short.

A round's close aggregates, completes its report and persists the round (:mod:`fedserver.round_close`). For a large
model or a slow disk those steps take milliseconds to seconds, and on the event loop they would hold every
heartbeat, poll and upload of the fleet meanwhile: they run on a worker thread (``asyncio.to_thread``). For a small
model they take a few hundred microseconds, and the thread's hop costs as much again on the round's critical path:
the worker's wake-up, the GIL handed over and back, the loop's wake-up when the result is in, each a scheduling
delay on a busy machine (``tools/bench/bench_rounds.py``'s ``aggregation`` and ``snapshot`` phases, against the same
work timed in place).

:class:`Offload` decides per step from the step's own last duration: a step whose last run took at most
:data:`INLINE_S` runs on the loop, any other (and every step's first run) on a worker thread. A step that grows
(a bigger history, a disk that slows down) goes back to the thread the round after one slow run. Either way the
same function runs on the same inputs, one step at a time, so what a close computes does not depend on where it
ran; only when the loop answers its other callers does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# A step whose last run took at most this long runs on the event loop: the loop's other callers wait at most about
# this long, once a round, and the round saves a thread hop (two wake-ups) per step.
INLINE_S = 0.002


class Offload:
    """Runs a named blocking step on a worker thread, or on the loop when its last run was short (module
    docstring). ``clock``: a monotonic clock in seconds (a test's fake one)."""

    def __init__(self, inline_s: float = INLINE_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inline_s = inline_s
        self._clock = clock
        self._seconds: dict[str, float] = {}  # each step's last run, its own time (not the hop's)

    def last_seconds(self, step: str) -> float | None:
        """How long ``step``'s last run took (None: it has not run)."""
        return self._seconds.get(step)

    def inline(self, step: str) -> bool:
        """Whether ``step``'s next run is on the event loop."""
        last = self._seconds.get(step)
        return last is not None and last <= self.inline_s

    async def run(self, step: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, on the loop or a worker thread (:meth:`inline`); its duration is recorded either way,
        also when it raises."""
        if self.inline(step):
            return self._timed(step, fn, *args)
        return await asyncio.to_thread(self._timed, step, fn, *args)

    def _timed(self, step: str, fn: Callable[..., T], *args: Any) -> T:
        start = self._clock()
        try:
            return fn(*args)
        finally:
            self._seconds[step] = self._clock() - start
