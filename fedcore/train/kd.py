"""Knowledge-distillation client objectives behind the trainer seam: FedNTD, MOON and HYDRA-FL (SPEC §10).

Each trainer trains the client's copy of the global model with :func:`fedcore.train.train_local` (the one training
loop: same batches, dropout masks, optimiser, FedProx term and gradient clip) and replaces its per-batch loss
(``objective``). The *teacher* is the round's received global model, frozen: a deep copy of ``model`` taken at the
start of ``train``, in eval mode, ``requires_grad`` off, evaluated under ``torch.no_grad()``.

- ``"fedntd"`` (Lee et al., *Preservation of the Global Knowledge by Not-True Distillation in Federated Learning*,
  NeurIPS 2022; HYDRA-FL App. B.1, Eq. 13): L = CE(y_c, y) + β·L_NTD with
  L_NTD = τ²·KL(softmax(nt(teacher)/τ) ‖ softmax(nt(student)/τ)) (:func:`ntd_loss`).
- ``"moon"`` (Li et al., *Model-Contrastive Federated Learning*, CVPR 2021; HYDRA-FL App. B.2, Eq. 14):
  L = CE(y_c, y) + μ·L_con(z, z_glob, z_prev) (:func:`moon_loss`), z the model's representation (the projection
  output of :func:`fedcore.models.zoo.moon_cnn`), z_glob the teacher's, z_prev the client's previous local model's.
- ``"hydra"`` (Khan et al., *HYDRA-FL: Hybrid Knowledge Distillation for Robust and Accurate Federated Learning*,
  NeurIPS 2024, §4, Eq. 8–10): L = CE + (β/b)·KD_final + γ·KD_shallow, on a
  :class:`~fedcore.models.zoo.HydraModel` (``hydra_ntd_cnn``, ``moon_cnn``) whose auxiliary head ``shallow_head``
  gives the shallow term; ``base`` picks FedNTD's (Eq. 9) or MOON's (Eq. 10) KD loss. As in the authors' code
  (``emtechlab/HYDRA-FL-NeurIPS``, ``algorithms/fedntd/criterion.py``) the default head is the one after the second
  conv block (``shallow_head = 1``) and FedNTD's shallow term is the plain not-true KL, not scaled by τ²
  (:func:`ntd_kl`; ``shallow_tau2 = true`` scales it like the final term).

None of them has a recovery method: ``recovery=True`` changes nothing (like ``vanilla``), and the client infers with
the received model (:func:`fedcore.train.trainers.inference_state` returns ``None``). MOON (and HYDRA on MOON) keep
the model the client ended its round with in ``state.kept["previous"]`` (persisted by
:func:`~fedcore.train.trainers.save_trainer_state`, so it survives a restart). In a client's first round there is no
previous model and the contrastive terms are zero (SPEC §10): with no negative the contrastive cross-entropy has a
single logit and is identically 0, so the round is plain cross-entropy training (bit-identical to ``train_local``).

Per-round loss components (means over the round's steps) go to ``state.metrics``: ``kd_ce`` (the cross-entropy),
``kd_final`` (the unweighted final-layer KD loss), ``kd_shallow`` (HYDRA's unweighted shallow KD loss) and
``kd_steps``. A term whose weight is 0 is not computed (and has no metric): the parameters only it reaches (a
HYDRA head) then get no gradient at all. Nothing is drawn from torch's global RNG (the teacher and the previous
model run in eval mode).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedcore.checks import is_finite_number, is_int
from fedcore.errors import ConfigError
from fedcore.models.zoo import HydraModel
from fedcore.options import from_dict
from fedcore.seeds import RoundSeeds
from fedcore.train import Batches, TrainResult, model_device, train_local
from fedcore.train.loop import LossMeter, raise_if_diverged
from fedcore.train.registry import TRAINERS
from fedcore.train.trainers import (
    Trainer,
    TrainerFactory,
    TrainerState,
    _check_adapted_matches,
    cpu_state,
    inference_state,
)
from fedcore.training_config import TrainingConfig

FEDNTD = "fedntd"
MOON = "moon"
HYDRA = "hydra"
# The name of MOON's previous local model in TrainerState.kept.
PREVIOUS = "previous"
HYDRA_BASES = (FEDNTD, MOON)
# HYDRA-FL's default shallow weight γ by base (App. D: γ = 2 for FedNTD, γ = 1 for MOON).
HYDRA_GAMMA_DEFAULT = {FEDNTD: 2.0, MOON: 1.0}
# HYDRA-FL's default shallow head: the index into HydraModel.heads of the head after the second conv block (the
# authors' code distils at that head, ``so2``; hydra_ntd_cnn and moon_cnn have heads after blocks (0, 1)).
HYDRA_SHALLOW_HEAD_DEFAULT = 1


# ---- the losses (pure functions) ----

def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """nt(): the C−1 logits of the classes other than each sample's true class, in class order ([N, C] -> [N, C−1])."""
    n, c = logits.shape
    idx = torch.arange(c - 1, device=logits.device).expand(n, c - 1)
    idx = idx + (idx >= y.unsqueeze(1)).long()  # skip the true class: j -> j for j < y, j + 1 for j >= y
    return logits.gather(1, idx)


def ntd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor,
           tau: float) -> torch.Tensor:
    """The not-true KL without FedNTD's τ² factor: KL(softmax(nt(t)/τ) ‖ softmax(nt(s)/τ)), averaged over the
    batch (``batchmean``), nt() = :func:`not_true_logits`. HYDRA-FL's shallow term in the authors' code.

    The true-class logits of both models take no part. ``teacher_logits`` are used as given (pass them detached)."""
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(f"ntd_loss: logits of shapes {tuple(student_logits.shape)} and "
                         f"{tuple(teacher_logits.shape)}; expected two equal [N, C]")
    if student_logits.shape[1] < 2:
        raise ValueError("ntd_loss: needs at least 2 classes (nt() leaves C−1 logits)")
    log_p_student = F.log_softmax(not_true_logits(student_logits, y) / tau, dim=1)
    p_teacher = F.softmax(not_true_logits(teacher_logits, y) / tau, dim=1)
    return F.kl_div(log_p_student, p_teacher, reduction="batchmean")


def ntd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor,
             tau: float) -> torch.Tensor:
    """FedNTD's not-true distillation loss L_NTD = τ²·:func:`ntd_kl` = τ²·KL(softmax(nt(t)/τ) ‖ softmax(nt(s)/τ))
    (FedNTD Eq. 6; HYDRA-FL Eq. 9 and 13's L_KL), KL averaged over the batch (``batchmean``)."""
    return (tau * tau) * ntd_kl(student_logits, teacher_logits, y, tau)


def moon_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float) -> torch.Tensor:
    """MOON's model-contrastive loss (MOON Eq. 3; HYDRA-FL Eq. 10 and 14's L_con), averaged over the batch:

    ℓ_con = −log( exp(cos(z, z_glob)/τ_m) / (exp(cos(z, z_glob)/τ_m) + exp(cos(z, z_prev)/τ_m)) ),

    i.e. the cross-entropy of the logits [cos(z, z_glob), cos(z, z_prev)]/τ_m with target 0 (the positive pair).
    Cosines per sample over the last dimension (``F.cosine_similarity``, eps 1e-8)."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([pos, neg], dim=1) / temperature
    target = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, target)


# ---- options ----

def _positive(value: object, field: str) -> None:
    if not is_finite_number(value) or float(value) <= 0:  # type: ignore[arg-type]
        raise ConfigError(field, f"must be > 0 (a finite number), got {value!r}")


def _non_negative(value: object, field: str) -> None:
    if not is_finite_number(value) or float(value) < 0:  # type: ignore[arg-type]
        raise ConfigError(field, f"must be >= 0 (a finite number), got {value!r}")


@dataclass(frozen=True)
class FedNtdConfig:
    """FedNTD options. ``tau``: the softmax temperature τ of the not-true logits (HYDRA-FL's config: 1; FedNTD's
    own default is 3). ``beta``: the weight β of L_NTD (1)."""

    tau: float = 1.0
    beta: float = 1.0

    def validate(self, prefix: str = "") -> FedNtdConfig:
        _positive(self.tau, f"{prefix}tau")
        _non_negative(self.beta, f"{prefix}beta")
        return self


@dataclass(frozen=True)
class MoonConfig:
    """MOON options. ``mu``: the weight μ of the contrastive loss (1). ``temperature``: τ_m of the cosine logits
    (MOON: 0.5)."""

    mu: float = 1.0
    temperature: float = 0.5

    def validate(self, prefix: str = "") -> MoonConfig:
        _non_negative(self.mu, f"{prefix}mu")
        _positive(self.temperature, f"{prefix}temperature")
        return self


@dataclass(frozen=True)
class HydraConfig:
    """HYDRA-FL options (Eq. 8–10; App. D).

    - ``base``: ``"fedntd"`` (Eq. 9: not-true KL at the output and at head ``shallow_head``'s logits, both
      against the teacher's output) or ``"moon"`` (Eq. 10: contrastive loss at the representation and at the
      head's hidden representation, both with the teacher's representation as positive).
    - ``beta``: the final-layer KD weight β (FedNTD's β, MOON's μ), 1.
    - ``b``: the diminishing factor b > 0 dividing β (App. D: 1 for FedNTD; the paper also uses 4), 1.
    - ``gamma``: the shallow KD weight γ; unset = 2.0 with base fedntd, 1.0 with base moon (App. D).
    - ``tau``: FedNTD's temperature τ (1); ``temperature``: MOON's τ_m (0.5); each used by its base only.
    - ``shallow_head``: the index into ``model.heads`` of the auxiliary classifier used; 1 = the head after the
      second conv block of ``hydra_ntd_cnn`` / ``moon_cnn`` (the authors' code; the paper's ablation calls it S2),
      0 = after the first (S1).
    - ``shallow_tau2``: base fedntd only: scale the shallow not-true KL by τ² like the final term (FedNTD's
      convention). Off by default, as in the authors' code: KD_shallow = :func:`ntd_kl`, KD_final = τ²·ntd_kl.
      With τ = 1 (the default) both readings are the same loss.
    """

    base: str = FEDNTD
    beta: float = 1.0
    b: float = 1.0
    gamma: float | None = None
    tau: float = 1.0
    temperature: float = 0.5
    shallow_head: int = HYDRA_SHALLOW_HEAD_DEFAULT
    shallow_tau2: bool = False

    def validate(self, prefix: str = "") -> HydraConfig:
        if self.base not in HYDRA_BASES:
            raise ConfigError(f"{prefix}base", f"must be one of {', '.join(HYDRA_BASES)}, got {self.base!r}")
        _non_negative(self.beta, f"{prefix}beta")
        _positive(self.b, f"{prefix}b")
        if self.gamma is not None:
            _non_negative(self.gamma, f"{prefix}gamma")
        _positive(self.tau, f"{prefix}tau")
        _positive(self.temperature, f"{prefix}temperature")
        if not is_int(self.shallow_head) or self.shallow_head < 0:
            raise ConfigError(f"{prefix}shallow_head", f"must be an integer >= 0, got {self.shallow_head!r}")
        if not isinstance(self.shallow_tau2, bool):
            raise ConfigError(f"{prefix}shallow_tau2", f"must be true or false, got {self.shallow_tau2!r}")
        return self

    @property
    def shallow_weight(self) -> float:
        """γ: ``gamma``, or the base's default (2.0 for fedntd, 1.0 for moon)."""
        return HYDRA_GAMMA_DEFAULT[self.base] if self.gamma is None else float(self.gamma)


# ---- models ----

def frozen_copy(model: nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """A frozen copy of ``model`` (same device): eval mode, ``requires_grad`` off, no gradients; holding ``state``
    when given (checked against ``model``: :class:`~fedcore.train.trainers.TrainerStateError` when it does not
    fit). The teacher (the received global model) and MOON's previous local model."""
    if state is not None:
        _check_adapted_matches(state, model, f"kept model {PREVIOUS!r}")
    m = copy.deepcopy(model)
    if state is not None:
        m.load_state_dict(state)
    m.eval()
    for p in m.parameters():
        p.grad = None
    m.requires_grad_(False)
    return m


def _needs_representation(model: nn.Module, who: str) -> HydraModel:
    if not isinstance(model, HydraModel):
        raise ConfigError("trainer", f"{who} needs a model with a representation (a fedcore.models.zoo.HydraModel "
                                     f"with kd_forward, e.g. 'moon_cnn' or 'hydra_ntd_cnn'); got "
                                     f"{type(model).__name__}")
    return model


def _needs_heads(model: nn.Module, cfg: HydraConfig) -> HydraModel:
    if not isinstance(model, HydraModel) or len(model.heads) == 0:
        raise ConfigError("trainer", "hydra needs a model with auxiliary shallow heads (a fedcore.models.zoo."
                                     "HydraModel with heads, e.g. 'hydra_ntd_cnn' or 'moon_cnn'); got "
                                     f"{type(model).__name__} without heads")
    if cfg.shallow_head >= len(model.heads):
        raise ConfigError("shallow_head", f"must be < the model's {len(model.heads)} heads, got {cfg.shallow_head}")
    if cfg.base == MOON and model.head_hidden_size(cfg.shallow_head) != model.representation_size:
        raise ConfigError("base", f"'moon' contrasts head {cfg.shallow_head}'s hidden representation with the "
                                  f"model's representation: their sizes differ "
                                  f"({model.head_hidden_size(cfg.shallow_head)} vs {model.representation_size}); "
                                  f"use a model whose heads' hidden size is the projection size (e.g. 'moon_cnn')")
    return model


# ---- the round ----

class _Meter(LossMeter):
    """The loss components of a round (:class:`~fedcore.train.loop.LossMeter`) and the steps the objective ran."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.steps = 0

    def metrics(self) -> dict[str, float]:
        out = {f"kd_{k}": self.mean(k, self.steps) for k in self.sums}
        out["kd_steps"] = float(self.steps)
        return out


_MakeObjective = Callable[[nn.Module, nn.Module, nn.Module | None, _Meter],
                          Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]]


def _kd_round(name: str, make_objective: _MakeObjective, keeps_previous: bool, model: nn.Module,
              state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig, seeds: RoundSeeds,
              learning_rate: float | None, epochs: int | None, batches: Batches | None) -> tuple[TrainResult,
                                                                                                TrainerState]:
    """One KD round: freeze the teacher (and the previous model), train with ``train_local`` and the objective
    (batches, masks, learning rate and epochs exactly as ``vanilla``), record metrics and, for MOON, keep the
    trained model as the next round's previous model."""
    teacher = frozen_copy(model)
    previous_state = state.kept.get(PREVIOUS) if keeps_previous else None
    previous = frozen_copy(model, previous_state) if previous_state is not None else None
    meter = _Meter(model_device(model))
    res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                      batches=batches, dropout_seed=seeds.dropout,
                      objective=make_objective(model, teacher, previous, meter))
    metrics = meter.metrics()
    raise_if_diverged(meter.steps, *metrics.values(),
                      message=f"{name}: a loss component became non-finite; lower the learning rate")
    kept = dict(state.kept)
    if keeps_previous:
        kept[PREVIOUS] = cpu_state(model)
    return res, dataclasses.replace(state, metrics=metrics, kept=kept)


def _fedntd_objective(cfg: FedNtdConfig) -> _MakeObjective:
    def make(model: nn.Module, teacher: nn.Module, previous: nn.Module | None,
             meter: _Meter) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
        def objective(student: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            logits = student(xb)
            ce = F.cross_entropy(logits, yb)
            meter.steps += 1
            if cfg.beta == 0:
                meter.add(ce=ce)
                return ce
            with torch.no_grad():
                t_logits = teacher(xb)
            kd = ntd_loss(logits, t_logits, yb, cfg.tau)
            meter.add(ce=ce, final=kd)
            return ce + cfg.beta * kd

        return objective

    return make


def _moon_objective(cfg: MoonConfig) -> _MakeObjective:
    def make(model: nn.Module, teacher: nn.Module, previous: nn.Module | None,
             meter: _Meter) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
        t_model = _needs_representation(teacher, MOON)
        p_model = _needs_representation(previous, MOON) if previous is not None else None

        def objective(student: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            out = _needs_representation(student, MOON).kd_forward(xb, heads=())
            ce = F.cross_entropy(out.logits, yb)
            meter.steps += 1
            if cfg.mu == 0:
                meter.add(ce=ce)
                return ce
            if p_model is None:  # a client's first round: no negative, the contrastive term is zero
                meter.add(ce=ce, final=torch.zeros((), device=ce.device))
                return ce
            with torch.no_grad():
                z_glob = t_model.kd_forward(xb, heads=()).representation
                z_prev = p_model.kd_forward(xb, heads=()).representation
            con = moon_loss(out.representation, z_glob, z_prev, cfg.temperature)
            meter.add(ce=ce, final=con)
            return ce + cfg.mu * con

        return objective

    return make


def _hydra_objective(cfg: HydraConfig) -> _MakeObjective:
    k = cfg.shallow_head
    w_final, w_shallow = cfg.beta / cfg.b, cfg.shallow_weight
    shallow_scale = cfg.tau * cfg.tau if cfg.shallow_tau2 else 1.0
    # A term whose weight is 0 is not computed: the parameters only it reaches (the head) get no gradient at all
    # (not a zero one, which weight decay and momentum would still act on).
    use_final, use_shallow = w_final != 0, w_shallow != 0

    def make(model: nn.Module, teacher: nn.Module, previous: nn.Module | None,
             meter: _Meter) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
        t_model = _needs_heads(teacher, cfg)
        p_model = _needs_heads(previous, cfg) if previous is not None else None
        # Without a previous model HYDRA-MOON's round is plain CE: the head is not needed.
        first_moon = cfg.base == MOON and p_model is None
        heads = (k,) if use_shallow and not first_moon else ()

        def objective(student: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            out = _needs_heads(student, cfg).kd_forward(xb, heads=heads)
            ce = F.cross_entropy(out.logits, yb)
            meter.steps += 1
            parts = {"ce": ce}
            if not (use_final or use_shallow):
                meter.add(**parts)
                return ce
            if first_moon:  # a client's first round: no negative, both contrastive terms are zero
                zero = torch.zeros((), device=ce.device)
                meter.add(**parts, **({"final": zero} if use_final else {}), **({"shallow": zero} if use_shallow
                                                                                 else {}))
                return ce
            if cfg.base == FEDNTD:  # Eq. 9
                with torch.no_grad():
                    t_logits = t_model(xb)
                if use_final:
                    parts["final"] = ntd_loss(out.logits, t_logits, yb, cfg.tau)
                if use_shallow:
                    parts["shallow"] = shallow_scale * ntd_kl(out.head_logits[k], t_logits, yb, cfg.tau)
            else:  # Eq. 10, with the previous local model's representations as negatives
                assert p_model is not None
                with torch.no_grad():
                    z_glob = t_model.kd_forward(xb, heads=()).representation
                    prev = p_model.kd_forward(xb, heads=heads)
                if use_final:
                    parts["final"] = moon_loss(out.representation, z_glob, prev.representation, cfg.temperature)
                if use_shallow:
                    parts["shallow"] = moon_loss(out.head_hidden[k], z_glob, prev.head_hidden[k], cfg.temperature)
            meter.add(**parts)
            loss = ce
            if use_final:
                loss = loss + w_final * parts["final"]
            if use_shallow:
                loss = loss + w_shallow * parts["shallow"]
            return loss

        return objective

    return make


# ---- the trainers ----

def _init(model: nn.Module) -> TrainerState:
    return TrainerState()


def fedntd_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """FedNTD (HYDRA-FL App. B.1, Eq. 13; SPEC §10): L = CE(student(x), y) + β·:func:`ntd_loss` (student logits,
    frozen teacher's logits, y, τ). Works on any classifier (logits from ``model(x)``; a ``HydraModel``'s heads take
    no part and get no gradient). Options: :class:`FedNtdConfig` (``tau`` 1.0, ``beta`` 1.0)."""
    cfg = from_dict(FedNtdConfig, dict(options or {}), "").validate()
    objective = _fedntd_objective(cfg)

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        return _kd_round(FEDNTD, objective, False, model, state, x, y, config, seeds, learning_rate, epochs,
                         batches)

    return Trainer(FEDNTD, _init, train, inference_state)


def moon_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """MOON (HYDRA-FL App. B.2, Eq. 14; SPEC §10): L = CE + μ·:func:`moon_loss` (z, z_glob, z_prev, τ_m), z the
    student's representation (``kd_forward``), z_glob the frozen teacher's, z_prev that of the model the client
    ended its previous round with (``state.kept["previous"]``). Zero contrastive term in a client's first round.
    Needs a :class:`~fedcore.models.zoo.HydraModel` (``moon_cnn``): others are refused by ``init`` and ``train``
    with a :class:`ConfigError`. Options: :class:`MoonConfig` (``mu`` 1.0, ``temperature`` 0.5)."""
    cfg = from_dict(MoonConfig, dict(options or {}), "").validate()
    objective = _moon_objective(cfg)

    def init(model: nn.Module) -> TrainerState:
        _needs_representation(model, MOON)
        return TrainerState()

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        _needs_representation(model, MOON)
        return _kd_round(MOON, objective, True, model, state, x, y, config, seeds, learning_rate, epochs, batches)

    return Trainer(MOON, init, train, inference_state)


def hydra_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """HYDRA-FL (Eq. 8): L = CE + (β/b)·KD_final + γ·KD_shallow on a model with auxiliary heads.

    - base ``fedntd`` (Eq. 9): KD_final = :func:`ntd_loss` (student logits, teacher logits; τ²·KL), KD_shallow =
      :func:`ntd_kl` (head ``shallow_head``'s logits, teacher logits; no τ², as the authors' code; ×τ² with
      ``shallow_tau2``).
    - base ``moon`` (Eq. 10): KD_final = :func:`moon_loss` (z, z_glob, z_prev), KD_shallow = :func:`moon_loss`
      (the head's hidden representation as anchor, z_glob as positive, the previous local model's same-head hidden
      representation as negative); the head's hidden size must equal the representation size (256 for
      ``moon_cnn``). Both terms are zero in a client's first round (no previous model).

    The shallow head gets gradient from KD_shallow only (Eq. 9–10 have no cross-entropy on it). Needs a
    :class:`~fedcore.models.zoo.HydraModel` with heads (``hydra_ntd_cnn``, ``moon_cnn``): others are refused by
    ``init`` and ``train`` with a :class:`ConfigError`. Options: :class:`HydraConfig`."""
    cfg = from_dict(HydraConfig, dict(options or {}), "").validate()
    objective = _hydra_objective(cfg)
    keeps_previous = cfg.base == MOON

    def init(model: nn.Module) -> TrainerState:
        _needs_heads(model, cfg)
        return TrainerState()

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        _needs_heads(model, cfg)
        return _kd_round(HYDRA, objective, keeps_previous, model, state, x, y, config, seeds, learning_rate,
                         epochs, batches)

    return Trainer(HYDRA, init, train, inference_state)


KD_TRAINERS: dict[str, TrainerFactory] = {
    FEDNTD: fedntd_trainer,
    MOON: moon_trainer,
    HYDRA: hydra_trainer,
}


# This module's trainers (declared, with their options and one lines, in fedcore.train.registry).
TRAINERS.add("fedntd", fedntd_trainer)
TRAINERS.add("moon", moon_trainer)
TRAINERS.add("hydra", hydra_trainer)
