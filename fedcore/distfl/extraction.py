"""DistFL distribution extraction (§4.2): synthetic inputs whose BatchNorm statistics match the model's.

Given the pre-aggregated model M_target (§4.2.1 Eq. 3, computed by the shell), :func:`synthesize` draws z
inputs X̂ ~ N(0, 1) of the model's input shape and minimises with Adam, over every BatchNorm layer i (Eq. 4):

    L(X̂) = Σ_i ‖μ_i,S(X̂) − running_mean_i,S‖₂ + ‖σ²_i,S(X̂) − running_var_i,S‖₂

where μ_i, σ²_i are the batch mean and biased variance of the layer's *input* over every dimension but the
channel dimension (captured with forward pre-hooks, the model in eval mode, so the BN layers normalise with their
running statistics and do not update them), and S is the top-E% channels of the layer by |γ| (the BN scaling
factor, "importance-based target selection", §4.2.2). The norms are plain (not squared) L2 norms, as in Eq. 4
and the reference code.

Unlike the public reference code, which copies the captured statistics through numpy and so builds a loss with
no path to the inputs (its optimiser never moves them), the loss here is computed in torch from the hooked
tensors, so its gradient reaches X̂ (SPEC §8). Other differences from the reference, all deliberate: channels
are ranked by |γ| (the reference keeps γ >= the layer's median γ, signed); the loss is not scaled (its
``bn_reg_scale`` 0.1 changes nothing for Adam but the epsilon); no cross-entropy or total-variation term (the
reference computes them and then overwrites its loss with the scaled BN term, and Eq. 4 has none); the final
inputs are returned (the reference's ``best_inputs`` aliases the live tensor, so it returns the final ones too).

Every random draw (the initial noise, the jitter shifts) comes from the ``generator`` passed in; nothing here
reads torch's global RNG or a clock, so the result is a function of (model, shape, config, generator seed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedcore.distfl.config import DistflConfig

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def bn_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers (1d/2d/3d) that keep running statistics, in ``modules()`` order.

    A layer built with ``track_running_stats=False`` has no running_mean / running_var, so there is nothing to
    match and it is left out.
    """
    return [m for m in model.modules()
            if isinstance(m, _BN_TYPES) and m.running_mean is not None and m.running_var is not None]


def check_has_batchnorm(model: nn.Module, model_name: str) -> None:
    """Raise :class:`ValueError` when ``model`` has no BatchNorm layer with running statistics.

    DistFL (§3.2.1, §4.2) reads the clients' data distribution from the BN layers' running_mean /
    running_variance: those statistics *are* the distribution it extracts, so a model without them cannot be
    clustered (the paper's §6: "check if the BN layer has been used in the model").
    """
    if not bn_layers(model):
        raise ValueError(
            f"model {model_name!r} has no BatchNorm layer with running statistics; DistFL extracts the clients' "
            "data distribution from the BatchNorm running_mean/running_var (DistFL §4.2), so it needs a model "
            "with BatchNorm (e.g. mnist_cnn_bn, har_cnn, vgg11_bn, resnet18_cifar, mlp_bn)")


def select_channels(bn: nn.modules.batchnorm._BatchNorm, top_fraction: float) -> torch.Tensor:
    """The indices (ascending, int64) of the ceil(top_fraction · C) channels of ``bn`` with the largest |γ|.

    §4.2.2: "we pick out E% channels with the larger factor value in each layer", the factor being the BN
    scaling factor γ, taken by magnitude. At least one channel is kept; ties go to the lower channel index. A
    layer without γ (``affine=False``) gives every channel the same importance, so all of them are kept.
    """
    c = int(bn.num_features)
    if bn.weight is None:
        return torch.arange(c, dtype=torch.long)
    k = min(c, max(1, math.ceil(top_fraction * c - 1e-9)))
    order = torch.argsort(-bn.weight.detach().abs().cpu(), stable=True)
    return torch.sort(order[:k]).values


def _channel_stats(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance over every dimension but 1 (the channel) of ``x[:, idx]``, differentiably."""
    xs = x.index_select(1, idx.to(x.device))
    flat = xs.transpose(0, 1).reshape(xs.shape[1], -1)
    return flat.mean(dim=1), flat.var(dim=1, correction=0)


class _Capture:
    """Forward pre-hooks on BN layers that keep each layer's latest input (with its autograd graph)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(i)) for i, m in enumerate(layers)]

    def _hook(self, i: int) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            self.inputs[i] = args[0]
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _bn_loss(layers: Sequence[nn.modules.batchnorm._BatchNorm], channels: Sequence[torch.Tensor],
             captured: dict[int, torch.Tensor]) -> torch.Tensor:
    """Eq. 4 for the inputs captured by one forward pass."""
    total: torch.Tensor | None = None
    for i, bn in enumerate(layers):
        if i not in captured:  # a BN layer the forward pass did not reach contributes nothing
            continue
        x = captured[i]
        idx = channels[i]
        mean, var = _channel_stats(x, idx)
        assert bn.running_mean is not None and bn.running_var is not None
        rm = bn.running_mean.detach().index_select(0, idx.to(x.device)).to(mean.dtype)
        rv = bn.running_var.detach().index_select(0, idx.to(x.device)).to(var.dtype)
        term = torch.linalg.vector_norm(mean - rm) + torch.linalg.vector_norm(var - rv)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("DistFL: the forward pass reached no BatchNorm layer")
    return total


def _model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            return t.device, t.dtype
    return torch.device("cpu"), torch.float32


@dataclass(frozen=True)
class Extraction:
    """The result of :func:`synthesize`.

    ``inputs``: the z synthetic inputs, ``[z, *input_shape]``, detached. ``losses``: the Eq. 4 loss at every
    Adam step, measured on that step's (jittered) inputs before the update (``steps`` values). ``final_loss``:
    Eq. 4 on the returned, un-jittered inputs.
    """

    inputs: torch.Tensor
    losses: list[float]
    final_loss: float


def _check_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"DistFL: input_shape must be a non-empty tuple of positive sizes, got {tuple(input_shape)}")
    return shape


def _jitter_dims(ndim: int) -> tuple[int, ...]:
    """The batch tensor's dims to roll: the last two of an image ``[z, C, H, W]`` (or any >= 2 spatial dims),
    the last of a 1-D signal ``[z, C, L]``, none of a flat input ``[z, F]``."""
    spatial = ndim - 2
    if spatial >= 2:
        return (ndim - 2, ndim - 1)
    if spatial == 1:
        return (ndim - 1,)
    return ()


def bn_statistics_loss(model: nn.Module, inputs: torch.Tensor, top_fraction: float) -> float:
    """Eq. 4 of ``inputs`` for ``model`` (eval mode, no gradient): how well they match its BN statistics."""
    layers = bn_layers(model)
    channels = [select_channels(bn, top_fraction) for bn in layers]
    capture = _Capture(layers)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(inputs)
            return float(_bn_loss(layers, channels, capture.inputs))
    finally:
        capture.close()
        model.train(was_training)


def synthesize(model: nn.Module, input_shape: Sequence[int], cfg: DistflConfig,
               generator: torch.Generator) -> Extraction:
    """Extract ``cfg.z`` synthetic inputs from ``model`` (§4.2, Eq. 4) and report the loss trajectory.

    The inputs start as N(0, 1) noise drawn from ``generator`` (on the generator's device, then moved to the
    model's) and are the only thing optimised (``torch.optim.Adam``, ``cfg.lr``, ``cfg.steps`` steps). At each
    step, when ``cfg.jitter > 0`` and the input has spatial dims, the batch is rolled by shifts drawn uniformly
    from [-jitter, jitter] with ``generator`` (one shift per rolled dim, shared by the batch, as in the
    reference code). The model is put in eval mode (BN uses, and does not update, its running statistics); its
    parameters are never stepped, their ``requires_grad`` flags are switched off for the run (no parameter
    gradients are computed or accumulated) and restored after it, as is its train/eval mode.

    Raises :class:`ValueError` when the model has no BatchNorm layer with running statistics.
    """
    check_has_batchnorm(model, type(model).__name__)
    shape = _check_shape(input_shape)
    layers = bn_layers(model)
    channels = [select_channels(bn, cfg.top_fraction) for bn in layers]
    device, dtype = _model_device_dtype(model)
    noise = torch.randn((cfg.z, *shape), generator=generator, device=generator.device, dtype=torch.float32)
    x = noise.to(device=device, dtype=dtype).requires_grad_(True)
    dims = _jitter_dims(x.dim()) if cfg.jitter > 0 else ()

    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    was_training = model.training
    capture = _Capture(layers)
    losses: list[float] = []
    try:
        for p in params:
            p.requires_grad_(False)
        model.eval()
        opt = torch.optim.Adam([x], lr=cfg.lr)
        for _ in range(cfg.steps):
            xin = x
            if dims:
                shifts = torch.randint(-cfg.jitter, cfg.jitter + 1, (len(dims),), generator=generator,
                                       device=generator.device)
                xin = torch.roll(x, shifts=tuple(int(s) for s in shifts.tolist()), dims=dims)
            opt.zero_grad(set_to_none=True)
            capture.inputs.clear()
            model(xin)
            loss = _bn_loss(layers, channels, capture.inputs)
            losses.append(float(loss.detach()))
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        capture.inputs.clear()
        with torch.no_grad():
            model(x)
            final = float(_bn_loss(layers, channels, capture.inputs))
    finally:
        capture.close()
        for p, f in zip(params, flags, strict=True):
            p.requires_grad_(f)
        model.train(was_training)
    return Extraction(inputs=x.detach(), losses=losses, final_loss=final)


def extract_inputs(model: nn.Module, input_shape: Sequence[int], cfg: DistflConfig,
                   generator: torch.Generator) -> torch.Tensor:
    """The synthetic inputs ``[cfg.z, *input_shape]`` of :func:`synthesize` (K_target of §4.2)."""
    return synthesize(model, input_shape, cfg, generator).inputs
