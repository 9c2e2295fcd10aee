"""A time limit on each of one task's waits, with one timer for all of them (the waits of a stream for its next
message).

``async with asyncio.timeout(s)`` around every wait makes a ``Timeout``, arms a loop timer, runs two coroutines and
disarms the timer: about 4 µs a wait on uvloop, two waits per client-round on the server (a stream's next message and
a parked long-poll), 4–7 % of its CPU per client-round at 500 @ K = 50 (``tools/bench_rounds.py``, two federations at
once with and without them). :class:`IdleLimit` keeps one timer per task and moves it only when it fires: a wait
records its deadline (a clock read and a store); the timer, when it fires before the current wait's deadline (it was
armed for an earlier wait), re-arms itself for that deadline; when it fires with no wait in progress it stops. It
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
"""

from __future__ import annotations

import asyncio


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
        self._cancelling = 0  # the task's cancel requests when the wait began (others are not this limit's)
        self._expiring = False  # this limit cancelled the task, and the wait has not seen it yet

    def start(self, seconds: float) -> None:
        """A wait of at most ``seconds`` begins (the task awaits next)."""
        when = self._loop.time() + seconds
        self._when = when
        self._cancelling = self._task.cancelling()
        handle = self._handle
        if handle is None or handle.when() > when:  # none armed, or armed too late for this wait
            if handle is not None:
                handle.cancel()
            self._handle = self._loop.call_at(when, self._fire)

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

    def _fire(self) -> None:
        self._handle = None
        when = self._when
        if when is None:  # no wait in progress: the next one arms the timer again
            return
        if self._loop.time() < when:  # armed for an earlier wait that ended: on to this one's deadline
            self._handle = self._loop.call_at(when, self._fire)
            return
        self._expiring = True
        self._task.cancel()
