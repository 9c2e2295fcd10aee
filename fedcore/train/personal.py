"""Personalisation baselines behind the trainer seam: Ditto, APFL, FT and FB (SPEC §7, FL-GUARD §5.2–5.4).

FL-GUARD compares its model adaptation with these recovery methods (§5.2, Table 3–5; §5.4, Table 9 swaps them in
under FL-GUARD's NFL detection), and SPEC §7 offers them as "compatible alternatives under the same flag". Each is a
:class:`fedcore.train.trainers.Trainer` with the same contract as ``flguard``:

- ``recovery=False``: the round is exactly :func:`fedcore.train.train_local` (the same call as ``vanilla``) and the
  personal model, if any, is kept unchanged (``active`` off, ``metrics`` emptied).
- ``recovery=True``: the client's copy of the global model is trained by the vanilla objective with a trajectory
  bit-identical to ``train_local``'s for the same seeds (the update sent to the server never changes), and a
  personal model is trained on the client's own data; the client infers with it (``inference_state``).

Trainers (:data:`PERSONAL_TRAINERS`):

- ``"ditto"`` (Li et al., *Ditto: Fair and Robust Federated Learning Through Personalization*, ICML 2021, Eq. 2 and
  Algorithm 1): vᵢ minimises ℓ(vᵢ) + (λ_d/2)‖vᵢ − w^{r-1}‖² against a frozen copy of the received global model.
- ``"apfl"`` (Deng et al., *Adaptive Personalized Federated Learning*, 2020, Algorithm 1 and Eq. 8/10): personal vᵢ
  and mixing weight αᵢ ∈ [0, 1]; the mixed model v̄ᵢ = αᵢvᵢ + (1−αᵢ)w_iʳ is trained on ℓ w.r.t. vᵢ and αᵢ.
- ``"ft"`` (FL-GUARD's FT baseline [12]): fine-tune the whole received global model locally for E′ epochs.
- ``"fb"`` (FL-GUARD's FB baseline [12]): like FT, but only the top (classifier) layer is fine-tuned.

Every recovery round reports its client compute in ``state.metrics``: ``personal_steps`` (SGD steps of the personal
model), ``personal_seconds`` (wall time of its training, ``time.perf_counter``: a measurement, not randomness) and
``passes`` = 1 + personal_steps / global steps, the forward/backward passes of the round relative to vanilla
training (Ditto with equal epochs: 2.0; FB counts a full forward per step although its backward stops at the top
layer). Also ``personal_loss``, ``personal_diverged`` (1.0 when the personal loss became non-finite: the round's
personal training is then discarded and the previous personal state kept; the update is unaffected) and per-method
numbers (Ditto's ``personal_ce``, APFL's ``alpha``).

Randomness: the personal model's batches are a shuffle of the client's data seeded with
``derive_seed(seeds.batches, "<name>")`` and its dropout masks come from ``derive_seed(seeds.dropout, "<name>")``
(APFL trains on the global copy's batches, its masks from ``derive_seed(seeds.dropout, "adapt_dropout")`` like
FL-GUARD's adapted model); nothing is drawn from torch's global RNG.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedcore.checks import is_finite_number, is_int
from fedcore.errors import ConfigError
from fedcore.options import from_dict
from fedcore.seeds import RoundSeeds, derive_seed
from fedcore.train import Batches, TrainResult, model_device, shuffled_batches, train_local
from fedcore.train.loop import LossMeter, Optimised, StepHooks, fill_missing_grads, run_sgd, sgd_step
from fedcore.train.registry import TRAINERS
from fedcore.train.trainers import (
    Trainer,
    TrainerFactory,
    TrainerState,
    _Adapter,
    _make_adapter,
    _train_with_adaptation,
    cpu_state,
    frozen_layer_keys,
    inference_state,
    parameterised_layers,
    personal_copy,
)
from fedcore.training_config import TrainingConfig

# Seed purposes (derive_seed(seeds.batches, purpose) / derive_seed(seeds.dropout, purpose)): the trainers' names.
DITTO = "ditto"
APFL = "apfl"
FT = "ft"
FB = "fb"


# ---- options ----

@dataclass(frozen=True)
class DittoConfig:
    """Ditto options. ``lam``: λ_d of the proximal term (λ_d/2)‖vᵢ − w^{r-1}‖² (Ditto Eq. 2; FL-GUARD/SPEC §7:
    fixed, e.g. 0.1–1), 0 gives plain local SGD of vᵢ. ``personal_epochs``: epochs of vᵢ's training per round;
    ``None`` = the round's epochs (``epochs`` of ``train``, else ``config.local_epochs``)."""

    lam: float = 0.1
    personal_epochs: int | None = None

    def validate(self, prefix: str = "") -> DittoConfig:
        if not is_finite_number(self.lam) or self.lam < 0:
            raise ConfigError(f"{prefix}lam", f"must be a finite number >= 0, got {self.lam!r}")
        if self.personal_epochs is not None and (not is_int(self.personal_epochs) or self.personal_epochs < 0):
            raise ConfigError(f"{prefix}personal_epochs",
                              f"must be an integer >= 0 (or absent for the round's epochs), "
                              f"got {self.personal_epochs!r}")
        return self


@dataclass(frozen=True)
class ApflConfig:
    """APFL options. ``alpha0``: the initial mixing weight α (LINDT's comparison and SPEC §7: 0.01), in [0, 1].
    ``alpha_lr``: α's step size; ``None`` = the round's learning rate."""

    alpha0: float = 0.01
    alpha_lr: float | None = None

    def validate(self, prefix: str = "") -> ApflConfig:
        if not is_finite_number(self.alpha0) or not 0.0 <= self.alpha0 <= 1.0:
            raise ConfigError(f"{prefix}alpha0", f"must be a number in [0, 1], got {self.alpha0!r}")
        if self.alpha_lr is not None and (not is_finite_number(self.alpha_lr) or self.alpha_lr < 0):
            raise ConfigError(f"{prefix}alpha_lr",
                              f"must be a finite number >= 0 (or absent for the round's learning rate), "
                              f"got {self.alpha_lr!r}")
        return self


@dataclass(frozen=True)
class FineTuneConfig:
    """FT/FB options. ``epochs``: E′, the epochs of local fine-tuning per recovery round (0: the received model)."""

    epochs: int = 1

    def validate(self, prefix: str = "") -> FineTuneConfig:
        if not is_int(self.epochs) or self.epochs < 0:
            raise ConfigError(f"{prefix}epochs", f"must be an integer >= 0, got {self.epochs!r}")
        return self


# ---- shared pieces ----

def _vanilla_round(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                   seeds: RoundSeeds, learning_rate: float | None, epochs: int | None,
                   batches: Batches | None) -> tuple[TrainResult, TrainerState]:
    """A round without recovery: ``train_local`` (the ``vanilla`` trainer's call); the personal state is kept."""
    res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                      batches=batches, dropout_seed=seeds.dropout)
    return res, dataclasses.replace(state, active=False, metrics={})


def _passes(global_steps: int, personal_steps: int) -> float:
    """Forward/backward passes of the round relative to vanilla training: 1 + personal / global steps."""
    return 1.0 + personal_steps / max(global_steps, 1)


@dataclass(frozen=True)
class _PersonalRun:
    steps: int
    loss: float  # mean objective
    ce: float  # mean cross-entropy
    seconds: float

    @property
    def diverged(self) -> bool:
        return self.steps > 0 and not (math.isfinite(self.loss) and math.isfinite(self.ce))


def _personal_sgd(v: nn.Module, params: list[torch.Tensor], anchors: list[torch.Tensor], lam: float,
                  x: torch.Tensor, y: torch.Tensor, config: TrainingConfig, lr: float, epochs: int, batch_seed: int,
                  dropout_seed: int) -> _PersonalRun:
    """``epochs`` epochs of SGD of ``params`` (of ``v``) on ℓ(v) + (λ/2)‖v − a‖² over a shuffle of (x, y) seeded
    with ``batch_seed``: Ditto's personal solver (Ditto Algorithm 1, lines 6–8) and, with λ = 0, FT/FB's
    fine-tuning. ``anchors`` (a, one per param, not modified) are read without gradient; the proximal gradient
    λ(v − a) is added to ∇ℓ in place (a ``grad_transform`` of :func:`fedcore.train.loop.run_sgd`). The optimiser
    is fresh SGD with the round's momentum and weight decay, and the round's gradient-norm clip applies to the
    objective's gradient; no FedProx term. Dropout masks from a generator seeded with ``dropout_seed``."""
    optimised = Optimised.sgd(params, lr, config)
    meter = LossMeter(model_device(v))

    def proximal_gradient(loss: torch.Tensor) -> None:
        grads = fill_missing_grads(params)
        diffs = torch._foreach_sub(params, anchors)
        sq = torch.stack([n.double() for n in torch._foreach_norm(diffs)]).pow(2).sum()
        torch._foreach_add_(grads, diffs, alpha=lam)  # ∇ = ∇ℓ(v) + λ(v − a)
        meter.add(loss=loss.detach().double() + 0.5 * lam * sq)

    prox = lam > 0 and bool(anchors)
    start = time.perf_counter()
    res = run_sgd(v, shuffled_batches(x, y, config.batch_size, batch_seed), epochs, [optimised],
                  dropout_seed=dropout_seed, hooks=StepHooks(grad_transform=proximal_gradient) if prox else None)
    # the loop's loss is the cross-entropy; with the proximal term the objective's mean is the meter's
    mean = meter.mean("loss", res.steps) if prox else res.loss  # synchronises: the time includes the device's work
    return _PersonalRun(res.steps, mean, res.loss, time.perf_counter() - start)


def _round_metrics(run: _PersonalRun, global_steps: int) -> dict[str, float]:
    return {"personal_loss": run.loss, "personal_steps": float(run.steps), "personal_seconds": run.seconds,
            "passes": _passes(global_steps, run.steps), "personal_diverged": 1.0 if run.diverged else 0.0}


# ---- Ditto ----

def ditto_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """Ditto (Li et al. 2021, Eq. 2: min_v hᵢ(v; w*) = Fᵢ(v) + (λ/2)‖v − w*‖²; Algorithm 1). Options: see
    :class:`DittoConfig` (``{"lam": 0.1, "personal_epochs": 2}``).

    Per round with ``recovery=True``: vᵢ starts from the saved personal model, or, the first time, from the received
    global model w^{r-1}, and takes ``personal_epochs`` epochs of SGD (:func:`_personal_sgd`) on
    ℓ(vᵢ) + (λ_d/2)‖vᵢ − w^{r-1}‖² with w^{r-1} the received model, frozen (Ditto's global reference of the round,
    "a frozen copy of the global model", FL-GUARD §5.2), the round's learning rate, momentum, weight decay and
    clip, on its own batches (``derive_seed(seeds.batches, "ditto")``). It is trained before the global copy,
    reading the received weights without changing them; the global copy then runs ``train_local`` (Ditto's
    global objective is the vanilla one, so the update is unchanged). The client infers with vᵢ.
    """
    cfg = from_dict(DittoConfig, dict(options or {}), "").validate()

    def init(model: nn.Module) -> TrainerState:
        return TrainerState()

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        if not recovery:
            return _vanilla_round(model, state, x, y, config, seeds, learning_rate, epochs, batches)
        lr = config.learning_rate if learning_rate is None else learning_rate
        n_epochs = cfg.personal_epochs
        if n_epochs is None:
            n_epochs = config.local_epochs if epochs is None else epochs
        v = personal_copy(model, state.adapted)
        params: list[torch.Tensor] = list(v.parameters())
        anchors = [p.detach() for p in model.parameters()]  # w^{r-1}: read before the global copy trains
        run = _personal_sgd(v, params, anchors, cfg.lam, x, y, config, lr, n_epochs,
                            derive_seed(seeds.batches, DITTO), derive_seed(seeds.dropout, DITTO))
        res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                          batches=batches, dropout_seed=seeds.dropout)
        metrics = {**_round_metrics(run, res.steps), "personal_ce": run.ce}
        adapted = state.adapted if run.diverged else cpu_state(v)
        return res, TrainerState(adapted=adapted, active=True, frozen_keys=(),
                                 rounds_adapted=state.rounds_adapted + 1, metrics=metrics, scalars=state.scalars)

    return Trainer(DITTO, init, train, inference_state)


# ---- APFL ----

@dataclass
class _ApflAdapter(_Adapter):
    """vᵢ and α for one round: ``step`` is APFL's personal update, the ``after_backward`` hook of the global copy's
    :func:`~fedcore.train.train_local` (:func:`fedcore.train.trainers._train_with_adaptation`), so w_iʳ is read at
    the current step and the global copy's trajectory is ``train_local``'s."""

    names: list[str] = field(default_factory=list)  # vᵢ's parameter names, aligned with params/anchors
    alpha: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # 0-d leaf on the device
    alpha_lr: float = 0.0
    seconds: float = 0.0
    _grad_alpha: torch.Tensor | None = None
    _started: float = 0.0

    def step(self, xb: torch.Tensor, yb: torch.Tensor, loss_w: torch.Tensor) -> None:
        """APFL Algorithm 1, lines 7–8 (w_iʳ's own step, line 6, is the caller's): with v̄ = α vᵢ + (1−α) w_iʳ
        (w_iʳ detached), vᵢ ← vᵢ − η ∇_v ℓ(v̄) = vᵢ − η α ∇ℓ(v̄) and α ← Π_[0,1](α − η_α ∇_α ℓ(v̄)),
        ∇_α ℓ(v̄) = ⟨vᵢ − w_iʳ, ∇ℓ(v̄)⟩ (Eq. 10), both gradients at the same point by autograd on the mixed model."""
        sgd_step(self.model, xb, yb, [self.optimised],
                 StepHooks(objective=self._mixed_loss, before_step=self._start, grad_transform=self._keep_grads,
                           after_step=self._step_alpha))

    def _start(self) -> None:
        self._started = time.perf_counter()
        self.alpha.grad = None

    def _mixed_loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        a = self.alpha
        mixed = {n: a * v + (1.0 - a) * w.detach() for n, v, w in zip(self.names, self.params, self.anchors,
                                                                     strict=True)}
        return F.cross_entropy(functional_call(model, mixed, (xb,)), yb)

    def _keep_grads(self, loss: torch.Tensor) -> None:
        fill_missing_grads(self.params)
        a = self.alpha
        self._grad_alpha = a.grad if a.grad is not None else torch.zeros_like(a)
        self.meter.add(ce=loss)

    def _step_alpha(self) -> None:
        assert self._grad_alpha is not None
        with torch.no_grad():
            self.alpha.sub_(self.alpha_lr * self._grad_alpha).clamp_(0.0, 1.0)
        self.seconds += time.perf_counter() - self._started


def apfl_mix(alpha: float, personal: Mapping[str, torch.Tensor],
             received: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """APFL's personalised model v̄ = α vᵢ + (1−α) w (APFL Eq. 8), tensor by tensor: floating-point tensors are
    mixed (on ``received``'s device and dtype), the others (e.g. BatchNorm's ``num_batches_tracked``) are taken
    from ``received``. Returns a new dict."""
    out: dict[str, torch.Tensor] = {}
    for k, w in received.items():
        if w.is_floating_point():
            v = personal[k].to(device=w.device, dtype=w.dtype)
            out[k] = alpha * v + (1.0 - alpha) * w
        else:
            out[k] = w
    return out


def _apfl_inference_state(state: TrainerState, received: Mapping[str, torch.Tensor] | None = None) -> dict[
    str, torch.Tensor
] | None:
    """α·vᵢ + (1−α)·received (:func:`apfl_mix`) once the client has a personal model, else ``None``.

    :class:`ValueError` without ``received``: APFL's inference model is a mixture with the global model."""
    if state.adapted is None:
        return None
    if received is None:
        raise ValueError("apfl: inference_state needs the received global model (APFL infers with "
                         "α·vᵢ + (1−α)·w)")
    alpha = state.scalars.get("alpha")
    if alpha is None:
        raise ValueError("apfl: the trainer state has a personal model but no mixing weight 'alpha'")
    return apfl_mix(alpha, state.adapted, received)


def apfl_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """APFL (Deng et al. 2020, Algorithm 1; SPEC §7). Options: see :class:`ApflConfig`
    (``{"alpha0": 0.01, "alpha_lr": 0.05}``).

    Per round with ``recovery=True``: vᵢ starts from the saved personal model, or, the first time, from the received
    global model; α from ``state.scalars["alpha"]``, or ``alpha0`` the first time. For every batch b of the round
    (the global copy's batches, same order), the global copy w_iʳ takes its vanilla step exactly as in
    ``train_local`` and, between its backward pass and its step, vᵢ and α take one step each on ℓ(v̄, b),
    v̄ = α vᵢ + (1−α) w_iʳ (w_iʳ at the current step, detached; :meth:`_ApflAdapter.step`): vᵢ by SGD with the
    round's learning rate, momentum, weight decay and clip, α by plain gradient descent with ``alpha_lr`` projected
    onto [0, 1]. The client infers with α vᵢ + (1−α) w, w the received global model (:func:`apfl_mix`; APFL's
    personalised model with the latest global model). α is kept in ``state.scalars["alpha"]`` (persisted).
    """
    cfg = from_dict(ApflConfig, dict(options or {}), "").validate()

    def init(model: nn.Module) -> TrainerState:
        return TrainerState()

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        if not recovery:
            return _vanilla_round(model, state, x, y, config, seeds, learning_rate, epochs, batches)
        lr = config.learning_rate if learning_rate is None else learning_rate
        alpha0 = state.scalars.get("alpha", cfg.alpha0)
        base = _make_adapter(model, state, (), lr, config)
        dev = model_device(model)
        adapter = _ApflAdapter(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
            names=[n for n, _ in base.model.named_parameters()],
            alpha=torch.tensor(alpha0, dtype=torch.float32, device=dev, requires_grad=True),
            alpha_lr=lr if cfg.alpha_lr is None else cfg.alpha_lr)
        res = _train_with_adaptation(model, adapter, x, y, config, lr, seeds, epochs, batches)
        alpha = float(adapter.alpha.detach())
        ce = adapter.meter.mean("ce", res.steps)
        run = _PersonalRun(res.steps, ce, ce, adapter.seconds)
        metrics = {**_round_metrics(run, res.steps), "alpha": alpha}
        if run.diverged or not math.isfinite(alpha):
            metrics["personal_diverged"] = 1.0
            adapted, scalars = state.adapted, state.scalars
        else:
            adapted, scalars = cpu_state(adapter.model), {**state.scalars, "alpha": alpha}
        return res, TrainerState(adapted=adapted, active=True, frozen_keys=(),
                                 rounds_adapted=state.rounds_adapted + 1, metrics=metrics, scalars=scalars)

    return Trainer(APFL, init, train, _apfl_inference_state)


# ---- FT and FB ----

def _fine_tune_trainer(name: str, options: Mapping[str, Any] | None, top_only: bool) -> Trainer:
    cfg = from_dict(FineTuneConfig, dict(options or {}), "").validate()

    def frozen(model: nn.Module) -> tuple[str, ...]:
        """FB: every state-dict key but the top parameterised layer's (:func:`parameterised_layers`)."""
        return frozen_layer_keys(model, max(len(parameterised_layers(model)) - 1, 0)) if top_only else ()

    def init(model: nn.Module) -> TrainerState:
        return TrainerState(frozen_keys=frozen(model))

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        frozen_keys = frozen(model)
        if not recovery:
            res, new = _vanilla_round(model, state, x, y, config, seeds, learning_rate, epochs, batches)
            return res, dataclasses.replace(new, frozen_keys=frozen_keys)
        lr = config.learning_rate if learning_rate is None else learning_rate
        v = personal_copy(model, None)  # every round starts again from the received w^{r-1}
        frozen_set = set(frozen_keys)
        params: list[torch.Tensor] = []
        for n, p in v.named_parameters():
            if n in frozen_set:
                p.requires_grad_(False)
            else:
                params.append(p)
        run = _personal_sgd(v, params, [], 0.0, x, y, config, lr, cfg.epochs, derive_seed(seeds.batches, name),
                            derive_seed(seeds.dropout, name))
        adapted = state.adapted
        if not run.diverged:
            adapted = cpu_state(v)
            received = model.state_dict()  # before the global copy trains
            for k in frozen_keys:  # lower layers' buffers (BatchNorm statistics) stay the received ones too
                adapted[k] = received[k].detach().to("cpu", copy=True)
        res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                          batches=batches, dropout_seed=seeds.dropout)
        return res, TrainerState(adapted=adapted, active=True, frozen_keys=frozen_keys,
                                 rounds_adapted=state.rounds_adapted + 1, metrics=_round_metrics(run, res.steps),
                                 scalars=state.scalars)

    return Trainer(name, init, train, inference_state)


def ft_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """FT (FL-GUARD §5.2, baseline [12]): fine-tune the whole received global model locally. Options: see
    :class:`FineTuneConfig` (``{"epochs": 1}``, E′).

    Per round with ``recovery=True``: a copy of the received model w^{r-1} takes E′ epochs of SGD on ℓ over the
    client's data (batches ``derive_seed(seeds.batches, "ft")``; the round's learning rate, momentum, weight decay
    and clip; :func:`_personal_sgd` with λ = 0), before the global copy runs ``train_local`` unchanged. The client
    infers with it; every recovery round starts again from the newly received model (FL-GUARD's FT fine-tunes the
    global model at the end of FL; run under the recovery flag, the "end" is each round's latest global model).
    """
    return _fine_tune_trainer(FT, options, top_only=False)


def fb_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """FB (FL-GUARD §5.2, baseline [12]): like :func:`ft_trainer`, but only the top layer, the last parameterised
    layer (:func:`fedcore.train.trainers.parameterised_layers`, the classifier), is fine-tuned (batches
    ``derive_seed(seeds.batches, "fb")``). The rest is the received model: its parameters are not trained and its
    buffers are reset to the received ones; they are ``state.frozen_keys``, taken from the received global model at
    inference (:func:`fedcore.train.trainers.inference_state`). A model with a single parameterised layer is
    fine-tuned whole. Options: see :class:`FineTuneConfig`.
    """
    return _fine_tune_trainer(FB, options, top_only=True)


PERSONAL_TRAINERS: dict[str, TrainerFactory] = {
    DITTO: ditto_trainer,
    APFL: apfl_trainer,
    FT: ft_trainer,
    FB: fb_trainer,
}


# This module's trainers (declared, with their options and one lines, in fedcore.train.registry).
TRAINERS.add("ditto", ditto_trainer)
TRAINERS.add("apfl", apfl_trainer)
TRAINERS.add("ft", ft_trainer)
TRAINERS.add("fb", fb_trainer)
