"""Closing a round: aggregate -> model stages -> report -> report stages -> persist -> publish, in that order.

The order and what each step is: :mod:`fedserver.pipeline` (the stages are composed there, in one place); this
module drives them. The aggregation is DistFL's per-cluster aggregation (:mod:`fedserver.clusters`) when the
intake kept the updates whole, else the configured rule (:mod:`fedserver.finalize`) after the simulation-only
adversary harness crafted its updates; a rule that cannot work with what arrived re-runs the round. The result
is the round machine's next observation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fedcore import rounds as rm
from fedcore.aggregation import AggregationResult, Aggregator
from fedcore.buffered import staleness_spread
from fedcore.report import RoundReport
from fedcore.secagg.aggregate import SecureFedAvg
from fedserver.clusters import ClusterShell, UpdateBuffer
from fedserver.finalize import RoundFinalizer
from fedserver.harness import AdversaryHarness
from fedserver.intake import UpdateIntake
from fedserver.offload import Offload
from fedserver.persistence import Persistence
from fedserver.pipeline import Pipeline
from fedserver.round_timing import RoundTimer
from fedserver.secure_round import SecureRounds

RoundSubscriber = Callable[[RoundReport], None]


class RoundCloser:
    def __init__(self, intake: UpdateIntake, clusters: ClusterShell, harness: AdversaryHarness,
                 finalizer: RoundFinalizer, persistence: Persistence, history: list[RoundReport],
                 state: Callable[[], rm.RoundState], ends_federation: Callable[[], str],
                 clock: Callable[[], float], log: Any, pipeline: Pipeline, timing: RoundTimer | None = None,
                 offload: Offload | None = None, secure: SecureRounds | None = None) -> None:
        self.intake = intake
        self.clusters = clusters
        self.harness = harness
        self.finalizer = finalizer
        self.persistence = persistence
        self.history = history  # the completed rounds' reports (the coordinator's; restored on resume)
        self._state = state
        # Why the federation ends after the round just completed ("" when it goes on): a spent DP budget.
        self._ends_federation = ends_federation
        self._clock = clock
        self.log = log
        self.timing = timing if timing is not None else RoundTimer()  # stamps the close's phase boundaries
        # Where the close's blocking steps run (fedserver.offload): the finalizer's too, one record per step name.
        self.offload = offload if offload is not None else Offload()
        self.pipeline = pipeline
        self.secure = secure  # secure aggregation: the round's sum is unmasked before it is aggregated
        self.started_at = clock()  # when the server started running (the coordinator's run() sets it)

    def subscribe(self, fn: RoundSubscriber) -> None:
        """Call ``fn`` with every completed round's report, after the round was persisted (on the event loop), after
        the pipeline's own published hooks."""
        self.pipeline.subscribe(fn)

    async def close(self, round_: int, reason: str) -> rm.Aggregated | rm.AggregationFailed:
        self.timing.close_began(round_)
        agg, round_log = self.intake.take()
        try:
            secure_metrics: dict[str, float] = {}
            if isinstance(agg, SecureFedAvg):  # the survivors reveal their shares; then the sum is known
                assert self.secure is not None
                total = await self.secure.unmasked(round_)
                agg.set_sum(total, {c: float(r.num_samples) for c, r in round_log.reports.items()})
                secure_metrics = self.secure.summary()
            result = await self._aggregate(agg, round_)
            result.metrics.update(secure_metrics)
        except ValueError as e:  # the rule cannot work with what arrived: re-run the round
            self.log.warning("round.aggregation_failed", round=round_, reason=str(e))
            return rm.AggregationFailed(round_, str(e), self._clock())
        if self.pipeline.shapes_model:  # step 3: the model stages (a server optimizer) shape what is applied
            shaped, metrics = await self.offload.run("model_stages", self.pipeline.shape_model, round_,
                                                     result.new_global)
            result = dataclasses.replace(result, new_global=shaped, metrics={**result.metrics, **metrics})
        self.timing.aggregated(round_)
        report = await self.finalizer.report(result, round_log, self._state(), reason)
        report = dataclasses.replace(report, wall_seconds=self._clock() - self.started_at)
        if self._state().buffered is not None:  # a buffer: its contributors are its sample (the DP accountant's q)
            low, avg, high = staleness_spread(round_log.staleness.values())
            report = dataclasses.replace(report, selected=len(round_log.reports), staleness_min=low,
                                         staleness_mean=avg, staleness_max=high)
        # The stages and the snapshot in one step (on a worker thread each hop is a thread wake-up and a loop wake-up).
        report = await self.offload.run("complete_and_persist", self._complete_and_persist, report, round_)
        self.timing.snapshotted(round_)
        self.pipeline.publish(report)
        self.intake.finished_round()
        return rm.Aggregated(round_, self._clock(), self._ends_federation())

    async def _aggregate(self, agg: Aggregator | UpdateBuffer | SecureFedAvg, round_: int) -> AggregationResult:
        if isinstance(agg, UpdateBuffer):  # DistFL: cluster, then aggregate per cluster
            return await self.clusters.aggregate(agg, round_)
        crafted = (await self.offload.run("harness", self.harness.apply, agg, self._state(), round_)
                   if self.harness.enabled and not isinstance(agg, SecureFedAvg) else {})
        result = await self.finalizer.aggregate(agg, round_)
        result.metrics.update(crafted)
        return result

    def _complete_and_persist(self, report: RoundReport, round_: int) -> RoundReport:
        """Steps 3 and 4 (one :class:`~fedserver.offload.Offload` step): the stages complete the report, then the
        round is persisted."""
        report = self.pipeline.complete(report)
        self.timing.reported(round_)
        self.persistence.snapshot(self._state(), [*self.history, report], round_)
        return report
