"""The types of the round's pipeline (:mod:`fedserver.pipeline`): a :class:`Stage` with its hooks and its state,
what a model stage sees (:class:`ModelStep`), what a stage factory may use (:class:`ServerParts`), and the registry
of stages by name (:data:`STAGES`, :func:`register_stage`). A leaf of fedserver's stage modules: a stage's own
module imports this one, never :mod:`fedserver.pipeline`, so no import circle forms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedcore.aggregation import AggregationConfig
from fedcore.config import ConfigError, ServerConfig
from fedcore.registry import Registry
from fedcore.report import RoundReport
from fedserver.clusters import ClusterShell
from fedserver.dp_monitor import DpMonitor
from fedserver.global_models import GlobalModels
from fedserver.nfl_monitor import NflMonitor
from fedserver.persistence import Persistence
from fedserver.round_timing import RoundTimer


@dataclass(frozen=True)
class ModelStep:
    """What a model stage sees and returns: the round, the global model's floating-point tensors before the round
    (``previous``, by name, read-only) and the model the round proposes (``proposed``: the aggregate, DP noise
    included, or what an earlier model stage made of it). A stage returns a new :class:`ModelStep` whose
    ``proposed`` it replaced (never changing the tensors it was given), with any ``metrics`` it adds to the round's
    report."""

    round: int
    previous: Mapping[str, torch.Tensor]
    proposed: Mapping[str, torch.Tensor]
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundAggregation:
    """How a round opened now aggregates: the ``[aggregation]`` section it runs (its clip norm S, its rule) and the
    DP noise as a multiplier of the round's sensitivity (``noise_multiplier``; None: ``config.noise_sigma`` as
    configured). Aggregation stages (adaptive clipping) return a changed copy."""

    config: AggregationConfig
    noise_multiplier: float | None = None


AggregationHook = Callable[[RoundAggregation], RoundAggregation]
ModelHook = Callable[[ModelStep], ModelStep]
ReportHook = Callable[[RoundReport], RoundReport]
PublishedHook = Callable[[RoundReport], None]


@dataclass(frozen=True)
class JsonState:
    """A stage's state as a JSON-safe dict, saved with every snapshot and given back on resume."""

    save: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class TensorState:
    """A stage's tensors (name -> tensor; e.g. a server optimizer's moments), saved with every snapshot as one
    verified tensor file and given back on resume (with its :class:`JsonState` loaded first)."""

    save: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class Stage:
    """One server feature in the round's close: any of its hooks (``aggregation`` when a round opens, ``model``,
    ``report`` and ``published`` when it closes), and the state it keeps."""

    name: str
    aggregation: AggregationHook | None = None
    model: ModelHook | None = None
    report: ReportHook | None = None
    published: PublishedHook | None = None
    state: JsonState | None = None
    tensors: TensorState | None = None


@dataclass(frozen=True)
class ServerParts:
    """What a stage factory may use: the configuration and the server's long-lived parts."""

    config: ServerConfig
    models: GlobalModels
    nfl: NflMonitor
    dp: DpMonitor
    clusters: ClusterShell
    history: list[RoundReport]
    persistence: Persistence
    timing: RoundTimer
    run_dir: Path
    log: Any


StageFactory = Callable[[ServerParts, Any], "Stage | None"]
# The server's stages by name ([pipeline] stages, DEFAULT_STAGES); register_stage adds one.
STAGES: Registry[StageFactory] = Registry("server stage", ConfigError)


def register_stage(name: str, factory: StageFactory, *, options: type | None = None, summary: str = "",
                   replace: bool = False) -> None:
    """Make ``factory`` a stage selectable as ``[pipeline] stages = [{name = NAME, options = {...}}]``;
    ``options``: its frozen options dataclass (validated by :meth:`Registry.parse_options`)."""
    STAGES.add(name, factory, options=options, summary=summary, replace=replace)
