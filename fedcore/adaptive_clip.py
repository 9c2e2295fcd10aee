"""Adaptive clipping for server-side DP (Andrew et al., "Differentially Private Learning with Adaptive Clipping",
NeurIPS 2021, Algorithm 1 and §3): the clip norm follows a target quantile of the update norms; docs/privacy.md.

Each round r clips every update to the round's clip norm ``C_r`` and counts the updates that were not clipped,
``b_i = 1[‖u_i‖ ≤ C_r]`` (the aggregation metric ``num_unclipped``). After the round the count is released with
Gaussian noise and the clip norm takes one geometric step towards the target quantile γ:

    b̃_r = (Σ_i b_i + N(0, σ_b²)) / m_r          (m_r: the round's number of updates, the aggregation's divisor)
    C_{r+1} = C_r · exp(−η_C · (b̃_r − γ))

Noise split (their Theorem 1). The round releases two Gaussian queries of the same sample: the noised average of the
clipped updates (L2 sensitivity ``C_r · s_r``, ``s_r`` the largest weight share) and the noised count. The count is
taken as ``Σ_i (b_i − ½) + m_r/2`` with ``m_r`` public, so its sensitivity is ½ and its noise multiplier ``2σ_b``.
With ``z_Δ`` the update's multiplier, the pair is one Gaussian mechanism with multiplier
``z = (z_Δ^{-2} + (2σ_b)^{-2})^{-1/2}``; for a configured total ``z`` the update therefore gets

    z_Δ = (z^{-2} − (2σ_b)^{-2})^{-1/2}      (needs 2σ_b > z)

and fedguard's absolute noise std on the (weighted) average of round r is ``σ_r = z_Δ · C_r · s_r`` (the aggregator
computes it when the round closes, from the round's own ``s_r``; ``aggregation.noise_sigma`` stays 0). The DP
accountant charges every round the sampled Gaussian mechanism with multiplier ``z`` (:mod:`fedcore.privacy`).

This module is pure: :func:`init` and :func:`update` hold no randomness (the caller draws the count's standard
normal from a generator seeded by (seed, round, ``"adaptive_clip_count"``) and passes it in), and the state is a
small frozen dataclass with :meth:`AdaptiveClipState.to_dict` / :meth:`~AdaptiveClipState.from_dict`, saved with
every snapshot by the server's ``adaptive_clip`` stage (:mod:`fedserver.adaptive_clip`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcore.checks import is_finite_number, is_int
from fedcore.errors import require
from fedcore.options import join

if TYPE_CHECKING:
    from fedcore.aggregation import AggregationConfig

# The seed purpose of the count's noise: derive_seed(seed, round, COUNT_NOISE).
COUNT_NOISE = "adaptive_clip_count"
# The paper's suggestion for the count's noise: sigma_b = m / 20 (m the expected number of updates per round).
COUNT_NOISE_PER_UPDATE = 1.0 / 20.0
# The aggregation rules whose sensitivity is C * max weight share (those fedcore.privacy accounts).
RULES = ("fedavg",)


@dataclass(frozen=True)
class AdaptiveClipConfig:
    """Adaptive clipping for server-side DP (Andrew et al., NeurIPS 2021): the clip norm follows the target_quantile
    of the update norms, driven by the noised fraction of unclipped updates, and the update noise scales with it.
    Replaces aggregation.clip_norm and aggregation.noise_sigma (leave those unset / 0); fedavg only."""

    # Turn adaptive clipping on (off: the fixed aggregation.clip_norm and noise_sigma, exactly as before).
    enabled: bool = False
    # C_0, the clip norm of the first round (Andrew et al. start at 0.1 and let it adapt).
    initial_clip_norm: float = 0.1
    # gamma, the quantile of the update norms the clip norm tracks: about this fraction of updates goes unclipped.
    target_quantile: float = 0.5
    # eta_C, the step of the geometric update C <- C * exp(-eta_C * (noised unclipped fraction - gamma)).
    learning_rate: float = 0.2
    # sigma_b, the absolute std of the Gaussian noise on the count of unclipped updates; unset: K / 20
    # (rounds.clients_per_round / 20, the paper's m / 20). Must exceed noise_multiplier / 2.
    count_noise_std: float | None = None
    # z, the noise multiplier of the whole round (update and count together, Andrew et al. Thm 1): the average gets
    # N(0, sigma_r^2 I) with sigma_r = z_D * C_r * (max weight share), z_D = (z^-2 - (2 sigma_b)^-2)^-1/2, and the
    # accountant charges z. 0: no update noise (adaptive clipping without a DP guarantee).
    noise_multiplier: float = 0.0

    def validate(self, prefix: str = "adaptive_clip") -> AdaptiveClipConfig:
        """Each field on its own; :class:`ConfigError` naming ``<prefix>.<field>``. Returns ``self``."""
        require(isinstance(self.enabled, bool), join(prefix, "enabled"),
                f"expected true or false, got {self.enabled!r}")
        require(is_finite_number(self.initial_clip_norm) and self.initial_clip_norm > 0,
                join(prefix, "initial_clip_norm"), f"must be a finite number > 0, got {self.initial_clip_norm!r}")
        require(is_finite_number(self.target_quantile) and 0.0 < self.target_quantile < 1.0,
                join(prefix, "target_quantile"), f"must be a number in (0, 1), got {self.target_quantile!r}")
        require(is_finite_number(self.learning_rate) and self.learning_rate > 0, join(prefix, "learning_rate"),
                f"must be a finite number > 0, got {self.learning_rate!r}")
        require(self.count_noise_std is None or (is_finite_number(self.count_noise_std) and self.count_noise_std >= 0),
                join(prefix, "count_noise_std"),
                f"must be a finite number >= 0 (or unset: K / 20), got {self.count_noise_std!r}")
        require(is_finite_number(self.noise_multiplier) and self.noise_multiplier >= 0,
                join(prefix, "noise_multiplier"), f"must be a finite number >= 0, got {self.noise_multiplier!r}")
        if self.count_noise_std is not None:
            _check_split(self.noise_multiplier, self.count_noise_std, prefix, "")
        return self

    def validate_for(self, aggregation: AggregationConfig, clients_per_round: int, distfl: bool = False,
                     prefix: str = "adaptive_clip") -> AdaptiveClipConfig:
        """:meth:`validate`, and, when enabled, the server configuration around it: fedavg only, no fixed
        ``aggregation.clip_norm`` / ``noise_sigma``, no DistFL, and a count noise that leaves the update a finite
        noise multiplier for rounds of ``clients_per_round`` (K). :class:`ConfigError` naming the field."""
        self.validate(prefix)
        if not self.enabled:
            return self
        enabled = join(prefix, "enabled")
        require(aggregation.rule in RULES, enabled,
                f"adaptive clipping needs an averaging rule whose sensitivity is the clip norm times the largest "
                f"weight share ({', '.join(RULES)}), got aggregation.rule = {aggregation.rule!r}")
        require(aggregation.clip_norm is None, "aggregation.clip_norm",
                f"must be unset with {enabled}: the clip norm adapts, starting at "
                f"{join(prefix, 'initial_clip_norm')}, got {aggregation.clip_norm}")
        require(aggregation.noise_sigma == 0.0, "aggregation.noise_sigma",
                f"must be 0 with {enabled}: the update noise follows the clip norm "
                f"({join(prefix, 'noise_multiplier')}), got {aggregation.noise_sigma}")
        require(not distfl, enabled, "not with distfl.enabled (DistFL aggregates a model per cluster)")
        if self.count_noise_std is None:
            std = resolved(self, clients_per_round).count_noise_std
            assert std is not None
            _check_split(self.noise_multiplier, std, prefix,
                         f" (unset: K / 20 = {std:g} with rounds.clients_per_round = {clients_per_round}; set it)")
        return self


def _check_split(z: float, count_std: float, prefix: str, note: str) -> None:
    require(z == 0.0 or 2.0 * count_std > z, join(prefix, "count_noise_std"),
            f"must exceed noise_multiplier / 2 = {z / 2:g}{note}, so that the update keeps a finite noise multiplier "
            f"(z_D = (z^-2 - (2 sigma_b)^-2)^-1/2), got {count_std:g}")


def resolved(config: AdaptiveClipConfig, clients_per_round: int) -> AdaptiveClipConfig:
    """``config`` with an unset ``count_noise_std`` made ``clients_per_round / 20`` (the paper's m / 20, with m the
    expected number of updates per round, K)."""
    if config.count_noise_std is not None:
        return config
    return dataclasses.replace(config, count_noise_std=clients_per_round * COUNT_NOISE_PER_UPDATE)


def update_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """``z_Δ = (z^{-2} − (2σ_b)^{-2})^{-1/2}``: the update's noise multiplier that, with the count's noise std σ_b,
    makes the round one Gaussian mechanism of multiplier ``z`` (Andrew et al., Thm 1); 0 for ``z = 0``. ValueError
    unless ``2σ_b > z``."""
    z, sb = noise_multiplier, count_noise_std
    if z == 0.0:
        return 0.0
    if not 2.0 * sb > z:
        raise ValueError(f"count_noise_std: must exceed noise_multiplier / 2 = {z / 2:g}, got {sb:g}")
    # = z / sqrt(1 - (z / 2 sigma_b)^2), the same value without forming z^-2 and (2 sigma_b)^-2.
    return z / math.sqrt(1.0 - (z / (2.0 * sb)) ** 2)


def combined_noise_multiplier(update_multiplier: float, count_noise_std: float) -> float:
    """``z = (z_Δ^{-2} + (2σ_b)^{-2})^{-1/2}``, the inverse of :func:`update_noise_multiplier`: the noise multiplier
    of the update (``z_Δ``) and the count (sensitivity ½, std σ_b) released together; 0 when either is 0."""
    if update_multiplier == 0.0 or count_noise_std == 0.0:
        return 0.0
    return update_multiplier / math.sqrt(1.0 + (update_multiplier / (2.0 * count_noise_std)) ** 2)


@dataclass(frozen=True)
class AdaptiveClipState:
    """The clip norm of the next round and the rounds folded in so far."""

    clip_norm: float
    rounds: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; a float survives JSON's round trip exactly (a resume is bit-identical)."""
        return {"clip_norm": self.clip_norm, "rounds": self.rounds}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdaptiveClipState:
        clip, rounds = d.get("clip_norm"), d.get("rounds", 0)
        if not (is_finite_number(clip) and clip > 0):  # type: ignore[operator]
            raise ValueError(f"adaptive_clip: the stored clip_norm must be a finite number > 0, got {clip!r}")
        if not (is_int(rounds) and rounds >= 0):
            raise ValueError(f"adaptive_clip: the stored rounds must be an integer >= 0, got {rounds!r}")
        return cls(float(clip), int(rounds))  # type: ignore[arg-type]


def init(config: AdaptiveClipConfig) -> AdaptiveClipState:
    """The state before the first round: ``C_0 = initial_clip_norm``."""
    return AdaptiveClipState(float(config.initial_clip_norm), 0)


def update(state: AdaptiveClipState, config: AdaptiveClipConfig, unclipped_count: int, m: int,
           noise: float) -> tuple[AdaptiveClipState, float]:
    """``state`` after a round of ``m`` updates of which ``unclipped_count`` had ``‖u_i‖ ≤ C``, and the noised
    fraction ``b̃ = (unclipped_count + σ_b · noise) / m``; ``noise`` is a standard normal draw (the caller's, from a
    generator seeded by what it is for). ``config.count_noise_std`` must be resolved (:func:`resolved`)."""
    if config.count_noise_std is None:
        raise ValueError("adaptive_clip.update: count_noise_std is unset; resolve the config first (resolved())")
    if not (is_int(m) and m >= 1):
        raise ValueError(f"adaptive_clip.update: m must be an integer >= 1, got {m!r}")
    if not (is_int(unclipped_count) and 0 <= unclipped_count <= m):
        raise ValueError(f"adaptive_clip.update: unclipped_count must be an integer in [0, m={m}], got "
                         f"{unclipped_count!r}")
    if not math.isfinite(noise):
        raise ValueError(f"adaptive_clip.update: the noise draw must be finite, got {noise!r}")
    fraction = (unclipped_count + config.count_noise_std * noise) / m
    clip = state.clip_norm * math.exp(-config.learning_rate * (fraction - config.target_quantile))
    return AdaptiveClipState(clip, state.rounds + 1), fraction
