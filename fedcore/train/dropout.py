"""Dropout masks from a ``torch.Generator`` instead of torch's process-global RNG (:func:`deterministic_dropout`).

Local training draws nothing from the global RNG, so a training result is a function of (weights, data, config,
seeds) only, whatever other threads of the process do at the same time: the training loop
(:mod:`fedcore.train.loop`) runs every model it trains inside :func:`deterministic_dropout`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd


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

