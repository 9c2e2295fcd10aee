"""Who is in the federation: join (token, session room, model fingerprint), the session behind a call, leave, and
which clients have learnt that the federation finished.

A separate part from :mod:`fedserver.coordinator` because identity is one job (sessions and the join checks) and
the round machine another: membership only turns these calls into the round machine's ``Joined`` / ``Seen`` /
``Left`` observations and wakes the long-polls a replaced or ended session leaves behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedcore import rounds as rm
from fedserver.errors import ProtocolError
from fedserver.sessions import Sessions

# The run loop came back this much later than it asked to (seconds): it was held up, not waiting.
LOOP_STALL_S = 1.0


class LivenessChecks:
    """When the run loop checks every client's silence (O(N)): every ``every`` seconds, not on every wake-up. A
    check right after the loop was held up is safe: :class:`StallWatch` has moved every client's last contact on by
    the stall before the check is applied, so the heartbeats that sat unread in the sockets meanwhile count (100
    devices of a SecAgg+ round were once dropped at the same instant, "silent" 31 s, at a load average of 176).
    Pure: the times are given."""

    def __init__(self, every: float, now: float) -> None:
        self.every = every
        self._last = now  # the last check

    def due(self, now: float) -> bool:
        """The loop's pass at ``now``: check liveness now?"""
        if now - self._last >= self.every:
            self._last = now
            return True
        return False


# While the coordinator's run loop runs, it observes a Tick at least this often (its longest wait, seconds).
RUN_LOOP_TICK_S = 0.25


class StallWatch:
    """Notices at the round machine's one entry (``Coordinator.observe``) that the server's loop was held up, and for
    how long. While the run loop runs (between :meth:`arm` and :meth:`disarm`) it observes at least every ``tick_s``;
    two observations more than ``tick_s + LOOP_STALL_S`` apart mean the loop did not run in between, and the time
    past ``tick_s`` is the stall, which the round machine then does not count (:class:`fedcore.rounds.Stalled`).
    Checked before each observation is applied: after a stall, whatever the loop handles first -- its own pass or an
    upload that sat in a socket -- would otherwise find the round's deadline passed (a whole round abandoned after a
    stopped server was continued). Pure: the times are given."""

    def __init__(self, tick_s: float = RUN_LOOP_TICK_S) -> None:
        self.tick_s = tick_s
        self._last: float | None = None  # the latest observation's time; None while not armed
        self.stalls = 0  # stalls seen (for tests and logs)
        self.stalled_s = 0.0  # their seconds in all

    def arm(self, now: float) -> None:
        self._last = now

    def disarm(self) -> None:
        self._last = None

    def stalled(self, now: float) -> float:
        """Seconds the loop was held up before an observation at ``now`` (0.0: it was not)."""
        last = self._last
        if last is None:
            return 0.0
        if now > last:
            self._last = now
        gap = now - last - self.tick_s
        if gap <= LOOP_STALL_S:
            return 0.0
        self.stalls += 1
        self.stalled_s += gap
        return gap


@dataclass(frozen=True)
class JoinResult:
    session_id: str
    client_index: int


class Membership:
    def __init__(self, sessions: Sessions, fingerprint: str, state: Callable[[], rm.RoundState],
                 observe: Callable[[rm.Observation], None], wake: Callable[[tuple[str, ...]], None],
                 clock: Callable[[], float], log: Any) -> None:
        self.sessions = sessions
        self.fingerprint = fingerprint
        self._state = state
        self._observe = observe
        self._wake = wake  # wakes the parked long-polls of these clients
        self._clock = clock
        self.log = log
        # Clients told that the federation finished (a leave forgets it: a client that joins again is told again).
        self._told_finished: set[str] = set()

    def join(self, client_id: str, token: str, num_samples: int, opt_out: bool, attacker: bool,
             model_fingerprint: str, credential: str = "") -> JoinResult:
        self.sessions.authenticate(client_id, token)
        self.sessions.check_room(client_id, credential)
        if model_fingerprint and model_fingerprint != self.fingerprint:
            self.log.warning("client.join_refused", client_id=client_id, reason="model fingerprint mismatch")
            raise ProtocolError("FAILED_PRECONDITION", f"model fingerprint {model_fingerprint} does not match "
                                                       f"the federation's {self.fingerprint}")
        session = self.sessions.open(client_id, credential)
        self._wake((client_id,))  # a poll of a replaced session returns
        rejoin = client_id in self._state().clients
        self._observe(rm.Joined(client_id, self._clock(), num_samples, opt_out, attacker))
        index = self._state().clients[client_id].index
        self.log.info("client.joined", client_id=client_id, index=index, rejoin=rejoin, num_samples=num_samples)
        return JoinResult(session, index)

    def client_of(self, session: str) -> str:
        return self.sessions.client_of(session)

    def touch(self, session: str) -> str:
        """The client behind ``session`` was heard from (raises UNAUTHENTICATED for an unknown session)."""
        cid = self.sessions.client_of(session)
        self._observe(rm.Seen(cid, self._clock()))
        return cid

    def leave(self, session: str, reason: str) -> None:
        cid = self.sessions.close(session)
        self._told_finished.discard(cid)
        self._wake((cid,))  # a poll of the ended session returns
        self._observe(rm.Left(cid, self._clock()))
        self.log.info("client.left", client_id=cid, reason=reason)

    def told_finished(self, client_id: str) -> None:
        """``client_id`` was answered that the federation finished."""
        self._told_finished.add(client_id)

    def still_here(self) -> int:
        """How many clients have not left: each one told that the federation finished acknowledges it with its
        Leave (a reply written is not a reply read: the server that stops once it has *written* its last
        "finished" can cut it off in the transport, and that client then retries a server that is gone)."""
        return self._state().alive_and_available()[0]

    def not_left(self) -> tuple[list[str], list[str]]:
        """The live clients that have not left: (told that the federation finished, not told)."""
        alive = self._state().alive_ids()
        return ([c for c in alive if c in self._told_finished], [c for c in alive if c not in self._told_finished])
