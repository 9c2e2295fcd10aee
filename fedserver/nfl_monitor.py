"""The server's NFL monitor: the imperative shell around :mod:`fedcore.nfl`'s detector state machine.

After a round is aggregated and its :class:`~fedcore.report.RoundReport` built, and *before* the round is
persisted, :meth:`NflMonitor.observe` feeds the detector the round's median β̂ (FL-GUARD Eq. 4) and Δ (LINDT
Eq. 7), logs the events it returns (``nfl.reported``, ``nfl.cancelled``, ``recovery.stopped``) and returns the
report completed with the detector's view (``beta_hat_avg``, ``nfl``, ``nfl_count``, ``recovery``). The
detector's state is a persistence slot, so it is saved in the same snapshot as the round that moved it and a
restarted server carries on with it. :attr:`NflMonitor.recovery` is the flag every task of the next round
carries.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fedcore import nfl
from fedcore.log import get_logger
from fedcore.nfl import NflConfig, NflEvent, NflState
from fedcore.report import NflStatus, RoundReport

SLOT = "nfl"


def nfl_state_name(state: NflState) -> str:
    """What the per-round table and ``rounds.jsonl`` show: ``off``, ``always`` (always-recover), ``reported``
    or ``watching``."""
    if state.mode == nfl.OFF:
        return "off"
    if state.mode == nfl.ALWAYS_RECOVER:
        return "always"
    return "reported" if state.reported else "watching"


class NflMonitor:
    def __init__(self, config: NflConfig) -> None:
        self.config = config
        self.state = nfl.init(config)
        self.log = get_logger("fedserver")

    @property
    def recovery(self) -> bool:
        """The recovery flag of the next round's tasks."""
        return self.state.recovery

    def observe(self, report: RoundReport) -> tuple[RoundReport, list[NflEvent]]:
        """Step the detector with ``report``'s round and return the report completed with the NFL state."""
        delta = report.metrics.get("delta")
        obs = nfl.NflObservation(report.round, _number(report.beta_hat), _number(delta))
        self.state, events = nfl.step(self.state, obs, self.config)
        for ev in events:
            self.log.warning(ev.kind, round=ev.round, detector=ev.detector, value=round(ev.value, 6),
                             count=ev.count, recovery=self.state.recovery)
        s = self.state
        return dataclasses.replace(
            report, beta_hat_avg=s.beta_hat_avg if s.beta_hat_avg is not None else math.nan,
            nfl=nfl_state_name(s), nfl_count=s.count, recovery=s.recovery), events

    def status(self) -> NflStatus:
        s = self.state
        return NflStatus(mode=s.mode, detector=s.detector, state=nfl_state_name(s), recovery=s.recovery,
                         count=s.count, consecutive_ok=s.consecutive_ok,
                         beta_hat=math.nan if s.beta_hat_avg is None else s.beta_hat_avg,
                         delta=math.nan if s.delta is None else s.delta, reported_round=s.reported_round or 0,
                         cancelled_round=s.cancelled_round or 0, stopped_round=s.stopped_round or 0)

    # ---- persistence slot ----

    def save(self) -> dict[str, Any]:
        # The detector's per-round trace (``history``) is not saved: the rounds' history (beta_hat, beta_hat_avg,
        # nfl, nfl_count, recovery per round) already holds it, appended once per round, so a snapshot stays O(1)
        # in the number of rounds. After a restart the trace starts empty; nothing decides on it.
        s = self.state
        d = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "history"}
        d["medians"] = list(s.medians)
        return d

    def load(self, d: dict[str, Any]) -> None:
        restored = NflState.from_dict(d)
        if restored.detector != self.config.detector or restored.mode != self.config.mode:
            raise ValueError(f"nfl: the stored NFL state is for detector {restored.detector!r} in mode "
                             f"{restored.mode!r}, the configuration asks for {self.config.detector!r} in mode "
                             f"{self.config.mode!r}")
        self.state = restored


def _number(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)
