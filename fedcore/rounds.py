"""The round machine: a deterministic state machine over plain, serializable state.

``state, events = step_in_place(state, observation, config, limits)``. The coordinator feeds it observations (a
client joined, was heard from, left; an update was accepted or rejected; time passed; aggregation finished) and acts
on the events it returns (start a round, aggregate, abandon, finish). It never reads a clock or draws randomness of
its own: time comes in with each observation and selection is seeded by (seed, round, attempt), so a run is
reproducible and a restarted server can carry on from the saved state.

Phases: ``sampling`` (waiting for enough available clients) -> ``training`` (tasks out, updates coming in) ->
``aggregating`` (the shell computes the new model) -> ``sampling`` of the next round, ..., ``finished``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore import buffered as bf


@dataclass
class RoundsConfig:
    # Rounds to run; the federation finishes after the last (a restart with a larger value carries on).
    num_rounds: int = 10
    # K: updates that close a round.
    clients_per_round: int = 10
    # Select ceil(K * over_select) clients; the first K updates close the round, so stragglers do not hold it.
    # Which K arrive first depends on timing: bit-identical reruns need 1.0 (the default).
    over_select: float = 1.0
    # A round whose deadline passes, or whose selected clients have all answered or been lost, aggregates when it
    # has at least this many updates (else it is abandoned and re-run); 0 means half of K, rounded up, so one
    # lost device never stops a federation.
    min_updates: int = 0
    # Clients that must be available before a round starts; 0 means K. Once the fleet has assembled (reached
    # it once), a round also starts when every live client is available and there are at least min_updates:
    # a lost device is not waited for.
    min_available: int = 0
    # A round's deadline in seconds from its start: it then aggregates with at least min_updates updates, or is
    # re-run.
    round_timeout_s: float = 60.0
    # How long to wait for enough available clients before giving up on the federation (exit status 3).
    sampling_timeout_s: float = 300.0
    # Seed of every server draw (selection by seed, round and attempt; DP noise; the initial model).
    seed: int = 0
    # "sync": each round selects clients and waits for K of their updates; "buffered" (FedBuff, docs/buffered.md):
    # concurrency devices train at once, each handed the current model when it is free, and every
    # clients_per_round updates that arrive form a round (a buffer), stale ones down-weighted.
    mode: str = "sync"
    # buffered: devices training at once (0: 2 x clients_per_round).
    concurrency: int = 0
    # buffered: an update trained from a model more than this many rounds older than the buffer it arrives in is
    # refused (the reason names this field).
    max_staleness: int = 10
    # buffered: the staleness weight w(s) an update s rounds stale is scaled by before it is aggregated:
    # "polynomial" (1 + s)^-staleness_a (FedBuff's 1/sqrt(1 + s) with a = 0.5), "constant" (1), or "hinge"
    # (1 up to s = staleness_b, then 1/(staleness_a (s - staleness_b) + 1)).
    staleness: str = "polynomial"
    # buffered: the staleness weight's a (polynomial: the exponent; hinge: the slope after staleness_b).
    staleness_a: float = 0.5
    # buffered: the hinge's b (rounds of staleness that count fully).
    staleness_b: float = 0.0
    # buffered: the arrival log (arrivals.jsonl) of an earlier run of this configuration to follow, so that the
    # run's models are bit-identical to that run's ("": off; docs/buffered.md, "Replay").
    replay: str = ""

    @property
    def effective_min_updates(self) -> int:
        return self.min_updates or math.ceil(self.clients_per_round / 2)

    @property
    def effective_min_available(self) -> int:
        return self.min_available or self.clients_per_round

    @property
    def num_selected(self) -> int:
        return math.ceil(self.clients_per_round * self.over_select)

    @property
    def buffered(self) -> bool:
        return self.mode == bf.BUFFERED

    @property
    def effective_concurrency(self) -> int:
        return self.concurrency or 2 * self.clients_per_round


SAMPLING, TRAINING, AGGREGATING, FINISHED = "sampling", "training", "aggregating", "finished"


@dataclass
class ClientRecord:
    client_id: str
    index: int
    num_samples: int = 0
    last_seen: float = 0.0
    alive: bool = True
    opt_out: bool = False
    attacker: bool = False
    # Set by its first poll: a client that joined but is still preparing (data, private model) is not selectable.
    ready: bool = False


DERIVED_FIELDS = ("counts", "graced", "answered", "registry_version")  # derived, never saved


@dataclass
class Answered:
    """Derived: who of an attempt's selected clients has answered (accepted, rejected or declined) and who has not,
    kept from the growth of the lists it was made from (:func:`who_answered`). It holds those lists themselves, not
    their ids: a list replaced (a new attempt) is noticed, and so is one that shrank."""

    selected: list[str]
    accepted: list[str]
    rejected: dict[str, str]
    declined: list[str]
    seen: tuple[int, int, int]  # how many of accepted, rejected and declined are in ``done``
    done: set[str]
    waiting: set[str]  # selected, not answered


@dataclass
class RoundState:
    # The round in progress (1-based); rounds completed = round - 1 (or num_rounds once finished).
    round: int = 1
    attempt: int = 0
    phase: str = SAMPLING
    phase_since: float = 0.0
    deadline: float = 0.0
    selected: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    # Selected clients that declined the round (their app said the device cannot train now: :class:`Declined`):
    # not waited for, not counted as failed.
    declined: list[str] = field(default_factory=list)
    # Every rejection while this round was current, solicited or not.
    rejected_in_round: int = 0
    rejected_total: int = 0
    clients: dict[str, ClientRecord] = field(default_factory=dict)
    outcome: str = ""
    # The fleet reached min_available once since this server started: from then on a round does not wait for
    # clients that were lost (see :func:`start_needs`).
    assembled: bool = False
    # Uploads refused because their round (or attempt) had already closed, since the federation began.
    late_total: int = 0
    # Derived, not saved: (alive, alive and ready) client counts, kept by ``step_in_place`` as each observation changes
    # one record, so a contact costs O(1) in the size of the fleet instead of a count over every client (a
    # 10,000-client fleet joining would cost 10^8 record visits). None: count afresh (after from_dict, and after a
    # liveness check, which may change many records). Code outside ``step_in_place`` that changes a record's ``alive``
    # or ``ready`` must set it to None.
    counts: tuple[int, int] | None = field(default=None, compare=False, repr=False)
    # Derived, not saved: the (round, attempt) whose selected clients the poll grace has been applied to.
    graced: tuple[int, int] | None = field(default=None, compare=False, repr=False)
    # Derived, not saved: the answered and waiting clients of the attempt (:func:`who_answered`), so that an observation
    # late in a round does not build the set of up to K answered clients and scan them again (O(K) per observation,
    # O(K^2) per round: 21 us an update at K = 1,000).
    answered: Answered | None = field(default=None, compare=False, repr=False)
    # Derived, not saved: counts the changes :func:`step_in_place` made to what :meth:`saved_registry` lists (a client
    # registered, or its samples or flags changed at a re-join), so a snapshot can reuse the registry it serialized
    # last (a 1,000-client fleet's is ~0.25 ms of JSON a round). Code outside ``step_in_place`` that changes a record's
    # saved fields must add one.
    registry_version: int = field(default=0, compare=False, repr=False)
    # Buffered rounds (rounds.mode = "buffered"): the tasks in flight and the buffer (:mod:`fedcore.buffered`);
    # None in sync mode (and then not saved at all).
    buffered: bf.BufferState | None = None

    def _plain(self) -> dict[str, Any]:
        """Every saved field but ``clients``, as plain data (the lists and dicts copied)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in DERIVED_FIELDS and f.name not in ("clients", "buffered")}
        d["selected"], d["accepted"], d["rejected"] = list(self.selected), list(self.accepted), dict(self.rejected)
        d["declined"] = list(self.declined)
        d["buffered"] = self.buffered.to_dict() if self.buffered is not None else None
        return d

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, equal to ``dataclasses.asdict`` but ~20x faster: a snapshot of a 1,000-client fleet
        every round must not cost tens of milliseconds."""
        d = self._plain()
        d["clients"] = {cid: dict(vars(rec)) for cid, rec in self.clients.items()}
        return d

    def to_saved(self) -> dict[str, Any]:
        """What a snapshot keeps (:func:`from_dict` reads it): :meth:`to_dict` with each client's record cut to
        what a restart keeps, ``[client_id, index, num_samples, opt_out, attacker]`` in a list. A client's
        liveness (``last_seen``, ``alive``, ``ready``) means nothing to another process: :func:`resume` resets it
        (every client re-joins and polls), so it is not written; a restored record reads not alive and not ready.
        The registry is then ints and flags only: for 10,000 clients 0.38 MB and ~4 ms of ``to_saved`` + JSON
        instead of 1.8 MB and ~27 ms, every round."""
        d = self._plain()
        d["clients"] = self.saved_registry()
        return d

    def saved_registry(self) -> list[list[Any]]:
        """The registry as :meth:`to_saved` writes it: ``[client_id, index, num_samples, opt_out, attacker]`` per
        client, in registration order (changed only with :attr:`registry_version`)."""
        return [[r.client_id, r.index, r.num_samples, r.opt_out, r.attacker] for r in self.clients.values()]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoundState:
        """The state :meth:`to_dict` or :meth:`to_saved` wrote (raises ValueError for a registry of neither
        shape)."""
        d = dict(d)
        for name in DERIVED_FIELDS:
            d.pop(name, None)
        if d.get("buffered") is not None:
            d["buffered"] = bf.BufferState.from_dict(d["buffered"])
        clients = d.get("clients", {})
        if isinstance(clients, dict):
            d["clients"] = {k: ClientRecord(**v) for k, v in clients.items()}
        elif isinstance(clients, list):
            d["clients"] = {}
            for entry in clients:
                if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str)):
                    raise ValueError(f"round_state.clients: a saved client record is [client_id, index, "
                                     f"num_samples, opt_out, attacker], got {entry!r:.200}")
                cid, index, num_samples, opt_out, attacker = entry
                d["clients"][cid] = ClientRecord(cid, int(index), int(num_samples), alive=False,
                                                 opt_out=bool(opt_out), attacker=bool(attacker), ready=False)
        else:
            raise ValueError(f"round_state.clients: expected a table or a list, got {type(clients).__name__}")
        return cls(**d)

    def alive_and_available(self) -> tuple[int, int]:
        """(clients alive, clients alive and ready), from :attr:`counts` or counted afresh."""
        if self.counts is None:
            alive = ready = 0
            for c in self.clients.values():
                if c.alive:
                    alive += 1
                    ready += c.ready
            self.counts = (alive, ready)
        return self.counts

    def alive_ids(self) -> list[str]:
        return sorted(cid for cid, c in self.clients.items() if c.alive)

    def available_ids(self) -> list[str]:
        """Alive clients that have asked for work: the pool a round selects from."""
        return sorted(cid for cid, c in self.clients.items() if c.alive and c.ready)

    @property
    def completed_rounds(self) -> int:
        return self.round - 1 if self.phase != FINISHED else self.round


# ---- observations ----

@dataclass(frozen=True)
class Joined:
    client_id: str
    now: float
    num_samples: int = 0
    opt_out: bool = False
    attacker: bool = False
    # Set by its first poll: a client that joined but is still preparing (data, private model) is not selectable.
    ready: bool = False


@dataclass(frozen=True)
class Seen:
    """Any contact from a live client (heartbeat, poll, upload)."""

    client_id: str
    now: float


@dataclass(frozen=True)
class Polled:
    """The client asked for work: it is ready to be selected."""

    client_id: str
    now: float


@dataclass(frozen=True)
class Declined:
    """The client is alive but declines work now (its device is not eligible: ``PullTaskRequest.declined``): it is
    not selectable until it polls again, and a round that selected it and has no update from it stops waiting for
    it. Unavailable, not failed: no rejection is counted."""

    client_id: str
    now: float


@dataclass(frozen=True)
class Left:
    client_id: str
    now: float


@dataclass(frozen=True)
class Tick:
    now: float
    # Clients holding a connection open right now (parked in a long-poll): alive whatever their last message.
    connected: frozenset[str] = frozenset()
    # Check liveness (every client's silence against the patience, and the poll grace): O(N). A tick without it
    # only moves time-driven phases on (deadlines, the sampling timeout), so a shell may tick often and check
    # liveness seldom.
    liveness: bool = True


@dataclass(frozen=True)
class UpdateAccepted:
    client_id: str
    round: int
    now: float


@dataclass(frozen=True)
class UpdateRejected:
    client_id: str
    round: int
    reason: str
    now: float


@dataclass(frozen=True)
class Aggregated:
    round: int
    now: float
    # Non-empty: the federation ends after this round with this outcome (e.g. "dp_budget": the privacy budget
    # is spent) even when rounds remain.
    finish: str = ""


@dataclass(frozen=True)
class AggregationFailed:
    """The rule could not aggregate what arrived (e.g. too few updates for Krum): the round is re-run."""

    round: int
    reason: str
    now: float


@dataclass(frozen=True)
class AttemptFailed:
    """The round's attempt cannot complete while it trains (secure aggregation lost too many devices, named in
    ``reason``): it is abandoned and re-run at once, not held to its deadline."""

    round: int
    attempt: int
    reason: str
    now: float


@dataclass(frozen=True)
class Pulled:
    """Buffered rounds: the client asked for a task. A device pulls only when it is free, so a task it still holds
    was abandoned (a dropout that came back): it is released, and the client may be granted the current model."""

    client_id: str
    now: float


@dataclass(frozen=True)
class TaskDelivered:
    """Buffered rounds: the granted task of ``client_id`` (round ``round``'s model) was sent to it."""

    client_id: str
    round: int
    now: float


@dataclass(frozen=True)
class Stalled:
    """The shell's loop was held up for ``seconds`` before ``now`` (its process stopped, or starved of CPU or memory):
    what clients sent meanwhile sat unread. Every time-driven anchor moves on by ``seconds`` -- the phase's start,
    the round's deadline, each client's last contact, the buffered tasks' delivery times -- so the server's own stall
    counts against no round, client or task. The shell observes it before anything it read after the stall."""

    now: float
    seconds: float


Observation = (Joined | Seen | Polled | Declined | Left | Tick | UpdateAccepted | UpdateRejected | Aggregated
               | AggregationFailed | AttemptFailed | Pulled | TaskDelivered | Stalled)


# ---- events ----

@dataclass(frozen=True)
class RoundStarted:
    round: int
    attempt: int
    selected: tuple[str, ...]
    deadline: float


@dataclass(frozen=True)
class RoundClosed:
    """Enough updates: the shell aggregates them and then observes :class:`Aggregated`."""

    round: int
    accepted: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class RoundAbandoned:
    round: int
    attempt: int
    accepted: int
    needed: int
    reason: str = "too few updates by the deadline"


@dataclass(frozen=True)
class ClientDropped:
    client_id: str
    silent_for: float


@dataclass(frozen=True)
class FederationFinished:
    rounds: int
    outcome: str


@dataclass(frozen=True)
class TasksGranted:
    """Buffered rounds: these clients may fetch round ``round``'s model now (the shell wakes their polls)."""

    round: int
    clients: tuple[str, ...]


@dataclass(frozen=True)
class TaskHanded:
    """Buffered rounds: a task left (the arrival log's ``hand`` line)."""

    client_id: str
    round: int


@dataclass(frozen=True)
class UpdateBuffered:
    """Buffered rounds: an update trained from round ``base``'s model entered round ``round``'s buffer as its
    ``seq``-th arrival of the federation (the arrival log's ``arrive`` line)."""

    client_id: str
    base: int
    round: int
    seq: int


Event = (RoundStarted | RoundClosed | RoundAbandoned | ClientDropped | FederationFinished | TasksGranted | TaskHanded
         | UpdateBuffered)


@dataclass(frozen=True)
class Limits:
    """What the machine needs of the configuration beyond rounds: liveness patience, and the poll grace.

    ``poll_grace_s`` (0: off): a ready client that is neither holding a poll (``Tick.connected``) nor selected
    in the running round, and was not heard from for this long, is no longer ready (it must poll again to be
    selected); and a selected client that has not been heard from since the round started (it did not come for
    its task) stops counting as pending this long after the start. So ids that joined and polled once, then fell
    silent (a token holder's made-up ids), are not waited for until the patience or the deadline.
    """

    heartbeat_patience_s: float
    poll_grace_s: float = 0.0
    # Buffered rounds replaying an arrival log (rounds.replay): the order to follow (None: timing decides).
    replay: bf.ReplaySchedule | None = None


def select_clients(available: list[str], n: int, seed: int, round_: int, attempt: int) -> list[str]:
    """Uniform sample of ``n`` of ``available`` (sorted first), seeded by (seed, round, attempt)."""
    pool = sorted(available)
    n = min(n, len(pool))
    rng = np.random.default_rng([seed, round_, attempt])
    idx = rng.choice(len(pool), size=n, replace=False)
    return [pool[i] for i in sorted(idx.tolist())]


def admission(state: RoundState, client_id: str, round_: int) -> str | None:
    """Why an update from ``client_id`` for ``round_`` cannot be taken now, or None when it can."""
    closed = closed_reason(state, round_)
    if closed is not None:
        return closed
    if client_id in who_answered(state).waiting:  # the common case, in O(1): selected and not answered yet
        return None
    return answered_reason(state, client_id, round_)


def closed_reason(state: RoundState, round_: int) -> str | None:
    """Why no update for ``round_`` can be taken now (the federation finished, another round, not training)."""
    if state.phase == FINISHED:
        return "the federation has finished"
    if round_ != state.round:
        return f"update for round {round_}, but the current round is {state.round}"
    if state.phase != TRAINING:
        return f"round {round_} is closed"
    return None


def answered_reason(state: RoundState, client_id: str, round_: int) -> str | None:
    """Why the training round cannot take an update from ``client_id``, read from the lists (O(K)): not selected, or
    it already answered. :func:`admission` asks only for a client that is not waiting."""
    if client_id not in state.selected:
        return f"client was not selected for round {round_}"
    if client_id in state.accepted:
        return f"an update for round {round_} was already accepted from this client"
    if client_id in state.rejected:
        return f"an update for round {round_} was already rejected from this client"
    if client_id in state.declined:
        return f"the client declined round {round_}"
    return None


def holds_update(state: RoundState, client_id: str, round_: int) -> bool:
    """Whether ``round_`` is the round in training and already holds an update accepted from ``client_id``."""
    return state.phase == TRAINING and round_ == state.round and client_id in state.accepted


def who_answered(s: RoundState) -> Answered:
    """The attempt's answered and waiting clients: :attr:`RoundState.answered` brought up to date with what was
    appended to ``accepted``, ``rejected`` and ``declined`` since (their only changes within an attempt), or made
    afresh when any of them or ``selected`` was replaced or shrank."""
    a = s.answered
    if (a is None or a.selected is not s.selected or a.accepted is not s.accepted or a.rejected is not s.rejected
            or a.declined is not s.declined or len(s.accepted) < a.seen[0] or len(s.rejected) < a.seen[1]
            or len(s.declined) < a.seen[2]):
        done = set(s.accepted)
        done.update(s.rejected)
        done.update(s.declined)
        a = Answered(s.selected, s.accepted, s.rejected, s.declined,
                     (len(s.accepted), len(s.rejected), len(s.declined)), done, set(s.selected) - done)
        s.answered = a
        return a
    n_accepted, n_rejected, n_declined = a.seen
    if (len(s.accepted), len(s.rejected), len(s.declined)) != a.seen:
        new = [*s.accepted[n_accepted:], *itertools.islice(s.rejected, n_rejected, None), *s.declined[n_declined:]]
        a.done.update(new)
        a.waiting.difference_update(new)
        a.seen = (len(s.accepted), len(s.rejected), len(s.declined))
    return a


def step_in_place(state: RoundState, obs: Observation, config: RoundsConfig, limits: Limits) -> tuple[
    RoundState, list[Event]
]:
    """Apply one observation to ``state`` -- updated in place (a copy per observation would cost O(fleet) on the
    hot path) and returned -- and list the events it caused.

    Liveness (dropping silent clients) is evaluated on :class:`Tick` observations only, so the cost of a
    contact from one client does not grow with the size of the fleet.
    """
    s = state
    if isinstance(obs, Stalled):
        _shift_clock(s, obs.seconds)
        return s, []
    if config.mode == bf.BUFFERED:
        return s, _step_buffered(s, obs, config, limits)
    # A contact from a client that was already alive (and, for a poll, already ready) changes nothing a waiting
    # round could start on; time-driven transitions come with Tick. Skipping the round's re-evaluation keeps a contact
    # O(1) in the size of the fleet (a thousand parked clients would otherwise be counted on every poll), and
    # skipping the general path below keeps the commonest observation to a dict lookup and a few compares.
    rec = _quiet_contact(s, obs, limits)
    if rec is not None:
        rec.last_seen = obs.now
        return s, []
    events: list[Event] = []
    touched = getattr(obs, "client_id", None) if isinstance(obs, Joined | Seen | Polled | Declined | Left) else None
    before = _standing(s, touched)
    if isinstance(obs, Joined | Seen | Polled | Declined | Left):
        _contact(s, obs)
    elif isinstance(obs, UpdateAccepted):
        if admission(s, obs.client_id, obs.round) is None:
            s.accepted.append(obs.client_id)
            s.clients[obs.client_id].last_seen = obs.now
    elif isinstance(obs, UpdateRejected):
        s.rejected_total += 1
        s.rejected_in_round += 1
        if obs.round < s.round or (obs.round == s.round and s.phase != TRAINING):
            s.late_total += 1
        if obs.round == s.round and s.phase == TRAINING and obs.client_id in s.selected:
            s.rejected.setdefault(obs.client_id, obs.reason)
    elif isinstance(obs, Aggregated) and s.phase == AGGREGATING and obs.round == s.round:
        _next_round(s, obs.now, config, events, obs.finish)
    elif isinstance(obs, AggregationFailed | AttemptFailed) and _fails_attempt(s, obs):
        events.append(RoundAbandoned(s.round, s.attempt, len(s.accepted), config.effective_min_updates,
                                     obs.reason))
        s.attempt += 1
        _to_sampling(s, obs.now)
    if touched is not None and s.counts is not None:
        after = _standing(s, touched)
        s.counts = (s.counts[0] + after[0] - before[0], s.counts[1] + after[1] - before[1])
    if isinstance(obs, Tick):
        _advance(s, obs.now, config, limits, events, check_liveness=obs.liveness, connected=obs.connected)
    else:  # a quiet contact with nothing due returned above
        _advance(s, obs.now, config, limits, events)
    return s, events


def _shift_clock(s: RoundState, seconds: float) -> None:
    """:class:`Stalled`: every time anchor of ``s`` moves on by ``seconds`` (O(clients); a stall is rare). Differences
    between anchors (a client heard from since the round began, for the poll grace) stay as they were."""
    if not (math.isfinite(seconds) and seconds > 0):
        return
    s.phase_since += seconds
    if s.deadline:
        s.deadline += seconds
    for rec in s.clients.values():
        rec.last_seen += seconds
    if s.buffered is not None:
        for c in s.buffered.delivered_at:
            s.buffered.delivered_at[c] += seconds


def _contact(s: RoundState, obs: Joined | Seen | Polled | Declined | Left) -> None:
    """A client's record after it joined, was heard from, declined or left."""
    if isinstance(obs, Joined):
        rec = s.clients.get(obs.client_id)
        if rec is None:
            rec = ClientRecord(obs.client_id, index=len(s.clients))
            s.clients[obs.client_id] = rec
            s.registry_version += 1
        if (rec.num_samples, rec.opt_out, rec.attacker) != (obs.num_samples, obs.opt_out, obs.attacker):
            rec.num_samples, rec.opt_out, rec.attacker = obs.num_samples, obs.opt_out, obs.attacker
            s.registry_version += 1
        rec.last_seen, rec.alive = obs.now, True
    elif isinstance(obs, Seen | Polled):
        rec = s.clients.get(obs.client_id)
        if rec is not None:
            rec.last_seen, rec.alive = obs.now, True
            rec.ready = rec.ready or isinstance(obs, Polled)
    elif isinstance(obs, Declined):
        rec = s.clients.get(obs.client_id)
        if rec is not None:
            rec.last_seen, rec.alive, rec.ready = obs.now, True, False
            if (s.phase == TRAINING and obs.client_id in s.selected and obs.client_id not in s.accepted
                    and obs.client_id not in s.rejected and obs.client_id not in s.declined):
                s.declined.append(obs.client_id)
    else:
        rec = s.clients.get(obs.client_id)
        if rec is not None:
            rec.alive = False


def _fails_attempt(s: RoundState, obs: AggregationFailed | AttemptFailed) -> bool:
    """Whether ``obs`` ends the round's current attempt: its aggregation failed, or (secure aggregation) it cannot
    complete while it trains."""
    if isinstance(obs, AggregationFailed):
        return s.phase == AGGREGATING and obs.round == s.round
    return s.phase == TRAINING and (obs.round, obs.attempt) == (s.round, s.attempt)


def _quiet_contact(s: RoundState, obs: Observation, limits: Limits) -> ClientRecord | None:
    """The record of a quiet contact's client, else None: a Seen or a Polled from a client already alive (and, for a
    poll, already ready) with nothing time-driven due (:func:`_nothing_due`). It moves that client's ``last_seen``
    and changes nothing else (no count, no event); two of a client-round's four observations are such contacts."""
    kind = type(obs)
    if kind is not Seen and kind is not Polled:
        return None
    rec = s.clients.get(obs.client_id)  # type: ignore[union-attr]
    if rec is None or not rec.alive or not (rec.ready or kind is Seen) or not _nothing_due(s, obs.now, limits):
        return None
    return rec


def _nothing_due(s: RoundState, now: float, limits: Limits) -> bool:
    """Whether :func:`_advance` would change nothing after a quiet contact (a client already alive, and ready if
    it polled, heard from again). While sampling such a contact adds no available client; while training it can only
    keep a client owed an update (its ``last_seen`` grows), never close the round, so only the time-driven steps
    matter: the deadline, and the poll grace's once-per-attempt pass. Skipping the rest keeps the commonest
    observation O(1) in K (``_advance`` builds the set of the K answered clients: three contacts per client-round,
    O(K^2) per round otherwise). Aggregating or finished, ``_advance`` does nothing without a Tick."""
    if s.phase != TRAINING:
        return True
    grace = limits.poll_grace_s
    return now < s.deadline and not (grace and now - s.phase_since >= grace and s.graced != (s.round, s.attempt))


def _standing(s: RoundState, client_id: str | None) -> tuple[int, int]:
    """(alive, alive and ready) of one client, as 0/1 (0, 0 for an unknown or no client)."""
    rec = s.clients.get(client_id) if client_id is not None else None
    if rec is None or not rec.alive:
        return 0, 0
    return 1, int(rec.ready)


def _next_round(s: RoundState, now: float, config: RoundsConfig, events: list[Event], finish: str = "") -> None:
    if finish or s.round >= config.num_rounds:
        s.phase, s.outcome = FINISHED, finish or "completed"
        s.phase_since = now
        events.append(FederationFinished(s.round, s.outcome))
        return
    s.round += 1
    s.attempt = 0
    _to_sampling(s, now)


def _to_sampling(s: RoundState, now: float) -> None:
    s.phase, s.phase_since = SAMPLING, now
    s.selected, s.accepted, s.rejected, s.rejected_in_round = [], [], {}, 0
    s.declined = []


def _advance(s: RoundState, now: float, config: RoundsConfig, limits: Limits, events: list[Event],
             check_liveness: bool = False, connected: frozenset[str] = frozenset()) -> None:
    if check_liveness:
        _liveness(s, now, limits, events, connected)
    if s.phase == SAMPLING:
        available = s.alive_and_available()[1]
        if available >= config.effective_min_available:
            s.assembled = True
        if available >= start_needs(s, config):
            _start_round(s, s.available_ids(), now, config, events)
        elif now - s.phase_since >= config.sampling_timeout_s:
            if available >= config.effective_min_updates:
                _start_round(s, s.available_ids(), now, config, events)
            else:
                s.phase, s.outcome, s.phase_since = FINISHED, "stalled", now
                events.append(FederationFinished(s.round - 1, s.outcome))
    elif s.phase == TRAINING:
        k = config.clients_per_round
        grace = limits.poll_grace_s
        # Who has answered and who not, kept up to date (not built per observation: O(K) each, O(K^2) a round).
        ans = who_answered(s)
        graced = bool(grace) and now - s.phase_since >= grace
        if graced and s.graced != (s.round, s.attempt):
            # Selected clients that did not come for their task within the grace are not waited for, and are not
            # ready again until they poll (else the next attempt could select the same silent ids). Once per
            # attempt: a client's last_seen only grows, so no other client can fall under it later.
            for c in s.selected:
                rec = s.clients[c]
                if c not in ans.done and rec.alive and rec.last_seen <= s.phase_since and rec.ready:
                    rec.ready = False
                    if s.counts is not None:
                        s.counts = (s.counts[0], s.counts[1] - 1)
            s.graced = (s.round, s.attempt)
        # A client still owed an update: the first waiting one early in a round, few to look at late in it.
        pending = any(s.clients[c].alive and (not graced or s.clients[c].last_seen > s.phase_since)
                      for c in ans.waiting)
        if len(s.accepted) >= k:
            _close(s, now, "quorum", events)
        elif not pending and len(s.accepted) >= config.effective_min_updates:
            _close(s, now, "all_responded", events)
        elif now >= s.deadline or not pending:
            if len(s.accepted) >= config.effective_min_updates:
                _close(s, now, "deadline", events)
            else:
                events.append(RoundAbandoned(s.round, s.attempt, len(s.accepted), config.effective_min_updates))
                s.attempt += 1
                _to_sampling(s, now)
                _advance(s, now, config, limits, events)


def _liveness(s: RoundState, now: float, limits: Limits, events: list[Event], connected: frozenset[str],
              busy: set[str] | None = None) -> None:
    """A client silent past its patience leaves the available pool until it re-joins; with a poll grace, a ready
    client silent past it that is not ``busy`` (selected in the running round) must poll again."""
    for cid in connected:
        if cid in s.clients:
            s.clients[cid].last_seen = now
    grace = limits.poll_grace_s
    if busy is None:
        busy = set(s.selected) if grace and s.phase != SAMPLING else set()
    s.counts = None  # many records may change: counted afresh below
    for cid in sorted(s.clients):
        rec = s.clients[cid]
        if rec.alive and now - rec.last_seen > limits.heartbeat_patience_s:
            rec.alive = False
            events.append(ClientDropped(cid, now - rec.last_seen))
        elif grace and rec.ready and now - rec.last_seen > grace and cid not in busy:
            rec.ready = False


def start_needs(s: RoundState, config: RoundsConfig) -> int:
    """Available clients a round needs to start: ``min_available`` (K by default) until the fleet has reached it
    once; after that, every live client (those not lost to silence or a leave) when fewer than that are alive,
    but never fewer than ``min_updates``. In a healthy fleet this is ``min_available``; a lost device lowers it
    at once instead of stalling the federation until ``sampling_timeout_s``."""
    if not s.assembled:
        return config.effective_min_available
    alive = s.alive_and_available()[0]
    return max(config.effective_min_updates, min(config.effective_min_available, alive))


def _start_round(s: RoundState, alive: list[str], now: float, config: RoundsConfig, events: list[Event]) -> None:
    s.selected = select_clients(alive, config.num_selected, config.seed, s.round, s.attempt)
    s.accepted, s.rejected, s.rejected_in_round, s.declined = [], {}, 0, []
    s.phase, s.phase_since = TRAINING, now
    s.deadline = now + config.round_timeout_s
    events.append(RoundStarted(s.round, s.attempt, tuple(s.selected), s.deadline))


def _close(s: RoundState, now: float, reason: str, events: list[Event]) -> None:
    s.phase, s.phase_since = AGGREGATING, now
    events.append(RoundClosed(s.round, tuple(s.accepted), reason))


def resume(state: RoundState, completed_rounds: int, config: RoundsConfig, now: float) -> RoundState:
    """A saved state made ready for a restarted server (``state`` is updated in place and returned).

    ``completed_rounds`` is the snapshot's count. A state saved while its round was aggregating (the snapshot of
    a completed round) moves on to the next round, or finishes; a round that was in flight is re-run from
    sampling with the same round number and attempt counter, hence the same selection seed. Times from the
    previous process mean nothing now: every client must re-join and poll before it is selectable again. A
    federation that completed all its rounds stays finished, unless ``config.num_rounds`` now asks for more; one
    that stalled tries again.
    """
    s = state
    for rec in s.clients.values():
        rec.alive, rec.ready, rec.last_seen = False, False, now
    s.assembled = False  # every client must re-join: wait for the fleet to assemble again
    if s.phase == AGGREGATING and s.round == completed_rounds:
        if s.round >= config.num_rounds:
            s.phase, s.outcome = FINISHED, "completed"
        else:
            s.round, s.attempt = s.round + 1, 0
    if s.phase == FINISHED and (s.outcome != "completed" or completed_rounds < config.num_rounds):
        s.phase, s.outcome = SAMPLING, ""
        s.round, s.attempt = completed_rounds + 1, 0
    if s.phase != FINISHED:
        if s.round != completed_rounds + 1:  # a progress record of another round: re-run from the snapshot
            s.round, s.attempt = completed_rounds + 1, 0
        s.phase, s.outcome = SAMPLING, ""
    s.phase_since = now
    s.deadline = 0.0
    s.selected, s.accepted, s.rejected, s.rejected_in_round = [], [], {}, 0
    s.declined = []
    return s


# ---- buffered rounds (rounds.mode = "buffered"; fedcore.buffered holds the bookkeeping) ----

def buffer_of(s: RoundState) -> bf.BufferState:
    """The buffered rounds' state of ``s`` (made on first use)."""
    if s.buffered is None:
        s.buffered = bf.BufferState()
    return s.buffered


def buffered_admission(s: RoundState, client_id: str, base: int, config: RoundsConfig,
                       limits: Limits) -> tuple[str, str] | None:
    """Why round ``s.round``'s buffer cannot take an update of ``client_id`` trained from round ``base``'s model,
    as ``(code, reason)`` (:data:`fedcore.buffered.RETRY`: send it again), or None."""
    return bf.admission(buffer_of(s), client_id, base, s.round, s.phase == AGGREGATING, s.phase == FINISHED,
                        config.max_staleness, limits.replay)


def _step_buffered(s: RoundState, obs: Observation, config: RoundsConfig, limits: Limits) -> list[Event]:
    """:func:`step_in_place` of buffered rounds. Phases: ``sampling`` until ``min_available`` clients are ready
    (once), then ``training`` (filling round ``s.round``'s buffer: ``s.accepted``; ``s.selected`` lists the tasks
    granted while it filled) -> ``aggregating`` (M updates arrived) -> ``training`` of the next round, ...,
    ``finished``. Devices in flight keep training across buffers."""
    b = buffer_of(s)
    events: list[Event] = []
    s.counts = None  # a buffered fleet is counted afresh (its observations are few per task)
    replay = limits.replay
    if isinstance(obs, Joined | Seen | Polled | Declined | Left):
        _contact(s, obs)
        if isinstance(obs, Declined | Left):
            b.free(obs.client_id)
    elif isinstance(obs, Pulled):
        _contact(s, Polled(obs.client_id, obs.now))
        if obs.client_id in b.flight and obs.client_id not in b.undelivered:
            b.free(obs.client_id)  # it pulls, so it is free: the task it held was abandoned
    elif isinstance(obs, TaskDelivered):
        if b.flight.get(obs.client_id) == obs.round == s.round and obs.client_id in b.undelivered:
            b.undelivered.remove(obs.client_id)
            b.delivered_at[obs.client_id] = obs.now
            b.delivered += 1
            if replay is not None:
                b.replayed[obs.client_id] = b.replayed.get(obs.client_id, 0) + 1
            events.append(TaskHanded(obs.client_id, obs.round))
    elif isinstance(obs, UpdateAccepted):
        base = b.flight.get(obs.client_id)
        if s.phase == TRAINING and base == obs.round and obs.client_id not in b.undelivered:
            b.free(obs.client_id)
            s.accepted.append(obs.client_id)
            b.buffer.append([obs.client_id, obs.round])
            b.arrivals += 1
            events.append(UpdateBuffered(obs.client_id, obs.round, s.round, b.arrivals))
            rec = s.clients.get(obs.client_id)
            if rec is not None:
                rec.last_seen = obs.now
    elif isinstance(obs, UpdateRejected):
        s.rejected_total += 1
        s.rejected_in_round += 1
        if b.flight.get(obs.client_id) == obs.round:
            b.free(obs.client_id)
            s.late_total += obs.round < s.round
    elif isinstance(obs, Aggregated) and s.phase == AGGREGATING and obs.round == s.round:
        if obs.finish or s.round >= config.num_rounds:
            s.phase, s.outcome, s.phase_since = FINISHED, obs.finish or "completed", obs.now
            events.append(FederationFinished(s.round, s.outcome))
            return events
        s.round, s.attempt = s.round + 1, 0
        _open_buffer(s, b, obs.now, config, events, replay is not None)
    elif isinstance(obs, AggregationFailed) and s.phase == AGGREGATING and obs.round == s.round:
        events.append(RoundAbandoned(s.round, s.attempt, len(s.accepted), config.clients_per_round, obs.reason))
        s.attempt += 1
        _open_buffer(s, b, obs.now, config, events, replay is not None)
    elif isinstance(obs, Tick):
        if obs.liveness:
            _liveness(s, obs.now, limits, events, obs.connected, busy=set(b.flight))
            for ev in events:
                if isinstance(ev, ClientDropped):
                    b.free(ev.client_id)
        if replay is None:
            for cid in b.expired(obs.now, config.round_timeout_s):  # not waited for any more
                b.free(cid)
    _advance_buffered(s, b, obs.now, config, limits, events)
    return events


def _open_buffer(s: RoundState, b: bf.BufferState, now: float, config: RoundsConfig, events: list[Event],
                 replaying: bool = False) -> None:
    """Round ``s.round``'s buffer opens (empty); tasks granted and not fetched yet will carry its model."""
    s.phase, s.phase_since = TRAINING, now
    s.deadline = now + config.round_timeout_s
    s.selected, s.accepted, s.rejected, s.rejected_in_round, s.declined = [], [], {}, 0, []
    b.buffer, b.delivered = [], 0
    b.rebase(s.round)
    events.append(RoundStarted(s.round, s.attempt, tuple(b.undelivered), s.deadline))
    if b.restored and b.restored_round == s.round:
        _refold(s, b, events, replaying)
    b.restored, b.restored_round = [], 0


def _refold(s: RoundState, b: bf.BufferState, events: list[Event], replaying: bool) -> None:
    """A resumed server's buffer opens with the updates its store kept (in arrival order), as if they had just
    arrived: each leaves the tasks in flight and enters the buffer; a task handed in this round (its base) counts
    as delivered in it (and, replaying, as the client's next logged task)."""
    for client_id, base in b.restored:
        b.free(client_id)
        if base == s.round:
            b.delivered += 1
            if replaying:
                b.replayed[client_id] = b.replayed.get(client_id, 0) + 1
            events.append(TaskHanded(client_id, base))
        s.accepted.append(client_id)
        b.buffer.append([client_id, base])
        b.arrivals += 1
        events.append(UpdateBuffered(client_id, base, s.round, b.arrivals))


def _advance_buffered(s: RoundState, b: bf.BufferState, now: float, config: RoundsConfig, limits: Limits,
                      events: list[Event]) -> None:
    if s.phase == SAMPLING:
        available = s.alive_and_available()[1]
        if available >= config.effective_min_available:
            s.assembled = True
        if s.assembled or (now - s.phase_since >= config.sampling_timeout_s and available >= 1):
            _open_buffer(s, b, now, config, events, limits.replay is not None)
        elif now - s.phase_since >= config.sampling_timeout_s:
            s.phase, s.outcome, s.phase_since = FINISHED, "stalled", now
            events.append(FederationFinished(s.round - 1, s.outcome))
            return
    if s.phase != TRAINING:
        return
    replay = limits.replay
    if replay is not None:  # the logged buffer: its arrivals all in, and every task logged in it delivered
        if (len(b.buffer) == len(replay.arrivals.get(s.round, ()))
                and b.delivered >= replay.hands_in.get(s.round, 0)):
            _close(s, now, "replayed", events)
            return
    elif len(s.accepted) >= config.clients_per_round:
        _close(s, now, "buffer_full", events)
        return
    _grant(s, b, now, config, replay, events)


def _grant(s: RoundState, b: bf.BufferState, now: float, config: RoundsConfig, replay: bf.ReplaySchedule | None,
           events: list[Event]) -> None:
    """Fill the free slots: a seeded uniform draw among the ready clients holding no task and not in this buffer
    (replaying: the clients whose next logged task is from this round)."""
    busy = set(b.flight)
    busy.update(s.accepted)
    if replay is not None:
        pick = [c for c in s.available_ids()
                if c not in busy and replay.next_hand(c, b.replayed.get(c, 0)) == s.round]
    else:
        need = config.effective_concurrency - len(b.flight)
        if need <= 0:
            return
        free = [c for c in s.available_ids() if c not in busy]
        if not free:
            return
        pick = select_clients(free, need, config.seed, s.round, 1000 + b.hands)
    if not pick:
        return
    b.hands += 1
    for c in pick:
        b.grant(c, s.round)
        s.selected.append(c)
    events.append(TasksGranted(s.round, tuple(pick)))


def resume_buffered(s: RoundState, completed_rounds: int, config: RoundsConfig, now: float) -> RoundState:
    """:func:`resume` of buffered rounds: the snapshot's round machine with its tasks in flight kept (their devices
    may still deliver, against the versions saved with them); a buffer being filled is filled again from empty
    (its arrivals since the snapshot are lost; their devices' updates are refused, and they pull again)."""
    b = buffer_of(s)
    flight = dict(b.flight)
    s = resume(s, completed_rounds, config, now)
    b.flight = {c: r for c, r in flight.items() if c not in b.undelivered}
    b.undelivered = []
    b.delivered_at = dict.fromkeys(b.flight, now)
    b.buffer = []
    s.buffered = b
    return s


def restore_buffer(s: RoundState, entries: list[tuple[str, int]]) -> None:
    """A resumed buffered server's store kept ``entries`` ((client, base), in arrival order) for the buffer of
    ``s.round`` (the one being filled when the last process died): they are re-folded when it opens."""
    b = buffer_of(s)
    b.restored = [[c, int(base)] for c, base in entries]
    b.restored_round = s.round
