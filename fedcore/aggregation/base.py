"""The aggregator interface the coordinator uses, and weighted FedAvg as a streaming accumulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class AggregationConfig:
    rule: str = "fedavg"
    # FedAvg: weight each update by its sample count (FL-GUARD) or take the plain mean (LINDT).
    weighted: bool = True


@dataclass
class AggregationResult:
    new_global: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class Aggregator(Protocol):
    def add(self, update: torch.Tensor, weight: float) -> None:
        """Take one client's flattened float32 update u_i (shape [P]) with its weight n_i."""
        ...

    @property
    def count(self) -> int: ...

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        """New global model w^r (shape [P]) from w^{r-1} and the updates added so far."""
        ...


class StreamingFedAvg:
    """Running weighted sum of updates: memory is one [P] vector whatever the number of clients."""

    def __init__(self, num_params: int, weighted: bool = True) -> None:
        self._sum = torch.zeros(num_params, dtype=torch.float32)
        self._weight = 0.0
        self._count = 0
        self._weighted = weighted

    @property
    def count(self) -> int:
        return self._count

    def add(self, update: torch.Tensor, weight: float) -> None:
        if update.shape != self._sum.shape:
            raise ValueError(f"update has shape {tuple(update.shape)}, expected {tuple(self._sum.shape)}")
        w = float(weight) if self._weighted else 1.0
        if w <= 0:
            raise ValueError(f"update weight must be positive, got {w}")
        self._sum.add_(update.to(self._sum.dtype), alpha=w)
        self._weight += w
        self._count += 1

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        if self._count == 0:
            raise ValueError("no updates to aggregate")
        step = (self._sum / self._weight).to(global_flat.dtype)
        return AggregationResult(global_flat + step, {"aggregate_update_norm": float(step.norm())})


def make_aggregator(config: AggregationConfig, num_params: int, k: int) -> Aggregator:
    if config.rule == "fedavg":
        return StreamingFedAvg(num_params, weighted=config.weighted)
    raise ValueError(f"unknown aggregation rule {config.rule!r}")
