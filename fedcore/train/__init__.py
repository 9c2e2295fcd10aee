"""Local training and evaluation on a client's data (plain SGD, optional FedProx proximal term)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedcore.config import TrainingConfig


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
    """Epoch e -> the mini-batches of a seeded shuffle of (x, y)."""
    g = torch.Generator().manual_seed(seed)

    def epoch(_: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        perm = torch.randperm(len(y), generator=g)
        for start in range(0, len(y), batch_size):
            idx = perm[start : start + batch_size]
            yield x[idx], y[idx]

    return epoch


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                learning_rate: float | None = None, seed: int = 0, epochs: int | None = None,
                batches: Batches | None = None) -> TrainResult:
    """``epochs`` (default ``config.local_epochs``) epochs of mini-batch SGD; returns the mean training loss.

    Batches come from ``batches(epoch)`` when given (e.g. an attacker's poisoned stream), else from a seeded
    shuffle of (x, y). With ``config.prox_mu > 0`` adds FedProx's (mu/2)·‖w − w_start‖² against the weights
    the call started from.
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
    for e in range(n_epochs):
        for xb_, yb_ in source(e):
            xb, yb = xb_.to(dev, non_blocking=True), yb_.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
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
