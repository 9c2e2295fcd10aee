"""Round finalisation: aggregate the closed round, evaluate, and build its one :class:`RoundReport`.

The coordinator then persists the round (``fedserver.persistence``) and hands the report to every subscriber.
All per-client numbers are reduced in client-id order, so the report, like the model, does not depend on
the order in which updates arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fedcore import rounds as rm
from fedcore.aggregation import AggregationResult, Aggregator
from fedcore.config import ServerConfig
from fedcore.data import load_client_data
from fedcore.metrics import central_accuracy, performance_gain, pooled_test_set
from fedcore.report import NAN, RoundReport, mean, median
from fedcore.seeds import derive_seed
from fedserver.global_models import GlobalModels
from fedserver.intake import RoundLog
from fedserver.offload import Offload

BETA_KEYS = ("beta", "beta_weighted", "beta_benign", "beta_benign_weighted")


class RoundFinalizer:
    def __init__(self, config: ServerConfig, models: GlobalModels, eval_model: torch.nn.Module | None,
                 clock: Callable[[], float], offload: Offload | None = None) -> None:
        self.config = config
        self.offload = offload if offload is not None else Offload()  # a worker thread, or the loop when short
        self.models = models
        self._clock = clock
        self._eval_model = eval_model
        self._central: tuple[torch.Tensor, torch.Tensor] | None = None
        if eval_model is not None:
            self._central = self._load_central_test_set()

    def noise_generator(self, round_: int) -> torch.Generator:
        """The server's DP noise for ``round_``: seeded by (seed, round, purpose), so a re-run draws the same."""
        return torch.Generator().manual_seed(derive_seed(self.config.rounds.seed, round_, "aggregation_noise"))

    async def aggregate(self, agg: Aggregator, round_: int) -> AggregationResult:
        """The new global model (raises ValueError when the rule cannot work with what arrived)."""
        return await self.offload.run("aggregate", agg.finalize, self.models.flat(), self.noise_generator(round_))

    async def report(self, result: AggregationResult, log: RoundLog, state: rm.RoundState,
                     reason: str) -> RoundReport:
        """Apply ``result`` to the global model and describe the round."""
        self.models.apply_flat(result.new_global)
        central = await self.offload.run("central_accuracy", self._central_accuracy) if self._central is not None \
            else NAN
        return build_report(log, state, reason, central, {k: float(v) for k, v in result.metrics.items()},
                            self._clock() - log.started_at)

    def _load_central_test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        n = cfg.evaluation.central_clients or int(cfg.data.options.get("num_clients", 100))
        shards = (load_client_data(cfg.data.dataset, i, cfg.rounds.seed, cfg.data.options) for i in range(n))
        return pooled_test_set(shards)

    def _central_accuracy(self) -> float:
        assert self._central is not None and self._eval_model is not None
        self._eval_model.load_state_dict(self.models.get())
        return central_accuracy(self._eval_model, *self._central)


def build_report(log: RoundLog, state: rm.RoundState, reason: str, central: float, metrics: dict[str, float],
                 seconds: float) -> RoundReport:
    """The round's report from the accepted clients' :class:`~fedcore.update_report.UpdateReport` s (reduced in
    client-id order)."""
    reports = dict(sorted(log.reports.items()))
    attackers = {c for c in reports if c in state.clients and state.clients[c].attacker}
    holdouts = {c for c in reports if c in state.clients and state.clients[c].opt_out}
    n_total = sum(r.num_samples for r in reports.values())
    acc = {c: r.test_accuracy for c, r in reports.items() if r.test_accuracy is not None}
    private = {c: r.private_accuracy for c, r in reports.items() if r.private_accuracy is not None}
    sizes = {c: r.num_samples for c, r in reports.items()}
    betas = _betas(acc, private, sizes, attackers)
    return RoundReport(
        round=log.round, attempt=log.attempt, selected=log.selected, accepted=len(reports),
        rejected=state.rejected_in_round, late_total=state.late_total,
        attackers=len(attackers),
        mean_train_loss=(sum(r.train_loss * r.num_samples for r in reports.values()) / n_total
                         if n_total else NAN),
        mean_test_accuracy=mean(list(acc.values())),
        test_accuracy_benign=mean([a for c, a in acc.items() if c not in attackers]),
        central_accuracy=central,
        beta=betas["beta"], beta_weighted=betas["beta_weighted"], beta_benign=betas["beta_benign"],
        beta_benign_weighted=betas["beta_benign_weighted"],
        beta_hat=median([r.beta_hat for r in reports.values() if r.beta_hat is not None]),
        beta_hat_error=mean([abs(r.beta_hat - (acc[c] - private[c])) for c, r in reports.items()
                             if r.beta_hat is not None and c in acc and c in private]),
        adapting=sum(1 for r in reports.values() if r.adapting),
        holdouts=len(holdouts),
        beta_adapting=_benign_beta(acc, private, attackers | holdouts),
        beta_holdout=_benign_beta({c: a for c, a in acc.items() if c in holdouts}, private, attackers),
        test_accuracy_adapting=mean([a for c, a in acc.items() if c not in attackers | holdouts]),
        test_accuracy_holdout=mean([a for c, a in acc.items() if c in holdouts and c not in attackers]),
        client_seconds=math.fsum(r.train_seconds for r in reports.values()),
        client_passes=mean([r.passes for r in reports.values()]),
        seconds=seconds, outcome=reason, metrics=metrics, bytes_received=log.bytes_received,
    )


def _benign_beta(acc: dict[str, float], private: dict[str, float], exclude: set[str]) -> float:
    """Mean beta_i = V_i - P_i over the clients of ``acc`` not in ``exclude`` that report P_i (alpha_i = 1/N)."""
    return mean([a - private[c] for c, a in acc.items() if c in private and c not in exclude])


def _betas(acc: dict[str, float], private: dict[str, float], sizes: dict[str, int],
           attackers: set[str]) -> dict[str, float]:
    """FL-GUARD Eq. 1-2 over this round's participants that report P_i: beta_i = V_i - P_i."""
    both = {c: v for c, v in acc.items() if c in private}
    if not both:
        return dict.fromkeys(BETA_KEYS, NAN)
    rep = performance_gain(both, private, sizes, exclude=attackers)
    return {"beta": rep.beta, "beta_weighted": rep.beta_weighted, "beta_benign": rep.beta_benign,
            "beta_benign_weighted": rep.beta_benign_weighted}
