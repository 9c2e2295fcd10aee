"""A time limit on each of one task's waits, with one timer for all of them (the waits of a stream for its next
message).

``async with asyncio.timeout(s)`` around every wait makes a ``Timeout``, arms a loop timer, runs two coroutines and
disarms the timer: about 4 µs a wait on uvloop, two waits per client-round on the server (a stream's next message and
a parked long-poll), 4–7 % of its CPU per client-round at 500 @ K = 50 (``tools/bench/bench_rounds.py``, two
federations at once with and without them). :class:`IdleLimit` keeps one timer per task and moves it only when it fires:
a wait records its deadline (a clock read and a store); the timer, when it fires before the current wait's deadline (it
was armed for an earlier wait), re-arms itself for that deadline; when it fires with no wait in progress it stops. It
cancels the task only when a wait outlives its deadline, and undoes its cancel request as ``asyncio.timeout`` does
(``Task.uncancel``), so a cancel of the task from elsewhere still propagates::

    limit = IdleLimit()             # in the task whose waits it limits
    limit.start(seconds)
    try:
        item = await next_message()
    except asyncio.CancelledError:
        if limit.stop():            # this limit's cancel: the wait took too long
            raise TimeoutError from None
        raise
    finally:
        limit.stop()
    ...
    limit.close()                   # when the task is done with it: its timer is disarmed

A wait is idle only while the loop could have read what it waits for. A timer that fires :data:`LATE_S` or more
after its due time finds a loop that was held up (a long callback, a process starved of CPU or memory): what the
peer sent meanwhile sits unread in the socket or in the transport's queue, and uvloop (libuv) runs due timers
*before* it polls for I/O, so cancelling then would refuse a peer for the server's own stall. The wait's deadline
moves on by the time the timer was late instead (at most the limit itself, at most :data:`MAX_MOVES` times a wait):
a peer that is truly silent is cancelled once the loop has been running for the whole limit, and a wait outlives its
limit by at most ``MAX_MOVES`` limits however starved the loop is. Seen on a 2-core host at a load average of 13-57: 35
uploads of one SecAgg+ round cancelled at the same instant after a ~30-s stall of the server's loop, their data
waiting to be read (docs/reliability.md, "A server that stalls").
"""

from __future__ import annotations

import asyncio

# A timer this late (seconds past its due time) means the loop itself was held up (module docstring).
LATE_S = 0.25
MAX_MOVES = 3


class IdleLimit:
    """One task's waits, each limited to the seconds given to :meth:`start` (module docstring)."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("IdleLimit() outside a task")
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._when: float | None = None  # the deadline of the wait in progress (loop time), None between waits
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the armed timer is due (loop time)
        self._seconds = 0.0  # the limit of the wait in progress
        self._moves = 0  # how often its deadline moved on for a stall
        self.stalls = 0  # deadlines moved on because the loop was held up (for tests and logs)
        self._cancelling = 0  # the task's cancel requests when the wait began (others are not this limit's)
        self._expiring = False  # this limit cancelled the task, and the wait has not seen it yet

    def start(self, seconds: float) -> None:
        """A wait of at most ``seconds`` begins (the task awaits next)."""
        when = self._loop.time() + seconds
        self._when = when
        self._seconds = seconds
        self._moves = 0
        self._cancelling = self._task.cancelling()
        handle = self._handle
        if handle is None or handle.when() > when:  # none armed, or armed too late for this wait
            if handle is not None:
                handle.cancel()
            self._arm(when)

    def stop(self) -> bool:
        """The wait ended. True when this limit cancelled it and no other cancel request came meanwhile: the task's
        cancel request is withdrawn and the caller raises the timeout's error instead of the CancelledError. A second
        call is False."""
        self._when = None
        if not self._expiring:
            return False
        self._expiring = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        """No more waits: the timer is disarmed."""
        self._when = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, when: float) -> None:
        self._due = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        when = self._when
        if when is None:  # no wait in progress: the next one arms the timer again
            return
        now = self._loop.time()
        if now < when:  # armed for an earlier wait that ended: on to this one's deadline
            self._arm(when)
            return
        late = now - self._due
        if late >= LATE_S and self._moves < MAX_MOVES:  # the loop was held up: what the peer sent meanwhile is
            self._moves += 1                             # read before the limit counts it
            self.stalls += 1
            self._when = max(when + min(late, self._seconds), now + LATE_S)
            self._arm(self._when)
            return
        self._expiring = True
        self._task.cancel()
