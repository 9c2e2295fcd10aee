"""The server's DP accountant: the imperative shell around :mod:`fedcore.privacy`.

After a round's report is built (and the NFL monitor completed it), :meth:`DpMonitor.observe` derives the round's
sampled Gaussian mechanism (noise multiplier z, sampling rate q) from its aggregation metrics, folds it into the
cumulative RDP state and returns the report with ``dp_epsilon``, ``dp_delta``, ``dp_noise_multiplier`` and
``dp_sample_rate``; the ``round.completed`` line and ``rounds.jsonl`` carry them. The state is a persistence slot,
saved with the round that moved it, so a resumed server carries on from it. With ``dp.max_epsilon`` set, the first
round whose epsilon exceeds it logs ``dp.budget_exceeded``; under ``dp.on_budget = "stop"`` the federation then
ends after that round (outcome ``dp_budget``), and a restarted server runs no further round. With adaptive clipping
(``[adaptive_clip]``) every round is charged the combined mechanism of the update and the count, multiplier
``adaptive_clip.noise_multiplier`` (:func:`fedcore.privacy.round_mechanism`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fedcore import privacy
from fedcore.adaptive_clip import AdaptiveClipConfig, resolved
from fedcore.config import ServerConfig, effective_aggregation
from fedcore.log import get_logger
from fedcore.report import RoundReport

SLOT = "dp"
OUTCOME = "dp_budget"


class DpMonitor:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config.dp
        self.aggregation = effective_aggregation(config)
        # Adaptive clipping, its count noise resolved (None: fixed clipping as in [aggregation]).
        self.adaptive: AdaptiveClipConfig | None = (resolved(config.adaptive_clip, config.rounds.clients_per_round)
                                                    if config.adaptive_clip.enabled else None)
        self.population = privacy.population_of(config.dp, config.data.options)
        self.state = privacy.init()
        self.epsilon = 0.0
        self.exceeded_round = 0
        self.log = get_logger("fedserver")
        reason = privacy.not_accounted(self.aggregation, config.distfl.enabled, self.adaptive)
        if reason is None and not self.config.accounting:
            reason = "dp.accounting = false"
        if reason is None and not privacy.available():
            reason = f"the privacy accountant is not installed: {privacy.INSTALL_HINT}"
        self.reason = reason
        agg, ad = self.aggregation, self.adaptive
        if ad is not None:
            if ad.noise_multiplier > 0 and reason is not None:
                self.log.warning("dp.not_accounted", noise_multiplier=ad.noise_multiplier, reason=reason)
            elif reason is None:
                self.log.info("dp.accounting", mechanism="user-level, server-side, adaptive clipping (Andrew et al. "
                              "2021): clip each update to the round's C, average, add N(0, (z_D C s)^2 I); release "
                              "the unclipped count with N(0, sigma_b^2); charged as one Gaussian mechanism of "
                              "multiplier z", noise_multiplier=ad.noise_multiplier,
                              count_noise_std=ad.count_noise_std, weighted=agg.weighted,
                              population=self.population or "unknown (q = 1)", delta=self.config.delta,
                              max_epsilon=self.config.max_epsilon, on_budget=self.config.on_budget)
        elif agg.noise_sigma > 0 and reason is not None:
            # DP noise without a stated budget: say so once at start (no epsilon in the rounds).
            self.log.warning("dp.not_accounted", noise_sigma=agg.noise_sigma, clip_norm=agg.clip_norm, reason=reason)
        elif reason is None:
            self.log.info("dp.accounting", mechanism="user-level, server-side: clip each update to S, average, add "
                          "N(0, sigma^2 I) to the average", clip_norm=agg.clip_norm, noise_sigma=agg.noise_sigma,
                          weighted=agg.weighted, population=self.population or "unknown (q = 1)",
                          delta=self.config.delta, max_epsilon=self.config.max_epsilon,
                          on_budget=self.config.on_budget)

    @property
    def enabled(self) -> bool:
        return self.reason is None

    @property
    def stop_required(self) -> bool:
        """The budget is spent and ``dp.on_budget = "stop"``: no further round may run."""
        return self.exceeded_round > 0 and self.config.on_budget == "stop"

    def observe(self, report: RoundReport) -> tuple[RoundReport, bool]:
        """The report completed with the round's DP figures, and whether the federation must stop after it."""
        if not self.enabled:
            return report, False
        try:
            mech = privacy.round_mechanism(self.aggregation, report.metrics, report.selected, self.population,
                                           self.adaptive)
        except ValueError as e:  # a round whose sensitivity is unknown: no guarantee from here on (epsilon = inf)
            self.log.error("dp.round_not_accounted", round=report.round, reason=str(e),
                           consequence="epsilon is infinite from this round on")
            mech = privacy.RoundMechanism(math.nan, math.nan)
            self.state = privacy.unbounded(self.state)
        else:
            self.state = privacy.update(self.state, mech)
        self.epsilon = privacy.epsilon(self.state, self.config.delta)
        budget = self.config.max_epsilon
        stop = False
        if budget is not None and self.epsilon > budget and not self.exceeded_round:
            self.exceeded_round = report.round
            stop = self.config.on_budget == "stop"
            self.log.warning("dp.budget_exceeded", round=report.round, epsilon=_short(self.epsilon),
                             delta=self.config.delta, max_epsilon=budget, action=self.config.on_budget,
                             reason="the federation ends after this round" if stop else
                             "dp.on_budget = warn: training goes on")
        return dataclasses.replace(report, dp_epsilon=self.epsilon, dp_delta=self.config.delta,
                                   dp_noise_multiplier=mech.noise_multiplier, dp_sample_rate=mech.sample_rate), stop

    # ---- persistence slot ----

    def save(self) -> dict[str, Any]:
        return {"accountant": self.state.to_dict(), "exceeded_round": self.exceeded_round}

    def load(self, d: dict[str, Any]) -> None:
        self.state = privacy.AccountantState.from_dict(d.get("accountant", {}))
        self.exceeded_round = int(d.get("exceeded_round", 0))
        if self.enabled and self.state.rdp:
            self.epsilon = privacy.epsilon(self.state, self.config.delta)
        budget = self.config.max_epsilon
        if budget is None or self.epsilon <= budget:
            self.exceeded_round = 0  # no budget now, or a raised one: training may go on
        elif not self.exceeded_round:
            self.exceeded_round = self.state.rounds  # a lowered budget: spent already


def _short(value: float) -> float:
    return float(f"{value:.6g}") if math.isfinite(value) else value
