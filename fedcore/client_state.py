"""What an app embedding a client sees of it, as plain frozen values (no gRPC, no threads).

- :class:`ClientNflState`: the client's NFL/recovery state (whether it is recovering, since which round, its last
  β̂ᵢ, the server's recovery flag as the client last saw it); :func:`next_nfl_state` moves it, one pure step per
  observation.
- :class:`ClientRoundReport`: one per round the client trained: the :class:`~fedcore.update_report.UpdateReport` it
  sent (the record the server reads), the β̂ᵢ it measured, and whether the server took it.
- :func:`infers_adapted`: the one rule for which model a client infers with -- the model it serves to its app
  *and* the one its β̂ᵢ and test accuracy measure (FL-GUARD Eq. 3: "the model it will use for inference").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fedcore.update_report import MEASURED_BETA_HAT_KEY, BetaHat, UpdateReport

NAN = float("nan")

# ClientConfig.infer_after_recovery
KEEP_ADAPTED = "adapted"
BACK_TO_GLOBAL = "global"


def infers_adapted(has_adapted: bool, recovering: bool, opt_out: bool, after_recovery: str) -> bool:
    """Whether the client infers with its adapted/personal model vᵢ rather than the received global model.

    An opt-out holdout never does; a client without vᵢ cannot; while recovering it does; after its recovery stopped
    it keeps vᵢ with ``after_recovery = "adapted"`` (FL-GUARD §5.1, SPEC §6-7: the adapted models are kept for
    local inference) and goes back to the global model with ``"global"``."""
    if opt_out or not has_adapted:
        return False
    return recovering or after_recovery == KEEP_ADAPTED


@dataclass(frozen=True)
class ClientNflState:
    """A client's NFL/recovery state as its app sees it.

    ``recovering``: the client runs its recovery method (the server's recovery flag, or its own individual-level
    decision; never for an opt-out client). ``since_round``: the round it started recovering (0 when it is not).
    ``serving_adapted``: :meth:`FedClient.inference_model` returns vᵢ (see :func:`infers_adapted`).
    ``server_recovery``: the recovery flag of the last task received (None before the first task).
    ``own_decision``: the client adapts by its own individual-level measure (FL-GUARD §4.3).
    ``beta_hat``: the last β̂ᵢ the client measured (NaN before any, or without a private model).
    ``round``: the round of the last task the client received (0 before the first).
    """

    recovering: bool = False
    since_round: int = 0
    serving_adapted: bool = False
    server_recovery: bool | None = None
    own_decision: bool = False
    opt_out: bool = False
    beta_hat: float = NAN
    round: int = 0

    def same_mode(self, other: ClientNflState) -> bool:
        """Equal in what a state change is about (recovering, serving vᵢ, the server's flag, the own decision);
        the round and β̂ᵢ move every round without being a change of state."""
        return (self.recovering, self.serving_adapted, self.server_recovery, self.own_decision) == (
            other.recovering, other.serving_adapted, other.server_recovery, other.own_decision)


def next_nfl_state(state: ClientNflState, round_: int, server_recovery: bool, recovering: bool,
                   serving_adapted: bool, own_decision: bool, beta_hat: BetaHat = None) -> ClientNflState:
    """The state after the client observed round ``round_`` (a new value; ``state`` is not modified)."""
    since = state.since_round if state.recovering and recovering else (round_ if recovering else 0)
    measured = state.beta_hat if beta_hat is None or not math.isfinite(beta_hat) else float(beta_hat)
    return dataclasses.replace(state, recovering=recovering, since_round=since, serving_adapted=serving_adapted,
                               server_recovery=server_recovery, own_decision=own_decision, beta_hat=measured,
                               round=round_)


@dataclass(frozen=True)
class ClientRoundReport:
    """One round as the client trained it (``FedClient.on_round_end`` gets it after the update was sent).

    ``update``: the :class:`~fedcore.update_report.UpdateReport` it sent -- the same record the server reads, so the
    app and the server see the same numbers under the same names (``update.test_accuracy``, ``update.adapting``,
    ``update.beta_hat``: the β̂ᵢ sent, ...); ``beta_hat_measured``: the β̂ᵢ the client measured (None without Pᵢ;
    differs from the one sent only for a fabricated-β̂ attacker); ``accepted``: the server took the update (False:
    refused, the reason is logged).
    """

    round: int
    update: UpdateReport
    beta_hat_measured: BetaHat = None
    accepted: bool = True

    def history_row(self) -> dict[str, float]:
        """The round as a flat name -> number row (``ClientSummary.history``): ``round``, ``train_loss``, the sent
        report's :meth:`~fedcore.update_report.UpdateReport.as_metrics` and ``beta_hat_measured`` when measured."""
        measured = {} if self.beta_hat_measured is None else {MEASURED_BETA_HAT_KEY: self.beta_hat_measured}
        return {"round": float(self.round), **self.update.as_metrics(), **measured,
                "train_loss": self.update.train_loss}
