"""What the server says about its rounds: one log line per round-machine event, the ``round.completed`` line of
each persisted round, and the ``round.waiting`` line while a round waits for clients.

Kept apart from :mod:`fedserver.coordinator` so that the coordinator only wires the round machine to the server's
parts; every line here is a pure function of a typed event or report (structlog, SPEC §2's event names).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fedcore import rounds as rm
from fedcore.config import RoundsConfig
from fedcore.report import RoundReport

# Seconds between two "round.waiting" lines while a round waits for clients.
WAIT_LOG_S = 10.0


def log_event(log: Any, ev: rm.Event) -> None:
    """The line of one round-machine event (``round.started``, ``round.closed``, ...)."""
    if isinstance(ev, rm.RoundStarted):
        log.info("round.started", round=ev.round, attempt=ev.attempt, selected=len(ev.selected),
                 clients=list(ev.selected))
    elif isinstance(ev, rm.RoundClosed):
        log.info("round.closed", round=ev.round, accepted=len(ev.accepted), reason=ev.reason)
    elif isinstance(ev, rm.RoundAbandoned):
        log.warning("round.abandoned", round=ev.round, attempt=ev.attempt, accepted=ev.accepted,
                    needed=ev.needed, reason=ev.reason)
    elif isinstance(ev, rm.ClientDropped):
        log.warning("client.dropped", client_id=ev.client_id, silent_for_s=round(ev.silent_for, 1))


class RoundCompletedLine:
    """The ``round.completed`` line of a persisted round, with the seconds its snapshot took (a round subscriber)."""

    def __init__(self, log: Any, snapshot_seconds: Callable[[], float]) -> None:
        self.log = log
        self._snapshot_seconds = snapshot_seconds

    def __call__(self, r: RoundReport) -> None:
        self.log.info("round.completed", round=r.round, outcome=r.outcome, **r.scalars(), **r.metrics,
                      snapshot_s=round(self._snapshot_seconds(), 5))


class WaitingLine:
    """While a round waits for clients, say so every :data:`WAIT_LOG_S` seconds: how many are ready of how many it
    needs, and how long until the federation gives up (a silent wait looks like a hang)."""

    def __init__(self, log: Any, rounds: RoundsConfig) -> None:
        self.log = log
        self.rounds = rounds
        self._last = -math.inf

    def maybe_log(self, s: rm.RoundState, now: float) -> None:
        if s.phase != rm.SAMPLING or now - s.phase_since < WAIT_LOG_S or now - self._last < WAIT_LOG_S:
            return
        self._last = now
        ready, needed = len(s.available_ids()), rm.start_needs(s, self.rounds)
        self.log.info("round.waiting", round=s.round, status=f"waiting: {ready} of {needed} ready", ready=ready,
                      needed=needed, alive=len(s.alive_ids()),
                      gives_up_in_s=round(max(0.0, s.phase_since + self.rounds.sampling_timeout_s - now)))
