"""The shell that acts out a client's simulated device behaviour (:mod:`fedcore.simulation` draws it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fedcore.simulation import Fate, SimulationConfig, next_online, online_at, round_fate


class DeviceGone(Exception):
    """The simulated device is gone for good: it dropped out for ever, or its last online window ended."""


class DeviceSimulation:
    """One client's :class:`SimulationConfig` over time: its clock starts at :meth:`start` (the client's run)."""

    def __init__(self, config: SimulationConfig, client_id: str, log: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.client_id, self.log, self.clock = config, client_id, log, clock
        self.started = clock()
        self._tasks: dict[int, int] = {}

    def start(self) -> None:
        self.started = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def wait_online(self, sleep: Callable[[float], None]) -> None:
        """Before contacting the server: sleep through an offline period (no contact at all); raises
        :class:`DeviceGone` after the last online window."""
        t = self.elapsed()
        back = next_online(self.config, t)
        if back is None:
            self.log.info("simulation.gone", client_id=self.client_id, reason="past its last online window")
            raise DeviceGone
        if back > t:
            self.log.info("simulation.offline", client_id=self.client_id, back_in_s=round(back - t, 3))
            sleep(back - t)

    def online(self) -> bool:
        return online_at(self.config, self.elapsed())

    def fate(self, round_: int) -> Fate:
        """The fate of the task just received for ``round_`` (a re-run round's task draws anew)."""
        n = self._tasks.get(round_, 0)
        self._tasks[round_] = n + 1
        return round_fate(self.config, self.client_id, round_, n)
