"""Local training and evaluation on a client's data (plain SGD, optional FedProx proximal term).

Training draws nothing from torch's process-global RNG: batches come from a ``torch.Generator`` seeded by the
call's seed, and dropout masks from another one (:func:`deterministic_dropout`), so a training result is a
function of (weights, data, config, seeds) only, whatever other threads of the process do at the same time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.dropout import _DropoutNd

from fedcore.config import TrainingConfig
from fedcore.seeds import DROPOUT, derive_seed


@dataclass(frozen=True)
class TrainResult:
    loss: float
    num_samples: int
    steps: int


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    loss: float
    num_samples: int


def resolve_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (the first GPU if torch sees one, else the CPU) as a
    device this process can use; :class:`ValueError` saying why when it cannot."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch build or machine has no usable CUDA GPU "
                             f"(torch {torch.__version__}); use device = 'cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters (the CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> EvalResult:
    """Accuracy and mean cross-entropy of ``model`` on (x, y), in eval mode; restores the mode.

    Batches are moved to the model's device; the data may stay on the CPU."""
    if len(y) == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    was_training = model.training
    model.eval()
    dev = model_device(model)
    correct = torch.zeros((), dtype=torch.long, device=dev)
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb = x[start : start + batch_size].to(dev, non_blocking=True)
            yb = y[start : start + batch_size].to(dev, non_blocking=True)
            logits = model(xb)
            total_loss += F.cross_entropy(logits, yb, reduction="sum")
            correct += (logits.argmax(dim=1) == yb).sum()
    model.train(was_training)
    return EvalResult(int(correct) / len(y), float(total_loss) / len(y), len(y))


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


# ---- dropout from a generator ----

class NondeterministicModuleError(ValueError):
    """The model holds a module that would draw from torch's global RNG while it trains."""


_ALPHA = 1.7580993408473766  # SELU's -scale*alpha, as in ATen's alpha dropout


def generator_dropout(x: torch.Tensor, p: float, generator: torch.Generator, *, feature: bool = False,
                      alpha: bool = False, inplace: bool = False) -> torch.Tensor:
    """Training-mode dropout of ``x`` with its mask drawn from ``generator`` (on ``x``'s device).

    Mirrors ATen's ``_dropout_impl``: a Bernoulli(1-p) mask, elementwise or, with ``feature``, one per
    (sample, channel) (shape [N, C, 1, ...]); kept values are scaled by 1/(1-p), or with ``alpha`` scaled and
    shifted to keep SELU's zero mean and unit variance (alpha dropout). ``p == 1`` gives zeros.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0.0 or x.numel() == 0:
        return x
    if p == 1.0:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return x.mul_(zero) if inplace else x.mul(zero)
    if feature:
        if x.dim() < 2:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        noise = x.new_empty((x.shape[0], x.shape[1], *([1] * (x.dim() - 2))))
    else:
        noise = torch.empty_like(x)
    noise.bernoulli_(1.0 - p, generator=generator)
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))
        b = noise.add(-1.0).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return (x.mul_(noise) if inplace else x.mul(noise)).add_(b)
    noise.div_(1.0 - p)
    return x.mul_(noise) if inplace else x.mul(noise)


class _Generators:
    """One generator per device, each seeded with ``seed`` when first used."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        g = self._by_device.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._by_device[device] = g
        return g


def _dropout_nd(kind: type[nn.Module], x: torch.Tensor, p: float, g: torch.Generator,
                inplace: bool) -> torch.Tensor:
    """What ``kind``'s forward computes in training mode (``F.dropout``, ``F.dropout1d`` ...), with ``g``."""
    if kind is nn.Dropout:
        return generator_dropout(x, p, g, inplace=inplace)
    if kind is nn.AlphaDropout:  # F.alpha_dropout: nn.AlphaDropout ignores inplace
        return generator_dropout(x, p, g, alpha=True)
    if kind is nn.FeatureAlphaDropout:
        return generator_dropout(x, p, g, feature=True, alpha=True)
    if kind is nn.Dropout2d:  # like F.dropout2d, a 3-D input is read as (N, C, L)
        return generator_dropout(x, p, g, feature=True, inplace=inplace)
    if kind is nn.Dropout1d and x.dim() not in (2, 3):
        raise RuntimeError(f"dropout1d: Expected 2D or 3D input, but received a {x.dim()}D input")
    batched = x.dim() == (3 if kind is nn.Dropout1d else 5)
    if batched:
        return generator_dropout(x, p, g, feature=True, inplace=inplace)
    x1 = x.unsqueeze_(0) if inplace else x.unsqueeze(0)
    out = generator_dropout(x1, p, g, feature=True, inplace=inplace)
    return out.squeeze_(0) if inplace else out.squeeze(0)


_DROPOUT_KINDS: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                                               nn.AlphaDropout, nn.FeatureAlphaDropout)


def _dropout_kind(module: nn.Module) -> type[nn.Module] | None:
    for cls in type(module).__mro__:
        if cls in _DROPOUT_KINDS:
            return cls
    return None


def check_deterministic_training(model: nn.Module) -> None:
    """Raise :class:`NondeterministicModuleError` naming the first module that would draw from torch's global RNG
    in training mode and that :func:`deterministic_dropout` cannot redirect to a generator.

    Refused: recurrent layers with inter-layer dropout (``nn.LSTM``/``GRU``/``RNN`` with ``num_layers > 1`` and
    ``dropout > 0``), ``nn.MultiheadAttention`` with ``dropout > 0`` (so also ``nn.Transformer*`` layers with
    dropout), ``nn.RReLU``, ``nn.FractionalMaxPool2d/3d``, and subclasses of the dropout modules that override
    ``forward``. Not detectable: functional calls such as ``F.dropout`` inside a custom ``forward``.
    """
    for name, m in model.named_modules():
        where = f"{name or 'the model'} ({type(m).__name__})"
        kind = _dropout_kind(m)
        if kind is not None and type(m).forward is not kind.forward:
            raise NondeterministicModuleError(
                f"{where}: a {kind.__name__} subclass with its own forward draws its masks from torch's global "
                f"RNG; use {kind.__name__} itself")
        if isinstance(m, nn.RNNBase) and m.num_layers > 1 and m.dropout > 0:
            raise NondeterministicModuleError(
                f"{where}: inter-layer dropout of a multi-layer recurrent module draws from torch's global RNG; "
                f"stack single-layer modules with nn.Dropout between them (as fedcore.models.zoo.LSTMBlock does)")
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            raise NondeterministicModuleError(
                f"{where}: attention dropout draws from torch's global RNG; use dropout=0.0 (and nn.Dropout "
                f"modules outside the attention)")
        if isinstance(m, (nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)):
            raise NondeterministicModuleError(f"{where}: draws from torch's global RNG while training")


@contextmanager
def deterministic_dropout(model: nn.Module, seed: int) -> Iterator[None]:
    """For the duration of the block, every dropout module of ``model`` draws its training-mode masks from a
    ``torch.Generator`` seeded with ``seed`` (one per device), not from torch's global RNG.

    Covers ``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout`` and ``FeatureAlphaDropout`` (and subclasses that
    keep their forward): each instance's ``forward`` is replaced by an equivalent with the same semantics as
    ``F.dropout`` and friends in training mode (eval mode calls the original); the original ``forward`` is put
    back on exit, also on error. Masks depend only on ``seed`` and the order of the forward calls. Raises
    :class:`NondeterministicModuleError` for modules that would still use the global RNG
    (:func:`check_deterministic_training`).
    """
    check_deterministic_training(model)
    gens = _Generators(seed)
    patched: list[tuple[nn.Module, Callable[..., Any] | None]] = []

    def make(m: _DropoutNd, kind: type[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
        original = m.forward

        def forward(input: torch.Tensor) -> torch.Tensor:
            if not m.training:
                out: torch.Tensor = original(input)
                return out
            return _dropout_nd(kind, input, float(m.p), gens.on(input.device), bool(m.inplace))

        return forward

    try:
        for m in model.modules():
            kind = _dropout_kind(m)
            if kind is None or not isinstance(m, _DropoutNd):
                continue
            patched.append((m, m.__dict__.get("forward")))
            m.forward = make(m, kind)
        yield
    finally:
        for m, previous in reversed(patched):
            if previous is None:
                del m.forward
            else:
                m.forward = previous


# A per-batch training loss: objective(model, xb, yb) -> 0-d tensor (see train_local's ``objective``).
Objective = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                learning_rate: float | None = None, seed: int = 0, epochs: int | None = None,
                batches: Batches | None = None, dropout_seed: int | None = None, *,
                objective: Objective | None = None) -> TrainResult:
    """``epochs`` (default ``config.local_epochs``) epochs of mini-batch SGD; returns the mean training loss.

    Batches come from ``batches(epoch)`` when given (e.g. an attacker's poisoned stream), else from a shuffle of
    (x, y) seeded with ``seed``. Dropout masks come from a generator seeded with ``dropout_seed`` (default
    ``derive_seed(seed, "dropout")``), never from torch's global RNG (:func:`deterministic_dropout`), so the
    result does not depend on other threads; a model that would draw from the global RNG anyway is refused
    with :class:`NondeterministicModuleError`. With ``config.prox_mu > 0`` adds FedProx's
    (mu/2)·‖w − w_start‖² against the weights the call started from.

    ``objective(model, xb, yb)``, when given, is the per-batch loss instead of ``F.cross_entropy(model(xb), yb)``
    (the knowledge-distillation trainers of :mod:`fedcore.train.kd`); it is called on the batch already moved to
    the model's device, inside the dropout context, and the FedProx term is still added to it. With ``None`` the
    loop is exactly the plain one (the same operations, so bit-identical results). The returned mean loss is the
    mean of the objective (plus FedProx term) over the steps.
    """
    lr = config.learning_rate if learning_rate is None else learning_rate
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    anchor = [p.detach().clone() for p in model.parameters()] if config.prox_mu > 0 else []
    source = batches or shuffled_batches(x, y, config.batch_size, seed)
    n_epochs = config.local_epochs if epochs is None else epochs
    dev = model_device(model)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=dev)
    steps, samples = 0, 0
    with deterministic_dropout(model, derive_seed(seed, DROPOUT) if dropout_seed is None else dropout_seed):
        for e in range(n_epochs):
            for xb_, yb_ in source(e):
                xb, yb = xb_.to(dev, non_blocking=True), yb_.to(dev, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb), yb) if objective is None else objective(model, xb, yb)
                if anchor:
                    prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
                    loss = loss + 0.5 * config.prox_mu * prox
                loss.backward()  # type: ignore[no-untyped-call]
                if config.grad_clip_norm > 0:
                    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
                opt.step()
                total += loss.detach()  # summed on the device: no synchronisation per step
                steps += 1
                samples += len(yb)
    mean_loss = float(total) / max(steps, 1)
    if steps and not math.isfinite(mean_loss):
        raise FloatingPointError("local training diverged (non-finite loss); lower the learning rate")
    return TrainResult(mean_loss, samples, steps)
