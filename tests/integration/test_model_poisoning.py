"""Model poisoning end to end over real gRPC on loopback: partial-knowledge attackers craft their own updates
through the client's update hook; the full-knowledge test harness crafts them on the server (simulation only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedclient import ClientConfig, FedClient
from fedcore.attacks import AttackConfig
from fedcore.config import ServerConfig
from fedcore.report import FederationStatus, RoundReport
from fedcore.serialization import load_state
from fedserver import ServerThread
from tests.integration.helpers import server_config

N = 6
ATTACKERS = (1, 4)


def _config(tmp_path: Path, name: str, **sections: dict[str, Any]) -> ServerConfig:
    return server_config(tmp_path / name, rounds={"num_rounds": 3, "clients_per_round": N, "min_updates": N,
                                                  "seed": 5},
                         aggregation={"rule": "trimmed_mean", "trim_m": 2}, **sections)


def _run(config: ServerConfig, attack: AttackConfig | None) -> tuple[list[RoundReport], list[Any]]:
    srv = ServerThread(config, linger_s=0.5).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=5.0,
                                      attack=attack if attack is not None and i in ATTACKERS else AttackConfig())
                         ).start() for i in range(N)]
    status = srv.wait(120)
    summaries = [c.join(30) for c in clients]
    assert isinstance(status, FederationStatus) and status.outcome == "completed", status
    lines = (Path(config.server.run_dir) / "rounds.jsonl").read_text().splitlines()
    return [RoundReport.from_dict(json.loads(line)) for line in lines], summaries


def _final(config: ServerConfig) -> dict[str, torch.Tensor]:
    return load_state(Path(config.server.run_dir) / "final_model.fgt")[0]


def test_partial_knowledge_dyn_opt_attackers_send_crafted_updates(tmp_path: Path) -> None:
    honest_rows, _ = _run(_config(tmp_path, "honest"), None)
    cfg = _config(tmp_path, "attacked")
    rows, summaries = _run(cfg, AttackConfig(kind="dyn_opt", options={"estimate_shards": 3, "assumed_attackers": 2}))
    assert [r.attackers for r in rows] == [2, 2, 2] and all(r.rejected == 0 for r in rows)
    assert [r.attackers for r in honest_rows] == [0, 0, 0]
    by_id = {s.client_id: s for s in summaries}
    for i in range(N):
        history = by_id[f"client-{i}"].history
        if i in ATTACKERS:  # gamma found against the assumed trimmed mean, from 3 honest shard updates
            assert all(h["attack_gamma"] > 0 and h["attack_estimate_shards"] == 3.0 for h in history)
        else:
            assert all("attack_gamma" not in h for h in history)
    assert "harness_crafted" not in rows[0].metrics
    # The attack moved the federation: a different global model than the honest run's.
    assert rows[-1].mean_train_loss != honest_rows[-1].mean_train_loss


def test_the_full_knowledge_harness_crafts_the_attackers_rows_reproducibly(tmp_path: Path) -> None:
    harness = {"full_knowledge_adversary": True, "attack": {"kind": "stat_opt", "knowledge": "full"}}
    attack = AttackConfig(kind="stat_opt", knowledge="full")
    runs = [_config(tmp_path, f"run{i}", simulation_harness=harness) for i in range(2)]
    results = [_run(cfg, attack) for cfg in runs]
    rows, summaries = results[0]
    assert [r.attackers for r in rows] == [2, 2, 2]
    assert [r.metrics["harness_crafted"] for r in rows] == [2.0, 2.0, 2.0]
    # The attackers sent honest updates (the server crafted their rows): no client-side attack metrics.
    assert all("attack_gamma" not in h for s in summaries for h in s.history)
    first, second = (_final(cfg) for cfg in runs)
    assert all(torch.equal(first[k], second[k]) for k in first)  # seeded: the same rows every run
    # Without the harness the same attacker clients change nothing: they train honestly.
    plain = _config(tmp_path, "plain")
    plain_rows, _ = _run(plain, attack)
    assert "harness_crafted" not in plain_rows[0].metrics
    assert any(not torch.equal(first[k], v) for k, v in _final(plain).items())
