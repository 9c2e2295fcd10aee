"""The adaptive-clipping stage: the imperative shell around :mod:`fedcore.adaptive_clip` (``[adaptive_clip]``).

Each round the intake (:meth:`fedserver.intake.UpdateIntake.open_round`) builds the round's aggregator with the clip
norm this stage holds, ``C_r``, and the update's noise multiplier ``z_Δ`` (the aggregator adds noise of std
``z_Δ · C_r · max weight share`` when the round closes and reports ``clip_norm``, ``num_unclipped`` and
``noise_sigma``). After the round, this stage's report hook draws the count's noise from a generator seeded by
(seed, round, ``"adaptive_clip_count"``), folds the round into the pure state with
:func:`fedcore.adaptive_clip.update` and adds ``noised_unclipped_fraction`` (b̃, the only form of the count that is
released) and ``next_clip_norm`` (``C_{r+1}``) to the round's metrics, before the DP accountant and the snapshot: the
state (the next clip norm) is saved with the round that moved it, so a resumed server carries on bit for bit.
Without ``adaptive_clip.enabled`` the stage is not in the pipeline and the aggregation is exactly as before.

The round's clip norm reaches the intake through the stage's aggregation hook (:meth:`AdaptiveClipShell.setup`),
which the pipeline runs whenever a round opens (:meth:`fedserver.pipeline.Pipeline.round_aggregation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fedcore import adaptive_clip as ac
from fedcore.log import get_logger
from fedcore.report import RoundReport
from fedcore.seeds import derive_seed
from fedserver.stage import JsonState, RoundAggregation, ServerParts, Stage

NAME = "adaptive_clip"


class AdaptiveClipShell:
    """Holds the adaptive clip norm between rounds; :meth:`observe` is the report hook."""

    def __init__(self, config: ac.AdaptiveClipConfig, clients_per_round: int, seed: int) -> None:
        self.config = ac.resolved(config, clients_per_round)
        assert self.config.count_noise_std is not None
        self.update_multiplier = ac.update_noise_multiplier(self.config.noise_multiplier, self.config.count_noise_std)
        self.seed = seed
        self.state = ac.init(self.config)
        self.log = get_logger("fedserver")

    @property
    def clip_norm(self) -> float:
        """C of the next round to aggregate."""
        return self.state.clip_norm

    def setup(self, round_setup: RoundAggregation) -> RoundAggregation:
        """The aggregation hook: the round clips to its C, and its noise is the update's multiplier z_Δ (for
        :func:`~fedcore.aggregation.make_aggregator`'s ``noise_multiplier``)."""
        return RoundAggregation(dataclasses.replace(round_setup.config, clip_norm=self.state.clip_norm),
                                self.update_multiplier)

    def count_noise(self, round_: int) -> float:
        """The round's standard normal draw for the count, from a generator seeded by (seed, round, purpose)."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, round_, ac.COUNT_NOISE))
        return float(torch.randn((), generator=g, dtype=torch.float64))

    def observe(self, report: RoundReport) -> RoundReport:
        """Fold the round's count into the state; the report with the noised fraction and the next clip norm."""
        m = report.metrics
        used, n, unclipped = m.get("clip_norm"), m.get("num_updates"), m.get("num_unclipped")
        if used is None or n is None or unclipped is None:
            self.log.error("adaptive_clip.round_not_counted", round=report.round,
                           reason="the round's metrics hold no clip_norm / num_updates / num_unclipped",
                           consequence="the clip norm stays at its value")
            return report
        if used != self.state.clip_norm:
            self.log.warning("adaptive_clip.clip_norm_differs", round=report.round, used=used,
                             state=self.state.clip_norm)
        self.state, fraction = ac.update(self.state, self.config, int(unclipped), int(n),
                                         self.count_noise(report.round))
        metrics = {**m, "noised_unclipped_fraction": fraction, "next_clip_norm": self.state.clip_norm}
        return dataclasses.replace(report, metrics=metrics)

    # ---- the snapshot ----

    def save(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load(self, d: dict[str, Any]) -> None:
        self.state = ac.AdaptiveClipState.from_dict(d)


def adaptive_clip_stage(parts: ServerParts) -> Stage | None:
    """The stage when ``adaptive_clip.enabled``; None otherwise (fixed clipping, as configured in [aggregation])."""
    cfg = parts.config
    if not cfg.adaptive_clip.enabled:
        return None
    shell = AdaptiveClipShell(cfg.adaptive_clip, cfg.rounds.clients_per_round, cfg.rounds.seed)
    shell.log.info("adaptive_clip.enabled", initial_clip_norm=shell.clip_norm,
                   target_quantile=shell.config.target_quantile, learning_rate=shell.config.learning_rate,
                   count_noise_std=shell.config.count_noise_std, noise_multiplier=shell.config.noise_multiplier,
                   update_noise_multiplier=shell.update_multiplier)
    return Stage(NAME, aggregation=shell.setup, report=shell.observe, state=JsonState(shell.save, shell.load))
