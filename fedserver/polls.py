"""Long-polls: a client asks for work (``PullTask``) and is answered with its task, a wait hint, or the news that
the federation finished; meanwhile its call is parked until the round machine has something for it.

Apart from the coordinator because parking and waking calls is its own job: one event per client with a poll
parked, so a round start wakes only the clients it selected (waking every parked client for every accepted update
would cost O(K^2) wake-ups per round). A client with a poll parked is connected, hence alive: the run loop's
``Tick`` carries :meth:`LongPolls.connected`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fedcore import rounds as rm
from fedcore.config import ServerSection
from fedserver.dispatch import Task, TaskDispatcher, WaitInfo
from fedserver.membership import Membership
from fedserver.round_timing import RoundTimer


class LongPolls:
    def __init__(self, server: ServerSection, members: Membership, dispatch: TaskDispatcher,
                 state: Callable[[], rm.RoundState], observe: Callable[[rm.Observation], None],
                 stopping: Callable[[], bool], clock: Callable[[], float], timing: RoundTimer | None = None) -> None:
        self.server = server
        self.members = members
        self.dispatch = dispatch
        self._state = state
        self._observe = observe
        self._stopping = stopping
        self._clock = clock
        self.timing = timing if timing is not None else RoundTimer()
        self.log = members.log
        self._parked: dict[str, asyncio.Event] = {}
        self._polling: dict[str, int] = {}
        # end_parked() bumps it: a poll parked under an older generation is answered with a zero wait.
        self._generation = 0
        self._end_reason = ""

    def connected(self) -> frozenset[str]:
        """The clients with a poll in progress."""
        return frozenset(self._polling)

    def wake(self, clients: tuple[str, ...] | None = None) -> None:
        """Wake the parked polls of ``clients`` (None: of every client)."""
        for cid in self._parked if clients is None else clients:
            parked = self._parked.get(cid)
            if parked is not None:
                parked.set()

    def end_parked(self, reason: str) -> None:
        """Answer every parked poll now with a zero wait naming ``reason``: each of those clients polls again at
        once, and its next call passes the server's checks afresh (a certificate revoked meanwhile is refused)."""
        self._generation += 1
        self._end_reason = reason
        self.wake()

    async def pull(self, session: str, max_wait_s: float, declined: bool = False) -> Task | WaitInfo:
        # One observation says the client was heard from: Polled (alive, last seen, ready) when it becomes ready,
        # Declined for a decline, Seen otherwise -- not a Seen first and then the poll's (one fewer per round).
        cid = self.members.client_of(session)
        if declined:
            return self._declined(cid)
        if self._state().buffered is not None and not self._stopping():  # buffered rounds: a pull frees the device
            self._observe(rm.Pulled(cid, self._clock()))
        elif not self._state().clients[cid].ready and not self._stopping():
            self._observe(rm.Polled(cid, self._clock()))
        else:
            self._observe(rm.Seen(cid, self._clock()))
        self._polling[cid] = self._polling.get(cid, 0) + 1
        try:
            return await self._wait(session, cid, max_wait_s)
        finally:
            self._polling[cid] -= 1
            if not self._polling[cid]:
                del self._polling[cid]
                self._parked.pop(cid, None)

    def _finished(self, cid: str) -> WaitInfo:
        self.members.told_finished(cid)
        return WaitInfo(0.0, True, f"federation {self._state().outcome}")

    def _declined(self, cid: str) -> WaitInfo:
        """The client declines work now (its device is not eligible): unavailable, not failed (rm.Declined).
        It is told to check again within a heartbeat interval (its decline poll keeps it alive)."""
        s = self._state()
        if s.phase == rm.FINISHED:
            self._observe(rm.Seen(cid, self._clock()))
            return self._finished(cid)
        rec = s.clients.get(cid)
        if rec is not None and (rec.ready or (cid in s.selected and cid not in s.declined)):
            self.log.info("client.declined", client_id=cid, round=s.round, selected=cid in s.selected)
        self._observe(rm.Declined(cid, self._clock()))
        return WaitInfo(self.server.heartbeat_interval_s, False, "declined: not selectable until it polls")

    async def _wait(self, session: str, cid: str, max_wait_s: float) -> Task | WaitInfo:
        wait = min(max(max_wait_s, 0.0), self.server.long_poll_s)
        deadline = self._clock() + wait
        generation = self._generation
        while True:
            if self._state().phase == rm.FINISHED:
                return self._finished(cid)
            if self._stopping():
                return WaitInfo(1.0, False, "server stopping; the federation resumes when it restarts")
            task = self.dispatch.task_for(self._state(), cid, self._clock())
            if task is not None:
                self.log.debug("task.sent", client_id=cid, round=task.round, model_id=task.model_id)
                if self._state().buffered is not None:  # buffered rounds: the task left (the arrival log's line)
                    self._observe(rm.TaskDelivered(cid, task.round, self._clock()))
                else:
                    self._observe(rm.Seen(cid, self._clock()))  # it came for its task: pending (poll grace)
                self.timing.handed_out(cid, task.round)  # its long-poll is answered
                return task
            remaining = deadline - self._clock()
            if remaining <= 0:
                return WaitInfo(0.0, False, "no task for this client yet")
            parked = self._parked.setdefault(cid, asyncio.Event())
            parked.clear()
            # The wait's end is a timer that wakes it (the loop above sees no time left): one timer armed and disarmed,
            # not asyncio.timeout's cancel machinery (~2 of its ~4 µs; fedserver.idle_limit says where that counts).
            timer = asyncio.get_running_loop().call_later(remaining, parked.set)
            try:
                await parked.wait()
            finally:
                timer.cancel()
            if session not in self.members.sessions:  # it left or re-joined meanwhile
                return WaitInfo(0.0, False, "session ended")
            if self._generation != generation:
                return WaitInfo(0.0, False, self._end_reason)
