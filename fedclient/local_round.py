"""One client round on the device: β̂ᵢ, the individual-level NFL measures, the trainer seam, the round's metrics.

:class:`LocalRound` is what :class:`fedclient.client.FedClient` calls with each task; it owns no gRPC. Per round:

1. the received model w^{r-1} is in ``model``; the model the client *infers with* is vᵢ (the trainer's adapted
   model, :meth:`Trainer.inference_state`) when it has one and is not an opt-out holdout, else w^{r-1};
2. on that inference model: ``test_accuracy``/``test_loss`` on the whole local test split (Vᵢ, so the server's
   βᵢ = Vᵢ − Pᵢ is the gain of what the client actually uses) and FL-GUARD's β̂ᵢ = EV(model, b_iʳ) − Pᵢ (Eq. 3)
   on the round's first training batch b_iʳ (the clean data, the batch seed of the round);
3. the individual-level measures (FL-GUARD §4.3, :mod:`fedcore.nfl.individual`) see β̂ᵢ: while the system has not
   reported NFL, a client whose β̂ᵢ was negative in more than NR rounds adapts on its own;
4. the trainer trains ``model`` (the update the client sends) with ``recovery = (task flag or own decision) and
   not opt-out``; FL-GUARD's adaptation trains vᵢ beside it without changing the sent update;
5. trainer state and individual counters are saved in the state dir (kept in memory without one).

The β̂ᵢ sent is the measured one, unless the client plays the fabricated-β̂ attacker (``attack.fake_beta_hat``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from fedcore.attacks import attacker_local_epochs, backdoor_batches
from fedcore.config import ClientConfig, FederationInfo
from fedcore.data import ClientData
from fedcore.nfl import DETECT_AND_RECOVER
from fedcore.nfl import individual as ind
from fedcore.seeds import round_seeds
from fedcore.train import evaluate
from fedcore.train.trainers import (
    Trainer,
    TrainerState,
    TrainerStateError,
    beta_hat,
    first_batch,
    load_trainer_state,
    make_trainer,
    save_trainer_state,
)


class LocalRoundError(RuntimeError):
    """Saved client state that cannot be used (the message names the file; nothing was overwritten)."""


@dataclass(frozen=True)
class RoundOutcome:
    train_loss: float
    # The β̂ᵢ to send (None when the client has no private accuracy Pᵢ).
    beta_hat: float | None
    metrics: dict[str, float]


class LocalRound:
    def __init__(self, config: ClientConfig, client_id: str, log: Any) -> None:
        self.config = config
        self.client_id = client_id
        self.log = log
        # The client's own trainer, else the server's [recovery] method once it is known (:meth:`use_method`).
        self._trainer: Trainer | None = make_trainer(config.trainer, config.trainer_options) if config.trainer else None
        self._tstate: TrainerState | None = None
        self._individual: ind.IndividualState | None = None
        self._inference_model: nn.Module | None = None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise LocalRoundError("no trainer yet: the federation's recovery method is learnt at join")
        return self._trainer

    def use_method(self, name: str, options: dict[str, Any]) -> None:
        """Train with the federation's announced method (a client's own ``trainer`` wins)."""
        if not self.config.trainer:
            self._trainer = make_trainer(name, options)

    # ---- state ----

    def _trainer_state(self, model: nn.Module) -> TrainerState:
        if self._tstate is None:
            loaded = None
            if self.config.state_dir:
                try:
                    loaded = load_trainer_state(self.config.state_dir)
                except TrainerStateError as e:
                    raise LocalRoundError(str(e)) from None
            self._tstate = loaded if loaded is not None else self.trainer.init(model)
        return self._tstate

    def _individual_state(self) -> ind.IndividualState:
        if self._individual is None:
            try:
                self._individual = (ind.load_individual_state(self.config.state_dir) if self.config.state_dir
                                    else ind.IndividualState())
            except ValueError as e:
                raise LocalRoundError(str(e)) from None
        return self._individual

    @property
    def adapting_on_its_own(self) -> bool:
        return self._individual is not None and self._individual.adapting

    # ---- the round ----

    def run(self, model: nn.Module, data: ClientData, train_data: ClientData, fed: FederationInfo, round_: int,
            recovery_flag: bool, learning_rate: float | None, private_accuracy: float | None) -> RoundOutcome:
        """Run round ``round_`` with the received model loaded in ``model``; ``model`` ends as the update."""
        cfg = self.config
        if self._trainer is None:
            self.use_method(fed.recovery_method, fed.recovery_options)
        tstate = self._trainer_state(model)
        received = model.state_dict()
        infer = model
        personal = False
        if not cfg.opt_out and self.trainer.inference_module is not None:
            module = self.trainer.inference_module(tstate, model)
            if module is not None:
                infer, personal = module, True
        elif not cfg.opt_out:
            adapted = self.trainer.inference_state(tstate, received)
            if adapted is not None:
                if self._inference_model is None:
                    self._inference_model = copy.deepcopy(model)
                self._inference_model.load_state_dict(adapted)
                infer, personal = self._inference_model, True
        ev = evaluate(infer, data.x_test, data.y_test)
        metrics = {"test_accuracy": ev.accuracy, "test_loss": ev.loss, "infers_adapted": float(personal)}
        seeds = round_seeds(fed.seed, self.client_id, round_)
        measured: float | None = None
        if private_accuracy is not None and data.num_train:
            metrics["private_accuracy"] = private_accuracy
            measured = beta_hat(infer, first_batch(data.x_train, data.y_train, fed.training.batch_size,
                                                   seeds.batches), private_accuracy)
            metrics["beta_hat_measured"] = measured
        own = self._individual_step(fed, round_, measured, recovery_flag)
        recovery = (recovery_flag or own) and not cfg.opt_out and fed.nfl_mode != "off"
        attack = cfg.attack
        batches = backdoor_batches(train_data, attack, seeds.attack).epoch if attack.kind == "backdoor" else None
        res, tstate = self.trainer.train(model, tstate, train_data.x_train, train_data.y_train, fed.training, seeds,
                                         recovery=recovery, learning_rate=learning_rate,
                                         epochs=attacker_local_epochs(attack, fed.training.local_epochs),
                                         batches=batches)
        self._tstate = tstate
        metrics["adapting"] = float(recovery)
        metrics.update(tstate.metrics if recovery else {})
        if cfg.state_dir:
            save_trainer_state(cfg.state_dir, tstate)
        sent = attack.fake_beta_hat if attack.fabricates_beta_hat else measured
        return RoundOutcome(res.loss, sent, {k: float(v) for k, v in metrics.items() if math.isfinite(v)})

    def _individual_step(self, fed: FederationInfo, round_: int, measured: float | None,
                         system_flag: bool) -> bool:
        """FL-GUARD's individual-level measures; returns whether this client adapts on its own this round."""
        if fed.nfl_mode != DETECT_AND_RECOVER or fed.nfl_c < 1:
            return False
        state = self._individual_state()
        state, events = ind.step(state, ind.Observation(round_, measured, system_flag), fed.nfl_nr, fed.nfl_c,
                                 self.config.opt_out)
        for ev in events:
            self.log.warning(ev.kind, client_id=self.client_id, round=ev.round, reason=ev.reason, scope=ev.scope)
        self._individual = state
        if self.config.state_dir:
            ind.save_individual_state(self.config.state_dir, state)
        return state.adapting

