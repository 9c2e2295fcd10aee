"""Attack configuration and data poisoning by simulated attacker clients: label flipping and LINDT's backdoor
(SPEC §9). Model poisoning (model replacement, Stat-Opt, Dyn-Opt) is in :mod:`fedcore.attacks.model_poisoning`;
:class:`AttackConfig` holds the options of both.

Pure functions of the client's data, an :class:`AttackConfig` and a seed. Only the attacker's *training* labels
are poisoned; its test split keeps the true labels, so its Pᵢ and βᵢ stay measurable (experiments report β over
benign clients with attackers excluded).

Label flipping (``kind="label_flip"``), mapping by ``flip``:

- ``reverse``: y -> C-1-y.
- ``swap``: each pair (a, b) in ``pairs`` is swapped both ways. DistFL flips "label 0-3 and label 4-7 mutually";
  :data:`DISTFL_FLIP_PAIRS` reads that as 0<->4, 1<->5, 2<->6, 3<->7.
- ``directed``: each pair (s, t) in ``pairs`` maps s -> t only (a single source -> target is one pair).
- ``all``: every label becomes ``target`` (LINDT's Shakespeare attackers predict "\\n" for everything).

Backdoor (``kind="backdoor"``, LINDT Appendix C after Bagdasaryan et al.): the backdoor set is the attacker's
samples of the source classes relabelled to their targets (CIFAR-10: deer -> horse, dog -> frog by default);
every training batch of ``batch_size`` holds ``poison_per_batch`` backdoor samples (3 of 10) and clean samples
with their true labels for the rest. Source-class samples are left out of the clean stream so that the model
is not taught both labels of the same images. Attackers train ``local_epochs_override`` epochs (LINDT: 5,
benign clients 1); :func:`attacker_local_epochs` applies it.

Attack kinds plug in by name (:data:`ATTACKS`, ``attack.kind``): each registers an :class:`AttackKind` saying
what it does to an attacker's round (the labels or batches it trains on, the update it sends, its option checks).
This module registers the data-poisoning kinds, :mod:`fedcore.attacks.model_poisoning` (imported with the
package) the model-poisoning ones; nothing here imports that module, so no import circle forms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fedcore.aggregation.config import Rule
from fedcore.data.base import ClientData
from fedcore.errors import ConfigError
from fedcore.options import decode_fields, join
from fedcore.registry import Registry, fold_flat_options, options_as
from fedcore.seeds import ATTACK_EPOCH, derive_seed

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
Craft = Callable[["AttackConfig", torch.Tensor, int, Rule, torch.Generator, str], Crafted]


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

# The flat keys ``[attack]`` held before each kind owned its options, with their old defaults: still read, into the
# chosen kind's ``options`` (fold_flat_options).
LEGACY_ATTACK_OPTIONS: dict[str, Any] = {
    "flip": "reverse", "pairs": (), "target": 0, "poison_per_batch": 3, "batch_size": 10, "boost": 10.0,
    "stat_b": 2.0, "dev_type": "std", "gamma_init": 10.0, "gamma_tol": 1e-5, "estimate_shards": 4,
    "assumed_rule": "trimmed_mean", "assumed_attackers": 2}


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


def _check_classes(classes: Sequence[int], num_classes: int, what: str) -> None:
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise AttackError(f"{what}: classes {bad} outside 0..{num_classes - 1}")


def label_mapping(config: AttackConfig, num_classes: int) -> torch.Tensor:
    """Lookup table ``lut`` (int64 [C]) with poisoned label ``lut[y]``; identity where nothing changes.

    For ``backdoor`` it is the backdoor's source -> target map (what ASR measures).
    """
    lut = torch.arange(num_classes, dtype=torch.int64)
    if not (config.flips_labels or config.kind_.backdoor):
        return lut
    if config.kind_.backdoor:
        _check_classes([c for p in config.backdoor_pairs for c in p], num_classes, "attack.options.pairs")
        for s, t in config.backdoor_pairs:
            lut[s] = t
        return lut
    flip = config.flip_options
    if flip.flip == "reverse":
        return num_classes - 1 - lut
    if flip.flip == "all":
        _check_classes([flip.target], num_classes, "attack.options.target")
        return torch.full((num_classes,), flip.target, dtype=torch.int64)
    _check_classes([c for p in flip.pairs for c in p], num_classes, "attack.options.pairs")
    for a, b in flip.pairs:
        lut[a] = b
        if flip.flip == "swap":
            lut[b] = a
    return lut


def target_mapping(config: AttackConfig, num_classes: int) -> dict[int, int]:
    """source -> target of every class the attack changes (the ``mapping`` argument of the ASR metric)."""
    lut = label_mapping(config, num_classes)
    return {s: int(t) for s, t in enumerate(lut.tolist()) if int(t) != s}


def flip_labels(y: torch.Tensor, config: AttackConfig, num_classes: int) -> torch.Tensor:
    """Poisoned copy of ``y`` under the label-flip ``config`` (``y`` is unchanged)."""
    if not config.flips_labels:
        return y.clone()
    return label_mapping(config, num_classes)[y]


def poison_client_data(data: ClientData, config: AttackConfig) -> ClientData:
    """``data`` with its training labels flipped (label flip) or unchanged (none, backdoor: see batches)."""
    if not config.flips_labels:
        return data
    return ClientData(data.x_train, flip_labels(data.y_train, config, data.num_classes), data.x_test, data.y_test,
                      data.num_classes)


def attacker_local_epochs(config: AttackConfig, local_epochs: int) -> int:
    """Epochs an attacker trains this round: ``local_epochs_override`` when set, else the federation's."""
    return config.local_epochs_override if config.active and config.local_epochs_override > 0 else local_epochs


# ---- batches ----

def clean_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int,
                  epoch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled mini-batches (seeded per epoch)."""
    g = torch.Generator().manual_seed(_seed(seed, epoch))
    perm = torch.randperm(len(y), generator=g)
    for start in range(0, len(y), batch_size):
        idx = perm[start : start + batch_size]
        yield x[idx], y[idx]


def _seed(seed: int, epoch: int) -> int:
    """The seed of one epoch's attacker batches: ``derive_seed(seed, "attack_epoch", epoch)`` (all of ``seed``'s
    bits count; a FedClient's ``seed`` is ``derive_seed(federation seed, client id, round, "attack")``)."""
    return derive_seed(int(seed), ATTACK_EPOCH, int(epoch))


@dataclass(frozen=True, eq=False)
class BackdoorBatches:
    """Mini-batches mixing clean samples with relabelled backdoor samples (LINDT: 3 of every 10).

    ``x_clean``/``y_clean``: samples with true labels; ``x_poison``/``y_poison``: backdoor samples with their target
    labels. An epoch passes once over the clean samples, ``batch_size - poison_per_batch`` per batch; each batch
    adds ``poison_per_batch`` backdoor samples, cycling through a fresh permutation of the backdoor set, and
    the batch is shuffled. Batches are a pure function of (seed, epoch).
    """

    x_clean: torch.Tensor
    y_clean: torch.Tensor
    x_poison: torch.Tensor
    y_poison: torch.Tensor
    batch_size: int = 10
    poison_per_batch: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.y_poison) == 0:
            raise AttackError("backdoor: no backdoor samples (the client holds none of the source classes); "
                              "give the attacker a backdoor set with backdoor_set(...) from other data")
        if not 0 < self.poison_per_batch < self.batch_size:
            raise AttackError(f"backdoor: poison_per_batch must be in [1, {self.batch_size}), "
                              f"got {self.poison_per_batch}")

    @property
    def clean_per_batch(self) -> int:
        return self.batch_size - self.poison_per_batch

    def batches_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.y_clean) / self.clean_per_batch))

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(_seed(self.seed, epoch))
        clean = torch.randperm(len(self.y_clean), generator=g)
        n_batches = self.batches_per_epoch()
        reps = math.ceil(n_batches * self.poison_per_batch / len(self.y_poison))
        poison = torch.cat([torch.randperm(len(self.y_poison), generator=g) for _ in range(reps)])
        for b in range(n_batches):
            ci = clean[b * self.clean_per_batch : (b + 1) * self.clean_per_batch]
            pi = poison[b * self.poison_per_batch : (b + 1) * self.poison_per_batch]
            xb = torch.cat([self.x_clean[ci], self.x_poison[pi]])
            yb = torch.cat([self.y_clean[ci], self.y_poison[pi]])
            order = torch.randperm(len(yb), generator=g)
            yield xb[order], yb[order]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.epoch(0)


def backdoor_set(x: torch.Tensor, y: torch.Tensor,
                 pairs: Sequence[tuple[int, int]] = LINDT_BACKDOOR_PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of the source classes in (x, y), relabelled to their targets."""
    lut = {int(s): int(t) for s, t in pairs}
    sources = torch.tensor(sorted(lut), dtype=y.dtype)
    mask = torch.isin(y, sources)
    y_src = y[mask]
    y_tgt = y_src.clone()
    for s, t in lut.items():
        y_tgt[y_src == s] = t
    return x[mask], y_tgt


def backdoor_batches(data: ClientData, config: AttackConfig, seed: int,
                     extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> BackdoorBatches:
    """LINDT backdoor batches for an attacker's training data.

    The backdoor set is the client's own source-class samples relabelled, plus ``extra`` (already relabelled
    backdoor samples from elsewhere, for attackers whose partition holds no source class). The clean stream is
    the client's other training samples.
    """
    if not config.kind_.backdoor:
        raise AttackError(f"backdoor_batches needs kind='backdoor', got {config.kind!r}")
    pairs = config.backdoor_pairs
    _check_classes([c for p in pairs for c in p], data.num_classes, "attack.options.pairs")
    xp, yp = backdoor_set(data.x_train, data.y_train, pairs)
    if extra is not None:
        xp, yp = torch.cat([xp, extra[0]]), torch.cat([yp, extra[1]])
    sources = torch.tensor([s for s, _ in pairs], dtype=data.y_train.dtype)
    keep = ~torch.isin(data.y_train, sources)
    x_clean, y_clean = data.x_train[keep], data.y_train[keep]
    if len(y_clean) == 0:  # nothing but source classes: the backdoor samples are all there is to learn
        x_clean, y_clean = xp, yp
    options = config.backdoor_options
    return BackdoorBatches(x_clean, y_clean, xp, yp, options.batch_size, options.poison_per_batch, seed)


def poisoned_batches(data: ClientData, config: AttackConfig, batch_size: int, seed: int, epoch: int = 0,
                     extra: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of the attacker's training batches under ``config`` (clean batches when ``kind="none"``).

    For a backdoor the batch size is ``config.options.batch_size`` (the recipe's 10); ``batch_size`` applies otherwise.
    """
    if config.kind_.backdoor:
        return backdoor_batches(data, config, seed, extra).epoch(epoch)
    y = flip_labels(data.y_train, config, data.num_classes) if config.flips_labels else data.y_train
    return clean_batches(data.x_train, y, batch_size, seed, epoch)
