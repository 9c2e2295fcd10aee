"""The ``[nfl]`` configuration section: which NFL detector the server runs and how recovery stops (SPEC §6).

A plain dataclass like the sections of :mod:`fedcore.config`, loadable with :func:`fedcore.options.from_dict`
(so its field types are the plain ``str``/``int``/``float`` that loader coerces). :func:`validate_nfl_config`
(also :meth:`NflConfig.validate`) raises :class:`fedcore.errors.ConfigError` naming the field (``nfl.nr: must
be an integer >= 0, got -1``).

The detector registry (:data:`DETECTORS`) is held here, beside the field that names a detector, and filled by
:mod:`fedcore.nfl.detectors` (imported with the package), so that the section validates the name without
importing the detectors: nothing here imports upward and no import circle forms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedcore.checks import is_int
from fedcore.errors import ConfigError, require
from fedcore.migrate import LEGACY_DETECTOR_OPTIONS
from fedcore.options import decode_fields, join
from fedcore.registry import Registry, fold_flat_options

# Modes (FL-GUARD §4.3): vanilla FL until the detector reports NFL / the recovery flag set from round 1 with no
# detection ("all-time recovery") / no recovery ever (vanilla FL; β̂ and Δ are still tracked for display).
DETECT_AND_RECOVER = "detect-and-recover"
ALWAYS_RECOVER = "always-recover"
OFF = "off"
MODES = (DETECT_AND_RECOVER, ALWAYS_RECOVER, OFF)

# Recovery stopping strategies (FL-GUARD §5.1, "long-term" / "short-term" recovery).
LONG_TERM = "long-term"
SHORT_TERM = "short-term"
RECOVERY_STRATEGIES = (LONG_TERM, SHORT_TERM)

# The NFL detectors by name (``nfl.detector``); fedcore.nfl.detectors registers the built-in ones.
# Typed loosely here (a step is fedcore.nfl.detectors.DetectorStep: (NflState, NflObservation, NflConfig) -> events),
# so that this section imports nothing of the detectors, not even for type checking; the detectors module reads
# its entries back as DetectorStep.
DETECTORS: Registry[Callable[..., Any]] = Registry("NFL detector", ValueError)


@dataclass
class NflConfig:
    # detect-and-recover (default) | always-recover | off; see the constants above.
    mode: str = DETECT_AND_RECOVER
    # The server's NFL detector, by registered name (fedcore.nfl.detectors.DETECTORS): "beta_hat" (FL-GUARD §4.1,
    # the median of the clients' β̂ᵢ averaged over the last c rounds, the paper's rule as published),
    # "beta_hat_plateau" (default: the paper's rule, counting only once β̂ has stopped rising, so that the start-up
    # rounds, when the young global model is still worse than the private models, raise no report;
    # docs/results/nfl_guard.md), "beta_hat_warmup", "beta_hat_cusum" (the other guards compared there) or
    # "delta" (LINDT §3.4, Δ = w_div − ‖noise‖).
    detector: str = "beta_hat_plateau"
    # beta_hat: NFL is reported when β̂ < 0 has been observed in more than nr rounds (a count, not necessarily
    # consecutive), i.e. at the (nr+1)-th negative round. FL-GUARD Table 3: 50 for 1,000 CIFAR rounds, 70 for
    # Shakespeare. Unset: fitted to rounds.num_rounds (fit_to_rounds: 2/15 of the rounds, between 5 and 50 --
    # 5 at 40 rounds, 20 at 150, the paper's 50 from 375 rounds on).
    nr: int | None = None
    # beta_hat: β̂ is the mean of the last c round medians (FL-GUARD Eq. 5), and a report is cancelled after c
    # consecutive rounds with β̂ >= 0. Unset: fitted to rounds.num_rounds, as nr.
    c: int | None = None
    # delta: the threshold ε > 0 on Δ (LINDT Thm. 1 / Algorithm 2; paper value 0.1).
    epsilon: float = 0.1
    # delta: NFL is reported when Δ > ε has been observed in more than r_prime rounds (LINDT's r′; paper: 250).
    r_prime: int = 250
    # long-term: recovery never stops once started. short-term: it stops when the detector's stop condition
    # fires -- beta_hat: when the report is cancelled; delta: delta_stop_rounds (below). Clients keep their
    # adapted models for inference either way (SPEC §6).
    recovery: str = LONG_TERM
    # delta with recovery = "short-term": LINDT appendix C.7's optional stop rule -- recovery stops after Δ < ε
    # has been observed in this many consecutive rounds (the paper uses 10). 0 disables the stop rule (recovery,
    # once started, then never stops, as with long-term). Ignored by the beta_hat detector.
    delta_stop_rounds: int = 10
    # The detector's options (a table; e.g. {warmup = 5} for beta_hat_warmup, {plateau_rounds = 2} for
    # beta_hat_plateau, {cusum_k = 0.05, cusum_h = 2.0} for beta_hat_cusum): the frozen options dataclass the detector
    # registered (listed under "Plugins" below), validated by it. Unset: the detector's defaults. The old flat keys
    # (nfl.warmup, plateau_rounds, cusum_k, cusum_h) are still read into it.
    detector_options: Any = None

    def __post_init__(self) -> None:
        self.detector_options = DETECTORS.coerce_options(self.detector, self.detector_options, "detector_options")

    @classmethod
    def from_table(cls, data: Mapping[str, Any], path: str = "") -> NflConfig:
        """The section from a TOML table / dict: ``detector_options`` parsed and validated by the detector
        (:meth:`Registry.parse_options`, errors name ``nfl.detector_options.<field>``), the old flat keys of
        :data:`LEGACY_DETECTOR_OPTIONS` moved into it first (:func:`fold_flat_options`)."""
        table = fold_flat_options(DETECTORS, data.get("detector", "beta_hat_plateau"), data, LEGACY_DETECTOR_OPTIONS,
                                  path=path, options_key="detector_options")
        options = table.pop("detector_options", None)
        config = decode_fields(cls, table, path)
        if config.detector in DETECTORS:
            options = DETECTORS.parse_options(config.detector, options, join(path, "detector_options"))
        if options is not None:
            config.detector_options = options
        return config

    def validate(self, prefix: str = "nfl") -> NflConfig:
        """Check every field (:func:`validate_nfl_config`); returns ``self``."""
        validate_nfl_config(self, prefix)
        return self


@dataclass(frozen=True)
class NflSettings:
    """What a client learns of the server's ``[nfl]`` section at join (``FederationConfig.nfl``): the mode, and NR
    and c as the server runs them (fitted to the run when ``[nfl]`` left them unset) for the clients'
    individual-level measures (FL-GUARD §4.3)."""

    mode: str
    nr: int
    c: int


# fit_to_rounds: NR and c as a share of the run, bounded. The share is the one the project's tuned runs agree on:
# the demo (40 rounds, NR = c = 5) and MNIST's paper-scale configs (150 rounds, 20), both 2/15 of the rounds; the
# ceiling is the paper's own choice (FL-GUARD Table 3: 50 for 1,000 rounds, which the share would exceed); the floor
# keeps c's β̂ window wide enough to average out one round's median (docs/nfl.md, "NR and c").
FIT_SHARE = 2 / 15
FIT_MIN = 5
FIT_MAX = 50


def fit_to_rounds(num_rounds: int) -> int:
    """NR (and c) for a run of ``num_rounds`` rounds when ``[nfl]`` leaves them unset: ``round(num_rounds * 2/15)``
    clamped to [5, 50]. NR + c then stays within a third of the run up to 375 rounds (within 10% at the paper's
    1,000), so a report and its cancel both fit in the run."""
    return min(FIT_MAX, max(FIT_MIN, round(num_rounds * FIT_SHARE)))


def fitted(c: NflConfig, num_rounds: int) -> NflConfig:
    """``c`` with an unset ``nr`` / ``c`` replaced by :func:`fit_to_rounds` (``num_rounds``); a copy, ``c`` is left
    as it is (its unset fields are what a resume with more rounds fits again)."""
    if c.nr is not None and c.c is not None:
        return c
    fit = fit_to_rounds(num_rounds)
    return dataclasses.replace(c, nr=fit if c.nr is None else c.nr, c=fit if c.c is None else c.c)


def thresholds(c: NflConfig) -> tuple[int, int]:
    """(NR, c) of a fitted config; :class:`ValueError` when either is unset (fit it first: :func:`fitted`)."""
    if c.nr is None or c.c is None:
        raise ValueError("nfl: nr and c are unset; fit them to the run first (fedcore.nfl.fitted(config, "
                         "num_rounds)) or give nfl.nr and nfl.c")
    return c.nr, c.c


def validate_nfl_config(c: NflConfig, prefix: str = "nfl") -> None:
    """Raise :class:`ConfigError` naming ``<prefix>.<field>`` for the first unusable field."""

    def check(cond: bool, name: str, message: str) -> None:
        require(cond, f"{prefix}.{name}", message)

    check(c.mode in MODES, "mode", f"one of {', '.join(repr(m) for m in MODES)}, got {c.mode!r}")
    check(isinstance(c.detector, str) and c.detector in DETECTORS, "detector",
          f"unknown NFL detector {c.detector!r}; known: {', '.join(DETECTORS.names())}")
    check(c.nr is None or (is_int(c.nr) and c.nr >= 0), "nr",
          f"must be an integer >= 0 (or unset: fitted to rounds.num_rounds), got {c.nr!r}")
    check(c.c is None or (is_int(c.c) and c.c >= 1), "c",
          f"must be an integer >= 1 (or unset: fitted to rounds.num_rounds), got {c.c!r}")
    check(isinstance(c.epsilon, (int, float)) and not isinstance(c.epsilon, bool)
          and math.isfinite(c.epsilon) and c.epsilon > 0, "epsilon",
          f"must be a finite number > 0, got {c.epsilon!r}")
    check(is_int(c.r_prime) and c.r_prime >= 0, "r_prime", f"must be an integer >= 0, got {c.r_prime!r}")
    check(c.recovery in RECOVERY_STRATEGIES, "recovery",
          f"one of {', '.join(repr(s) for s in RECOVERY_STRATEGIES)}, got {c.recovery!r}")
    check(is_int(c.delta_stop_rounds) and c.delta_stop_rounds >= 0, "delta_stop_rounds",
          f"must be an integer >= 0 (0 disables the stop rule), got {c.delta_stop_rounds!r}")
    if c.detector in DETECTORS:
        try:
            c.detector_options = DETECTORS.coerce_options(c.detector, c.detector_options, "detector_options")
        except ConfigError as e:
            raise e.under(prefix) from None
        DETECTORS.validate_options(c.detector, c.detector_options, f"{prefix}.detector_options")
