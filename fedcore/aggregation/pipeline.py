"""The aggregation pipeline validate -> clip -> rule -> noise, composed from the steps and a rule.

:class:`Pipeline` composes the steps; :func:`aggregate` runs it as one pure function over a stacked
``[K, P]`` tensor. The aggregators in :mod:`fedcore.aggregation.base` run the same steps incrementally
(validate and clip as each update arrives, rule and noise at the end of the round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedcore.aggregation.config import AggregationConfig, AggregationResult, TooFewUpdatesError
from fedcore.aggregation.metrics import norm_stats, weight_divergence
from fedcore.aggregation.rules import Rule, build_rule
from fedcore.aggregation.steps import Clip, GaussianNoise, Validate, adaptive_metrics, scaled_noise


@dataclass(frozen=True)
class Pipeline:
    validate: Validate
    clip: Clip
    rule: Rule
    noise: GaussianNoise
    # Adaptive clipping (fedcore.adaptive_clip): the noise std is this multiplier times the round's sensitivity
    # (clip norm times the largest weight share), instead of ``noise``'s fixed sigma; None: ``noise`` as configured.
    noise_multiplier: float | None = None

    @classmethod
    def from_config(cls, config: AggregationConfig, num_params: int,
                    noise_multiplier: float | None = None) -> Pipeline:
        return cls(
            validate=Validate(num_params, config.max_update_norm),
            clip=Clip(config.clip_norm),
            rule=build_rule(config),
            noise=GaussianNoise(config.noise_sigma),
            noise_multiplier=noise_multiplier,
        )

    def check_count(self, n: int, k: int | None = None) -> None:
        """Raise :class:`TooFewUpdatesError` if the rule cannot aggregate ``n`` updates."""
        if n == 0:
            raise TooFewUpdatesError("no updates to aggregate")
        try:
            self.rule.check(n)
        except ValueError as e:
            of_k = f" of K={k}" if k is not None else ""
            raise TooFewUpdatesError(f"{e} (the round closed with {n}{of_k} updates)") from None

    def finish(
        self,
        clipped: torch.Tensor,
        weights: torch.Tensor,
        raw_norms: torch.Tensor,
        scales: torch.Tensor,
        global_flat: torch.Tensor,
        generator: torch.Generator | None,
        *,
        num_rejected: int = 0,
        k: int | None = None,
    ) -> tuple[AggregationResult, torch.Tensor]:
        """Rule, noise and metrics over already validated and clipped rows ``[n, P]``.

        ``raw_norms`` are the norms before clipping and ``scales`` the clip factors (row i is
        ``scales[i] * u_i``). Returns the result and the final step g (``new_global - global_flat``).
        """
        n = int(clipped.shape[0])
        self.check_count(n, k)
        out = self.rule(clipped, weights)
        # The largest weight share w_i / Σ w (1/n for the plain mean): the DP accountant's sensitivity factor.
        share = float(weights.max() / weights.sum())
        noise_step = self.noise
        if self.noise_multiplier is not None:
            assert self.clip.max_norm is not None, "a noise multiplier needs a clip norm"
            noise_step = scaled_noise(self.noise_multiplier, self.clip.max_norm, share)
        step, noise = noise_step(out.step, generator)
        new_global = global_flat + step.to(global_flat.dtype)
        w_div = weight_divergence(clipped, scales, step)
        num_clipped = int((scales < 1.0).sum())
        metrics: dict[str, float] = {
            "num_updates": float(n),
            "num_rejected": float(num_rejected),
            "num_clipped": float(num_clipped),
            "num_excluded": float(out.num_excluded),
            "num_trimmed_per_coord": float(out.num_trimmed_per_coord),
            **norm_stats(raw_norms),
            "rule_update_norm": float(torch.linalg.vector_norm(out.step)),
            "aggregate_update_norm": float(torch.linalg.vector_norm(step)),
            "noise_norm": noise.noise_norm,
            "w_div": w_div,
            "delta": w_div - noise.noise_norm,
            "w_div_exact": 1.0,
            "max_weight_share": share,
        }
        if self.noise_multiplier is not None and self.clip.max_norm is not None:
            metrics.update(adaptive_metrics(self.clip.max_norm, n, num_clipped, noise_step.sigma))
        return AggregationResult(new_global, metrics, selected=out.selected), step

    def __call__(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor | Sequence[float],
        global_flat: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> AggregationResult:
        """Validate, clip, aggregate and add noise over stacked ``[K, P]`` updates (inputs are not modified)."""
        w = torch.as_tensor(weights, dtype=torch.float64)
        if w.shape != (updates.shape[0],):
            raise ValueError(f"expected {updates.shape[0]} weights, got shape {tuple(w.shape)}")
        report = self.validate(updates)
        reasons = [f"update {i}: {r}" for i, r in report.rejected]
        bad_weight = [i for i in report.accepted if not (bool(torch.isfinite(w[i])) and float(w[i]) > 0)]
        reasons += [f"update {i}: weight must be a finite number > 0, got {float(w[i])}" for i in bad_weight]
        keep = [i for i in report.accepted if i not in set(bad_weight)]
        idx = torch.tensor(keep, dtype=torch.long)
        rows = updates.index_select(0, idx).to(torch.float32)  # a private copy: clipped in place below
        norms = report.norms[idx]
        clip_report = self.clip.scales(norms)
        if clip_report.num_clipped:
            rows.mul_(clip_report.scales.to(torch.float32).unsqueeze(1))
        result, _ = self.finish(rows, w[idx], norms, clip_report.scales, global_flat, generator,
                                num_rejected=len(reasons))
        result.rejected = reasons
        if result.selected is not None:
            result.selected = tuple(keep[j] for j in result.selected)
        return result


def aggregate(
    config: AggregationConfig,
    updates: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    global_flat: torch.Tensor,
    generator: torch.Generator | None = None,
    noise_multiplier: float | None = None,
) -> AggregationResult:
    """One round of the pipeline over stacked ``[K, P]`` updates, as a pure function.

    Weights are the sample counts n_i (used when ``config.weighted``, otherwise replaced by ones). Rejected
    rows are listed in ``result.rejected`` as ``"update i: reason"``; ``result.selected`` refers to rows of
    ``updates``. Always computes exact metrics. ``noise_multiplier``: as :func:`~fedcore.aggregation.make_aggregator`'s.
    """
    pipeline = Pipeline.from_config(config, int(updates.shape[1]), noise_multiplier)
    w = torch.as_tensor(weights, dtype=torch.float64)
    if not config.weighted:
        w = torch.ones_like(w)
    return pipeline(updates, w, global_flat, generator)
