"""The one local training loop: mini-batch SGD with hooks, used by every trainer and recovery method.

Why one loop: every method promises something about the client's copy of the global model (FL-GUARD, Ditto, APFL,
FT and FB: "the update sent to the server is the vanilla one, bit for bit"; the KD objectives: "same batches,
masks, optimiser, FedProx term and clip as vanilla"). With one loop those promises hold by construction, and a
new method writes only what differs, as a hook.

:func:`run_sgd` runs ``epochs`` epochs over ``batches(epoch)``; each batch is moved to the model's device and
takes one :func:`sgd_step`, whose order of operations is fixed (the numbers of every method depend on it)::

    before_step()                                   # FL-GUARD: copy the frozen layers in; APFL: start its clock
    zero_grad() of every optimiser
    loss = objective(model, xb, yb)                 # default: F.cross_entropy(model(xb), yb)
    loss = loss + penalty()                         # FedProx's (mu/2)·‖w − w_start‖² (counted in the loss)
    (loss + extra_loss()).backward()                # LINDT: the local model's CE (not counted in the loss)
    after_backward(xb, yb, objective's loss)        # FL-GUARD / APFL: their model's own step on this batch,
                                                    #   reading w before its step
    with no_grad: grad_transform(objective's loss)  # Ditto: λ(v − a); FL-GUARD: 2λ(v − w), in place
    clip_grad_norm_ of each Optimised with clip > 0, then step() of each, in order
    after_step()                                    # APFL: α's projected step

The hooks are :class:`StepHooks`, all optional. Per-batch extra forward passes run inside the objective (KD
teachers, MOON's previous model, LINDT's dual model) or inside ``after_backward`` (a second trained model).
``Optimised`` pairs a parameter list with its optimiser (:meth:`Optimised.sgd`: SGD with the config's momentum
and weight decay, the only optimiser local training builds) and its gradient-norm clip; LINDT steps two of them
on one backward pass. ``companions`` are other modules trained in the same loop: in training mode, each with
dropout masks from its own seed. The loop returns the mean of the step losses as a :class:`TrainResult` and
never raises on divergence: :func:`raise_if_diverged` (``train_local``, LINDT, KD) or :func:`diverged` (the
personal models, whose divergence discards the round's personal training) decide. :class:`LossMeter` sums
further loss parts on the device; :func:`fill_missing_grads` gives gradient transforms a gradient for every
parameter.

Nothing is drawn from torch's process-global RNG: batches come from a ``torch.Generator`` seeded by the call's
seed (:func:`shuffled_batches`) and dropout masks from another (:func:`fedcore.train.dropout.deterministic_dropout`),
so a training result is a function of (weights, data, config, seeds) only, whatever other threads of the process
do at the same time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from fedcore.seeds import DROPOUT, derive_seed
from fedcore.train.dropout import deterministic_dropout
from fedcore.training_config import TrainingConfig

DIVERGED = "local training diverged (non-finite loss); lower the learning rate"


@dataclass(frozen=True)
class TrainResult:
    loss: float
    num_samples: int
    steps: int


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters (the CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


Batches = Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]]


def shuffled_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> Batches:
    """Epoch e -> the mini-batches of a seeded shuffle of (x, y).

    A last batch of a single sample is folded into the batch before it (which then has ``batch_size + 1``
    samples): a BatchNorm layer cannot train on one sample (PyTorch refuses it), and a shard whose size is 1
    modulo the batch size would otherwise stop every BatchNorm model at the end of its first epoch.
    """
    g = torch.Generator().manual_seed(seed)

    def epoch(_: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(y)
        perm = torch.randperm(n, generator=g)
        starts = list(range(0, n, batch_size))
        if len(starts) > 1 and n - starts[-1] == 1:
            starts.pop()
        for i, start in enumerate(starts):
            stop = starts[i + 1] if i + 1 < len(starts) else n
            idx = perm[start:stop]
            yield x[idx], y[idx]

    return epoch


# A per-batch training loss: objective(model, xb, yb) -> 0-d tensor, on the batch already on the model's device.
Objective = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# after_backward(xb, yb, loss): runs between the backward pass and the clip/step (see the module docstring).
AfterBackward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def cross_entropy(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """The default objective: the mean cross-entropy of ``model(xb)`` against ``yb``."""
    return F.cross_entropy(model(xb), yb)


@dataclass(frozen=True)
class Optimised:
    """A list of parameters, the optimiser that steps them, and the gradient-norm bound they are clipped to before
    each step (0: no clip)."""

    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    clip: float = 0.0

    @classmethod
    def sgd(cls, params: Iterable[torch.Tensor], learning_rate: float, config: TrainingConfig) -> Optimised:
        """SGD over ``params`` with ``learning_rate`` and ``config``'s momentum, weight decay and clip: the optimiser
        of every local training (fresh each round, so momentum never crosses rounds)."""
        ps = list(params)
        opt = torch.optim.SGD(ps, lr=learning_rate, momentum=config.momentum, weight_decay=config.weight_decay)
        return cls(ps, opt, config.grad_clip_norm)


def fedprox_penalty(model: nn.Module, mu: float) -> Callable[[], torch.Tensor]:
    """FedProx's term (mu/2)·‖w − w_start‖² against ``model``'s weights now (copied), as a ``penalty`` hook."""
    anchor = [p.detach().clone() for p in model.parameters()]

    def penalty() -> torch.Tensor:
        prox = cast(torch.Tensor, sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True)))
        return 0.5 * mu * prox

    return penalty


@dataclass(frozen=True)
class StepHooks:
    """What a method changes in :func:`sgd_step`; every hook is optional (none: plain cross-entropy SGD).

    - ``objective(model, xb, yb)``: the per-batch loss (default :func:`cross_entropy`).
    - ``penalty()``: a term added to the objective's loss, counted in the step's loss (FedProx).
    - ``extra_loss()``: a term added only for the backward pass, after the penalty (LINDT's local model).
    - ``before_step()``: first thing of the step, before ``zero_grad``.
    - ``after_backward(xb, yb, loss)``: after the backward pass, before the clip and the step, with the
      objective's loss (without the penalty): another model's step on the same batch.
    - ``grad_transform(loss)``: under ``torch.no_grad()``, after ``after_backward``: changes gradients in place.
    - ``after_step()``: last thing of the step.
    """

    objective: Objective | None = None
    penalty: Callable[[], torch.Tensor] | None = None
    extra_loss: Callable[[], torch.Tensor] | None = None
    before_step: Callable[[], None] | None = None
    after_backward: AfterBackward | None = None
    grad_transform: Callable[[torch.Tensor], None] | None = None
    after_step: Callable[[], None] | None = None


@dataclass(frozen=True)
class Companion:
    """A module trained alongside the loop's model (FL-GUARD's or APFL's adapted model, LINDT's local model): put
    in training mode for the loop, its dropout masks from a generator seeded with ``dropout_seed``."""

    module: nn.Module
    dropout_seed: int


def sgd_step(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, optimised: Sequence[Optimised],
             hooks: StepHooks) -> torch.Tensor:
    """One SGD step of ``model`` on (xb, yb) in the order of the module docstring; returns the step's loss (the
    objective's plus the penalty), detached."""
    if hooks.before_step is not None:
        hooks.before_step()
    for o in optimised:
        o.optimizer.zero_grad(set_to_none=True)
    objective_loss = (hooks.objective or cross_entropy)(model, xb, yb)
    loss = objective_loss if hooks.penalty is None else objective_loss + hooks.penalty()
    (loss if hooks.extra_loss is None else loss + hooks.extra_loss()).backward()  # type: ignore[no-untyped-call]
    if hooks.after_backward is not None:
        hooks.after_backward(xb, yb, objective_loss)
    if hooks.grad_transform is not None:
        with torch.no_grad():
            hooks.grad_transform(objective_loss)
    for o in optimised:
        if o.clip > 0:
            nn.utils.clip_grad_norm_(o.params, o.clip)
    for o in optimised:
        o.optimizer.step()
    if hooks.after_step is not None:
        hooks.after_step()
    return loss.detach()


def run_sgd(model: nn.Module, batches: Batches, epochs: int, optimised: Sequence[Optimised], *, dropout_seed: int,
            hooks: StepHooks | None = None, companions: Sequence[Companion] = ()) -> TrainResult:
    """``epochs`` epochs of :func:`sgd_step` over ``batches(epoch)`` (each batch moved to ``model``'s device),
    ``model`` and the ``companions`` in training mode with their dropout masks from their seeds.

    Returns the mean step loss, the samples seen and the steps; a non-finite mean is returned, not raised
    (:func:`raise_if_diverged`). The losses are summed on the device (no synchronisation per step)."""
    step_hooks = hooks or StepHooks()
    dev = model_device(model)
    model.train()
    for c in companions:
        c.module.train()
    total = torch.zeros((), dtype=torch.float64, device=dev)
    steps, samples = 0, 0
    with ExitStack() as masks:
        masks.enter_context(deterministic_dropout(model, dropout_seed))
        for c in companions:
            masks.enter_context(deterministic_dropout(c.module, c.dropout_seed))
        for e in range(epochs):
            for xb_, yb_ in batches(e):
                xb, yb = xb_.to(dev, non_blocking=True), yb_.to(dev, non_blocking=True)
                total += sgd_step(model, xb, yb, optimised, step_hooks)
                steps += 1
                samples += len(yb)
    return TrainResult(float(total) / max(steps, 1), samples, steps)


def diverged(steps: int, *means: float) -> bool:
    """Whether a run of ``steps`` steps (none: nothing to diverge) ended with a non-finite mean."""
    return steps > 0 and not all(math.isfinite(m) for m in means)


def raise_if_diverged(steps: int, *means: float, message: str = DIVERGED) -> None:
    """:class:`FloatingPointError` with ``message`` when :func:`diverged`."""
    if diverged(steps, *means):
        raise FloatingPointError(message)


def fill_missing_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Give every parameter the loss does not reach a zero gradient (∇ℓ = 0, so a gradient transform can add its
    term to it); returns the gradients in ``params``' order."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


class LossMeter:
    """Sums of named loss parts over a run, in float64 on the device (no synchronisation per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, **parts: torch.Tensor) -> None:
        for k, v in parts.items():
            if k not in self.sums:
                self.sums[k] = torch.zeros((), dtype=torch.float64, device=self.device)
            self.sums[k] += v.detach().double()

    def mean(self, name: str, steps: int) -> float:
        """The sum of ``name`` over ``steps`` steps (0.0 when nothing was added)."""
        total = self.sums.get(name)
        return 0.0 if total is None else float(total) / max(steps, 1)


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                learning_rate: float | None = None, seed: int = 0, epochs: int | None = None,
                batches: Batches | None = None, dropout_seed: int | None = None, *,
                objective: Objective | None = None, after_backward: AfterBackward | None = None,
                companions: Sequence[Companion] = ()) -> TrainResult:
    """``epochs`` (default ``config.local_epochs``) epochs of mini-batch SGD; returns the mean training loss.

    Batches come from ``batches(epoch)`` when given (e.g. an attacker's poisoned stream), else from a shuffle of
    (x, y) seeded with ``seed``. Dropout masks come from a generator seeded with ``dropout_seed`` (default
    ``derive_seed(seed, "dropout")``), never from torch's global RNG (:func:`deterministic_dropout`), so the
    result does not depend on other threads; a model that would draw from the global RNG anyway is refused
    with :class:`NondeterministicModuleError`. With ``config.prox_mu > 0`` adds FedProx's
    (mu/2)·‖w − w_start‖² against the weights the call started from. A non-finite mean loss raises
    :class:`FloatingPointError`.

    ``objective(model, xb, yb)``, when given, is the per-batch loss instead of ``F.cross_entropy(model(xb), yb)``
    (the knowledge-distillation trainers of :mod:`fedcore.train.kd`); the FedProx term is still added to it. The
    returned mean loss is the mean of the objective (plus FedProx term) over the steps. ``after_backward`` and
    ``companions`` train a second model on the same batches without touching this one's trajectory (FL-GUARD's
    adapted model, APFL): see :class:`StepHooks`.
    """
    lr = config.learning_rate if learning_rate is None else learning_rate
    optimised = Optimised.sgd(model.parameters(), lr, config)
    penalty = fedprox_penalty(model, config.prox_mu) if config.prox_mu > 0 else None
    source = batches or shuffled_batches(x, y, config.batch_size, seed)
    n_epochs = config.local_epochs if epochs is None else epochs
    hooks = StepHooks(objective=objective, penalty=penalty, after_backward=after_backward)
    result = run_sgd(model, source, n_epochs, [optimised], hooks=hooks, companions=companions,
                     dropout_seed=derive_seed(seed, DROPOUT) if dropout_seed is None else dropout_seed)
    raise_if_diverged(result.steps, result.loss)
    return result
