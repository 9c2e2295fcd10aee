"""One client round on the device: β̂ᵢ, the individual-level NFL measures, the trainer seam, the round's UpdateReport.

:class:`LocalRound` is what :class:`fedclient.client.FedClient` calls with each task; it owns no gRPC. Per round:

1. the received model w^{r-1} is in ``model``; the model the client *infers with* is vᵢ (the trainer's adapted
   model, :meth:`Trainer.inference_state`) when it has one and is not an opt-out holdout -- after its recovery
   stopped only with ``infer_after_recovery = "adapted"`` (the default; :func:`fedcore.client_state.infers_adapted`)
   -- else w^{r-1};
2. on that inference model: ``test_accuracy``/``test_loss`` on the whole local test split (Vᵢ, so the server's
   βᵢ = Vᵢ − Pᵢ is the gain of what the client actually uses) and FL-GUARD's β̂ᵢ = EV(model, b_iʳ) − Pᵢ (Eq. 3)
   on the round's first training batch b_iʳ (the clean data, the batch seed of the round);
3. the individual-level measures (FL-GUARD §4.3, :mod:`fedcore.nfl.individual`) see β̂ᵢ: while the system has not
   reported NFL, a client whose β̂ᵢ was negative in more than NR rounds adapts on its own;
4. the trainer trains ``model`` (the update the client sends) with ``recovery = (task flag or own decision) and
   not opt-out``; FL-GUARD's adaptation trains vᵢ beside it without changing the sent update;
5. the outcome carries the received and trained weights (:attr:`RoundOutcome.update`) for a client mod that
   replaces what is sent (:func:`fedclient.mods.model_poisoning`);
6. trainer state and individual counters are saved in the client's state (:class:`fedclient.state.ClientState`;
   kept in memory without a state dir);
7. :attr:`LocalRound.view` is the round's :class:`InferenceView` (what an embedding app is served:
   :meth:`personal_module` builds vᵢ's module from it).

Attacks are not played here: client mods (:mod:`fedclient.mods`) change what the round trains on (poisoned data or
batches, an attacker's epochs) and what is sent (a crafted update, a fabricated β̂ᵢ).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from fedclient.state import ClientState
from fedcore.attacks import UpdateContext
from fedcore.attacks.model_poisoning import flat_update
from fedcore.client_state import infers_adapted
from fedcore.config import ClientConfig, FederationInfo
from fedcore.data import ClientData
from fedcore.nfl import DETECT_AND_RECOVER
from fedcore.nfl import individual as ind
from fedcore.nfl.measure import client_beta_hat, first_batch
from fedcore.seeds import RoundSeeds, derive_seed, round_seeds
from fedcore.train import evaluate
from fedcore.train.loop import Batches
from fedcore.train.trainers import (
    Trainer,
    TrainerState,
    TrainerStateError,
    make_trainer,
)
from fedcore.update_report import BetaHat, UpdateReport


class LocalRoundError(RuntimeError):
    """Saved client state that cannot be used (the message names the file; nothing was overwritten)."""


@dataclass(frozen=True)
class InferenceView:
    """What the client infers with at one moment, as references to tensors nobody modifies afterwards:
    ``received`` the global (or cluster) model of the round, ``tstate`` the trainer state (vᵢ; None before the
    client's first round), ``recovering`` whether the client runs its recovery method, ``serving_adapted`` whether
    it infers with vᵢ (:func:`fedcore.client_state.infers_adapted`), ``own_decision`` whether it recovers by its
    own individual-level measure."""

    round: int
    received: dict[str, torch.Tensor]
    tstate: TrainerState | None
    server_recovery: bool
    recovering: bool
    own_decision: bool
    serving_adapted: bool


@dataclass(frozen=True)
class RoundOutcome:
    # What is sent with the update (its ``beta_hat`` the measured β̂ᵢ unless a mod fabricates one; the runner fills in
    # ``train_seconds``).
    report: UpdateReport
    # The β̂ᵢ the client measured (None when it has no private accuracy Pᵢ), whatever is sent.
    beta_hat_measured: BetaHat
    # The round's received and trained weights, for a mod that replaces the update (None: not for a mod to change).
    update: UpdateContext | None = None


class LocalRound:
    def __init__(self, config: ClientConfig, client_id: str, log: Any, state: ClientState | None = None) -> None:
        self.config = config
        # Where the trainer state and the individual counters persist (the client's, else config.state_dir's).
        self.state = state if state is not None else ClientState.open(config.state_dir, log)
        self.client_id = client_id
        self.log = log
        # The client's own trainer, else the server's [recovery] method once it is known (:meth:`use_method`).
        self._trainer: Trainer | None = make_trainer(config.trainer, config.trainer_options) if config.trainer else None
        self._tstate: TrainerState | None = None
        self._individual: ind.IndividualState | None = None
        self._inference_model: nn.Module | None = None
        # The last round's inference view (set at the end of :meth:`run`); None before the first round.
        self.view: InferenceView | None = None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise LocalRoundError("no trainer yet: the federation's recovery method is learnt at join")
        return self._trainer

    def use_method(self, name: str, options: dict[str, Any]) -> None:
        """Train with the federation's announced method (a client's own ``trainer`` wins)."""
        if not self.config.trainer:
            self._trainer = make_trainer(name, options)

    def ensure_trainer(self, fed: FederationInfo) -> None:
        """The federation's announced method unless a trainer is already chosen."""
        if self._trainer is None:
            self.use_method(fed.recovery_method, fed.recovery_options)

    # ---- state ----

    def _trainer_state(self, model: nn.Module) -> TrainerState:
        if self._tstate is None:
            try:
                loaded = self.state.load_trainer_state()
            except TrainerStateError as e:
                raise LocalRoundError(str(e)) from None
            self._tstate = loaded if loaded is not None else self.trainer.init(model)
        return self._tstate

    def _individual_state(self) -> ind.IndividualState:
        if self._individual is None:
            self._individual = self.state.individual()
        return self._individual

    @property
    def adapting_on_its_own(self) -> bool:
        return self._individual is not None and self._individual.adapting

    def trainer_state(self, model: nn.Module) -> TrainerState:
        """The trainer state the next round starts from: the last round's, else the state dir's, else a new one
        (``model``: the client's model, for a new state's frozen-layer keys)."""
        return self._trainer_state(model)

    def recovering(self, fed: FederationInfo, recovery_flag: bool) -> tuple[bool, bool]:
        """(whether the client runs its recovery method given the task's flag and its individual state as it
        stands, whether its individual-level measure says so); never for an opt-out client or with NFL off."""
        own = fed.nfl.mode == DETECT_AND_RECOVER and fed.nfl.c >= 1 and self._individual_state().adapting
        return (recovery_flag or own) and not self.config.opt_out and fed.nfl.mode != "off", own

    def serves_adapted(self, has_adapted: bool, recovering: bool) -> bool:
        return infers_adapted(has_adapted, recovering, self.config.opt_out, self.config.infer_after_recovery)

    def personal_module(self, tstate: TrainerState, received_model: nn.Module, received: dict[str, torch.Tensor],
                        scratch: nn.Module | None = None) -> nn.Module | None:
        """The module the client infers with when it uses its personal model (vᵢ, LINDT's dual model), built from
        ``tstate`` and the round's received model (``received_model`` holds ``received``; it is not modified);
        None when the trainer has no personal model yet. ``scratch``: a module of the architecture to load vᵢ
        into (else a copy of ``received_model``)."""
        if self.trainer.inference_module is not None:
            return self.trainer.inference_module(tstate, received_model)
        adapted = self.trainer.inference_state(tstate, received)
        if adapted is None:
            return None
        target = scratch if scratch is not None else copy.deepcopy(received_model)
        target.load_state_dict(adapted)
        return target

    # ---- the round ----

    def run(self, model: nn.Module, data: ClientData, train_data: ClientData, fed: FederationInfo, round_: int,
            recovery_flag: bool, learning_rate: float | None, private_accuracy: float | None, *,
            batches: Batches | None = None, local_epochs: int | None = None,
            received: Mapping[str, torch.Tensor] | None = None) -> RoundOutcome:
        """Run round ``round_`` with the received model loaded in ``model``; ``model`` ends as the update.
        ``train_data``, ``batches`` and ``local_epochs`` (None: the federation's): what the trainer trains on.
        ``received``: the weights loaded into ``model``, in tensors of their own that nobody modifies (the task's);
        None: a copy of ``model``'s is taken."""
        cfg = self.config
        self.ensure_trainer(fed)
        tstate = start_state = self._trainer_state(model)
        # w^{r-1} for the hook, vᵢ and the inference view: tensors training does not change.
        before = dict(received) if received is not None else \
            {k: v.detach().clone() for k, v in model.state_dict().items()}
        infer = model
        personal = False
        if self.serves_adapted(tstate.adapted is not None, self.recovering(fed, recovery_flag)[0]):
            if self.trainer.inference_module is None and self._inference_model is None:
                self._inference_model = copy.deepcopy(model)
            module = self.personal_module(tstate, model, before, self._inference_model)
            if module is not None:
                infer, personal = module, True
        ev = evaluate(infer, data.x_test, data.y_test)
        seeds = round_seeds(fed.seed, self.client_id, round_)
        measured: BetaHat = None
        if private_accuracy is not None and data.num_train:
            measured = client_beta_hat(infer, first_batch(data.x_train, data.y_train, fed.training.batch_size,
                                                   seeds.batches), private_accuracy)
        own = self._individual_step(fed, round_, measured, recovery_flag)
        recovery = (recovery_flag or own) and not cfg.opt_out and fed.nfl.mode != "off"
        res, tstate = self.trainer.train(model, tstate, train_data.x_train, train_data.y_train, fed.training, seeds,
                                         recovery=recovery, learning_rate=learning_rate,
                                         epochs=fed.training.local_epochs if local_epochs is None else local_epochs,
                                         batches=batches)
        for p in model.parameters():  # the last step's gradients: read by nobody after the round, and a device that
            p.grad = None  # waits for its next task (a virtual client among thousands) would hold a model's worth
        update = UpdateContext(
            received=before, trained=ModelState(model), num_train=data.num_train, seed=seeds.attack,
            honest_update=partial(self._honest_update, model, before, start_state, data, fed, seeds, learning_rate))
        self._tstate = tstate
        self.state.save_trainer_state(tstate)
        # Every trainer's personal model is ``tstate.adapted`` (None until its recovery first ran).
        self.view = InferenceView(round_, before, tstate, recovery_flag, recovery, own,
                                  self.serves_adapted(tstate.adapted is not None, recovery))
        # The recovery method's numbers of a recovery round: its passes, the rest as extras (non-finite ones unsent).
        method = {k: float(v) for k, v in (tstate.metrics if recovery else {}).items() if math.isfinite(v)}
        report = UpdateReport(
            num_samples=data.num_train, train_loss=res.loss, beta_hat=measured,
            test_accuracy=_finite(ev.accuracy), test_loss=_finite(ev.loss),
            private_accuracy=_finite(private_accuracy) if data.num_train else None,
            adapting=recovery, infers_adapted=personal, passes=method.pop("passes", 1.0), extras=method)
        return RoundOutcome(report, measured, update)

    def _honest_update(self, model: nn.Module, received: dict[str, torch.Tensor], tstate: TrainerState,
                       data: ClientData, fed: FederationInfo, seeds: RoundSeeds, learning_rate: float | None,
                       idx: torch.Tensor) -> torch.Tensor:
        """The update an honest round of this client's trainer makes from ``received`` on its clean training
        samples ``idx`` (a model-poisoning attacker's partial knowledge); batches and dropout seeded per shard;
        the trainer state it returns is thrown away."""
        shard = derive_seed(seeds.attack, "honest_shard", int(idx.numel()), int(idx[0]) if idx.numel() else -1)
        shard_seeds = dataclasses.replace(seeds, batches=derive_seed(shard, "batches"),
                                          dropout=derive_seed(shard, "dropout"))
        honest = copy.deepcopy(model)
        honest.load_state_dict(received)
        self.trainer.train(honest, tstate, data.x_train[idx], data.y_train[idx], fed.training, shard_seeds,
                           recovery=False, learning_rate=learning_rate)
        return flat_update(honest.state_dict(), received)

    def _individual_step(self, fed: FederationInfo, round_: int, measured: float | None,
                         system_flag: bool) -> bool:
        """FL-GUARD's individual-level measures; returns whether this client adapts on its own this round."""
        if fed.nfl.mode != DETECT_AND_RECOVER or fed.nfl.c < 1:
            return False
        state = self._individual_state()
        state, events = ind.step(state, ind.Observation(round_, measured, system_flag), fed.nfl.nr, fed.nfl.c,
                                 self.config.opt_out)
        for ev in events:
            self.log.warning(ev.kind, client_id=self.client_id, round=ev.round, reason=ev.reason, scope=ev.scope)
        self._individual = state
        self.state.save_individual(state)
        return state.adapting


class ModelState(Mapping[str, torch.Tensor]):
    """``model.state_dict()`` (views of its tensors), taken when first read: a round's update hook sees the trained
    weights without every round paying for a state dict that no hook reads."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._state: dict[str, torch.Tensor] | None = None

    def _get(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            self._state = self._model.state_dict()
        return self._state

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _finite(value: float | None) -> float | None:
    """``value`` as a float, None when it is missing or not finite (an empty test split's NaN is not sent)."""
    return float(value) if value is not None and math.isfinite(value) else None
