"""Evaluation of a model on a client's data, and the device a name stands for."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedcore.train.loop import model_device


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


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> EvalResult:
    """Accuracy and mean cross-entropy of ``model`` on (x, y), in eval mode; restores the mode (a model of
    mode-free layers, :func:`mode_free`, computes the same in either mode and is not switched).

    Batches are moved to the model's device; the data may stay on the CPU. A test split of at most one batch (a
    device's, every round) is one forward pass with no running sums: the same float32 loss and count, so the same
    result, for about two thirds of the loop's cost on a small model (the client's NFL measurement of each received
    model: ``tools/bench/bench_rounds.py --cpu-breakdown``)."""
    n = len(y)
    if n == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    was_training = model.training
    switch = not mode_free(model)  # else eval mode computes what train mode does: the switch and back are skipped
    if switch:
        model.eval()
    try:
        dev = model_device(model)
        with torch.no_grad():
            if n <= batch_size:
                yb = y.to(dev, non_blocking=True)
                logits = model(x.to(dev, non_blocking=True))
                # float(): the float32 sum widened exactly, as the loop's float64 running sum holds it after one add
                loss = float(F.cross_entropy(logits, yb, reduction="sum"))
                return EvalResult(int((logits.argmax(dim=1) == yb).sum()) / n, loss / n, n)
            correct = torch.zeros((), dtype=torch.long, device=dev)
            total_loss = torch.zeros((), dtype=torch.float64, device=dev)
            for start in range(0, n, batch_size):
                xb = x[start : start + batch_size].to(dev, non_blocking=True)
                yb = y[start : start + batch_size].to(dev, non_blocking=True)
                logits = model(xb)
                total_loss += F.cross_entropy(logits, yb, reduction="sum")
                correct += (logits.argmax(dim=1) == yb).sum()
            return EvalResult(int(correct) / n, float(total_loss) / n, n)
    finally:
        if switch:
            model.train(was_training)


# Layers whose forward computes the same in train and eval mode (exact types: a subclass may read ``training``).
# Not here: dropout, batch and instance norm, RReLU, the recurrent and attention layers (their dropout).
MODE_FREE_LAYERS: frozenset[type[nn.Module]] = frozenset({
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d,
    nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.LayerNorm, nn.GroupNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
})


def mode_free(model: nn.Module) -> bool:
    """Whether ``model`` computes the same in train and eval mode: every module one of :data:`MODE_FREE_LAYERS`
    (exactly that type) with no forward hook that could read its mode."""
    return all(type(m) in MODE_FREE_LAYERS and not (m._forward_hooks or m._forward_pre_hooks)
               for m in model.modules())
