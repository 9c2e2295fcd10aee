"""The pipeline's generic steps, each a small frozen dataclass holding its parameters.

Order (SPEC §5, LINDT-TM): :class:`Validate` -> :class:`Clip` -> rule (:mod:`fedcore.aggregation.rules`)
-> :class:`GaussianNoise`. Steps work on a stacked ``[n, P]`` float32 tensor of flattened updates
``u_i = w_i - w^{r-1}`` (or on one ``[P]`` row, which is how the aggregators apply them as updates arrive).
Apart from the explicitly in-place :meth:`Clip.apply_`, they do not modify their inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def row_norms(updates: torch.Tensor) -> torch.Tensor:
    """L2 norm of every row of ``[n, P]`` (float64 ``[n]``; inf/nan for rows with non-finite values)."""
    if updates.dim() != 2:
        raise ValueError(f"expected a stacked [n, P] tensor, got shape {tuple(updates.shape)}")
    norms: torch.Tensor = torch.linalg.vector_norm(updates, dim=1)
    return norms.to(torch.float64)


@dataclass(frozen=True)
class ValidationReport:
    """Per-row outcome of :class:`Validate` on a stacked ``[n, P]`` tensor."""

    norms: torch.Tensor  # float64 [n]; meaningless for rejected rows
    rejected: tuple[tuple[int, str], ...]  # (row, reason) for each refused row, by row

    @property
    def accepted(self) -> list[int]:
        bad = {i for i, _ in self.rejected}
        return [i for i in range(int(self.norms.numel())) if i not in bad]


@dataclass(frozen=True)
class Validate:
    """Refuse an update that is not a float vector of ``num_params`` values, has a non-finite value, or whose
    L2 norm exceeds ``max_norm``. A refused update is reported with its reason, never averaged in."""

    num_params: int
    max_norm: float = math.inf

    def check(self, update: torch.Tensor) -> tuple[float, str | None]:
        """``(norm, None)`` for an acceptable ``[P]`` update, or ``(norm, reason)`` for a refused one."""
        if update.dim() != 1 or update.numel() != self.num_params:
            return math.nan, f"update has shape {tuple(update.shape)}, expected ({self.num_params},)"
        if not update.is_floating_point():
            return math.nan, f"update has dtype {update.dtype}, expected a floating-point dtype"
        # Judge the values that will be aggregated: float32 (a float64 1e39 becomes inf).
        update = update.to(torch.float32)
        norm = float(torch.linalg.vector_norm(update))
        if not math.isfinite(norm):
            # One pass in the common case: only a non-finite norm needs the finer diagnosis.
            finite = torch.isfinite(update)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                return math.nan, f"update has {bad} non-finite value(s)"
            norm = float(torch.linalg.vector_norm(update.to(torch.float64)))
        if norm > self.max_norm:
            return norm, f"update norm {norm:.6g} exceeds the ceiling max_update_norm={self.max_norm:.6g}"
        return norm, None

    def __call__(self, updates: torch.Tensor) -> ValidationReport:
        if updates.dim() != 2 or updates.shape[1] != self.num_params:
            raise ValueError(f"expected a stacked [n, {self.num_params}] tensor, got shape {tuple(updates.shape)}")
        norms = torch.empty(updates.shape[0], dtype=torch.float64)
        rejected: list[tuple[int, str]] = []
        for i in range(updates.shape[0]):
            norm, reason = self.check(updates[i])
            norms[i] = norm
            if reason is not None:
                rejected.append((i, reason))
        return ValidationReport(norms=norms, rejected=tuple(rejected))


@dataclass(frozen=True)
class ClipReport:
    scales: torch.Tensor  # float64 [n]: min(1, S / ||u_i||); 1 where no clipping happened
    num_clipped: int  # rows whose norm exceeded S


@dataclass(frozen=True)
class Clip:
    """``Clip(u, S) = u * min(1, S / ||u||)`` (LINDT Eq. 4); ``max_norm=None`` leaves updates unchanged."""

    max_norm: float | None

    def scale(self, norm: float) -> float:
        """The factor an update of L2 norm ``norm`` is multiplied by."""
        if self.max_norm is None or norm <= self.max_norm:
            return 1.0
        return self.max_norm / norm

    def scales(self, norms: torch.Tensor) -> ClipReport:
        if self.max_norm is None:
            return ClipReport(torch.ones_like(norms, dtype=torch.float64), 0)
        norms64 = norms.to(torch.float64)
        clipped = norms64 > self.max_norm
        scales = torch.where(clipped, self.max_norm / norms64.clamp_min(1e-300), torch.ones_like(norms64))
        return ClipReport(scales, int(clipped.sum()))

    def __call__(self, updates: torch.Tensor, norms: torch.Tensor | None = None) -> tuple[torch.Tensor, ClipReport]:
        """Clipped copy of ``[n, P]`` ``updates`` (rows with norm <= S are copied unchanged)."""
        report = self.scales(row_norms(updates) if norms is None else norms)
        if report.num_clipped == 0:
            return updates.clone(), report
        return updates * report.scales.to(updates.dtype).unsqueeze(1), report

    def apply_(self, row: torch.Tensor, norm: float) -> float:
        """Clip one ``[P]`` row in place; returns the scale applied."""
        s = self.scale(norm)
        if s != 1.0:
            row.mul_(s)
        return s


@dataclass(frozen=True)
class NoiseReport:
    noise_norm: float  # ||N(0, sigma^2 I)|| of the noise actually added (0 when sigma = 0)


@dataclass(frozen=True)
class GaussianNoise:
    """Add ``N(0, sigma^2 I)`` to the aggregate step, drawn from ``generator`` (deterministic given its seed;
    torch's default generator when None). Records the norm of the noise vector for the Delta detector."""

    sigma: float

    def __call__(self, step: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, NoiseReport]:
        if self.sigma == 0.0:
            return step.clone(), NoiseReport(0.0)
        noise = torch.randn(step.shape, generator=generator, dtype=step.dtype, device=step.device)
        noise.mul_(self.sigma)
        noise_norm = float(torch.linalg.vector_norm(noise))
        return noise.add_(step), NoiseReport(noise_norm)


def scaled_noise(multiplier: float, clip_norm: float, max_weight_share: float) -> GaussianNoise:
    """The noise of a Gaussian mechanism with noise multiplier ``multiplier`` on an average of updates clipped to
    ``clip_norm``: ``σ = multiplier · clip_norm · max_weight_share``, the multiplier times the average's L2
    sensitivity (adaptive clipping, :mod:`fedcore.adaptive_clip`: the clip norm, and so σ, changes every round)."""
    return GaussianNoise(multiplier * clip_norm * max_weight_share)


def adaptive_metrics(clip_norm: float, num_updates: int, num_clipped: int, noise_sigma: float) -> dict[str, float]:
    """What a round with a per-round clip norm adds to its metrics: the clip norm used, the count of updates it did
    not clip (``‖u_i‖ ≤ clip_norm``, the count adaptive clipping releases with noise) and the noise std σ added."""
    return {"clip_norm": clip_norm, "num_unclipped": float(num_updates - num_clipped), "noise_sigma": noise_sigma}
