"""DistFL on the server: the imperative shell around :mod:`fedcore.distfl` (SPEC §8, paper §4).

With ``[distfl] enabled`` the round's updates are kept whole (:class:`UpdateBuffer`, instead of the streaming
aggregator: the clusters are formed from this round's uploads, so the updates can only be grouped once the round
is closed; memory K x P float32). When a round closes, :meth:`ClusterShell.aggregate` does, in a worker thread:

1. **Probe** (once, at the first clustering round, the first round after ``warmup_rounds``): M_target = the
   (sample-weighted, as FedAvg) mean of the models uploaded this round (SPEC §8.1); z synthetic inputs extracted
   from it (:func:`fedcore.distfl.synthesize`, §8.2) with a generator seeded by (seed, round, "distfl_inputs").
   The inputs are written to ``run_dir/distfl/probe-r<round>.fgt`` and kept for the rest of the run: every later
   response is computed on the same inputs, so every client's latest response stays comparable with every other
   and a re-clustering covers all clients seen so far (SPEC §8's cross-device design; the paper re-extracts every
   round under full participation, where that question does not arise).
2. **Responses** (every round once the probe exists): each uploaded model (the model it was handed plus its
   update) answers the probe, softmax at temperature 1 (§8.3); the responses go to the cluster state machine
   (:func:`fedcore.distfl.step`: store, re-cluster every ``recluster_every`` rounds with KL + either-direction
   linking + union-find (§8.4–8.5), a newly seen client joins the cluster of its nearest response).
3. **Aggregation**, the configured rule (robust rules, clipping and DP included) per group (§8.6):
   - the global model aggregates the updates of the clients that were handed it (everyone before the first
     clustering, so warm-up rounds are exactly the plain federation's rounds; later, clients not yet in a
     cluster), with the plain federation's noise generator;
   - on a clustering round, each cluster aggregates the updates of its members that uploaded this round onto the
     model it starts from (``seed_from``: its own, the old cluster most of its members came from, or the global
     model at the first clustering -- then the cluster model is exactly FedAvg of its members' uploads); a
     member handed another model contributes its update as received (the model it trained from differs);
   - between clusterings, each cluster aggregates the updates of the clients handed its model;
   - a cluster absent from a round keeps its model; a cluster whose rule cannot work with the few updates it got
     (e.g. trimmed mean with two) keeps its model and the round goes on (``distfl.cluster_not_aggregated``).
     Before the first clustering a failure of the global model re-runs the round, as without DistFL.
   Each cluster's noise generator is seeded by (seed, round, "aggregation_noise/<cluster id>").

Then, on the event loop: the new models and the cluster state are committed, ``cluster.formed`` /
``cluster.assigned`` are logged, the round's report gets the cluster sizes, and the dispatcher hands every client
its cluster's model (:meth:`ClusterShell.model_id_for`; the global model before the first clustering and for
clients with no cluster yet). The cluster state and the probe's id and SHA-256 are a persistence slot, saved in
the snapshot of the round that moved them; the cluster models are saved with the other models by id.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedcore import distfl
from fedcore.aggregation import AggregationResult, Aggregator, make_aggregator
from fedcore.config import ConfigError, ServerConfig, effective_aggregation
from fedcore.distfl import ClusterAssigned, ClusterFormed, ClusterState, DistflConfig
from fedcore.log import get_logger
from fedcore.report import DistflStatus, RoundReport
from fedcore.seeds import derive_seed
from fedcore.serialization import load_state, save_state
from fedserver.global_models import GLOBAL, GlobalModels

SLOT = "distfl"
PROBE_DIR = "distfl"


@dataclass(frozen=True)
class KeptUpdate:
    """One accepted update kept for the end of the round: the flat update u_i (relative to the model the client
    was handed), its weight n_i and that model's id."""

    flat: torch.Tensor
    weight: float
    model_id: str


class UpdateBuffer:
    """The round's accepted updates, kept whole for DistFL's grouping at the end of the round.

    Takes the place of the streaming aggregator in :class:`fedserver.intake.UpdateIntake` (same ``check`` /
    ``add`` / ``count``); ``add`` refuses what the configured rule's aggregator would refuse (``validator``).
    """

    def __init__(self, validator: Aggregator, model_id_for: Callable[[str], str]) -> None:
        self._validator = validator
        self._model_id_for = model_id_for
        self.updates: dict[str, KeptUpdate] = {}

    def check(self, update: torch.Tensor) -> str | None:
        return self._validator.check(update)

    def add(self, update: torch.Tensor, weight: float, key: str = "") -> None:
        reason = self.check(update)
        if reason is not None:
            raise ValueError(reason)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight}")
        if key in self.updates:
            raise ValueError(f"a second update from {key!r} in the same round")
        self.updates[key] = KeptUpdate(update, float(weight), self._model_id_for(key))

    @property
    def count(self) -> int:
        return len(self.updates)


@dataclass
class _Plan:
    """What a closed round changes, computed off the event loop and committed on it."""

    state: ClusterState
    events: list[distfl.ClusterEvent]
    models: dict[str, dict[str, torch.Tensor]]  # new or changed models by id
    dropped: list[str]
    result: AggregationResult
    probe_id: str
    probe: torch.Tensor | None
    probe_sha256: str
    not_aggregated: list[tuple[str, str]] = field(default_factory=list)


def check_model(config: ServerConfig, model: nn.Module) -> None:
    """Refuse, at start, a DistFL configuration whose model has no BatchNorm layer or no declared input shape."""
    if not config.distfl.enabled:
        return
    try:
        distfl.check_has_batchnorm(model, config.model.name)
    except ValueError as e:
        raise ConfigError("distfl.enabled", str(e)) from None
    shape = getattr(model, "input_shape", None)
    if not isinstance(shape, tuple) or not shape:
        raise ConfigError("distfl.enabled", f"model {config.model.name!r} does not declare its input_shape "
                                            "(the shape of the synthetic inputs DistFL extracts); zoo models "
                                            "(fedcore.models.zoo.BlockModel) do")


class ClusterShell:
    def __init__(self, config: ServerConfig, models: GlobalModels, model: nn.Module, device: torch.device) -> None:
        self.config = config
        self.cfg: DistflConfig = config.distfl
        self.enabled = config.distfl.enabled
        self.models = models
        self.device = device
        self.run_dir = Path(config.server.run_dir)
        self.state = ClusterState()
        self.probe_id = ""
        self.probe: torch.Tensor | None = None
        self.probe_sha256 = ""
        self.log = get_logger("fedserver")
        # A private copy to load uploaded models into (responses) and M_target (extraction).
        self._model = copy.deepcopy(model).to(device) if self.enabled else None
        self._input_shape: tuple[int, ...] = tuple(getattr(model, "input_shape", ()) or ())

    # ---- dispatch ----

    def model_id_for(self, client_id: str) -> str:
        """The model ``client_id`` is handed: its cluster's, or the global model."""
        if not self.enabled:
            return GLOBAL
        return self.state.assignment.get(client_id, GLOBAL)

    def make_buffer(self, validator: Aggregator) -> UpdateBuffer:
        return UpdateBuffer(validator, self.model_id_for)

    # ---- end of round ----

    async def aggregate(self, buf: UpdateBuffer, round_: int) -> AggregationResult:
        """Group, cluster and aggregate the closed round (module docstring); the new models and cluster state
        are committed when this returns. Raises ValueError when the global model cannot be aggregated before
        the first clustering (the round is re-run, as without DistFL)."""
        plan = await asyncio.to_thread(self._compute, dict(sorted(buf.updates.items())), round_)
        self._commit(plan)
        return plan.result

    def complete(self, report: RoundReport) -> RoundReport:
        """The round's report with the cluster sizes after it."""
        if not self.enabled:
            return report
        sizes = {cid: len(m) for cid, m in distfl.cluster_members(self.state).items()}
        return dataclasses.replace(report, clusters=sizes)

    def _compute(self, uploads: dict[str, KeptUpdate], round_: int) -> _Plan:
        started = time.perf_counter()
        cfg = self.cfg
        state = ClusterState.from_dict(self.state.to_dict())
        probe_id, probe, probe_sha = self.probe_id, self.probe, self.probe_sha256
        extra: dict[str, float] = {}
        bases = {mid: self.models.flat(mid) for mid in {u.model_id for u in uploads.values()}}
        full = {cid: bases[u.model_id] + u.flat for cid, u in uploads.items()}  # the uploaded models
        if probe is None and uploads and distfl.clustering_due(state, round_, cfg):
            probe_id, probe, probe_sha, loss = self._extract(uploads, full, round_)
            extra["distfl_extraction_loss"] = loss
        responses: dict[str, list[float]] = {}
        shape: tuple[int, ...] = ()
        if probe is not None:
            for cid, u in uploads.items():
                responses[cid], shape = distfl.flatten_response(
                    distfl.responses(self._load(full[cid], u.model_id), probe))
        state, events = distfl.step(state, distfl.ClusterObservation(round_, responses, shape, probe_id), cfg)
        formed = next((e for e in events if isinstance(e, ClusterFormed)), None)

        # Groups: (target model id, start model id, members).
        groups: list[tuple[str, str, list[str]]] = []
        handed_global = [cid for cid, u in uploads.items() if u.model_id == GLOBAL]
        if handed_global:
            groups.append((GLOBAL, GLOBAL, handed_global))
        if formed is not None:
            for info in formed.clusters:
                members = [cid for cid in info.members if cid in uploads]
                if members:
                    groups.append((info.cluster_id, info.seed_from or GLOBAL, members))
        else:
            for mid in sorted({u.model_id for u in uploads.values()} - {GLOBAL}):
                groups.append((mid, mid, [cid for cid, u in uploads.items() if u.model_id == mid]))

        new_flat: dict[str, tuple[torch.Tensor, str]] = {}  # id -> (flat, model whose non-float tensors it keeps)
        results: list[AggregationResult] = []
        not_aggregated: list[tuple[str, str]] = []
        for target, start, members in groups:
            base = self.models.flat(start)
            try:
                agg = make_aggregator(effective_aggregation(self.config), self.models.num_params, len(members))
                for cid in members:
                    agg.add(uploads[cid].flat, uploads[cid].weight, key=cid)
                res = agg.finalize(base, self._noise(round_, target))
            except ValueError as e:
                if target == GLOBAL and not state.assignment:
                    raise  # before the first clustering: the plain federation's behaviour (re-run the round)
                not_aggregated.append((target, str(e)))
                continue
            results.append(res)
            new_flat[target] = (res.new_global, start)
        if formed is not None:  # clusters with no upload this round start from their seed model as it stood
            for info in formed.clusters:
                if info.cluster_id not in new_flat and info.cluster_id not in self.models.ids():
                    start = info.seed_from or GLOBAL
                    new_flat[info.cluster_id] = (self.models.flat(start), start)
        dropped = list(formed.retired) if formed is not None else []

        models = {mid: self.models.state_from_flat(flat, start) for mid, (flat, start) in new_flat.items()}
        global_flat = new_flat[GLOBAL][0] if GLOBAL in new_flat else self.models.flat(GLOBAL)
        metrics = _merge_metrics(results)
        metrics.update(extra)
        metrics["distfl_clusters"] = float(len(set(state.assignment.values())))
        metrics["distfl_not_aggregated"] = float(len(not_aggregated))
        metrics["distfl_seconds"] = time.perf_counter() - started
        if formed is not None and formed.tau is not None:
            metrics["distfl_tau"] = formed.tau
        result = AggregationResult(global_flat, metrics)
        return _Plan(state, events, models, dropped, result, probe_id, probe, probe_sha, not_aggregated)

    def _extract(self, uploads: dict[str, KeptUpdate], full: dict[str, torch.Tensor],
                 round_: int) -> tuple[str, torch.Tensor, str, float]:
        """M_target (the weighted mean of the uploaded models) and the probe extracted from it, saved to disk."""
        weighted = self.config.aggregation.weighted
        w = {cid: (u.weight if weighted else 1.0) for cid, u in uploads.items()}
        total = math.fsum(w.values())
        target = torch.zeros_like(next(iter(full.values())), dtype=torch.float64)
        for cid in sorted(full):
            target += full[cid].to(torch.float64) * (w[cid] / total)
        first = next(iter(uploads.values())).model_id
        model = self._load(target.to(torch.float32), first)
        gen = torch.Generator().manual_seed(derive_seed(self.config.rounds.seed, round_, "distfl_inputs"))
        ext = distfl.synthesize(model, self._input_shape, self.cfg, gen)
        probe = ext.inputs.detach().to("cpu", torch.float32).contiguous()
        probe_id = f"r{round_}"
        path = self._probe_path(probe_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_state(path, {"inputs": probe}, {"round": round_, "steps": self.cfg.steps, "z": self.cfg.z})
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        self.log.info("distfl.probe_extracted", round=round_, z=self.cfg.z, steps=self.cfg.steps,
                      loss_first=round(float(ext.losses[0]), 6) if len(ext.losses) else None,
                      loss_final=round(float(ext.final_loss), 6), file=str(path))
        return probe_id, probe, sha, float(ext.final_loss)

    def _load(self, flat: torch.Tensor, model_id: str) -> nn.Module:
        assert self._model is not None
        self._model.load_state_dict(self.models.state_from_flat(flat, model_id))
        return self._model

    def _noise(self, round_: int, target: str) -> torch.Generator:
        """The plain federation's DP noise for the global model; per cluster, seeded by the cluster id too."""
        purpose = "aggregation_noise" if target == GLOBAL else f"aggregation_noise/{target}"
        return torch.Generator().manual_seed(derive_seed(self.config.rounds.seed, round_, purpose))

    def _commit(self, plan: _Plan) -> None:
        for mid, state in plan.models.items():
            self.models.put(mid, state)
        for mid in plan.dropped:
            self.models.drop(mid)
        self.state = plan.state
        self.probe_id, self.probe, self.probe_sha256 = plan.probe_id, plan.probe, plan.probe_sha256
        for target, reason in plan.not_aggregated:
            self.log.warning("distfl.cluster_not_aggregated", round=plan.state.last_round, cluster=target,
                             reason=reason, note="the cluster keeps its model this round")
        for ev in plan.events:
            if isinstance(ev, ClusterFormed):
                self.log.info("cluster.formed", round=ev.round, clusters=ev.sizes, retired=list(ev.retired),
                              excluded=len(ev.excluded), threshold=self.cfg.threshold, tau=ev.tau,
                              seeded_from={c.cluster_id: c.seed_from or GLOBAL for c in ev.clusters})
            elif isinstance(ev, ClusterAssigned):
                self.log.info("cluster.assigned", round=ev.round, client_id=ev.client_id, cluster=ev.cluster_id,
                              distance=round(ev.distance, 6), nearest=ev.nearest)

    # ---- status ----

    def status(self, known_clients: list[str]) -> DistflStatus:
        if not self.enabled:
            return DistflStatus()
        s, cfg = self.state, self.cfg
        if s.clustered_round == 0:
            nxt = cfg.warmup_rounds + 1 if s.last_round <= cfg.warmup_rounds else s.last_round + 1
        else:
            nxt = s.clustered_round + cfg.recluster_every if cfg.recluster_every > 0 else 0
        pending = sum(1 for c in known_clients if c not in s.assignment) if s.clustered_round else 0
        return DistflStatus(enabled=True, clustered_round=s.clustered_round, next_clustering=nxt,
                            probe=self.probe_id,
                            clusters={cid: len(m) for cid, m in distfl.cluster_members(s).items()},
                            assignment=dict(s.assignment), pending=pending)

    # ---- persistence slot ----

    def _probe_path(self, probe_id: str) -> Path:
        return self.run_dir / PROBE_DIR / f"probe-{probe_id}.fgt"

    def save(self) -> dict[str, Any]:
        return {"state": self.state.to_dict(), "probe": self.probe_id, "probe_sha256": self.probe_sha256}

    def load(self, d: Mapping[str, Any]) -> None:
        state = ClusterState.from_dict(d.get("state", {}))
        probe_id, sha = str(d.get("probe", "")), str(d.get("probe_sha256", ""))
        probe = None
        if probe_id:
            path = self._probe_path(probe_id)
            if not path.exists():
                raise ValueError(f"distfl: the probe inputs {path} the stored clusters were computed on are "
                                 "missing")
            got = hashlib.sha256(path.read_bytes()).hexdigest()
            if got != sha:
                raise ValueError(f"distfl: {path} does not match the stored SHA-256 (got {got}, expected {sha})")
            tensors, _ = load_state(path)
            probe = tensors["inputs"]
        self.state, self.probe_id, self.probe, self.probe_sha256 = state, probe_id, probe, sha


def _merge_metrics(results: list[AggregationResult]) -> dict[str, float]:
    """One metric map for the round over every aggregated group: counts (``num_*``) summed, the rest averaged
    weighted by each group's number of updates."""
    if len(results) == 1:
        return dict(results[0].metrics)
    out: dict[str, float] = {}
    weights = [max(r.metrics.get("num_updates", 1.0), 1.0) for r in results]
    for key in sorted({k for r in results for k in r.metrics}):
        vals = [(r.metrics[key], w) for r, w in zip(results, weights, strict=True) if key in r.metrics]
        if key.startswith("num_"):
            out[key] = math.fsum(v for v, _ in vals)
        else:
            out[key] = math.fsum(v * w for v, w in vals) / math.fsum(w for _, w in vals)
    return out
