"""FL-GUARD individual-level measures (§4.3): a client's own decision to start and stop model adaptation.

"Each client can independently start model adaptation when the system-wide NFL state is not reported, if its
locally computed β̂ᵢ remains negative in more than NR rounds. Moreover, each client can stop its activated model
adaptation to save the computation cost, if it observed β̂ᵢ ≥ 0 for c consecutive rounds." (FL-GUARD §4.3)

Shaped like :mod:`fedcore.rounds`: ``state, events = step(state, observation, nr, c, opt_out)`` over plain,
JSON-serialisable state, with no clock and no randomness, so a restarted client carries on from the saved state
(:func:`save_individual_state` / :func:`load_individual_state`). ``step`` does not modify its input state.

Rules, per observed round r with the client's β̂ᵢ (FL-GUARD Eq. 3, computed with the model it infers with):

- Not adapting, NFL not reported by the system: β̂ᵢ < 0 increments ``negative_count`` (a count, not necessarily
  consecutive, like the server's detector); when it exceeds NR (the (NR+1)-th negative round) adaptation starts
  (``recovery.started``) and ``consecutive_ok`` starts from 0.
- Adapting, NFL not reported: β̂ᵢ ≥ 0 increments ``consecutive_ok``, β̂ᵢ < 0 resets it; at c, adaptation stops
  (``recovery.stopped``, vᵢ is kept for inference) and ``negative_count`` restarts from 0.
- While the system reports NFL the individual machine is suspended: the client adapts anyway because of the system
  flag (the caller's ``recovery = system_reported or state.adapting``), and its β̂ᵢ then measures the adapted model
  under the system's recovery, so it feeds neither counter and no individual transition happens. An individual
  adaptation in progress when the system reports NFL is neither stopped nor restarted: it stays recorded, and when
  the system cancels its report (short-term stopping) the client keeps adapting on its own decision until its own
  stop rule fires, rather than being dragged out of adaptation by a system decision about the majority; a client
  that was not adapting resumes counting from its counters as they were before the report.
- An opt-out client (FL-GUARD §4.4's vanilla clients) never adapts: no ``recovery.started`` ever; its counters still
  follow its β̂ᵢ (for logs). A client found adapting with ``opt_out`` set (restarted with ``--opt-out``) stops at
  once (``recovery.stopped``, reason "opt-out").
- A round at or below ``last_round`` (a round re-run after a restart, a duplicate observation) changes nothing, so
  replaying an observation after a crash between ``step`` and the save cannot count a round twice. A missing or
  non-finite β̂ᵢ (no private model) only advances ``last_round``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcore.serialization import atomic_write
from fedcore.update_report import BetaHat

INDIVIDUAL_STATE_FILE = "individual_nfl.json"
_FORMAT = "fedguard.individual_nfl"
_VERSION = 1

STARTED = "recovery.started"
STOPPED = "recovery.stopped"


@dataclass(frozen=True)
class IndividualState:
    """A client's individual-measure counters. ``started_round``/``stopped_round``: the rounds of the last start
    and stop (0 = never); ``last_round``: the last round observed."""

    negative_count: int = 0
    consecutive_ok: int = 0
    adapting: bool = False
    started_round: int = 0
    stopped_round: int = 0
    last_round: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IndividualState:
        """The state from :meth:`to_dict`'s output; :class:`ValueError` naming the field on a wrong or unknown one."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k not in known:
                raise ValueError(f"{k}: unknown field; known: {', '.join(sorted(known))}")
            want_bool = k == "adapting"
            if want_bool != isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{k}: expected {'true or false' if want_bool else 'an integer'}, got {v!r}")
            if not want_bool and v < 0:
                raise ValueError(f"{k}: must be >= 0, got {v}")
        return cls(**d)


@dataclass(frozen=True)
class Observation:
    """What the client knows at the end of its round ``round``: its β̂ᵢ (:data:`~fedcore.update_report.BetaHat`,
    ``None`` when it has none) and whether the system reported NFL for this round (the server's recovery flag in the
    task)."""

    round: int
    beta_hat: BetaHat
    system_reported: bool


@dataclass(frozen=True)
class RecoveryStarted:
    round: int
    reason: str
    negative_count: int
    beta_hat: float
    kind: str = STARTED
    scope: str = "individual"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RecoveryStopped:
    round: int
    reason: str
    consecutive_ok: int
    beta_hat: float | None
    keep_adapted: bool = True
    kind: str = STOPPED
    scope: str = "individual"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Event = RecoveryStarted | RecoveryStopped


def check_thresholds(nr: int, c: int) -> None:
    """:class:`ValueError` naming ``nr`` or ``c`` unless NR >= 0 and c >= 1."""
    if isinstance(nr, bool) or not isinstance(nr, int) or nr < 0:
        raise ValueError(f"nr: must be an integer >= 0, got {nr!r}")
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"c: must be an integer >= 1, got {c!r}")


def step(state: IndividualState, obs: Observation, nr: int, c: int, opt_out: bool = False) -> tuple[
    IndividualState, list[Event]
]:
    """Apply one round's observation; return the new state and the events (module docstring for the rules).

    ``nr``: NR, adaptation starts after more than ``nr`` negative rounds; ``c``: it stops after ``c`` consecutive
    non-negative ones."""
    check_thresholds(nr, c)
    s = state
    events: list[Event] = []
    if obs.round <= s.last_round:
        return s, events
    s = dataclasses.replace(s, last_round=obs.round)
    beta = obs.beta_hat
    if opt_out and s.adapting:
        events.append(RecoveryStopped(obs.round, "opt-out: this client never adapts", s.consecutive_ok, beta))
        s = dataclasses.replace(s, adapting=False, stopped_round=obs.round, negative_count=0, consecutive_ok=0)
    if obs.system_reported or beta is None or not math.isfinite(beta):
        return s, events
    if s.adapting:
        if beta >= 0:
            ok = s.consecutive_ok + 1
            if ok >= c:
                events.append(RecoveryStopped(obs.round, f"β̂ᵢ >= 0 for {ok} consecutive rounds (c={c})", ok, beta))
                s = dataclasses.replace(s, adapting=False, stopped_round=obs.round, consecutive_ok=0,
                                        negative_count=0)
            else:
                s = dataclasses.replace(s, consecutive_ok=ok)
        else:
            s = dataclasses.replace(s, consecutive_ok=0)
        return s, events
    if beta < 0:
        neg = s.negative_count + 1
        s = dataclasses.replace(s, negative_count=neg)
        if neg > nr and not opt_out:
            events.append(RecoveryStarted(obs.round, f"β̂ᵢ < 0 in {neg} rounds > NR={nr} while NFL is not reported",
                                          neg, beta))
            s = dataclasses.replace(s, adapting=True, started_round=obs.round, consecutive_ok=0)
    return s, events


def save_individual_state(state_dir: str | os.PathLike[str], state: IndividualState) -> Path:
    """Write ``state`` to ``state_dir/individual_nfl.json`` atomically."""
    path = Path(state_dir) / INDIVIDUAL_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"format": _FORMAT, "version": _VERSION, "state": state.to_dict()}, indent=1).encode()
    with atomic_write(path) as f:
        f.write(data)
    return path


def load_individual_state(state_dir: str | os.PathLike[str]) -> IndividualState:
    """The saved state, or a fresh :class:`IndividualState` when ``state_dir`` has none; :class:`ValueError` naming
    the file for one that cannot be read (the counters are the client's history: never reset silently)."""
    path = Path(state_dir) / INDIVIDUAL_STATE_FILE
    if not path.exists():
        return IndividualState()
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
            raise ValueError(f"not a version-{_VERSION} individual-measure state")
        st = doc.get("state")
        if not isinstance(st, dict):
            raise ValueError("no state object")
        return IndividualState.from_dict(st)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable individual-measure state ({e})") from None
