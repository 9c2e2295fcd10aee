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

Attack kinds plug in by name (:data:`fedcore.attacks.config.ATTACKS`, ``attack.kind``), registered with their
options in the torch-free :mod:`fedcore.attacks.config` beside :class:`AttackConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fedcore.attacks.config import ATTACKS as ATTACKS  # re-exported: the configuration lives in attacks.config
from fedcore.attacks.config import DISTFL_FLIP_PAIRS as DISTFL_FLIP_PAIRS  # re-exported
from fedcore.attacks.config import LINDT_BACKDOOR_PAIRS as LINDT_BACKDOOR_PAIRS  # re-exported
from fedcore.attacks.config import AttackConfig as AttackConfig  # re-exported
from fedcore.attacks.config import AttackError as AttackError  # re-exported
from fedcore.attacks.config import AttackKind as AttackKind  # re-exported
from fedcore.attacks.config import BackdoorOptions as BackdoorOptions  # re-exported
from fedcore.attacks.config import Crafted as Crafted  # re-exported
from fedcore.attacks.config import LabelFlipOptions as LabelFlipOptions  # re-exported
from fedcore.attacks.config import PoisonedUpdate as PoisonedUpdate  # re-exported
from fedcore.attacks.config import UpdateContext as UpdateContext  # re-exported
from fedcore.data.base import ClientData
from fedcore.seeds import ATTACK_EPOCH, derive_seed


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
