"""The server's NFL detectors: deterministic state machines over plain, serializable state (SPEC §6).

``state, events = step(state, observation, config)``, shaped like :mod:`fedcore.rounds`: after each aggregated
round the server feeds it an :class:`NflObservation` (the round's median of the clients' β̂ᵢ and LINDT's Δ) and
acts on the :class:`NflEvent` s it returns (log them, put ``state.recovery`` -- the recovery flag -- into the next
round's tasks). It reads no clock and draws no randomness, and :class:`NflState` round-trips exactly through
``to_dict``/``from_dict`` (JSON-safe), so a restarted server carries on from its saved state. ``step`` returns a new
state and leaves the one it was given as it was (unlike the round machine's hot-path
:func:`fedcore.rounds.step_in_place`; the detector steps once a round).

Detectors plug in by name (:data:`DETECTORS`, :func:`register_detector`); ``config.detector`` picks one. A
detector is a function ``(state, observation, config) -> events`` that runs only in mode ``detect-and-recover``;
the bookkeeping common to all of them (the β̂ window and history) is done by :func:`step`.

Common rules, every mode:

- β̂ (FL-GUARD Eq. 4–5): the observation's ``beta_hat`` is the round's median β̂^r of the clients' β̂ᵢ (Eq. 4,
  computed by the shell); the state keeps the last ``c`` medians and ``state.beta_hat_avg`` is their mean (Eq. 5),
  over fewer medians in the first rounds (SPEC §6). ``state.delta`` is the latest Δ observed.
- A missing value -- ``None`` (no client reported a β̂ᵢ; no w_div this round) or a non-finite one -- is not an
  observation: it enters neither the window nor any count, and it neither extends nor breaks a run of
  consecutive rounds (c, ``delta_stop_rounds``): those count rounds *with* an observation. The round is still
  recorded in the history, with ``None``.
- A round at or below ``state.last_round`` (a round re-run after a restart, an observation replayed after a crash
  between ``step`` and the save) changes nothing and causes no event, so no round is ever counted twice.
- Mode ``always-recover`` (FL-GUARD §4.3 "all-time recovery", LINDT's all-time mode): ``recovery`` is True from
  :func:`init` on, no detection runs, no event is ever emitted. Mode ``off``: ``recovery`` stays False, no
  detection, no event. In both, β̂, Δ and the history are still tracked so that operators can see them.

FL-GUARD β̂ detector (``"beta_hat"``, FL-GUARD §4.1 "NFL Detection", Algorithm 1), per round with a median:

- Not reported: a round whose running β̂ < 0 increments ``count`` (a count of rounds, not necessarily
  consecutive); when ``count > nr`` -- at the (NR+1)-th negative round -- NFL is reported (``nfl.reported``) and
  the recovery flag is set. Rounds with β̂ >= 0 do not touch the count.
- Reported: a round with β̂ >= 0 increments ``consecutive_ok``, one with β̂ < 0 resets it to 0; at ``c`` the report
  is cancelled (``nfl.cancelled``), ``count`` restarts from 0 and detection continues, so a second report needs
  NR+1 new negative rounds. ``count`` does not move while reported.
- Recovery stopping (FL-GUARD §5.1, "long-term"/"short-term" recovery): long-term keeps ``recovery`` True after a
  cancel (and a later report re-reports with the flag already on); short-term clears it at the cancel
  (``recovery.stopped`` right after ``nfl.cancelled``, same round) and a later report sets it again.

Start-up guards in front of the β̂ rule (issue 28; docs/results/nfl_guard.md compares them on recorded runs). In a
healthy federation's first rounds the young global model is worse than every private model, so β̂ < 0 and the
paper's rule counts those rounds (at NR = c = 10 it reports NFL at round 11 in every ideal run). Each guard keeps
the paper's rule and changes only what it counts:

- ``"beta_hat_plateau"`` (the default): a round is counted only once β̂ has stopped rising -- at the first round
  where the mean of the last k round medians is not above the mean of the k before them (k = ``plateau_rounds``,
  2k observed rounds needed). That round is ``armed_round``; the β̂ window restarts there with its median, so the
  start-up medians leave β̂, and from then on the rule above runs unchanged (report, cancel, short-term stop).
  The guard arms once per run (a cancel does not re-arm it).
- ``"beta_hat_warmup"``: the same, armed at the first observed round after ``warmup`` observed rounds.
- ``"beta_hat_cusum"``: no guard but a sequential test on the round medians m: S = max(0, S − m − k), NFL
  reported when S > h (``cusum_k``, ``cusum_h``; event ``value`` = S, ``count`` = rounds with m < −k since the last
  reset); while reported, the β̂ rule's cancel (c consecutive rounds with β̂ >= 0), after which S and the count
  restart from 0.

LINDT Δ detector (``"delta"``, LINDT §3.4.1 and Algorithm 2 s6–s11, appendix C.7), per round with a Δ:

- Δ > ε increments ``count`` (every such round, reported or not, as in Algorithm 2 s8–s9); when ``count > r_prime``
  and the flag is off, NFL is reported and recovery starts (``nfl.reported``; LINDT has one flag for both).
- Stop rule (C.7, "the system stops dual-model training (and degrades to FedAvg) after the value of Δ is observed
  below ε in 10 consecutive rounds"): only with ``recovery = "short-term"`` and ``delta_stop_rounds > 0``. While
  recovering, Δ < ε increments ``consecutive_ok`` and Δ >= ε resets it; at ``delta_stop_rounds`` the flag is
  cleared: ``nfl.cancelled`` then ``recovery.stopped``. With long-term recovery (or ``delta_stop_rounds = 0``)
  recovery never stops.
- After a stop, LINDT says nothing more; Algorithm 2 never resets ``count``, so we do not either: ``count`` is
  still above r′ and the next round with Δ > ε reports NFL again at once. (By LINDT's Theorem 1, a converging
  process has Δ <= ε in every round past some r′, so a Δ > ε after the stop is read as the negative effects
  returning; a flap needs at least ``delta_stop_rounds`` rounds below ε in between.)

Event ``count``: for ``nfl.reported`` the detector's count (negative rounds / rounds with Δ > ε); for
``nfl.cancelled`` and ``recovery.stopped`` the length of the run of consecutive rounds that ended the report.
``value``: the running β̂ (beta_hat) or the round's Δ (delta) that triggered the transition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedcore.checks import check_known_fields, is_int
from fedcore.errors import require
from fedcore.nfl.config import ALWAYS_RECOVER, DETECT_AND_RECOVER, SHORT_TERM, NflConfig, thresholds
from fedcore.nfl.config import DETECTORS as DETECTORS  # re-exported: the registry the detectors below fill
from fedcore.registry import options_as
from fedcore.update_report import BetaHat

REPORTED = "nfl.reported"
CANCELLED = "nfl.cancelled"
STOPPED = "recovery.stopped"
EVENT_KINDS = (REPORTED, CANCELLED, STOPPED)


@dataclass(frozen=True)
class NflObservation:
    """What the server knows once round ``round`` is aggregated.

    ``beta_hat``: the median β̂^r of the β̂ᵢ reported by the round's clients (FL-GUARD Eq. 4), ``None`` when none
    reported one (:data:`fedcore.update_report.BetaHat`, the type of each client's β̂ᵢ from its device on).
    ``delta``: LINDT's Δ = w_div^r − ‖noise‖ (Eq. 7), ``None`` when w_div was not computed.
    """

    round: int
    beta_hat: BetaHat = None
    delta: float | None = None


@dataclass(frozen=True)
class NflEvent:
    """A transition of the NFL state (``kind`` one of :data:`EVENT_KINDS`); see the module docstring."""

    kind: str
    round: int
    value: float
    count: int
    detector: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class NflRecord:
    """One observed round, for status and plots: the round's median β̂^r, the running β̂ after it, its Δ, and
    the flags after the step (``recovery`` is the flag the next round's tasks carry)."""

    round: int
    median: float | None
    beta_hat_avg: float | None
    delta: float | None
    reported: bool
    recovery: bool


@dataclass
class NflState:
    """The detector's state; plain data, JSON-safe through :meth:`to_dict` / :meth:`from_dict`.

    ``count``: negative-round count (beta_hat) or Δ > ε count (delta). ``consecutive_ok``: the current run of
    rounds toward a cancel (β̂ >= 0) or a stop (Δ < ε). ``medians``: the last c round medians; ``beta_hat_avg``
    their mean (FL-GUARD Eq. 5; None before the first). ``delta``: the latest Δ. ``last_round``: the last round
    observed (0: none). ``reported_round`` / ``cancelled_round`` / ``stopped_round``: the rounds of the latest
    such transition.
    Start-up guards (``beta_hat_warmup``, ``beta_hat_plateau``): ``armed_round`` is the round the guard let
    counting begin (None: still in the start-up); ``startup_seen`` the rounds observed before it; ``startup`` the
    last ``2 * plateau_rounds`` medians before it (plateau). ``cusum``: the CUSUM statistic (``beta_hat_cusum``).
    """

    detector: str = "beta_hat"
    mode: str = DETECT_AND_RECOVER
    reported: bool = False
    recovery: bool = False
    count: int = 0
    consecutive_ok: int = 0
    medians: list[float] = field(default_factory=list)
    beta_hat_avg: float | None = None
    delta: float | None = None
    last_round: int = 0
    reported_round: int | None = None
    cancelled_round: int | None = None
    stopped_round: int | None = None
    armed_round: int | None = None
    startup_seen: int = 0
    startup: list[float] = field(default_factory=list)
    cusum: float = 0.0
    history: list[NflRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NflState:
        """The state from :meth:`to_dict`'s output (after a JSON round trip too); :class:`ValueError` naming an
        unknown field."""
        d = dict(d)
        if "beta_hat" in d and "beta_hat_avg" not in d:  # a snapshot written before the field had its name
            d["beta_hat_avg"] = d.pop("beta_hat")
        check_known_fields(cls, d, "NFL state")
        d["medians"] = list(d.get("medians", []))
        d["startup"] = list(d.get("startup", []))
        try:
            d["history"] = [NflRecord(**{("beta_hat_avg" if k == "beta_hat" else k): v for k, v in h.items()})
                            for h in d.get("history", [])]
        except TypeError as e:
            raise ValueError(f"history: {e}") from None
        return cls(**d)


# A detector: updates, in place, the copy of the state that ``step`` made for one observation (already cleaned:
# non-finite values are None, and the β̂ window is updated) and returns the events. Runs only in mode
# detect-and-recover.
DetectorStep = Callable[[NflState, NflObservation, NflConfig], list[NflEvent]]

def register_detector(name: str, detector: DetectorStep, *, options: type | None = None, summary: str = "",
                      replace: bool = False) -> None:
    """Make ``detector`` selectable as ``nfl.detector = name``; ``options``: its frozen options dataclass
    (``config.detector_options`` is one), ``summary``: one line for --help and the docs."""
    DETECTORS.add(name, detector, options=options, summary=summary, replace=replace)


def detector_names() -> list[str]:
    return DETECTORS.names()


def init(config: NflConfig) -> NflState:
    """The state before round 1 (``config`` is validated first): ``recovery`` is True from the start only in mode
    ``always-recover``."""
    config.validate()
    return NflState(detector=config.detector, mode=config.mode, recovery=config.mode == ALWAYS_RECOVER)


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def step(state: NflState, obs: NflObservation, config: NflConfig) -> tuple[NflState, list[NflEvent]]:
    """The state after one round's observation (a new :class:`NflState`; ``state`` is left as it was) and the
    events it caused.

    Raises :class:`ValueError` when ``state`` was made for another detector or mode than ``config`` names (a
    server resumed with a changed ``[nfl]`` section: start again from :func:`init`).
    """
    if state.detector != config.detector or state.mode != config.mode:
        raise ValueError(f"nfl: the NFL state is for detector {state.detector!r} in mode {state.mode!r}, the "
                         f"configuration asks for detector {config.detector!r} in mode {config.mode!r}; start from "
                         "init(config)")
    if config.nr is None or config.c is None:
        raise ValueError("nfl: nr and c are unset (fitted to the run's length when the server starts); step a "
                         "config made by fedcore.nfl.fitted(config, num_rounds) or give nfl.nr and nfl.c")
    if obs.round <= state.last_round:
        return state, []
    s = dataclasses.replace(state, medians=list(state.medians), startup=list(state.startup),
                            history=list(state.history))
    obs = NflObservation(obs.round, _finite(obs.beta_hat), _finite(obs.delta))
    s.last_round = obs.round
    if obs.beta_hat is not None:
        s.medians.append(obs.beta_hat)
        del s.medians[:-config.c]  # c is set: checked above
        s.beta_hat_avg = math.fsum(s.medians) / len(s.medians)  # FL-GUARD Eq. 5 over the medians we have
    if obs.delta is not None:
        s.delta = obs.delta
    detector: DetectorStep = DETECTORS.get(config.detector)
    events = detector(s, obs, config) if config.mode == DETECT_AND_RECOVER else []
    s.history.append(NflRecord(obs.round, obs.beta_hat, s.beta_hat_avg, obs.delta, s.reported, s.recovery))
    return s, events


@DETECTORS.register("beta_hat", summary="FL-GUARD §4.1 as published, the median β̂ᵢ averaged over c rounds")
def beta_hat_step(s: NflState, obs: NflObservation, config: NflConfig) -> list[NflEvent]:
    """FL-GUARD §4.1 "NFL Detection" (1)–(2) over the running β̂ (Eq. 5); see the module docstring."""
    if obs.beta_hat is None or s.beta_hat_avg is None:
        return []
    return _count_or_cancel(s, obs.round, s.beta_hat_avg, config, "beta_hat")


def _count_or_cancel(s: NflState, r: int, b: float, config: NflConfig, name: str) -> list[NflEvent]:
    """The paper's rule for one observed round with running β̂ ``b``: count a negative β̂ (report at count > NR)
    or, while reported, count the run of β̂ >= 0 toward the cancel at c."""
    if not s.reported:
        if b < 0:
            s.count += 1
            if s.count > thresholds(config)[0]:
                s.reported = s.recovery = True
                s.consecutive_ok, s.reported_round = 0, r
                return [NflEvent(REPORTED, r, b, s.count, name)]
        return []
    return _toward_cancel(s, r, b, config, name)


def _toward_cancel(s: NflState, r: int, b: float, config: NflConfig, name: str) -> list[NflEvent]:
    """While reported: a round with β̂ >= 0 extends the run toward the cancel at c, one with β̂ < 0 resets it; at
    the cancel ``count`` (and the CUSUM statistic) restart from 0, short-term recovery stops."""
    if b < 0:
        s.consecutive_ok = 0
        return []
    s.consecutive_ok += 1
    if s.consecutive_ok < thresholds(config)[1]:
        return []
    ok = s.consecutive_ok
    events = [NflEvent(CANCELLED, r, b, ok, name)]
    s.reported, s.count, s.consecutive_ok, s.cancelled_round, s.cusum = False, 0, 0, r, 0.0
    if config.recovery == SHORT_TERM and s.recovery:
        s.recovery, s.stopped_round = False, r
        events.append(NflEvent(STOPPED, r, b, ok, name))
    return events


def _guarded(armed: Callable[[NflState, float, NflConfig], bool], name: str) -> DetectorStep:
    """The paper's rule behind a start-up guard: until ``armed(state, median, config)`` says the start-up is over,
    a round neither counts nor stays in the β̂ window; at the arming round the window restarts with that round's
    median (the start-up medians leave β̂), and from then on the paper's rule runs unchanged."""

    def detector(s: NflState, obs: NflObservation, config: NflConfig) -> list[NflEvent]:
        m = obs.beta_hat
        if m is None:
            return []
        if s.armed_round is None:
            s.startup_seen += 1
            if not armed(s, m, config):
                return []
            s.armed_round, s.startup = obs.round, []
            s.medians, s.beta_hat_avg = [m], m
        return _count_or_cancel(s, obs.round, m if s.beta_hat_avg is None else s.beta_hat_avg, config, name)

    return detector


@dataclass(frozen=True)
class WarmupOptions:
    """beta_hat_warmup's options."""

    # The first `warmup` rounds with a β̂ (the start-up, while the young global model is still worse than the
    # clients' private models) neither count nor stay in the β̂ window.
    warmup: int = 5

    def validate(self) -> None:
        require(is_int(self.warmup) and self.warmup >= 0, "warmup", f"must be an integer >= 0, got {self.warmup!r}")


@dataclass(frozen=True)
class PlateauOptions:
    """beta_hat_plateau's options."""

    # Counting starts once β̂ has stopped rising -- at the first round where the mean of the last k round medians
    # is not above the mean of the k before them (k = plateau_rounds); the β̂ window restarts there.
    # docs/results/nfl_guard.md compares the guards.
    plateau_rounds: int = 2

    def validate(self) -> None:
        require(is_int(self.plateau_rounds) and self.plateau_rounds >= 1, "plateau_rounds",
                f"must be an integer >= 1, got {self.plateau_rounds!r}")


@dataclass(frozen=True)
class CusumOptions:
    """beta_hat_cusum's options."""

    # One-sided CUSUM on the round medians, S = max(0, S - median - cusum_k); NFL is reported when S > cusum_h.
    cusum_k: float = 0.05
    cusum_h: float = 2.0

    def validate(self) -> None:
        for name, v, low in (("cusum_k", self.cusum_k, -math.inf), ("cusum_h", self.cusum_h, 0.0)):
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low, name,
                    f"must be a finite number{'' if low == -math.inf else ' >= 0'}, got {v!r}")


def _warmup_over(s: NflState, m: float, config: NflConfig) -> bool:
    """Armed at the first observed round after ``warmup`` observed rounds."""
    return s.startup_seen > options_as(config.detector_options, WarmupOptions, "nfl.detector_options").warmup


def _plateau_reached(s: NflState, m: float, config: NflConfig) -> bool:
    """Armed once β̂ has stopped rising: the mean of the last k round medians (this one included) is not above the
    mean of the k before them (k = ``plateau_rounds``; needs 2k observed rounds)."""
    k = options_as(config.detector_options, PlateauOptions, "nfl.detector_options").plateau_rounds
    s.startup.append(m)
    del s.startup[:-2 * k]
    if len(s.startup) < 2 * k:
        return False
    return math.fsum(s.startup[k:]) <= math.fsum(s.startup[:k])


register_detector("beta_hat_warmup", _guarded(_warmup_over, "beta_hat_warmup"), options=WarmupOptions,
                  summary="beta_hat, the first nfl.detector_options.warmup rounds with a β̂ not counted")
register_detector("beta_hat_plateau", _guarded(_plateau_reached, "beta_hat_plateau"), options=PlateauOptions,
                  summary="beta_hat, counting only once β̂ has stopped rising (the default)")


@DETECTORS.register("beta_hat_cusum", options=CusumOptions, summary="one-sided CUSUM on the round medians of β̂ᵢ")
def beta_hat_cusum_step(s: NflState, obs: NflObservation, config: NflConfig) -> list[NflEvent]:
    """One-sided CUSUM on the round medians (no start-up guard): S = max(0, S − m − k); NFL is reported when
    S > h. ``count``: the rounds with m < −k since the last reset. While reported, the paper's cancel rule (c
    consecutive rounds with the running β̂ >= 0), after which S and ``count`` restart from 0."""
    m = obs.beta_hat
    if m is None or s.beta_hat_avg is None:
        return []
    r = obs.round
    if s.reported:
        return _toward_cancel(s, r, s.beta_hat_avg, config, "beta_hat_cusum")
    o = options_as(config.detector_options, CusumOptions, "nfl.detector_options")
    s.cusum = max(0.0, s.cusum - m - o.cusum_k)
    if m < -o.cusum_k:
        s.count += 1
    if s.cusum <= o.cusum_h:
        return []
    s.reported = s.recovery = True
    s.consecutive_ok, s.reported_round = 0, r
    return [NflEvent(REPORTED, r, s.cusum, s.count, "beta_hat_cusum")]


@DETECTORS.register("delta", summary="LINDT §3.4, Δ = w_div − ‖noise‖ above ε for more than r′ rounds")
def delta_step(s: NflState, obs: NflObservation, config: NflConfig) -> list[NflEvent]:
    """LINDT Algorithm 2 s8–s11 (count Δ > ε, report at count > r′) and appendix C.7's stop rule."""
    d = obs.delta
    if d is None:
        return []
    r, eps = obs.round, config.epsilon
    if d > eps:
        s.count += 1
        s.consecutive_ok = 0
        if s.count > config.r_prime and not s.recovery:
            s.reported = s.recovery = True
            s.reported_round = r
            return [NflEvent(REPORTED, r, d, s.count, "delta")]
        return []
    if d == eps or not s.recovery:
        s.consecutive_ok = 0
        return []
    s.consecutive_ok += 1
    if config.recovery != SHORT_TERM or config.delta_stop_rounds == 0 or s.consecutive_ok < config.delta_stop_rounds:
        return []
    ok = s.consecutive_ok
    s.reported = s.recovery = False
    s.consecutive_ok, s.cancelled_round, s.stopped_round = 0, r, r
    return [NflEvent(CANCELLED, r, d, ok, "delta"), NflEvent(STOPPED, r, d, ok, "delta")]
