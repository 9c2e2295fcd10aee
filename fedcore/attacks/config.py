"""The attack configuration (``attack`` of a client, ``[simulation_harness]`` of a server) and the attack kinds'
registry, torch-free: reading and checking a configuration imports no attack implementation.

Attack kinds plug in by name (:data:`ATTACKS`, ``attack.kind``): each registers an :class:`AttackKind` saying what
it does to an attacker's round (the labels or batches it trains on, the update it sends, its option checks). The
built-in kinds are registered here, each with its options dataclass; the model-poisoning kinds' update hooks and
crafting live in :mod:`fedcore.attacks.model_poisoning` and are imported on first use (:func:`fedcore.registry.
deferred`). Data poisoning is :mod:`fedcore.attacks.poisoning`, the server-side harness :mod:`fedcore.attacks.
harness`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fedcore.aggregation.config import RULES, AggregationConfig, Rule, build_rule
from fedcore.errors import ConfigError
from fedcore.migrate import LEGACY_ATTACK_OPTIONS
from fedcore.options import decode_fields, join
from fedcore.registry import Registry, deferred, fold_flat_options, option_names, options_as

if TYPE_CHECKING:
    import torch

KNOWLEDGE = ("partial", "full")
DEV_TYPES = ("std", "sign", "unit")

OptionsT = TypeVar("OptionsT")

FLIPS = ("reverse", "swap", "directed", "all")
# DistFL §5.5: labels 0-3 and 4-7 flipped mutually.
DISTFL_FLIP_PAIRS: tuple[tuple[int, int], ...] = ((0, 4), (1, 5), (2, 6), (3, 7))
# LINDT CIFAR-10 backdoor: deer (4) -> horse (7), dog (5) -> frog (6).
LINDT_BACKDOOR_PAIRS: tuple[tuple[int, int], ...] = ((4, 7), (5, 6))


class AttackError(ValueError):
    """An attack configuration that cannot be applied; the message names the field."""


# ---- attack kinds: what each does to an attacker's round ----

@dataclass(frozen=True)
class UpdateContext:
    """What the update hook sees of a client's round.

    ``received``/``trained``: the model the client was handed and the one its (possibly data-poisoned) training
    produced; ``honest_update(idx)``: the update of an honest training run from ``received`` on the client's
    clean training samples ``idx`` (partial knowledge); ``num_train``: the client's clean training samples;
    ``seed``: the round's attack seed."""

    received: Mapping[str, torch.Tensor]
    trained: Mapping[str, torch.Tensor]
    honest_update: Callable[[torch.Tensor], torch.Tensor]
    num_train: int
    seed: int


@dataclass(frozen=True)
class PoisonedUpdate:
    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]


@dataclass(frozen=True)
class Crafted:
    rows: torch.Tensor  # [num_mal, P]
    gamma: float = math.nan  # Dyn-Opt's γ


# Crafts num_mal malicious rows from benign ones against a rule: (attack, benign, num_mal, rule, generator,
# knowledge) -> Crafted.
Craft = Callable[["AttackConfig", "torch.Tensor", int, Rule, "torch.Generator", str], Crafted]


@dataclass(frozen=True)
class AttackKind:
    """What one attack kind does to an attacker's round; registered in :data:`ATTACKS` under its ``attack.kind``."""

    # Trains on labels flipped by ``flip`` (label_flip; model_replacement trains its malicious model on them).
    flips_labels: bool = False
    # Trains on backdoor batches: ``poison_per_batch`` backdoor samples in every batch of ``batch_size``.
    backdoor: bool = False
    # The client's update hook: the weights it sends instead of the trained ones (model poisoning), or None.
    poison: Callable[[AttackConfig, UpdateContext], PoisonedUpdate | None] | None = None
    # Crafts malicious rows from benign statistics (stat_opt, dyn_opt; also the server-side harness's rows).
    craft: Craft | None = None
    # Refuses impossible options of this kind (ValueError whose message starts with the field).
    check: Callable[[AttackConfig], None] | None = None

    @property
    def poisons_model(self) -> bool:
        return self.poison is not None


ATTACKS: Registry[AttackKind] = Registry("attack", AttackError)


# ---- options: each kind's frozen options dataclass (``attack.options``), registered with it ----


@dataclass(frozen=True)
class LabelFlipOptions:
    """label_flip's options (and model_replacement's, whose malicious model trains on the flipped labels)."""

    # The mapping: "reverse" | "swap" | "directed" | "all".
    flip: str = "reverse"
    # swap: pairs swapped both ways; directed: source -> target.
    pairs: tuple[tuple[int, int], ...] = ()
    # flip = "all": the label every sample gets.
    target: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", tuple((int(a), int(b)) for a, b in self.pairs))

    def validate(self) -> None:
        if self.flip not in FLIPS:
            raise ConfigError("flip", f"one of {', '.join(FLIPS)}, got {self.flip!r}")
        if self.flip in ("swap", "directed") and not self.pairs:
            raise ConfigError("pairs", f"flip={self.flip!r} needs at least one (a, b) pair")
        if self.flip == "swap":
            seen = [c for p in self.pairs for c in p]
            if len(seen) != len(set(seen)):
                raise ConfigError("pairs", f"swapped pairs must be disjoint, got {list(self.pairs)}")
        if self.flip == "directed":
            sources = [a for a, _ in self.pairs]
            if len(sources) != len(set(sources)):
                raise ConfigError("pairs", f"a source class appears twice in {list(self.pairs)}")


@dataclass(frozen=True)
class BackdoorOptions:
    """backdoor's options."""

    # Source -> target class pairs (empty = LINDT's CIFAR-10 deer -> horse, dog -> frog).
    pairs: tuple[tuple[int, int], ...] = ()
    # Poisoned samples in every batch of batch_size.
    poison_per_batch: int = 3
    batch_size: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", tuple((int(a), int(b)) for a, b in self.pairs))

    def validate(self) -> None:
        if not 0 < self.poison_per_batch < self.batch_size:
            raise ConfigError("poison_per_batch", f"must be in [1, batch_size={self.batch_size}), "
                                                  f"got {self.poison_per_batch}")


ATTACKS.add("none", AttackKind(), summary="no attack (fake_beta_hat alone may fabricate the reported β̂)")
ATTACKS.add("label_flip", AttackKind(flips_labels=True), options=LabelFlipOptions,
            summary="trains on labels flipped by attack.options.flip")
ATTACKS.add("backdoor", AttackKind(backdoor=True), options=BackdoorOptions,
            summary="trains on batches holding attack.options.poison_per_batch relabelled source-class samples")

# ---- options: each model-poisoning kind's frozen options dataclass (``attack.options``), registered with it ----


@dataclass(frozen=True)
class ModelReplacementOptions(LabelFlipOptions):
    """model_replacement's options: the label flip its malicious model trains on, and the boost."""

    # The malicious update (trained on labels flipped by ``flip``) is multiplied by this.
    boost: float = 10.0

    def validate(self) -> None:
        super().validate()
        if not (math.isfinite(self.boost) and self.boost > 0):
            raise ConfigError("boost", f"must be a finite number > 0, got {self.boost}")


@dataclass(frozen=True)
class CraftOptions:
    """What stat_opt and dyn_opt share: the partial-knowledge estimate and the rule the adversary assumes."""

    # Partial knowledge: honest updates on this many disjoint shards of the attacker's data form the benign sample.
    estimate_shards: int = 4
    # The server's rule as the adversary assumes it (HYDRA-FL: trimmed mean) and the number of malicious rows it
    # assumes beside the benign ones (assumed_attackers: trimmed_mean's trim_m, krum's f).
    assumed_rule: str = "trimmed_mean"
    assumed_attackers: int = 2

    def validate(self) -> None:
        if self.estimate_shards < 2:
            raise ConfigError("estimate_shards", f"must be >= 2 (a std needs two samples), got {self.estimate_shards}")
        if self.assumed_attackers < 1:
            raise ConfigError("assumed_attackers", f"must be >= 1, got {self.assumed_attackers}")
        try:
            assumed_aggregation(self.assumed_rule, self.assumed_attackers)
        except ValueError as e:
            raise ConfigError("assumed_rule", str(e)) from None


@dataclass(frozen=True)
class StatOptOptions(CraftOptions):
    """stat_opt's options."""

    # Full knowledge: malicious values between the benign extreme and the extreme scaled by stat_b.
    stat_b: float = 2.0

    def validate(self) -> None:
        if not (math.isfinite(self.stat_b) and self.stat_b >= 1):
            raise ConfigError("stat_b", f"must be a finite number >= 1, got {self.stat_b}")
        super().validate()


@dataclass(frozen=True)
class DynOptOptions(CraftOptions):
    """dyn_opt's options."""

    # The perturbation direction "std" | "sign" | "unit", and the halving search's start gamma_init and tolerance
    # gamma_tol.
    dev_type: str = "std"
    gamma_init: float = 10.0
    gamma_tol: float = 1e-5

    def validate(self) -> None:
        if self.dev_type not in DEV_TYPES:
            raise ConfigError("dev_type", f"one of {', '.join(DEV_TYPES)}, got {self.dev_type!r}")
        if not (math.isfinite(self.gamma_init) and self.gamma_init > 0):
            raise ConfigError("gamma_init", f"must be a finite number > 0, got {self.gamma_init}")
        if not (math.isfinite(self.gamma_tol) and 0 < self.gamma_tol < self.gamma_init):
            raise ConfigError("gamma_tol", f"must be in (0, gamma_init), got {self.gamma_tol}")
        super().validate()


def assumed_aggregation(rule: str, f: int) -> AggregationConfig:
    """The robust rule the adversary assumes the server runs, with ``f`` trimmed per side / Byzantine clients
    (trimmed_mean's trim_m, krum's f), as an aggregation configuration (checked, not built)."""
    declared = option_names(RULES, rule) if rule in RULES else []
    return AggregationConfig(rule=rule, options={k: f for k in ("trim_m", "krum_f") if k in declared})


@dataclass(frozen=True)
class AttackConfig:
    # The attack: "none", a data-poisoning kind ("label_flip", "backdoor") or a model-poisoning kind
    # ("model_replacement", "stat_opt", "dyn_opt").
    kind: str = "none"
    # The kind's options (a table; e.g. {flip = "swap", pairs = [[0, 4]]} for label_flip, {boost = 5.0} for
    # model_replacement): the frozen options dataclass the kind registered (listed under "Plugins" below), validated
    # by it. Unset: the kind's defaults. The old flat keys (attack.flip, pairs, target, poison_per_batch,
    # batch_size, boost, stat_b, dev_type, gamma_init, gamma_tol, estimate_shards, assumed_rule, assumed_attackers)
    # are still read into it.
    options: Any = None
    # epochs an attacker trains per round; 0 keeps the federation's local_epochs (LINDT attackers: 5)
    local_epochs_override: int = 0
    # Attack on NFL detection (FL-GUARD §4.1): report this beta_hat_i with every update instead of the measured
    # one (NaN: report the truth). Combines with any kind, or alone (kind "none").
    fake_beta_hat: float = math.nan
    # Model poisoning (model_replacement, stat_opt, dyn_opt; fedcore.attacks.model_poisoning): where the benign
    # statistics come from: "partial" (the attacker's own honest training on shards of its data) or "full"
    # (simulation only: the server-side harness [simulation_harness] crafts the row from the round's benign updates;
    # the client sends its honest update). Shared by the three kinds, so it stays beside kind.
    knowledge: str = "partial"

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise AttackError(f"attack.kind: one of {', '.join(ATTACKS.names())}, got {self.kind!r}")
        try:
            object.__setattr__(self, "options", ATTACKS.coerce_options(self.kind, self.options, "options"))
            ATTACKS.validate_options(self.kind, self.options, "options")
        except ConfigError as e:
            raise AttackError(str(e.under("attack"))) from None
        if not (math.isnan(self.fake_beta_hat) or -1.0 <= self.fake_beta_hat <= 1.0):
            raise AttackError(f"attack.fake_beta_hat: must be in [-1, 1] (or nan: no fabrication), "
                              f"got {self.fake_beta_hat}")
        check = self.kind_.check
        if check is not None:
            try:
                check(self)
            except ValueError as e:
                raise AttackError(str(e)) from None
        if self.local_epochs_override < 0:
            raise AttackError(f"attack.local_epochs_override: must be >= 0, got {self.local_epochs_override}")

    @classmethod
    def from_table(cls, data: Mapping[str, Any], path: str = "") -> AttackConfig:
        """The section from a TOML table / dict: ``options`` parsed and validated by the kind
        (:meth:`Registry.parse_options`, errors name ``attack.options.<field>``), the old flat keys of
        :data:`LEGACY_ATTACK_OPTIONS` moved into it first (:func:`fold_flat_options`)."""
        table = fold_flat_options(ATTACKS, data.get("kind", "none"), data, LEGACY_ATTACK_OPTIONS, path=path)
        options = table.pop("options", None)
        kind = table.get("kind", "none")
        if isinstance(kind, str) and kind in ATTACKS:
            options = ATTACKS.parse_options(kind, options, join(path, "options"))
        return decode_fields(cls, {**table, "options": options}, path)

    def options_as(self, cls: type[OptionsT]) -> OptionsT:
        """The kind's options, typed (``cls``: the options dataclass the reader expects)."""
        return options_as(self.options, cls, "attack.options")

    @property
    def kind_(self) -> AttackKind:
        """The registered :class:`AttackKind` of ``kind``."""
        return ATTACKS.get(self.kind)

    @property
    def active(self) -> bool:
        return self.kind != "none" or self.fabricates_beta_hat

    @property
    def flips_labels(self) -> bool:
        """Whether the attacker trains on flipped labels: label flipping, and model replacement (whose malicious
        model is trained on them before it is boosted)."""
        return self.kind_.flips_labels

    @property
    def poisons_model(self) -> bool:
        """A model-poisoning attack: the sent update is crafted (fedcore.attacks.model_poisoning)."""
        return self.kind_.poisons_model

    @property
    def fabricates_beta_hat(self) -> bool:
        return not math.isnan(self.fake_beta_hat)

    @property
    def flip_options(self) -> LabelFlipOptions:
        """The label-flip options of a kind that flips labels (label_flip, model_replacement)."""
        return self.options_as(LabelFlipOptions)

    @property
    def backdoor_options(self) -> BackdoorOptions:
        return self.options_as(BackdoorOptions)

    @property
    def backdoor_pairs(self) -> tuple[tuple[int, int], ...]:
        return self.backdoor_options.pairs or LINDT_BACKDOOR_PAIRS

    @classmethod
    def reverse_flip(cls, local_epochs_override: int = 0) -> AttackConfig:
        return cls(kind="label_flip", options=LabelFlipOptions(flip="reverse"),
                   local_epochs_override=local_epochs_override)

    @classmethod
    def distfl_flip(cls) -> AttackConfig:
        """DistFL's label flipping: 0-3 <-> 4-7."""
        return cls(kind="label_flip", options=LabelFlipOptions(flip="swap", pairs=DISTFL_FLIP_PAIRS))

    @classmethod
    def lindt_backdoor(cls) -> AttackConfig:
        """LINDT's CIFAR-10 backdoor: deer -> horse, dog -> frog, 3 per batch of 10, 5 local epochs."""
        return cls(kind="backdoor", options=BackdoorOptions(pairs=LINDT_BACKDOOR_PAIRS, poison_per_batch=3,
                                                            batch_size=10), local_epochs_override=5)


def check_model_attack(a: AttackConfig, prefix: str = "attack.") -> None:
    """Refuse impossible model-attack options; errors name the field (checked for every attack config, so a
    bad option fails at start, not in the first round the client is an attacker). The kind's own options are
    validated by their dataclass (``attack.options.<field>``); here: ``knowledge``, and Dyn-Opt with partial
    knowledge, whose assumed rule must work with its estimate's rows."""
    if not a.poisons_model:
        return
    if a.knowledge not in KNOWLEDGE:
        raise ValueError(f"{prefix}knowledge: one of {', '.join(KNOWLEDGE)}, got {a.knowledge!r}")
    try:
        ATTACKS.validate_options(a.kind, a.options, "options")
    except ConfigError as e:
        raise ValueError(f"{prefix}{e}") from None
    if a.kind == "dyn_opt" and a.knowledge == "partial":
        o = a.options_as(CraftOptions)
        try:
            build_rule(assumed_aggregation(o.assumed_rule, o.assumed_attackers)).check(
                o.estimate_shards + o.assumed_attackers)
        except ValueError as e:
            raise ValueError(f"{prefix}options.assumed_rule: {e}") from None


_MODEL_POISONING = "fedcore.attacks.model_poisoning"
ATTACKS.add("model_replacement", AttackKind(flips_labels=True, poison=deferred(f"{_MODEL_POISONING}:replace_model"),
                                            check=check_model_attack),
            options=ModelReplacementOptions,
            summary="sends its update trained on flipped labels, boosted by attack.options.boost")
ATTACKS.add("stat_opt", AttackKind(poison=deferred(f"{_MODEL_POISONING}:craft_from_own_shards"),
                                   craft=deferred(f"{_MODEL_POISONING}:stat_opt_rows"), check=check_model_attack),
            options=StatOptOptions,
            summary="Stat-Opt (Fang et al.): coordinates beyond the benign extremes, against the benign mean's sign")
ATTACKS.add("dyn_opt", AttackKind(poison=deferred(f"{_MODEL_POISONING}:craft_from_own_shards"),
                                  craft=deferred(f"{_MODEL_POISONING}:dyn_opt_rows"), check=check_model_attack),
            options=DynOptOptions,
            summary="Dyn-Opt (Shejwalkar & Houmansadr): μ − γ·dev with the largest γ the assumed rule accepts")


def crafting_kinds() -> tuple[str, ...]:
    """The attack kinds that craft rows from benign statistics (registered with a ``craft``): what the server-side
    harness can run."""
    return tuple(name for name in ATTACKS.names() if ATTACKS.get(name).craft is not None)


@dataclass
class SimulationHarnessConfig:
    """``[simulation_harness]``: SIMULATION ONLY. ``full_knowledge_adversary`` turns the server-side adversary on;
    ``attack`` is what it crafts (kind stat_opt or dyn_opt and their options; ``knowledge`` must be "full");
    ``trim_to_attackers`` gives the trimmed mean the round's attacker count as m (the papers' oracle defender)."""

    # Turn the server-side full-knowledge adversary on (simulation only: refused with TLS or enrolled keys).
    full_knowledge_adversary: bool = False
    # The trimmed mean trims, per side, at least as many values as the round has attacker updates (the defender
    # of HYDRA-FL's and Shejwalkar & Houmansadr's evaluations knows m; capped at (n - 1) // 2); the rows are then
    # crafted against that rule. Off: the configured trim_m / trim_fraction.
    trim_to_attackers: bool = False
    # What it crafts: kind stat_opt or dyn_opt with knowledge = "full", and their options.
    attack: AttackConfig = field(default_factory=lambda: AttackConfig(kind="dyn_opt", knowledge="full"))

    def validate(self, prefix: str = "simulation_harness.") -> SimulationHarnessConfig:
        if self.full_knowledge_adversary:
            kinds = crafting_kinds()
            if self.attack.kind not in kinds:
                raise ValueError(f"{prefix}attack.kind: the full-knowledge adversary crafts "
                                 f"{' or '.join(kinds)}, got {self.attack.kind!r}")
            if self.attack.knowledge != "full":
                raise ValueError(f"{prefix}attack.knowledge: must be 'full' for the server-side adversary, got "
                                 f"{self.attack.knowledge!r}")
        return self
