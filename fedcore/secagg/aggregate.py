"""Secure aggregation's two ends around :mod:`fedcore.secagg.protocol`: what a device masks, and what the server
makes of the unmasked sum.

- :func:`prepare_input` is the device's half of streaming FedAvg (:class:`fedcore.aggregation.StreamingFedAvg`):
  the same validation (the ``max_update_norm`` ceiling, finite values), the same weight (the sample count, or 1),
  the same clip scale ``min(1, S / ||u||)`` and so the same multiplier, encoded exactly as the server's
  :meth:`FixedPointSum.add` would fold it, followed by the :data:`~fedcore.secagg.config.EXTRAS` scalars.
- :class:`SecureFedAvg` is an :class:`~fedcore.aggregation.Aggregator` that is handed the round's
  :class:`~fedcore.secagg.protocol.SecureSum` instead of updates: its ``finalize`` forms the mean from the same
  fixed-point accumulators and the same weight total, and adds the same noise from the same generator, so the new
  global model is bit-identical to plain streaming FedAvg over the same survivors.

w_div under secure aggregation (LINDT Eq. 5 needs each ``||u_i - g||``, which the server never sees) is the exact
weighted root mean square ``sqrt(Σ w_i ||c_i - g||² / Σ w_i)`` of the clipped updates ``c_i`` around the applied
step ``g``, from the sum of ``w_i ||c_i||²`` (an extra coordinate): ``Σ w ||c||² / Σ w - 2 <ū, g> + ||g||²``. It
is at least the plain server's mean of norms (they agree when the updates are equally far from ``g``); Δ = w_div -
||noise|| as ever.
"""

from __future__ import annotations

import math

import torch

from fedcore.aggregation.base import _weight
from fedcore.aggregation.config import AggregationResult, TooFewUpdatesError
from fedcore.aggregation.steps import Clip, GaussianNoise, Validate
from fedcore.secagg.config import EXTRAS, SecureSettings
from fedcore.secagg.protocol import SecureSum, Words, encode_input

NUM_EXTRAS = len(EXTRAS)


def prepare_input(update: torch.Tensor, num_samples: float, settings: SecureSettings) -> Words:
    """A device's plain input for :func:`fedcore.secagg.protocol.client_mask`: ``update`` (u_i, float32 ``[P]``)
    weighted and clipped as streaming FedAvg would, then the extras. Raises ValueError with the reason the server
    would have refused the update for (it cannot refuse it any more)."""
    u = update.detach().to(device="cpu", dtype=torch.float32).contiguous()
    norm, reason = Validate(int(u.numel()), settings.max_update_norm).check(u)
    if reason is not None:
        raise ValueError(reason)
    w, reason = _weight(num_samples, settings.weighted)
    if reason is not None:
        raise ValueError(reason)
    scale = Clip(settings.clip_norm).scale(norm)
    clipped_norm = scale * norm
    bound = settings.config.norm_bound
    if bound > 0 and not clipped_norm <= bound:  # what is masked (after the clip) must respect the bound
        raise ValueError(f"update L2 norm {clipped_norm:.6g} (after clipping) exceeds the secure-aggregation norm "
                         f"bound {bound:.6g} (secagg.norm_bound)")
    extras = (w, w * clipped_norm * clipped_norm, 1.0 if scale < 1.0 else 0.0, norm)
    return encode_input(u, w * scale, extras)


class SecureFedAvg:
    """Streaming FedAvg's result from a :class:`SecureSum` (module docstring). ``weights``: the survivors' weights
    as the round knows them in the clear (the sample counts each report states; for the noise's sensitivity, the
    largest weight's share), checked against the sum of the weights inside the secure sum."""

    def __init__(self, num_params: int, weighted: bool = True, *, noise_sigma: float = 0.0) -> None:
        self.num_params = num_params
        self._weighted = weighted
        self._noise = GaussianNoise(noise_sigma)
        self._sum: SecureSum | None = None
        self._weights: dict[str, float] = {}

    def check(self, update: torch.Tensor) -> str | None:
        return "secure aggregation takes no individual update"

    def add(self, update: torch.Tensor, weight: float, key: str = "") -> None:
        raise ValueError("secure aggregation takes no individual update: the round's secure sum is set instead")

    @property
    def count(self) -> int:
        return 0 if self._sum is None else len(self._sum.survivors)

    def set_sum(self, result: SecureSum, weights: dict[str, float]) -> None:
        """The round's unmasked sum and its survivors' stated weights (raises ValueError when they disagree)."""
        if result.num_params != self.num_params or result.num_extras != NUM_EXTRAS:
            raise ValueError(f"secure sum of {result.num_params} + {result.num_extras} coordinates, expected "
                             f"{self.num_params} + {NUM_EXTRAS}")
        missing = [c for c in result.survivors if c not in weights]
        if missing:
            raise ValueError(f"no report from survivor {missing[0]!r}")
        self._sum = result
        self._weights = {c: (float(weights[c]) if self._weighted else 1.0) for c in result.survivors}

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        if self._sum is None or not self._sum.survivors:
            raise TooFewUpdatesError("no secure sum to aggregate")
        result = self._sum
        extras = dict(zip(EXTRAS, result.extras(), strict=True))
        total_weight = math.fsum(self._weights[c] for c in sorted(self._weights))
        if float(extras["weight"]) != total_weight:  # what the devices masked is not what they stated
            raise ValueError(f"the weights inside the secure sum total {float(extras['weight']):.17g}, the survivors "
                             f"stated {total_weight:.17g}: a device masked another weight than it reported")
        n = len(result.survivors)
        mean = result.params().value(total_weight)
        share = max(self._weights.values()) / total_weight
        step, noise = self._noise(mean, generator)
        mean64, step64 = mean.to(torch.float64), step.to(torch.float64)
        ms = float(extras["weighted_sq_norm"] / extras["weight"])
        w_div = math.sqrt(max(0.0, ms - 2.0 * float(mean64 @ step64) + float(step64 @ step64)))
        metrics: dict[str, float] = {
            "num_updates": float(n),
            "num_rejected": 0.0,
            "num_clipped": float(extras["clipped"]),
            "num_excluded": 0.0,
            "num_trimmed_per_coord": 0.0,
            "update_norm_mean": float(extras["norm"]) / n,
            "rule_update_norm": float(torch.linalg.vector_norm(mean)),
            "aggregate_update_norm": float(torch.linalg.vector_norm(step)),
            "noise_norm": noise.noise_norm,
            "max_weight_share": share,
            "w_div": w_div,
            "delta": w_div - noise.noise_norm,
            "w_div_exact": 1.0,
        }
        return AggregationResult(global_flat + step.to(global_flat.dtype), metrics, rejected=[])
