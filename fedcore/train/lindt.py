"""LINDT's layer-wise intertwined dual model as a client trainer (SPEC §7; LINDT §4.1–4.2, Eq. 8–10, App. B.1).

A client keeps a local model Lᵢ(·, vᵢ) with the same M layers ("blocks") as the global model G(·, w_iʳ). For
m = 1..M−1 an *attaching module* (:func:`attach`) mixes the two layer-m representations of a sample x::

    score = sigmoid(⟨Lᵐ, Gᵐ⟩ / ‖Lᵐ‖)          (Eq. 8; per sample, and per time step for sequence layers)
    h     = score·Gᵐ + (1 − score)·Lᵐ          (Eq. 9)

and h is the input of local layer m+1 (:class:`DualModel`). Both models are trained together on
CE(G^M(x), y) + CE(L^M(x), y) (Eq. 10); at test time the client predicts with the local output L^M only.

A "layer" is one block (:func:`split_blocks`): a zoo :class:`~fedcore.models.zoo.BlockModel`'s blocks, or an
``nn.Sequential`` cut before each Linear/Conv/LSTM/Embedding layer.

Trainer (:data:`LINDT_TRAINERS`): ``"lindt"`` (:func:`lindt_trainer`), options :class:`LindtConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedcore.errors import ConfigError
from fedcore.models.zoo import BlockModel
from fedcore.options import from_dict
from fedcore.seeds import RoundSeeds, derive_seed
from fedcore.train import Batches, TrainResult, model_device, shuffled_batches, train_local
from fedcore.train.loop import (
    Companion,
    LossMeter,
    Optimised,
    StepHooks,
    fedprox_penalty,
    raise_if_diverged,
    run_sgd,
)
from fedcore.train.registry import TRAINERS
from fedcore.train.trainers import (
    Trainer,
    TrainerFactory,
    TrainerState,
    cpu_state,
    inference_state,
    personal_copy,
)
from fedcore.training_config import TrainingConfig

LINDT = "lindt"
# Guard of Eq. 8's denominator: ‖Lᵐ‖ = 0 gives score = sigmoid(0) = 1/2 instead of 0/0.
_NORM_EPS = 1e-12

# Modules that start a new layer when an nn.Sequential is split into blocks.
_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d, nn.RNNBase, nn.Embedding,
)
# Blocks whose output is a batch-first sequence [B, T, F]: attached per sample and time step.
_SEQUENCE_TYPES: tuple[type[nn.Module], ...] = (nn.RNNBase, nn.Embedding)


def _not_splittable(model: nn.Module, detail: str = "") -> ConfigError:
    return ConfigError("trainer", "LINDT needs a model made of blocks (a fedcore BlockModel or an nn.Sequential of "
                                  f"layers); {type(model).__name__} cannot be split{detail}")


def _is_layer(module: nn.Module) -> bool:
    return any(isinstance(m, _LAYER_TYPES) for m in module.modules())


def split_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's layers 1..M in LINDT's sense, input first.

    - a :class:`~fedcore.models.zoo.BlockModel` (every zoo model): its blocks (:meth:`BlockModel.layers`);
    - an ``nn.Sequential`` (``mlp``, ``logreg``): one block per Linear/Conv/LSTM/Embedding child (or child that
      contains one) with the activation/pool/dropout/flatten/normalisation children that follow it up to the next
      such child; children before the first one (a leading ``Flatten``) go with the first block. Blocks of several
      children are new ``nn.Sequential`` wrappers around the model's own modules (shared, not copied).

    Anything else, or a model of fewer than 2 blocks (no layer to attach), raises :class:`ConfigError`.
    """
    if isinstance(model, BlockModel):
        blocks = model.layers()
    elif isinstance(model, nn.Sequential):
        groups: list[list[nn.Module]] = []
        current: list[nn.Module] = []
        has_layer = False
        for child in model:
            if _is_layer(child) and has_layer:
                groups.append(current)
                current, has_layer = [], False
            current.append(child)
            has_layer = has_layer or _is_layer(child)
        if current:
            groups.append(current)
        blocks = [g[0] if len(g) == 1 else nn.Sequential(*g) for g in groups]
    else:
        raise _not_splittable(model)
    if len(blocks) < 2:
        raise _not_splittable(model, f" (it has {len(blocks)} layer(s); the dual model needs at least 2)")
    return blocks


def _is_sequence_block(block: nn.Module) -> bool:
    return any(isinstance(m, _SEQUENCE_TYPES) for m in block.modules())


def attach(g: torch.Tensor, l: torch.Tensor, *, sequence: bool = False,  # noqa: E741
           detach_global: bool = False) -> torch.Tensor:
    """LINDT's attaching module (Eq. 8–9, App. B.1): h = score·G + (1 − score)·L with
    score = sigmoid(⟨flat(L), flat(G)⟩ / ‖flat(L)‖) per sample.

    ``g`` and ``l`` are the layer-m outputs of the global and the local model for the same batch (same shape,
    batch first). The dot product and the norm run over each sample's flattened representation (dims 1..); with
    ``sequence`` (an LSTM/Embedding layer's [B, T, F] output) over the features of each sample *and* time step
    (dims 2..), so there is one score per (sample, step). ‖L‖ is clamped at a tiny eps: L = 0 gives score = 1/2.
    With ``detach_global``, G enters detached (no gradient reaches the global model through the module).
    """
    if g.shape != l.shape:
        raise ValueError(f"attach: global and local representations differ in shape: {tuple(g.shape)} vs "
                         f"{tuple(l.shape)}")
    if detach_global:
        g = g.detach()
    start = 2 if sequence and l.dim() >= 3 else 1
    lf, gf = l.flatten(start), g.flatten(start)
    if lf.dim() == 1:  # a [B] representation: one feature per sample
        lf, gf = lf.unsqueeze(1), gf.unsqueeze(1)
    dot = (lf * gf).sum(dim=-1)
    norm = torch.linalg.vector_norm(lf, dim=-1).clamp_min(_NORM_EPS)
    score = torch.sigmoid(dot / norm)
    score = score.reshape(*score.shape, *([1] * (l.dim() - score.dim())))
    return score * g + (1.0 - score) * l


class DualModel(nn.Module):
    """LINDT's dual model: the global model G and the local model L (same architecture), intertwined layer by
    layer (Fig. 2): L¹ = local layer 1 on x; for m = 1..M−1, L^{m+1} = local layer m+1 on attach(Gᵐ, Lᵐ).

    ``forward(x)`` returns the local model's logits L^M (inference and evaluation, LINDT Fig. 2: "when testing,
    each client only considers the prediction from its local model"); :meth:`forward_both` returns (G^M, L^M) for
    Eq. 10. The two models are submodules ``global_model`` and ``local_model`` (not copied: training the dual
    model trains them). G runs its layers in turn on x exactly as its own forward does for a BlockModel or an
    ``nn.Sequential``.
    """

    def __init__(self, global_model: nn.Module, local_model: nn.Module, *, detach_global: bool = False) -> None:
        super().__init__()
        self.global_model = global_model
        self.local_model = local_model
        self.detach_global = detach_global
        # Plain lists (not ModuleLists): the blocks are already registered through the two models.
        self._global_blocks = split_blocks(global_model)
        self._local_blocks = split_blocks(local_model)
        if len(self._global_blocks) != len(self._local_blocks):
            raise ValueError(f"DualModel: the global model has {len(self._global_blocks)} layers, the local one "
                             f"{len(self._local_blocks)}")
        gs, ls = global_model.state_dict(), local_model.state_dict()
        if list(gs) != list(ls) or any(gs[k].shape != ls[k].shape for k in gs):
            raise ValueError("DualModel: the global and the local model must have the same architecture")
        self._sequence = [_is_sequence_block(b) for b in self._local_blocks]

    @property
    def num_layers(self) -> int:
        return len(self._local_blocks)

    def forward_both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(G^M(x), L^M(x)): the global model's and the intertwined local model's logits."""
        g, l = x, x  # noqa: E741
        last = len(self._local_blocks) - 1
        for m, (gb, lb) in enumerate(zip(self._global_blocks, self._local_blocks, strict=True)):
            g = gb(g)
            l = lb(l)  # noqa: E741
            if m < last:
                l = attach(g, l, sequence=self._sequence[m], detach_global=self.detach_global)  # noqa: E741
        return g, l

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_both(x)[1]


@dataclass(frozen=True)
class LindtConfig:
    """LINDT options. ``detach_global``: the attaching modules read the global model's representations detached,
    so the local model's loss does not reach w (the update sent to the server is then the vanilla one); off by
    default, as written in the paper (Eq. 10, both w and v step on the summed loss)."""

    detach_global: bool = False

    def validate(self, prefix: str = "") -> LindtConfig:
        if not isinstance(self.detach_global, bool):
            raise ConfigError(f"{prefix}detach_global", f"must be true or false, got {self.detach_global!r}")
        return self


def inference_module(state: TrainerState, received_model: nn.Module) -> nn.Module | None:
    """The module a LINDT client infers with: ``None`` (the received model) before it has a local model, else a
    :class:`DualModel` of a copy of the received global model and the local model vᵢ (``state.adapted``), in eval
    mode; its output is the local model's logits. ``received_model`` is copied, never modified."""
    if state.adapted is None:
        return None
    local = personal_copy(received_model, state.adapted)
    dual = DualModel(copy.deepcopy(received_model), local)
    dual.eval()
    return dual


@dataclass(frozen=True)
class _DualRun:
    result: TrainResult
    global_ce: float
    local_ce: float
    seconds: float


class _DualObjective:
    """Eq. 10 on the one loop: the objective is the global copy's CE(G^M) (so FedProx's term and the reported loss
    are the global copy's, as ``train_local``'s), and the local model's CE(L^M) of the same dual forward pass is the
    ``extra_loss`` added for the backward pass only. Both are summed in ``meter`` (``global``, ``local``)."""

    def __init__(self, dual: DualModel, meter: LossMeter) -> None:
        self.dual = dual
        self.meter = meter
        self._local: tuple[torch.Tensor, torch.Tensor] | None = None  # this batch's (L^M, y)

    def __call__(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        g_out, l_out = self.dual.forward_both(xb)
        ce_g = F.cross_entropy(g_out, yb)
        self.meter.add(**{"global": ce_g})
        self._local = (l_out, yb)
        return ce_g

    def local_loss(self) -> torch.Tensor:
        assert self._local is not None
        l_out, yb = self._local
        self._local = None
        ce_l = F.cross_entropy(l_out, yb)
        self.meter.add(local=ce_l)
        return ce_l


def _train_dual(model: nn.Module, v: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                lr: float, seeds: RoundSeeds, epochs: int | None, batches: Batches | None,
                detach_global: bool) -> _DualRun:
    """:func:`fedcore.train.train_local`'s loop with the dual model: per batch, one backward pass of
    (CE(G^M) + FedProx term) + CE(L^M), then each model's gradient clipped separately and one SGD step of each
    (two :class:`~fedcore.train.loop.Optimised` on one backward pass)."""
    objective = _DualObjective(DualModel(model, v, detach_global=detach_global), LossMeter(model_device(model)))
    optimised = [Optimised.sgd(model.parameters(), lr, config), Optimised.sgd(v.parameters(), lr, config)]
    penalty = fedprox_penalty(model, config.prox_mu) if config.prox_mu > 0 else None
    source = batches or shuffled_batches(x, y, config.batch_size, seeds.batches)
    n_epochs = config.local_epochs if epochs is None else epochs
    start = time.perf_counter()
    res = run_sgd(model, source, n_epochs, optimised, dropout_seed=seeds.dropout,
                  hooks=StepHooks(objective=objective, penalty=penalty, extra_loss=objective.local_loss),
                  companions=[Companion(v, derive_seed(seeds.dropout, LINDT))])
    global_ce, local_ce = objective.meter.mean("global", res.steps), objective.meter.mean("local", res.steps)
    seconds = time.perf_counter() - start
    raise_if_diverged(res.steps, res.loss, local_ce,
                      message="LINDT dual-model training diverged (non-finite loss); lower the learning rate")
    return _DualRun(res, global_ce, local_ce, seconds)


def lindt_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """LINDT's layer-wise intertwined dual model (LINDT §4, Eq. 8–10). Options: see :class:`LindtConfig`
    (``{"detach_global": true}``).

    With ``recovery=False`` the round is exactly :func:`fedcore.train.train_local` (the ``vanilla`` trainer's call)
    and the local model, if any, is kept unchanged (``active`` off, ``metrics`` emptied).

    With ``recovery=True`` the local model vᵢ starts from the saved one (``state.adapted``) or, the first time, from
    the received global model, and is trained *together* with the client's copy of the global model w_iʳ
    (``model``, in place) on Eq. 10: per batch, loss = CE(G^M(x), y) + CE(L^M(x), y) (plus FedProx's term on the
    global copy when ``config.prox_mu > 0``, as in ``train_local``), one backward pass, each model's gradient
    clipped separately by ``config.grad_clip_norm``, and one SGD step of each (two optimisers with the round's
    learning rate, momentum and weight decay, fresh each round). Batches: ``batches(epoch)`` when given, else the
    vanilla shuffle seeded with ``seeds.batches``; dropout masks: the global copy's from ``seeds.dropout`` (as
    ``train_local``), the local model's from ``derive_seed(seeds.dropout, "lindt")``.

    Unlike the other recovery methods, **LINDT changes the global update**: the local loss reaches w through the
    attaching modules (as written in the paper: both w and v step on Eq. 10's loss), so the update sent to the
    server differs from the vanilla one. With ``detach_global`` the attaching modules read G detached: w then gets
    only CE(G^M)'s gradient and its trajectory is bit-identical to ``train_local``'s for the same seeds.

    A non-finite loss (global or local) raises :class:`FloatingPointError`, like ``train_local``. The result's loss
    is the global copy's mean training loss (as ``train_local``'s); ``state.metrics`` holds ``lindt_global_ce``,
    ``lindt_local_ce`` (mean cross-entropies), ``passes`` (forward/backward passes relative to vanilla training:
    1 + local passes / global passes = 2.0) and ``personal_seconds`` (wall time of the round's training). The client
    infers with the local model fed by the received global model (:func:`inference_module`).
    """
    cfg = from_dict(LindtConfig, dict(options or {}), "").validate()

    def init(model: nn.Module) -> TrainerState:
        split_blocks(model)  # a model LINDT cannot split is a configuration error: say so before training
        return TrainerState()

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        if not recovery:
            res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                              batches=batches, dropout_seed=seeds.dropout)
            return res, dataclasses.replace(state, active=False, metrics={})
        lr = config.learning_rate if learning_rate is None else learning_rate
        v = personal_copy(model, state.adapted)
        run = _train_dual(model, v, x, y, config, lr, seeds, epochs, batches, cfg.detach_global)
        steps = run.result.steps
        metrics = {"lindt_global_ce": run.global_ce, "lindt_local_ce": run.local_ce,
                   "passes": 1.0 + steps / max(steps, 1),  # one local pass per global pass
                   "personal_seconds": run.seconds}
        return run.result, TrainerState(adapted=cpu_state(v), active=True, frozen_keys=(),
                                        rounds_adapted=state.rounds_adapted + 1, metrics=metrics,
                                        scalars=state.scalars)

    return Trainer(LINDT, init, train, inference_state, inference_module=inference_module)


LINDT_TRAINERS: dict[str, TrainerFactory] = {LINDT: lindt_trainer}


# This module's trainers (declared, with their options and one lines, in fedcore.train.registry).
TRAINERS.add("lindt", lindt_trainer)
