"""Buffered asynchronous rounds (FedBuff, Nguyen et al. 2022): the pure parts -- staleness weights, the state of the
tasks in flight, the admission of an update by the model version it was trained from, and the replay schedule.

With ``rounds.mode = "buffered"`` the server keeps ``rounds.concurrency`` devices training at once; a device that is
free is handed the current model (its *base* version: the round the server was filling when the device fetched it);
every ``rounds.clients_per_round`` (M) accepted updates form a buffer, and a buffer is a round: it is aggregated, the
new model is version ``round``, and the round machine moves on (:mod:`fedcore.rounds` drives the phases; this module
holds the bookkeeping it calls). An update trained from round ``b``'s model arriving while round ``r`` fills has
*staleness* ``r - b``; it is scaled by ``w(r - b)`` before it enters the aggregation (:data:`STALENESS`), and refused
beyond ``rounds.max_staleness`` with the reason named.

Reproducibility: which device trains from which version, and which buffer takes its update, depend on timing. The
server logs both (``arrivals.jsonl``: one ``hand`` line per task delivered, one ``arrive`` line per update
buffered); :class:`ReplaySchedule` read from that log makes a second run follow it exactly, so its models are
bit-identical (docs/buffered.md).

No clock and no randomness here: times come in as arguments, selection is :func:`fedcore.rounds.select_clients`'s
seeded draw.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcore.errors import ConfigError, require

SYNC, BUFFERED = "sync", "buffered"
MODES = (SYNC, BUFFERED)
# An admission's outcome code: try again later (the buffer is being aggregated, or -- replaying -- a later buffer
# takes it); anything else is a refusal.
RETRY, REFUSE = "UNAVAILABLE", "FAILED_PRECONDITION"

# ---- staleness weights, registered by name ----

StalenessFn = Callable[[int, float, float], float]  # (staleness s >= 0, a, b) -> weight in (0, 1]
STALENESS: dict[str, tuple[StalenessFn, str]] = {}


def register_staleness(name: str, fn: StalenessFn, summary: str) -> None:
    """Register a staleness weight ``fn(s, a, b)`` under ``name`` (``rounds.staleness``); it must be in (0, 1] and
    1 at s = 0."""
    STALENESS[name] = (fn, summary)


def _polynomial(s: int, a: float, _: float) -> float:
    return float((1.0 + s) ** -a)


def _constant(_s: int, _a: float, _b: float) -> float:
    return 1.0


def _hinge(s: int, a: float, b: float) -> float:
    return 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0)


register_staleness("polynomial", _polynomial, "(1 + s)^-a; a = staleness_a (0.5: FedBuff's 1/sqrt(1 + s))")
register_staleness("constant", _constant, "1: every update counts fully, however stale")
register_staleness("hinge", _hinge, "1 for s <= staleness_b, then 1/(staleness_a (s - staleness_b) + 1) (FedAsync)")


def staleness_weight(name: str, s: int, a: float, b: float) -> float:
    """The weight of an update ``s`` buffers stale under the registered function ``name``."""
    if name not in STALENESS:
        raise ConfigError("rounds.staleness", f"unknown staleness function {name!r}; known: {', '.join(STALENESS)}")
    return STALENESS[name][0](s, a, b)


def validate(mode: str, concurrency: int, max_staleness: int, staleness: str, a: float, b: float,
             clients_per_round: int) -> None:
    """The buffered settings of ``[rounds]`` (errors name the field)."""
    require(mode in MODES, "rounds.mode", f"one of {list(MODES)}, got {mode!r}")
    require(concurrency >= 0, "rounds.concurrency", f"must be >= 0 (0: 2 x clients_per_round), got {concurrency}")
    require(concurrency == 0 or concurrency >= clients_per_round, "rounds.concurrency",
            f"must be >= clients_per_round ({clients_per_round}): a buffer of M updates needs M devices training, "
            f"got {concurrency}")
    require(max_staleness >= 0, "rounds.max_staleness", f"must be >= 0, got {max_staleness}")
    require(staleness in STALENESS, "rounds.staleness", f"one of {list(STALENESS)}, got {staleness!r}")
    require(math.isfinite(a) and a >= 0, "rounds.staleness_a", f"must be a finite number >= 0, got {a}")
    require(math.isfinite(b) and b >= 0, "rounds.staleness_b", f"must be a finite number >= 0, got {b}")


# ---- the tasks in flight ----

@dataclass
class BufferState:
    """What buffered rounds keep beside :class:`fedcore.rounds.RoundState` (saved with it).

    ``flight``: client -> the round whose model it was handed (its base); a client is in flight from the moment it
    is granted a task until its update is buffered or refused, it pulls again (a device pulls only when it is free:
    the task was abandoned), its task expires (``rounds.round_timeout_s`` after delivery), or it is lost.
    ``undelivered``: granted, not fetched yet (re-based to the newest round when a buffer closes: the device gets
    the model current when it fetches). ``delivered_at``: when each delivered task left. ``hands``: grants so far
    (seeds the next draw). ``arrivals``: updates buffered so far (each arrival's sequence number). ``replayed``:
    client -> tasks delivered while replaying a log (its position in :attr:`ReplaySchedule.hands`).
    """

    flight: dict[str, int] = field(default_factory=dict)
    undelivered: list[str] = field(default_factory=list)
    delivered_at: dict[str, float] = field(default_factory=dict)
    hands: int = 0
    arrivals: int = 0
    # (client, base) of each update in the current buffer, in arrival order.
    buffer: list[list[Any]] = field(default_factory=list)
    # Tasks delivered while the current buffer filled.
    delivered: int = 0
    replayed: dict[str, int] = field(default_factory=dict)
    # A resumed server: the (client, base) of the updates its store kept for round ``restored_round``'s buffer, in
    # arrival order, re-folded when that buffer opens (:func:`fedcore.rounds.restore_buffer`; not saved: a
    # snapshot is taken only after they were applied).
    restored: list[list[Any]] = field(default_factory=list)
    restored_round: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"flight": dict(self.flight), "undelivered": list(self.undelivered),
                "delivered_at": dict(self.delivered_at), "hands": self.hands, "arrivals": self.arrivals,
                "buffer": [list(e) for e in self.buffer], "delivered": self.delivered, "replayed": dict(self.replayed)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BufferState:
        return cls(flight={str(k): int(v) for k, v in d.get("flight", {}).items()},
                   undelivered=[str(c) for c in d.get("undelivered", [])],
                   delivered_at={str(k): float(v) for k, v in d.get("delivered_at", {}).items()},
                   hands=int(d.get("hands", 0)), arrivals=int(d.get("arrivals", 0)),
                   buffer=[[str(e[0]), int(e[1])] for e in d.get("buffer", [])],
                   delivered=int(d.get("delivered", 0)),
                   replayed={str(k): int(v) for k, v in d.get("replayed", {}).items()})

    def free(self, client_id: str) -> None:
        """``client_id`` holds no task any more."""
        self.flight.pop(client_id, None)
        self.delivered_at.pop(client_id, None)
        if client_id in self.undelivered:
            self.undelivered.remove(client_id)

    def grant(self, client_id: str, round_: int) -> None:
        self.flight[client_id] = round_
        self.delivered_at.pop(client_id, None)
        if client_id not in self.undelivered:
            self.undelivered.append(client_id)

    def rebase(self, round_: int) -> None:
        """A buffer closed: the granted tasks not fetched yet will carry the new round's model."""
        for c in self.undelivered:
            self.flight[c] = round_

    def expired(self, now: float, timeout_s: float) -> list[str]:
        """Delivered tasks older than ``timeout_s`` (sorted): their devices are not waited for any more."""
        return sorted(c for c, t in self.delivered_at.items() if now - t > timeout_s)

    def oldest_base(self) -> int | None:
        """The oldest model version a device in flight trains from (None: none in flight)."""
        return min(self.flight.values(), default=None)


def admission(b: BufferState, client_id: str, base: int, round_: int, aggregating: bool, finished: bool,
              max_staleness: int, replay: ReplaySchedule | None = None) -> tuple[str, str] | None:
    """Why an update from ``client_id`` trained from round ``base``'s model cannot be buffered in round ``round_``
    now, as ``(code, reason)`` (:data:`RETRY`: send it again later; :data:`REFUSE`: never), or None. The base the
    device claims is checked against the task the server handed it, never taken on trust."""
    if finished:
        return REFUSE, "the federation has finished"
    if b.flight.get(client_id) != base or client_id in b.undelivered:
        return REFUSE, (f"this client holds no task from round {base}'s model (never handed, expired after "
                        "rounds.round_timeout_s, or released when it pulled again)")
    staleness = round_ - base
    if staleness > max_staleness:
        return REFUSE, (f"stale update: trained from round {base}'s model, {staleness} buffers behind round {round_} "
                        f"(rounds.max_staleness = {max_staleness})")
    if aggregating:
        return RETRY, f"round {round_}'s buffer is being aggregated; send the update again"
    if replay is not None:
        logged = replay.arrival_round(client_id, base)
        if logged is None:
            return REFUSE, f"replaying {replay.source}: this update was not buffered in the logged run"
        if logged > round_:
            return RETRY, f"replaying {replay.source}: this update belongs to round {logged}'s buffer"
        if logged < round_:
            return REFUSE, f"replaying {replay.source}: this update belonged to round {logged}'s buffer"
    return None


def staleness_spread(staleness: Iterable[int]) -> tuple[float, float, float]:
    """(min, mean, max) of a buffer's staleness values (NaN for an empty buffer)."""
    values = list(staleness)
    if not values:
        return math.nan, math.nan, math.nan
    return float(min(values)), math.fsum(values) / len(values), float(max(values))


# ---- the arrival log and its replay ----

ARRIVALS_FILE = "arrivals.jsonl"


def hand_line(client_id: str, round_: int) -> dict[str, Any]:
    return {"hand": client_id, "round": round_}


def arrive_line(client_id: str, base: int, round_: int, seq: int) -> dict[str, Any]:
    return {"arrive": client_id, "base": base, "round": round_, "seq": seq}


@dataclass(frozen=True)
class ReplaySchedule:
    """A logged run's order (``arrivals.jsonl``), for a run that follows it (``rounds.replay``).

    ``hands``: client -> the rounds of its delivered tasks, in order; ``arrivals``: round -> the (client, base) its
    buffer took; ``hands_in``: round -> tasks delivered while it filled. A replayed round closes when its logged
    deliveries and arrivals have all happened (not at M), and a task is delivered to a client only in the round the
    log names, so every device trains from the same model versions and every buffer holds the same updates."""

    source: str
    hands: Mapping[str, tuple[int, ...]]
    arrivals: Mapping[int, frozenset[tuple[str, int]]]
    hands_in: Mapping[int, int]
    last_round: int

    def arrival_round(self, client_id: str, base: int) -> int | None:
        for r, entries in self.arrivals.items():
            if (client_id, base) in entries:
                return r
        return None

    def next_hand(self, client_id: str, done: int) -> int | None:
        """The round of ``client_id``'s next logged task after ``done`` delivered (None: it gets no more)."""
        rounds = self.hands.get(client_id, ())
        return rounds[done] if done < len(rounds) else None

    @classmethod
    def from_lines(cls, lines: Iterable[Mapping[str, Any]], source: str = "the log") -> ReplaySchedule:
        hands: dict[str, list[int]] = {}
        arrivals: dict[int, set[tuple[str, int]]] = {}
        hands_in: dict[int, int] = {}
        for d in lines:
            if "hand" in d:
                r = int(d["round"])
                hands.setdefault(str(d["hand"]), []).append(r)
                hands_in[r] = hands_in.get(r, 0) + 1
            elif "arrive" in d:
                arrivals.setdefault(int(d["round"]), set()).add((str(d["arrive"]), int(d["base"])))
        last = max(arrivals, default=0)
        return cls(source, {c: tuple(r) for c, r in hands.items()},
                   {r: frozenset(e) for r, e in arrivals.items()}, hands_in, last)

    @classmethod
    def load(cls, path: str | Path) -> ReplaySchedule:
        """The schedule in ``path`` (an ``arrivals.jsonl``); :class:`ConfigError` naming ``rounds.replay``."""
        try:
            text = Path(path).read_text()
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            raise ConfigError("rounds.replay", f"cannot read the arrival log {str(path)!r}: {e}") from None
        return cls.from_lines(lines, str(path))
