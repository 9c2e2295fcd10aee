"""DistFL on the coordinator over real gRPC (SPEC §8): warm-up rounds are the plain federation's rounds, the first
clustering forms clusters from the round's uploads, every client is handed its own cluster's model, a client seen
later joins its nearest cluster, clusters and memberships survive a restart, a model without BatchNorm is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedclient import ClientConfig, FedClient
from fedcore.config import ConfigError, ServerConfig
from fedcore.report import FederationStatus, RoundReport
from fedcore.serialization import load_state
from fedserver import ServerThread
from fedserver.coordinator import Coordinator
from fedserver.dispatch import Task
from tests.integration.helpers import server_config

N = 6
# One full-batch step per epoch: BatchNorm1d cannot train on a batch of one sample (a shard size that is 1 modulo
# the batch size would leave one at the end of an epoch).
DATA = {"max_samples": 120, "min_samples": 40, "num_features": 20, "num_classes": 4}


def _config(tmp_path: Path, name: str, rounds: int, k: int = N, distfl: dict[str, Any] | None = None,
            **sections: dict[str, Any]) -> ServerConfig:
    d = {"enabled": True, "z": 16, "steps": 10, "warmup_rounds": 1, "recluster_every": 0, "tau": 0.2,
         **(distfl or {})}
    return server_config(tmp_path / name, rounds={"num_rounds": rounds, "clients_per_round": k, "min_available": N,
                                                  "seed": 5},
                         model={"name": "mlp_bn", "kwargs": {"in_features": 20, "num_classes": 4, "hidden": [16]}},
                         data={"dataset": "synthetic", "options": DATA},
                         training={"batch_size": 256, "local_epochs": 2, "learning_rate": 0.1}, distfl=d,
                         **sections)


def _run(config: ServerConfig, record: bool = False) -> tuple[FederationStatus, list[tuple[int, str, str]],
                                                              dict[int, dict[str, str]]]:
    """Run the federation with N clients; with ``record``, every task handed out (round, client, model id) and
    the cluster assignment after every round."""
    srv = ServerThread(config, linger_s=0.5).start()
    tasks: list[tuple[int, str, str]] = []
    after: dict[int, dict[str, str]] = {}
    if record:
        coord = srv.coordinator
        assert isinstance(coord, Coordinator)
        original = coord.dispatch.task_for

        def task_for(state: Any, client_id: str, now: float) -> Task | None:
            task = original(state, client_id, now)
            if task is not None:
                tasks.append((task.round, client_id, task.model_id))
            return task

        def on_round(r: RoundReport) -> None:
            after[r.round] = dict(coord.clusters.state.assignment)

        srv.call(lambda: setattr(coord.dispatch, "task_for", task_for))
        srv.call(lambda: coord.subscribe(on_round))
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=5.0)).start() for i in range(N)]
    status = srv.wait(180)
    for c in clients:
        c.join(30)
    assert isinstance(status, FederationStatus) and status.outcome == "completed", status
    return status, tasks, after


def _models(config: ServerConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Every model of the final snapshot, by id."""
    from fedserver.store import StateStore
    store = StateStore(Path(config.server.run_dir) / "state", keep=3, fsync=False)
    try:
        snap = store.load().snapshot
        assert snap is not None
        return {k: dict(v) for k, v in snap.models.items()}
    finally:
        store.close()


def test_warmup_then_clusters_and_every_client_is_handed_its_clusters_model(tmp_path: Path) -> None:
    # A small τ links only near-identical responses: several clusters, so several models are handed out.
    cfg = _config(tmp_path, "distfl", rounds=4, distfl={"tau": 0.001, "threshold": "fixed"})
    status, tasks, after = _run(cfg, record=True)
    rows = list(status.history)
    assert len(status.distfl.clusters) >= 2
    # Warm-up (round 1): no clusters; round 2 (the first after warm-up) clusters everyone who uploaded.
    assert rows[0].clusters == {} and rows[0].metrics["distfl_clusters"] == 0.0
    assert sum(rows[1].clusters.values()) == N and all(sum(r.clusters.values()) == N for r in rows[1:])
    assert status.distfl.enabled and status.distfl.clustered_round == 2 and status.distfl.probe == "r2"
    assert set(status.distfl.assignment) == {f"client-{i}" for i in range(N)} and status.distfl.pending == 0
    assert status.distfl.clusters == rows[-1].clusters
    # Every task's model is the client's cluster as it stood after the previous round (global before clustering).
    assert tasks and {r for r, _, _ in tasks} == {1, 2, 3, 4}
    assert len({m for r, _, m in tasks if r == 4}) >= 2
    for round_, cid, model_id in tasks:
        assert model_id == after.get(round_ - 1, {}).get(cid, "global"), (round_, cid, model_id)
    # Each cluster has its own model, saved with the run; the probe inputs are on disk.
    models = _models(cfg)
    assert set(models) == {"global", *status.distfl.clusters}
    assert (Path(cfg.server.run_dir) / "distfl" / "probe-r2.fgt").exists()
    probe, _ = load_state(Path(cfg.server.run_dir) / "distfl" / "probe-r2.fgt")
    assert tuple(probe["inputs"].shape) == (16, 20)


def test_warmup_rounds_are_the_plain_federations_rounds(tmp_path: Path) -> None:
    """Before the first clustering DistFL aggregates exactly as the plain federation: bit-identical global models
    (same seed, DP noise on), whatever the clustering does later."""
    noise = {"aggregation": {"clip_norm": 5.0, "noise_sigma": 0.001}}
    plain = _config(tmp_path, "plain", rounds=2, distfl={"enabled": False}, **noise)
    warm = _config(tmp_path, "warm", rounds=2, distfl={"warmup_rounds": 5}, **noise)
    _run(plain)
    _run(warm)
    a, b = _models(plain)["global"], _models(warm)["global"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_client_seen_later_joins_its_nearest_cluster_and_clusters_survive_a_restart(tmp_path: Path) -> None:
    """K = 3 of 6: the first clustering covers round 2's three uploaders; the others join the cluster of their
    nearest response when they first upload. A restart after round 3 carries on with the same clusters,
    memberships and probe: the result is bit-identical to the run in one go."""
    straight = _config(tmp_path, "straight", rounds=6, k=3)
    s_status, _, _ = _run(straight)
    first_rows = s_status.history
    clustered_first = sum(first_rows[1].clusters.values())
    assert clustered_first == 3  # round 2's uploaders
    assert sum(s_status.distfl.clusters.values()) > clustered_first  # later clients were assigned
    _run(_config(tmp_path, "resumed", rounds=3, k=3))
    r_status, _, _ = _run(_config(tmp_path, "resumed", rounds=6, k=3))
    assert r_status.resumed_from == 3
    assert r_status.distfl == s_status.distfl
    assert [r.clusters for r in r_status.history] == [r.clusters for r in first_rows]
    ms, mr = _models(straight), _models(_config(tmp_path, "resumed", rounds=6, k=3))
    assert set(ms) == set(mr)
    for mid in ms:
        assert all(torch.equal(ms[mid][k], mr[mid][k]) for k in ms[mid]), mid


def test_a_model_without_batchnorm_is_refused_at_start(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "nobn", rounds=1)
    cfg.model.name, cfg.model.kwargs = "mlp", {"in_features": 20, "num_classes": 4}
    with pytest.raises(ConfigError) as e:
        Coordinator(cfg)
    assert e.value.field == "distfl.enabled" and "BatchNorm" in str(e.value)


def test_reclustering_keeps_ids_drops_retired_models_and_small_clusters_keep_their_model(tmp_path: Path) -> None:
    """Re-clustering every 2 rounds: every model the server keeps belongs to a live cluster (retired clusters'
    models are dropped) and every client's cluster is live. A robust rule that needs 3 updates (trimmed mean,
    trim 1 per side) cannot aggregate a cluster of one or two: that cluster keeps its model and the round goes on."""
    cfg = _config(tmp_path, "re", rounds=6, distfl={"tau": 0.001, "threshold": "fixed", "recluster_every": 2},
                  aggregation={"rule": "trimmed_mean", "trim_m": 1})
    status, _, _ = _run(cfg)
    rows = list(status.history)
    assert [r.round for r in rows] == [1, 2, 3, 4, 5, 6] and status.distfl.clustered_round == 6
    live = set(status.distfl.clusters)
    assert set(status.distfl.assignment.values()) == live
    assert set(_models(cfg)) == {"global", *live}
    # Singletons and pairs cannot be trimmed: counted, not fatal.
    small = [r for r in rows[1:] if any(n < 3 for n in r.clusters.values())]
    assert small and all(r.metrics["distfl_not_aggregated"] >= 1 for r in small)
