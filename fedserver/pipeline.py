"""The round's close as one composed pipeline of registered stages: the one place to add a server algorithm.

A round closes in this order (:class:`fedserver.round_close.RoundCloser` drives it; the stages decide what it does):

0. **aggregation stages**, when a round opens -- each may change how the round aggregates (:class:`RoundAggregation`:
   the clip norm and the DP noise; adaptive clipping, :mod:`fedserver.adaptive_clip`);
1. **intake** -- the round's accepted updates, folded as they arrived (:mod:`fedserver.intake`);
2. **aggregate** -- the configured rule with server-side DP's clip and noise (:mod:`fedcore.aggregation`; DistFL's
   per-cluster aggregation, the simulation-only adversary harness before it);
3. **model stages** -- each :class:`ModelStep` hook, in pipeline order, may replace the model the round proposes
   before it is applied (a server optimizer: :mod:`fedcore.server_opt`);
4. the model is applied and the central evaluation runs; the round's one typed :class:`~fedcore.report.RoundReport`
   is built (:mod:`fedserver.finalize`);
5. **report stages** -- ``RoundReport -> RoundReport`` hooks complete it, in pipeline order (DistFL's cluster sizes,
   the NFL monitor, the DP accountant), before the snapshot, so each stage's state is saved with the round that
   moved it;
6. **persist** -- one snapshot: the round machine, the models, the history and every stage's state;
7. **published** -- ``RoundReport -> None`` hooks read the persisted report (the history, the ``round.completed``
   line, the ``rounds.jsonl`` writer; an embedding app's callback after them).

A stage is a :class:`Stage`: a name, any of the three hooks, and the state it keeps across rounds (JSON, tensors or
both), which :func:`compose` registers with the snapshot under the stage's name. Stages are registered by name in
:data:`STAGES` with a factory ``(ServerParts, options) -> Stage | None`` (None: not active in this configuration)
and a frozen options dataclass. :data:`DEFAULT_STAGES` is the built-in order; ``[pipeline] stages`` appends more,
each by registered name or by import path (``"mypkg.stages:make_stage"``, a factory as above); docs/extending.md,
"Add a server algorithm".
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from fedcore.aggregation import AggregationConfig
from fedcore.config import ConfigError
from fedcore.report import RoundReport
from fedserver.adaptive_clip import adaptive_clip_stage
from fedserver.clusters import SLOT as DISTFL_SLOT
from fedserver.dp_monitor import SLOT as DP_SLOT
from fedserver.global_models import GlobalModels
from fedserver.nfl_monitor import SLOT as NFL_SLOT
from fedserver.persistence import write_round
from fedserver.round_log import RoundCompletedLine
from fedserver.server_optimizer import server_optimizer_stage
from fedserver.stage import (
    STAGES,
    JsonState,
    ModelStep,
    PublishedHook,
    RoundAggregation,
    ServerParts,
    Stage,
    StageFactory,
    register_stage,
)

__all__ = ["DEFAULT_STAGES", "STAGES", "ModelStep", "Pipeline", "ServerParts", "Stage", "compose", "register_stage"]


class Pipeline:
    """The composed stages: their hooks in pipeline order (:func:`compose` makes one)."""

    def __init__(self, stages: list[Stage], models: GlobalModels) -> None:
        self.stages = tuple(stages)
        self.models = models
        self._aggregation_hooks = [s.aggregation for s in stages if s.aggregation is not None]
        self._model_hooks = [s.model for s in stages if s.model is not None]
        self._report_hooks = [s.report for s in stages if s.report is not None]
        self._published: list[PublishedHook] = [s.published for s in stages if s.published is not None]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def round_aggregation(self, config: AggregationConfig) -> RoundAggregation:
        """Step 0, when a round opens: how it aggregates -- ``config`` (the server's effective ``[aggregation]``)
        through every aggregation hook, in order (adaptive clipping sets the round's clip norm and noise)."""
        setup = RoundAggregation(config)
        for hook in self._aggregation_hooks:
            setup = hook(setup)
        return setup

    @property
    def shapes_model(self) -> bool:
        """Whether any stage replaces the aggregated model (when none does the close skips step 3 entirely)."""
        return bool(self._model_hooks)

    def shape_model(self, round_: int, proposed_flat: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Step 3: the model stages over the round's proposed ``[P]`` float32 vector (views by name, no copy), and
        the metrics they add; the returned vector is what the round applies."""
        step = ModelStep(round_, self.models.unflatten(self.models.flat()), self.models.unflatten(proposed_flat))
        metrics: dict[str, float] = {}
        for hook in self._model_hooks:
            step = hook(step)
            metrics.update(step.metrics)
        return self.models.flatten(step.proposed), metrics

    def complete(self, report: RoundReport) -> RoundReport:
        """Step 5: every report stage, in order."""
        for hook in self._report_hooks:
            report = hook(report)
        return report

    def publish(self, report: RoundReport) -> None:
        """Step 7: every published hook, in order (an app's subscriber added with :meth:`subscribe` last)."""
        for hook in self._published:
            hook(report)

    def subscribe(self, fn: PublishedHook) -> None:
        self._published.append(fn)


# The built-in stages, in this order, before those [pipeline] stages adds.
DEFAULT_STAGES = ("server_optimizer", "adaptive_clip", "distfl", "nfl", "dp", "history", "round_line", "rounds_file")


def stage_factory(name: str, where: str = "pipeline.stages") -> tuple[StageFactory, str | None]:
    """A stage's factory and the name it is registered under: a registered name, or an import path
    ``"module:attribute"`` (importing the module may register the factory with its options; None when it did
    not). :class:`ConfigError` naming ``where`` for a name that is neither."""
    if name in STAGES:
        return STAGES.get(name), name
    module, sep, attribute = name.partition(":")
    if not sep or not module or not attribute:
        raise ConfigError(where, f"unknown server stage {name!r}; known: {', '.join(STAGES.names())}, or an "
                                 "import path 'module:factory'")
    try:
        factory = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ConfigError(where, f"cannot import the stage factory {name!r}: {e}") from None
    if not callable(factory):
        raise ConfigError(where, f"{name!r} is not a stage factory (not callable)")
    registered = [n for n in STAGES.names() if STAGES.get(n) is factory]
    return factory, registered[0] if registered else None


def compose(parts: ServerParts) -> Pipeline:
    """The round's stages in one place: :data:`DEFAULT_STAGES`, then ``[pipeline] stages``; each active stage's
    state registered with the snapshot under its name. Raises :class:`ConfigError` naming the field."""
    wanted: list[tuple[str, Any, str]] = [(name, None, f"pipeline.default.{name}") for name in DEFAULT_STAGES]
    for i, entry in enumerate(parts.config.pipeline.stages):
        wanted.append((entry.name, entry.options, f"pipeline.stages[{i}]"))
    stages: list[Stage] = []
    for name, options, where in wanted:
        factory, registered = stage_factory(name, f"{where}.name")
        if registered is not None:
            parsed = STAGES.parse_options(registered, options, f"{where}.options")
        elif options:
            raise ConfigError(f"{where}.options", f"{name!r} declares no options (register it with "
                                                  "fedserver.stage.register_stage(..., options=...))")
        else:
            parsed = None
        stage = factory(parts, parsed)
        if stage is None:
            continue
        if any(s.name == stage.name for s in stages):
            raise ConfigError(f"{where}.name", f"a stage named {stage.name!r} is already in the pipeline")
        if stage.state is not None:
            parts.persistence.register_slot(stage.name, stage.state.save, stage.state.load)
        if stage.tensors is not None:
            parts.persistence.register_tensor_slot(stage.name, stage.tensors.save, stage.tensors.load)
        stages.append(stage)
    return Pipeline(stages, parts.models)


# ---- the built-in stages ----

def _server_optimizer(parts: ServerParts, _: Any) -> Stage | None:
    return server_optimizer_stage(parts)


def _adaptive_clip(parts: ServerParts, _: Any) -> Stage | None:
    return adaptive_clip_stage(parts)


def _distfl(parts: ServerParts, _: Any) -> Stage | None:
    if not parts.clusters.enabled:
        return None
    return Stage(DISTFL_SLOT, report=parts.clusters.complete,
                 state=JsonState(parts.clusters.save, parts.clusters.load))


def _nfl(parts: ServerParts, _: Any) -> Stage:
    nfl = parts.nfl
    # moves the detector before the snapshot saves it
    return Stage(NFL_SLOT, report=lambda r: nfl.observe(r)[0], state=JsonState(nfl.save, nfl.load))


def _dp(parts: ServerParts, _: Any) -> Stage:
    dp = parts.dp
    return Stage(DP_SLOT, report=lambda r: dp.observe(r)[0], state=JsonState(dp.save, dp.load))


def _history(parts: ServerParts, _: Any) -> Stage:
    return Stage("history", published=parts.history.append)


def _round_line(parts: ServerParts, _: Any) -> Stage:
    persistence = parts.persistence
    return Stage("round_line", published=RoundCompletedLine(parts.log, lambda: persistence.last_save_seconds))


def _rounds_file(parts: ServerParts, _: Any) -> Stage:
    run_dir, timing = parts.run_dir, parts.timing
    return Stage("rounds_file", published=lambda r: write_round(run_dir, timing.timed(r)))


register_stage("server_optimizer", _server_optimizer,
               summary="[server_optimizer]: FedAvgM, FedAdam, FedYogi, FedAdagrad on the aggregate (model stage)")
register_stage("adaptive_clip", _adaptive_clip,
               summary="[adaptive_clip]: the DP clip norm follows a quantile of the update norms (Andrew et al. 2021)")
register_stage("distfl", _distfl, summary="DistFL's cluster sizes in the report (with [distfl] enabled)")
register_stage("nfl", _nfl, summary="the NFL detector (FL-GUARD / LINDT): beta_hat_avg, nfl, recovery")
register_stage("dp", _dp, summary="the DP accountant: (epsilon, delta) so far")
register_stage("history", _history, summary="the completed rounds' reports (GetStatus, the resume)")
register_stage("round_line", _round_line, summary="the round.completed log line")
register_stage("rounds_file", _rounds_file, summary="the rounds.jsonl row")
