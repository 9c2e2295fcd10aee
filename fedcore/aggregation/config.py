"""Aggregation configuration, its validation, the rule registry it names a rule from, and the result types.

The registry (:data:`RULES`) and the :class:`Rule` protocol live here, beside the field that names a rule, and
:mod:`fedcore.aggregation.rules` (imported with the package) registers the built-in rules into it: the section
validates its rule without importing the rules, so no import circle forms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fedcore.errors import ConfigError
from fedcore.migrate import LEGACY_RULE_OPTIONS
from fedcore.options import decode_fields, join
from fedcore.registry import Registry, fold_flat_options, option_names

if TYPE_CHECKING:
    import torch



class TooFewUpdatesError(ValueError):
    """A rule's parameters cannot work with the number of updates actually received this round.

    Raised by :meth:`Aggregator.finalize` when a round closed at its deadline with fewer updates than the
    rule needs (e.g. Krum with ``krum_f = 3`` needs more than ``2*3 + 2 = 8`` updates). Validate the config
    with ``config.validate(k, min_updates=...)`` to rule this out at configuration time.
    """


# aggregation.secure's values.
SECURE_PROTOCOLS = ("off", "secagg+")


@dataclass(frozen=True)
class AggregationConfig:
    """Everything the server's aggregation pipeline (validate -> clip -> rule -> noise) needs.

    Every parameter is checked by :meth:`validate`; errors name the field.
    """

    # Aggregation rule, by registered name: fedavg, median, trimmed_mean, krum, multi_krum, bulyan, knorm.
    rule: str = "fedavg"
    # The rule's options (a table; e.g. {trim_m = 2} for trimmed_mean, {krum_f = 2} for krum): the frozen options
    # dataclass the rule registered (listed under "Plugins" below), validated by it. Unset: the rule's defaults.
    # The old flat keys (aggregation.trim_m, trim_fraction, krum_f, multi_krum_m, knorm_k) are still read into it.
    options: Any = None
    # FedAvg, and the averaging step of multi_krum / knorm: weight each update by its sample count n_i
    # (FL-GUARD) or take the plain mean (LINDT). LINDT Eq. 4 (server-side DP) is the plain mean: set False
    # to reproduce it exactly. median, trimmed_mean, krum and bulyan ignore weights.
    weighted: bool = True
    # Server-side DP (LINDT Eq. 4): clip every update to L2 norm clip_norm (S); None disables clipping.
    clip_norm: float | None = None
    # Server-side DP: std sigma of the Gaussian noise N(0, sigma^2 I) added to the aggregate step; 0 = none.
    noise_sigma: float = 0.0
    # Hard ceiling on an update's L2 norm: a larger (or non-finite) update is rejected, never averaged in.
    max_update_norm: float = 1e6
    # FedAvg only: keep every update in a [K, P] buffer so w_div is exact (otherwise FedAvg streams with
    # memory independent of K and w_div is estimated from a sketch; see sketch_dim).
    exact_metrics: bool = False
    # Streaming FedAvg: width of the per-update CountSketch used to estimate w_div (relative error of each
    # ||u_i - g|| about 1/sqrt(2 * sketch_dim)); 0 = do not estimate w_div (nor delta) in streaming mode;
    # sketch_seed seeds its bucket signs.
    sketch_dim: int = 4093
    sketch_seed: int = 0
    # make_aggregator refuses a rule/K/P combination whose working memory exceeds this; 0 = no check.
    memory_budget_bytes: int = 0
    # Secure aggregation: "off", or "secagg+" (SecAgg+, the server learns only the sum of the survivors' updates;
    # its parameters are the [secagg] section; docs/security.md). Needs rule = "fedavg"; clipping (clip_norm) and
    # the max_update_norm ceiling then run on the devices, before masking.
    secure: str = "off"

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", RULES.coerce_options(self.rule, self.options, "options"))

    @classmethod
    def from_table(cls, data: Mapping[str, Any], path: str = "") -> AggregationConfig:
        """The section from a TOML table / dict: ``options`` parsed and validated by the rule
        (:meth:`Registry.parse_options`, errors name ``aggregation.options.<field>``), the old flat keys of
        :data:`LEGACY_RULE_OPTIONS` moved into it first (:func:`fold_flat_options`)."""
        table = fold_flat_options(RULES, data.get("rule", "fedavg"), data, LEGACY_RULE_OPTIONS, path=path)
        options = table.pop("options", None)
        config = decode_fields(cls, table, path)
        if config.rule not in RULES:
            return config if options is None else dataclasses.replace(config, options=options)
        return dataclasses.replace(config, options=RULES.parse_options(config.rule, options, join(path, "options")))

    def validate(self, k: int, min_updates: int | None = None) -> AggregationConfig:
        """Refuse impossible parameters for rounds of ``k`` updates (and, if given, as few as ``min_updates``).

        Raises :class:`ValueError` whose message starts with the offending field's name.
        """
        if self.rule not in rule_names():
            raise ValueError(f"rule: unknown aggregation rule {self.rule!r}; known: {', '.join(rule_names())}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k: the number of updates per round must be an integer >= 1, got {k!r}")
        if self.secure not in SECURE_PROTOCOLS:
            raise ValueError(f"secure: one of {', '.join(repr(p) for p in SECURE_PROTOCOLS)}, got {self.secure!r}")
        if self.secure != "off" and self.rule != "fedavg":
            raise ValueError(f"secure: secure aggregation gives the server only the sum of the updates; rule "
                             f"{self.rule!r} needs each update (robust rules are impossible under secure "
                             "aggregation): use rule = \"fedavg\", or secure = \"off\"")
        if self.secure != "off" and self.exact_metrics:
            raise ValueError("secure: exact_metrics keeps every update, which secure aggregation never shows the "
                             "server (w_div is exact anyway: from the sum of the squared norms)")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm: must be a finite number > 0 (or None for no clipping), got {self.clip_norm}")
        if not (math.isfinite(self.noise_sigma) and self.noise_sigma >= 0):
            raise ValueError(f"noise_sigma: must be a finite number >= 0, got {self.noise_sigma}")
        if math.isnan(self.max_update_norm) or self.max_update_norm <= 0:
            raise ValueError(f"max_update_norm: must be > 0 (inf = no ceiling), got {self.max_update_norm}")
        try:
            RULES.validate_options(self.rule, self.options, "options")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if self.sketch_dim < 0:
            raise ValueError(f"sketch_dim: must be >= 0 (0 = no w_div estimate when streaming), got {self.sketch_dim}")
        if self.memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes: must be >= 0 (0 = unchecked), got {self.memory_budget_bytes}")
        rule = build_rule(self)
        try:
            rule.check(k)
        except ValueError as e:
            raise ValueError(self._under_options(str(e))) from None
        if min_updates is not None and 1 <= min_updates < k:
            try:
                rule.check(min_updates)
            except ValueError as e:
                raise ValueError(f"{self._under_options(str(e))} (rounds may close with as few as "
                                 f"min_updates={min_updates} updates)") from None
        return self

    def _under_options(self, message: str) -> str:
        """A rule's check message (it starts with its option's name) with the option's path in the section."""
        field_name = message.partition(":")[0]
        return f"options.{message}" if field_name in option_names(RULES, self.rule) else message


@dataclass(frozen=True)
class RuleOutput:
    step: torch.Tensor  # float32 [P], the aggregate update before noise
    num_excluded: int = 0  # whole updates the rule left out
    num_trimmed_per_coord: int = 0  # values per coordinate a coordinate-wise rule left out
    selected: tuple[int, ...] | None = None  # rows kept whole (selection rules only)


class Rule(Protocol):
    """An aggregation rule; see the module docstring."""

    @property
    def name(self) -> str: ...

    @property
    def streamable(self) -> bool:
        """True when the rule can run as a running sum (memory independent of the number of updates)."""
        ...

    def check(self, n: int) -> None:
        """Raise :class:`ValueError` naming the config field if the parameters cannot work with n updates."""
        ...

    def workspace(self, n: int, num_params: int) -> tuple[int, str]:
        """Transient bytes the rule needs beyond its input and its [P] output, with the arithmetic."""
        ...

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> RuleOutput: ...


RuleFactory = Callable[[AggregationConfig], Rule]
# ---- options: each rule's frozen options dataclass (``aggregation.options``), declared with it ----


@dataclass(frozen=True)
class TrimmedMeanOptions:
    """trimmed_mean's options."""

    # Drop the trim_m largest and trim_m smallest values of every coordinate, or a fraction (floor(trim_fraction
    # * n) per side, n = updates received). Set at most one; neither means fraction 0.1.
    trim_m: int | None = None
    trim_fraction: float | None = None

    def validate(self) -> None:
        if self.trim_m is not None and self.trim_fraction is not None:
            raise ConfigError("trim_m", f"set trim_m or trim_fraction, not both (got trim_m={self.trim_m}, "
                                        f"trim_fraction={self.trim_fraction})")
        if self.trim_m is not None and self.trim_m < 0:
            raise ConfigError("trim_m", f"must be >= 0, got {self.trim_m}")
        if self.trim_fraction is not None and not (0.0 <= self.trim_fraction < 0.5):
            raise ConfigError("trim_fraction", f"must be in [0, 0.5), got {self.trim_fraction}")


@dataclass(frozen=True)
class KrumOptions:
    """krum's and bulyan's options."""

    # The number f of assumed Byzantine clients.
    krum_f: int = 1

    def validate(self) -> None:
        if self.krum_f < 0:
            raise ConfigError("krum_f", f"must be >= 0, got {self.krum_f}")


@dataclass(frozen=True)
class MultiKrumOptions(KrumOptions):
    """multi_krum's options: Krum's f, and the number m of best-scored updates averaged."""

    # The number m of best-scored updates to average; None keeps n - f.
    multi_krum_m: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.multi_krum_m is not None and self.multi_krum_m < 1:
            raise ConfigError("multi_krum_m", f"must be >= 1 (or None for n - f), got {self.multi_krum_m}")


@dataclass(frozen=True)
class KNormOptions:
    """knorm's options."""

    # Discard the knorm_k updates with the largest L2 norms, average the rest.
    knorm_k: int = 1

    def validate(self) -> None:
        if self.knorm_k < 0:
            raise ConfigError("knorm_k", f"must be >= 0, got {self.knorm_k}")



# The aggregation rules by name (``aggregation.rule``): the built-in ones declared here (known without importing
# torch), registered by fedcore.aggregation.rules when a rule is first built.
RULES: Registry[RuleFactory] = Registry("aggregation rule", ValueError)
_RULES_MODULE = "fedcore.aggregation.rules"
RULES.declare("fedavg", _RULES_MODULE, summary="the mean of the updates, weighted by n_i (weighted) or plain")
RULES.declare("median", _RULES_MODULE, summary="the coordinate-wise median")
RULES.declare("trimmed_mean", _RULES_MODULE, options=TrimmedMeanOptions,
              summary="the coordinate-wise mean without the trim_m (or trim_fraction) largest and smallest values")
RULES.declare("krum", _RULES_MODULE, options=KrumOptions,
              summary="the one update closest to its n - krum_f - 2 neighbours")
RULES.declare("multi_krum", _RULES_MODULE, options=MultiKrumOptions,
              summary="the mean of the multi_krum_m best-scored updates by Krum's score")
RULES.declare("bulyan", _RULES_MODULE, options=KrumOptions,
              summary="repeated Krum, then the coordinate-wise mean of the values closest to the median")
RULES.declare("knorm", _RULES_MODULE, options=KNormOptions,
              summary="the mean without the knorm_k updates of largest norm")


def register_rule(name: str, factory: RuleFactory, *, options: type | None = None, summary: str = "",
                  replace: bool = False) -> None:
    """Make ``AggregationConfig(rule=name)`` build ``factory(config)``; ``options``: the rule's frozen options
    dataclass (``config.options`` is one), ``summary``: one line for the docs."""
    RULES.add(name, factory, options=options, summary=summary, replace=replace)


def unregister_rule(name: str) -> None:
    """Undo :func:`register_rule`."""
    RULES.remove(name)


def rule_names() -> list[str]:
    return RULES.names()


def build_rule(config: AggregationConfig) -> Rule:
    if config.rule not in RULES:
        raise ValueError(f"rule: unknown aggregation rule {config.rule!r}; known: {', '.join(rule_names())}")
    return RULES.get(config.rule)(config)


@dataclass
class AggregationResult:
    """The new global model and what happened on the way.

    ``metrics`` (all floats; see :mod:`fedcore.aggregation.metrics` for exact definitions): num_updates,
    num_rejected, num_clipped, num_excluded, num_trimmed_per_coord, update_norm_mean/max/min,
    aggregate_update_norm, rule_update_norm, noise_norm, and — when available — w_div, delta, w_div_exact.
    """

    new_global: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    # Reasons of the updates refused by the aggregator's validation this round, in arrival order.
    rejected: list[str] = field(default_factory=list)
    # Positions (in order of acceptance) of the updates the rule kept whole; None for rules that keep all
    # updates or work coordinate-wise (fedavg, median, trimmed_mean).
    selected: tuple[int, ...] | None = None
