"""Simulated device behaviour (SPEC §4): stragglers, dropouts, crashes and availability windows.

A client's ``[simulation]`` section (:class:`SimulationConfig`, the ``simulation.*`` fields of a
:class:`fedcore.config.ClientConfig`; the client CLI's ``--straggler ... --dropout ...``; the launcher's
fractions) says how the device misbehaves; :func:`round_fate` draws what happens to one task, from a generator
seeded by (seed, client id, round, the task's number within the round), never torch's or numpy's global RNG:
the same fleet misbehaves the same way in every run, whatever the thread timing. The client shell's
``DeviceSimulation`` acts on a fate. Nothing here is ever set by a server: it is the device's own (simulated)
nature.

- **straggler**: an extra delay before the update is pushed: ``fixed`` (``straggler_delay_s``) or ``lognormal``
  (median ``straggler_delay_s``, log-space standard deviation ``straggler_sigma``).
- **dropout**: with probability ``dropout`` per task the device takes the task and never answers: no update, no
  heartbeat; after ``dropout_return_s`` of silence it comes back and polls again (a negative value: it never
  comes back, the process ends without leaving).
- **crash**: with probability ``crash`` per task the device crashes after training: the update is lost with its
  session, and after ``crash_rejoin_s`` it re-joins as a restarted process would (state dir kept).
- **availability**: online windows ``[[start_s, end_s], ...]`` in seconds since the client started; outside them
  the device is offline (no contact at all), an update whose window closed is never sent, and after the last
  window the device is gone. Empty: always online. The launcher reads a trace file of per-client windows
  (:func:`load_trace`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.checks import is_finite_number
from fedcore.errors import ConfigError, require
from fedcore.seeds import derive_seed

STRAGGLERS = ("fixed", "lognormal")
ANSWER, DROP, CRASH = "answer", "drop", "crash"


@dataclass
class SimulationConfig:
    # "fixed": every update waits straggler_delay_s; "lognormal": a delay drawn per task with median
    # straggler_delay_s and log-space standard deviation straggler_sigma.
    straggler: str = "fixed"
    straggler_delay_s: float = 0.0
    straggler_sigma: float = 1.0
    # Per-task probability of taking the task and never answering ...
    dropout: float = 0.0
    # ... and the silence after which the device comes back (< 0: it never does).
    dropout_return_s: float = 30.0
    # Per-task probability of crashing after training (update and session lost) ...
    crash: float = 0.0
    # ... and how long until the crashed device re-joins.
    crash_rejoin_s: float = 5.0
    # Online windows [start_s, end_s] in seconds since the client started; empty = always online.
    availability: list[list[float]] = field(default_factory=list)
    # Mixed into every draw: fleets with the same ids but different seeds misbehave differently.
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.straggler_delay_s or self.dropout or self.crash or self.availability)

    def validate(self, prefix: str = "simulation") -> SimulationConfig:
        validate_simulation_config(self, prefix)
        return self


def validate_simulation_config(c: SimulationConfig, prefix: str = "simulation") -> None:
    """Raise :class:`fedcore.errors.ConfigError` naming ``<prefix>.<field>`` for the first unusable field."""

    def check(cond: bool, name: str, message: str) -> None:
        require(cond, f"{prefix}.{name}", message)

    check(c.straggler in STRAGGLERS, "straggler", f"one of {', '.join(STRAGGLERS)}, got {c.straggler!r}")
    check(is_finite_number(c.straggler_delay_s) and c.straggler_delay_s >= 0, "straggler_delay_s",
          f"must be a finite number >= 0, got {c.straggler_delay_s!r}")
    check(is_finite_number(c.straggler_sigma) and c.straggler_sigma >= 0, "straggler_sigma",
          f"must be a finite number >= 0, got {c.straggler_sigma!r}")
    for name in ("dropout", "crash"):
        p = getattr(c, name)
        check(is_finite_number(p) and 0 <= p <= 1, name, f"must be a probability in [0, 1], got {p!r}")
    check(is_finite_number(c.dropout_return_s), "dropout_return_s",
          f"must be a finite number (< 0: never comes back), got {c.dropout_return_s!r}")
    check(is_finite_number(c.crash_rejoin_s) and c.crash_rejoin_s >= 0, "crash_rejoin_s",
          f"must be a finite number >= 0, got {c.crash_rejoin_s!r}")
    try:
        windows(c.availability)
    except ValueError as e:
        raise ConfigError(f"{prefix}.availability", str(e)) from None


def windows(raw: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Online windows as sorted, non-overlapping ``(start_s, end_s)`` pairs; :class:`ValueError` otherwise."""
    out: list[tuple[float, float]] = []
    for i, w in enumerate(raw):
        if isinstance(w, (str, bytes)) or not isinstance(w, Sequence) or len(w) != 2 or \
                not all(is_finite_number(x) for x in w):
            raise ValueError(f"window {i} must be [start_s, end_s] (two finite numbers), got {w!r}")
        start, end = float(w[0]), float(w[1])
        if not 0 <= start < end:
            raise ValueError(f"window {i} must have 0 <= start_s < end_s, got {w!r}")
        if out and start < out[-1][1]:
            raise ValueError(f"window {i} starts before window {i - 1} ends: windows must be sorted and disjoint")
        out.append((start, end))
    return out


@dataclass(frozen=True)
class Fate:
    """What happens to one task: ``answer`` after ``delay_s``, ``drop`` (never answer) or ``crash``."""

    outcome: str
    delay_s: float = 0.0


def round_fate(c: SimulationConfig, client_id: str, round_: int, task_no: int = 0) -> Fate:
    """The fate of the ``task_no``-th task of round ``round_`` handed to ``client_id`` (0 for the first; a round
    re-run after an abandoned attempt hands a new task). Deterministic in its arguments.

    Without dropouts, crashes or a straggler delay no draw can change the fate (every ``u < 0`` is false, the delay
    is 0), so none is made: a generator seeded per task is ~16 µs, a twentieth of a no-op client's round."""
    if c.dropout <= 0 and c.crash <= 0 and c.straggler_delay_s <= 0:
        return Fate(ANSWER, c.straggler_delay_s)
    return drawn_fate(c, client_id, round_, task_no)


def drawn_fate(c: SimulationConfig, client_id: str, round_: int, task_no: int = 0) -> Fate:
    """:func:`round_fate` from its draws, whatever the configuration (a generator seeded by the task)."""
    rng = np.random.default_rng(derive_seed(c.seed, client_id, round_, task_no, "simulation"))
    u_drop, u_crash, z = rng.random(), rng.random(), rng.standard_normal()
    if u_drop < c.dropout:
        return Fate(DROP)
    if u_crash < c.crash:
        return Fate(CRASH)
    delay = c.straggler_delay_s
    if c.straggler == "lognormal" and delay > 0:
        delay = float(delay * math.exp(c.straggler_sigma * z))
    return Fate(ANSWER, delay)


def online_at(c: SimulationConfig, t: float) -> bool:
    """Whether the device is online ``t`` seconds after it started."""
    ws = windows(c.availability)
    return not ws or any(start <= t < end for start, end in ws)


def next_online(c: SimulationConfig, t: float) -> float | None:
    """The earliest time >= ``t`` at which the device is online (``t`` itself when it is); None when it never is
    again (past its last window)."""
    ws = windows(c.availability)
    if not ws:
        return t
    for start, end in ws:
        if t < end:
            return max(t, start)
    return None


def load_trace(path: str | Path) -> dict[str, list[list[float]]]:
    """An availability trace: a JSON object mapping client ids (or ``"*"``, every client not named) to their
    online windows ``[[start_s, end_s], ...]``; :class:`ValueError` naming the client for a malformed entry."""
    try:
        raw: Any = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"availability trace {path}: {e}") from None
    clients = raw.get("clients", raw) if isinstance(raw, Mapping) else None
    if not isinstance(clients, Mapping):
        raise ValueError(f"availability trace {path}: expected a JSON object of client id -> windows")
    out: dict[str, list[list[float]]] = {}
    for cid, ws in clients.items():
        try:
            out[str(cid)] = [[s, e] for s, e in windows(ws if isinstance(ws, Sequence) else [ws])]
        except ValueError as e:
            raise ValueError(f"availability trace {path}: client {cid!r}: {e}") from None
    return out


def trace_windows(trace: Mapping[str, list[list[float]]], client_id: str) -> list[list[float]]:
    """The windows of ``client_id`` in a trace (its own, else ``"*"``, else always online)."""
    return list(trace.get(client_id, trace.get("*", [])))
