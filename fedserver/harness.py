"""The server's shell around the full-knowledge test harness (:mod:`fedcore.attacks.harness`).

Only built when ``[simulation_harness] full_knowledge_adversary`` is on (a simulation option that
:func:`fedcore.config.validate_server_config` refuses with TLS, mutual TLS or enrolled keys). After a round closes
and before its rule runs, the attackers' rows in the round's buffer (canonical order) are replaced with rows
crafted from the benign ones; the round's metrics count them.
"""

from __future__ import annotations

import math

from fedcore import rounds as rm
from fedcore.aggregation import Aggregator, BufferedAggregator
from fedcore.aggregation.rules import TrimmedMean, build_rule
from fedcore.attacks.harness import full_knowledge_rows, harness_seed, oracle_trimmed_mean
from fedcore.config import ServerConfig, effective_aggregation
from fedcore.log import get_logger


class AdversaryHarness:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.enabled = config.simulation_harness.full_knowledge_adversary
        self.attack = config.simulation_harness.attack
        self.rule = build_rule(effective_aggregation(config))
        self.log = get_logger("fedserver")

    def apply(self, agg: Aggregator, state: rm.RoundState, round_: int) -> dict[str, float]:
        """Craft the attackers' rows of the closed round ``round_`` in ``agg``; the metrics to report."""
        if not self.enabled:
            return {}
        if not isinstance(agg, BufferedAggregator):  # effective_aggregation keeps a buffer when the harness is on
            raise RuntimeError("the full-knowledge harness needs the round's rows (a buffered aggregator)")
        agg.canonical_order()
        keys = agg.keys
        attackers = {c for c in keys if c in state.clients and state.clients[c].attacker}
        rule = self.rule
        metrics: dict[str, float] = {}
        if self.config.simulation_harness.trim_to_attackers:
            rule = oracle_trimmed_mean(rule, len(keys), len(attackers))
            agg.use_rule(rule)
            if isinstance(rule, TrimmedMean):
                metrics["harness_trim_m"] = float(rule.m(len(keys)))
        crafted = full_knowledge_rows(agg.rows, keys, attackers, self.attack, rule,
                                      harness_seed(self.config.rounds.seed, round_, sorted(attackers)))
        if crafted is None:
            return {**metrics, "harness_crafted": 0.0}
        for pos, row in zip(crafted.positions, crafted.rows, strict=True):
            agg.replace_row(pos, row)
        metrics["harness_crafted"] = float(len(crafted.positions))
        if math.isfinite(crafted.gamma):
            metrics["harness_gamma"] = crafted.gamma
        self.log.info("harness.crafted", round=round_, kind=self.attack.kind, rows=len(crafted.positions),
                      gamma=None if math.isnan(crafted.gamma) else round(crafted.gamma, 6))
        return metrics
