"""Secure aggregation's server shell: the SecAgg+ machine of :mod:`fedcore.secagg.protocol` driven by the round.

A secure round runs inside the round machine's (:mod:`fedcore.rounds`) attempt, one protocol round per attempt
(:func:`protocol_round`: the attempt is bound into every key, share and mask):

1. **advertise** -- a selected device that received its task advertises its keys (``SecAggRequest.advertisement``)
   and waits for its key request; the phase closes once every selected device advertised, or
   ``secagg.phase_timeout_s`` after it opened (the silent are dropped);
2. **share** -- each participant uploads its sealed shares and waits for its mask request (the same deadline);
3. **masked** -- each device trains, masks its update (:func:`fedcore.secagg.aggregate.prepare_input`) and uploads it
   as an update of kind MASKED through the usual upload path (:meth:`take_masked`: added to the running sum and
   counted with the round machine as the device's update). The phase is the round's training: it closes when
   every device that shared has uploaded, or when the round machine closes the round (quorum, deadline);
4. **unmask** -- the survivors reveal shares (``SecAggRequest.unmask``); the round's close waits for the sum
   (:meth:`unmasked`, ``phase_timeout_s``) and aggregates it (:class:`fedcore.secagg.aggregate.SecureFedAvg`).

A round the protocol abandons (too few advertised, too many dropped, a secret below its threshold, a bad share)
re-runs: during training through :class:`fedcore.rounds.AttemptFailed`, at the close as a failed aggregation; its
reason is named in the ``round.abandoned`` line. The server holds no client secret and never an individual update:
public keys, sealed shares, commitments, the running masked sum and the shares revealed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable
from typing import Any

from fedcore import rounds as rm
from fedcore.config import ServerConfig
from fedcore.secagg import protocol as sp
from fedcore.secagg.aggregate import NUM_EXTRAS
from fedcore.secagg.config import SecureSettings, protocol_round
from fedcore.secagg.crypto import Verifier
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver.errors import ProtocolError


def graph_seed(seed: int, round_: int, attempt: int) -> int:
    """The neighbour graph's seed of an attempt: derived from the federation seed, the round and the attempt."""
    digest = hashlib.sha256(f"fedguard/secagg/graph/{seed}/{round_}/{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def settings_of(config: ServerConfig) -> SecureSettings | None:
    """What the server announces of its secure aggregation (None when it is off)."""
    agg = config.aggregation
    if agg.secure == "off":
        return None
    return SecureSettings(config.secagg, agg.secure, agg.clip_norm, agg.weighted, agg.max_update_norm)


def session_bound(client_id: str, message: bytes, signature: bytes) -> bool:
    """The verifier without enrolled keys: the authenticated session (mutual TLS, or the session token over TLS)
    binds an advertisement to its client, and a signature is not expected."""
    return signature == b""


class SecureRounds:
    """The current attempt's protocol state and the devices waiting on it (module docstring). ``observe`` reports
    to the round machine; ``verify`` checks advertisement signatures (:func:`session_bound` or the enrolled keys)."""

    def __init__(self, config: ServerConfig, num_params: int, clock: Callable[[], float], log: Any,
                 verify: Verifier, observe: Callable[[rm.Observation], None],
                 notice_stall: Callable[[float], None] = lambda now: None) -> None:
        self.enabled = config.aggregation.secure != "off"
        self.config = config.secagg
        self.federation_id = config.server.federation_id
        self.seed = config.rounds.seed
        self.num_params = num_params
        self.long_poll_s = config.server.long_poll_s
        self._clock = clock
        self.log = log
        self.verify = verify
        self._observe = observe
        # Called before a phase's deadline is judged: a stall of the server's loop found there moves the phase's start
        # on (:meth:`stalled`), so the devices' answers that sat in the sockets meanwhile are not dropped as late.
        self._notice_stall = notice_stall
        self.state: sp.ServerState | None = None
        self.round = 0
        self.attempt = 0
        self._phase_since = 0.0
        self._changed: asyncio.Event | None = None
        self.dropped_total = 0

    # ---- the round's life ----

    def open(self, round_: int, attempt: int, selected: tuple[str, ...]) -> None:
        """A round (or a new attempt of it) started: a fresh protocol round over ``selected``."""
        if not self.enabled:
            return
        self.round, self.attempt = round_, attempt
        self.state, _ = sp.new_round(self.federation_id, protocol_round(round_, attempt), selected, self.config,
                                     graph_seed(self.seed, round_, attempt), self.num_params, NUM_EXTRAS)
        self._phase_since = self._clock()
        self._notify()

    def tick(self, now: float) -> None:
        """Close an exchange phase (advertise, share, unmask) whose deadline passed."""
        s = self.state
        if s is None or s.phase not in (sp.ADVERTISE, sp.SHARE, sp.UNMASK):
            return
        self._notice_stall(now)
        if now - self._phase_since >= self.config.phase_timeout_s:
            self._apply(sp.Deadline(s.round, s.phase))

    def stalled(self, seconds: float) -> None:
        """The server's loop was held up ``seconds``: the open phase's deadline moves on by them."""
        self._phase_since += seconds

    def end_masking(self, round_: int) -> None:
        """The round machine closed the round: no more masked inputs; whoever shared and did not upload dropped."""
        s = self.state
        if s is not None and self.round == round_ and s.phase == sp.MASKED:
            self._apply(sp.Deadline(s.round, sp.MASKED))
        elif s is not None and self.round == round_ and s.phase in (sp.ADVERTISE, sp.SHARE):
            self._apply(sp.Deadline(s.round, s.phase))  # closed before masking began: abandons below the minimum

    async def unmasked(self, round_: int) -> sp.SecureSum:
        """The round's unmasked sum, once the survivors revealed their shares (or ``phase_timeout_s`` passed);
        raises ValueError naming why the round cannot be summed."""
        self.end_masking(round_)
        while True:
            s = self.state
            if s is None or self.round != round_:
                raise ValueError(f"no secure round {round_} in progress")
            if s.phase == sp.DONE and s.result is not None:
                return s.result
            if s.phase == sp.ABANDONED:
                raise ValueError(f"secure aggregation abandoned the round: {s.reason}: {s.detail}")
            changed = self._event()
            with contextlib.suppress(asyncio.TimeoutError):
                remaining = self.config.phase_timeout_s - (self._clock() - self._phase_since)
                await asyncio.wait_for(changed.wait(), timeout=max(0.01, min(0.25, remaining)))
            self.tick(self._clock())

    def summary(self) -> dict[str, float]:
        """The round's secure-aggregation figures for its report."""
        s = self.state
        if s is None or s.graph is None:
            return {}
        return {"secagg_participants": float(len(s.participants)), "secagg_survivors": float(len(s.masked)),
                "secagg_dropped": float(len(s.dropped)), "secagg_neighbours": float(s.graph.neighbours),
                "secagg_threshold": float(s.graph.threshold)}

    # ---- the devices' messages ----

    def take_masked(self, client_id: str, round_: int, attempt: int, vector: sp.Words) -> None:
        """A device's masked input (an update of kind MASKED): into the running sum, or :class:`ProtocolError`."""
        s = self._current(round_, attempt)
        self._apply(sp.MaskedUpload(s.federation_id, s.round, client_id, vector), refuse=True)

    async def exchange(self, client_id: str, request: pb.SecAggRequest) -> pb.SecAggReply:
        """One ``SecAggRequest``: its upload applied (:class:`ProtocolError` when refused), then the device's next
        request once its phase opens (or a wait after ``max_wait_s``)."""
        if not self.enabled:
            raise ProtocolError("FAILED_PRECONDITION", "this server does not run secure aggregation "
                                                       "(aggregation.secure = \"off\")")
        kind = request.WhichOneof("kind")
        round_, attempt = int(request.round), int(request.attempt)
        if kind in (None, "poll"):
            if self.state is None or (round_, attempt) != (self.round, self.attempt):
                return self._reply(round_, attempt, abandoned=f"round {round_} attempt {attempt} is not the "
                                                              "current secure round")
        else:
            s = self._current(round_, attempt)
            obs: sp.Observation
            if kind == "advertisement":
                obs = wire.advertisement_from_pb(request.advertisement, s.federation_id, s.round)
                if obs.client_id != client_id:
                    raise ProtocolError("PERMISSION_DENIED", "an advertisement for another client than the "
                                                             "session's (forged)")
            elif kind == "shares":
                obs = wire.shares_from_pb(request.shares, s.federation_id, s.round, client_id)
            else:
                obs = wire.unmask_from_pb(request.unmask, s.federation_id, s.round, client_id)
            self._apply(obs, refuse=True)
        wait = min(max(0.0, float(request.max_wait_s)), self.long_poll_s)
        return await self._next_request(client_id, wait)

    # ---- inside ----

    def _current(self, round_: int, attempt: int) -> sp.ServerState:
        s = self.state
        if s is None or (round_, attempt) != (self.round, self.attempt):
            raise ProtocolError("FAILED_PRECONDITION", f"secure-aggregation message for round {round_} attempt "
                                                       f"{attempt}; the current is round {self.round} attempt "
                                                       f"{self.attempt}")
        return s

    def _apply(self, obs: sp.Observation, refuse: bool = False) -> None:
        assert self.state is not None
        before, dropped = self.state.phase, set(self.state.dropped)
        self.state, events = sp.step(self.state, obs, self.verify, in_place=True)  # the old state is dropped
        for c in sorted(set(self.state.dropped) - dropped):
            if self.state.dropped[c] == sp.UNMASK:
                continue  # its masked input is in the sum: only its reveals are missing
            reason = f"secure aggregation: dropped in phase {self.state.dropped[c]}"
            self._observe(rm.UpdateRejected(c, self.round, reason, self._clock()))  # the round stops waiting for it
        for ev in events:
            if isinstance(ev, sp.Refused):
                self.log.warning("secagg.refused", client_id=ev.client_id, round=self.round, attempt=self.attempt,
                                 reason=ev.reason)
                if refuse:
                    raise ProtocolError("FAILED_PRECONDITION", f"secure aggregation: {ev.reason}")
            elif isinstance(ev, sp.PhaseStarted):
                self._phase_since = self._clock()
                self.log.info("secagg.phase", round=self.round, attempt=self.attempt, phase=ev.phase,
                              clients=len(ev.clients), dropped=len(self.state.dropped))
            elif isinstance(ev, sp.Abandoned):
                reason = f"secure aggregation: {ev.reason} in phase {ev.phase}: {ev.detail}"
                self.log.warning("secagg.abandoned", round=self.round, attempt=self.attempt, reason=reason)
                if ev.phase != sp.UNMASK:  # still training: the attempt is re-run now (else the close fails)
                    self._observe(rm.AttemptFailed(self.round, self.attempt, reason, self._clock()))
            elif isinstance(ev, sp.Completed):
                self.dropped_total += len(self.state.dropped)
                self.log.info("secagg.completed", round=self.round, attempt=self.attempt,
                              survivors=len(ev.result.survivors), dropped=len(self.state.dropped))
        if self.state.phase != before or events:
            self._notify()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _next_request(self, client_id: str, wait_s: float) -> pb.SecAggReply:
        deadline = self._clock() + wait_s
        while True:
            reply = self._request_for(client_id)
            if reply is not None:
                return reply
            remaining = deadline - self._clock()
            if remaining <= 0:
                return self._reply(self.round, self.attempt, wait=pb.Wait(retry_after_s=0.0))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event().wait(), timeout=remaining)

    def _reply(self, round_: int, attempt: int, **kind: Any) -> pb.SecAggReply:
        return pb.SecAggReply(round=round_, attempt=attempt, **kind)

    def _request_for(self, c: str) -> pb.SecAggReply | None:
        """The device's next request in the current phase, ``done``, ``abandoned``, or None (nothing yet)."""
        s = self.state
        assert s is not None
        r, a = self.round, self.attempt
        if s.phase == sp.ABANDONED:
            return self._reply(r, a, abandoned=f"{s.reason}: {s.detail}")
        if c not in s.selected:
            return self._reply(r, a, abandoned="not selected for this round")
        if c in s.dropped:
            return self._reply(r, a, abandoned=f"counted as dropped in phase {s.dropped[c]}")
        if s.phase == sp.DONE or c in s.revealed:
            return self._reply(r, a, done=True)
        if s.phase == sp.SHARE:
            if c in s.shares:
                return None
            return self._reply(r, a, key_request=wire.key_request_to_pb(sp.key_request(s, c)))
        if s.phase == sp.MASKED:
            if c in s.masked:
                return None
            return self._reply(r, a, mask_request=wire.mask_request_to_pb(sp.mask_request(s, c)))
        if s.phase == sp.UNMASK:
            if c not in s.masked:
                return self._reply(r, a, abandoned="its masked input is not in this round's sum")
            return self._reply(r, a, unmask_request=wire.unmask_request_to_pb(sp.unmask_request(s, c)))
        return None  # advertise: waiting for the others
