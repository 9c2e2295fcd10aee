"""The aggregator interface the coordinator uses, and its two implementations.

- :class:`StreamingFedAvg`: weighted (or plain) FedAvg as a running sum, memory independent of K, with
  server-side DP (clip each update as it arrives, add noise at the end) and a CountSketch estimate of w_div.
- :class:`BufferedAggregator`: every other rule (and FedAvg with ``exact_metrics``): updates are validated,
  clipped and written as they arrive into ONE preallocated ``[K, P]`` float32 buffer; ``finalize`` runs the
  rule, the noise and the exact metrics over the filled rows.

Both validate each update in :meth:`add` (shape, finite values, norm ceiling, weight) and raise
:class:`ValueError` with the reason for a bad one, which is then counted in ``num_rejected`` and never
averaged in; :meth:`check` is the same validation as a dry run.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from fedcore.aggregation.config import AggregationConfig, AggregationResult, TooFewUpdatesError
from fedcore.aggregation.memory import check_memory, uses_buffer
from fedcore.aggregation.metrics import CountSketch, norm_stats, sketched_weight_divergence
from fedcore.aggregation.pipeline import Pipeline
from fedcore.aggregation.steps import Clip, GaussianNoise, Validate

__all__ = [
    "AggregationConfig",
    "AggregationResult",
    "Aggregator",
    "BufferedAggregator",
    "StreamingFedAvg",
    "TooFewUpdatesError",
    "make_aggregator",
]


class Aggregator(Protocol):
    def check(self, update: torch.Tensor) -> str | None:
        """Why ``update`` would be rejected by :meth:`add`, or None if it is acceptable (nothing is recorded)."""
        ...

    def add(self, update: torch.Tensor, weight: float) -> None:
        """Take one client's flattened update u_i (shape [P]) with its weight n_i.

        Raises :class:`ValueError` with the reason (and counts it as rejected) for a bad update or weight.
        """
        ...

    @property
    def count(self) -> int: ...

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        """New global model w^r (shape [P]) from w^{r-1} and the updates added so far, with the round's metrics.

        Raises :class:`TooFewUpdatesError` (a ValueError) if the rule cannot work with the updates received.
        """
        ...


def _weight(weight: float, weighted: bool) -> tuple[float, str | None]:
    if not weighted:
        return 1.0, None
    w = float(weight)
    if not (math.isfinite(w) and w > 0):
        return w, f"update weight must be a finite number > 0, got {w}"
    return w, None


class StreamingFedAvg:
    """Running (weighted) sum of clipped updates: memory is a few [P] vectors whatever the number of clients.

    ``finalize`` returns ``w^{r-1} + Σ w_i Clip(u_i, S) / Σ w_i + N(0, σ² I)`` (LINDT Eq. 4 when unweighted).
    w_div and delta are *estimates* from a CountSketch of each raw update when ``sketch_dim > 0``
    (``w_div_exact = 0``); with ``sketch_dim = 0`` they are not reported at all.
    """

    def __init__(
        self,
        num_params: int,
        weighted: bool = True,
        *,
        clip_norm: float | None = None,
        noise_sigma: float = 0.0,
        max_update_norm: float = math.inf,
        sketch_dim: int = 0,
        sketch_seed: int = 0,
    ) -> None:
        self._sum = torch.zeros(num_params, dtype=torch.float32)
        self._weight = 0.0
        self._weighted = weighted
        self._validate = Validate(num_params, max_update_norm)
        self._clip = Clip(clip_norm)
        self._noise = GaussianNoise(noise_sigma)
        self._sketch = CountSketch(num_params, sketch_dim, sketch_seed) if sketch_dim > 0 else None
        self._sketches: list[torch.Tensor] = []
        self._norms: list[float] = []
        self._num_clipped = 0
        self._rejected: list[str] = []

    @property
    def count(self) -> int:
        return len(self._norms)

    def check(self, update: torch.Tensor) -> str | None:
        return self._validate.check(update)[1]

    def _reject(self, reason: str) -> None:
        self._rejected.append(reason)
        raise ValueError(reason)

    def add(self, update: torch.Tensor, weight: float) -> None:
        w, reason = _weight(weight, self._weighted)
        if reason is not None:
            self._reject(reason)
        norm, reason = self._validate.check(update)
        if reason is not None:
            self._reject(reason)
        u = update.to(torch.float32)
        scale = self._clip.scale(norm)
        self._sum.add_(u, alpha=w * scale)
        self._weight += w
        self._norms.append(norm)
        self._num_clipped += scale < 1.0
        if self._sketch is not None:
            self._sketches.append(self._sketch(u))

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        if self.count == 0:
            raise TooFewUpdatesError("no updates to aggregate")
        mean = self._sum / self._weight
        step, noise = self._noise(mean, generator)
        metrics: dict[str, float] = {
            "num_updates": float(self.count),
            "num_rejected": float(len(self._rejected)),
            "num_clipped": float(self._num_clipped),
            "num_excluded": 0.0,
            "num_trimmed_per_coord": 0.0,
            **norm_stats(torch.tensor(self._norms, dtype=torch.float64)),
            "rule_update_norm": float(torch.linalg.vector_norm(mean)),
            "aggregate_update_norm": float(torch.linalg.vector_norm(step)),
            "noise_norm": noise.noise_norm,
        }
        if self._sketch is not None:
            w_div = sketched_weight_divergence(torch.stack(self._sketches), self._sketch(step))
            metrics.update({"w_div": w_div, "delta": w_div - noise.noise_norm, "w_div_exact": 0.0})
        return AggregationResult(global_flat + step.to(global_flat.dtype), metrics, rejected=list(self._rejected))


class BufferedAggregator:
    """Any rule over ONE preallocated ``[K, P]`` float32 buffer that updates are validated, clipped and
    written into as they arrive (no stacking copy); exact metrics. At most ``k`` updates can be added."""

    def __init__(self, config: AggregationConfig, num_params: int, k: int) -> None:
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        self._config = config
        self._k = k
        self._pipeline = Pipeline.from_config(config, num_params)
        # torch.empty does not touch the pages: the process's memory grows as rows are written.
        self._buffer = torch.empty(k, num_params, dtype=torch.float32)
        self._weights = torch.zeros(k, dtype=torch.float64)
        self._norms = torch.zeros(k, dtype=torch.float64)
        self._scales = torch.ones(k, dtype=torch.float64)
        self._count = 0
        self._rejected: list[str] = []

    @property
    def count(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return self._k

    @property
    def rows(self) -> torch.Tensor:
        """A view of the ``[count, P]`` filled rows of the buffer (the clipped updates); do not modify it."""
        return self._buffer[: self._count]

    def check(self, update: torch.Tensor) -> str | None:
        return self._pipeline.validate.check(update)[1]

    def _reject(self, reason: str) -> None:
        self._rejected.append(reason)
        raise ValueError(reason)

    def add(self, update: torch.Tensor, weight: float) -> None:
        if self._count >= self._k:
            raise ValueError(f"the aggregator already holds its K={self._k} updates")
        w, reason = _weight(weight, self._config.weighted)
        if reason is not None:
            self._reject(reason)
        norm, reason = self._pipeline.validate.check(update)
        if reason is not None:
            self._reject(reason)
        i = self._count
        row = self._buffer[i]
        row.copy_(update)
        self._scales[i] = self._pipeline.clip.apply_(row, norm)
        self._norms[i] = norm
        self._weights[i] = w
        self._count += 1

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        n = self._count
        result, _ = self._pipeline.finish(
            self._buffer[:n], self._weights[:n], self._norms[:n], self._scales[:n], global_flat, generator,
            num_rejected=len(self._rejected), k=self._k,
        )
        result.rejected = list(self._rejected)
        return result


def make_aggregator(config: AggregationConfig, num_params: int, k: int) -> Aggregator:
    """The aggregator for ``config`` for rounds of up to ``k`` updates of ``num_params`` float32 values.

    Validates ``config`` against ``k`` and, when ``config.memory_budget_bytes > 0``, checks the memory
    arithmetic against it (:func:`fedcore.aggregation.memory.check_memory`). FedAvg without
    ``exact_metrics`` streams; every other configuration uses a ``[k, num_params]`` buffer.
    """
    config.validate(k)
    if config.memory_budget_bytes > 0:
        check_memory(config, k, num_params, config.memory_budget_bytes)
    if not uses_buffer(config):
        return StreamingFedAvg(
            num_params,
            weighted=config.weighted,
            clip_norm=config.clip_norm,
            noise_sigma=config.noise_sigma,
            max_update_norm=config.max_update_norm,
            sketch_dim=config.sketch_dim,
            sketch_seed=config.sketch_seed,
        )
    return BufferedAggregator(config, num_params, k)
