"""Local training and evaluation on a client's data (plain SGD, optional FedProx proximal term)."""

from __future__ import annotations

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


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> EvalResult:
    """Accuracy and mean cross-entropy of ``model`` on (x, y), in eval mode; restores the mode."""
    if len(y) == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    was_training = model.training
    model.eval()
    correct = 0
    total_loss = 0.0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            logits = model(xb)
            total_loss += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return EvalResult(correct / len(y), total_loss / len(y), len(y))


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
    model.train()
    total, steps, samples = 0.0, 0, 0
    for e in range(n_epochs):
        for xb, yb in source(e):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            if anchor:
                prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
                loss = loss + 0.5 * config.prox_mu * prox
            loss.backward()  # type: ignore[no-untyped-call]
            if config.grad_clip_norm > 0:
                nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
            opt.step()
            total += float(loss.detach())
            steps += 1
            samples += len(yb)
    if steps and not torch.isfinite(torch.tensor(total)):
        raise FloatingPointError("local training diverged (non-finite loss); lower the learning rate")
    return TrainResult(total / max(steps, 1), samples, steps)
