"""Buffered asynchronous rounds over real gRPC on loopback: a timing-dependent run (lognormal stragglers), then a
second run that follows its arrival log (rounds.replay) and must give bit-identical models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedcore.config import ServerConfig
from fedcore.models import build_model
from fedcore.serialization import load_state
from fedcore.simulation import SimulationConfig
from tests.integration.helpers import run_federation, server_config

N, M, C, ROUNDS = 6, 2, 4, 4


def _config(tmp_path: Path, **rounds: object) -> ServerConfig:
    return server_config(tmp_path, rounds={"num_rounds": ROUNDS, "clients_per_round": M, "mode": "buffered",
                                           "concurrency": C, "min_available": N, "max_staleness": 3, **rounds},
                         training={"local_epochs": 1, "learning_rate": 0.05})


def _lines(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "arrivals.jsonl").read_text().splitlines()]


def test_buffered_run_and_its_replay_give_bit_identical_models(tmp_path: Path) -> None:
    # every device a straggler with its own lognormal delays: which update lands in which buffer depends on timing
    sim = SimulationConfig(straggler="lognormal", straggler_delay_s=0.05, straggler_sigma=1.5)
    first = tmp_path / "first"
    status, _ = run_federation(_config(first), N, timeout=90, simulation=sim)
    assert status is not None and status.finished and status.outcome == "completed"
    rows = [json.loads(line) for line in (first / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["accepted"] == M and r["selected"] == M and r["outcome"] == "buffer_full" for r in rows)
    assert all(r["wall_seconds"] > 0 for r in rows) and rows[0]["staleness_max"] == 0
    arrivals = [d for d in _lines(first / "run") if "arrive" in d]
    assert len(arrivals) == M * ROUNDS and [d["seq"] for d in arrivals] == list(range(1, M * ROUNDS + 1))
    stale = [d for d in arrivals if d["round"] != d["base"]]
    assert stale, "no update arrived stale: the run did not exercise the order"  # C > M: devices span buffers
    assert max(r["staleness_max"] for r in rows) == max(int(d["round"]) - int(d["base"]) for d in arrivals)

    second = tmp_path / "second"
    replay = str(first / "run" / "arrivals.jsonl")
    status2, _ = run_federation(_config(second, replay=replay), N, timeout=90, simulation=sim)
    assert status2 is not None and status2.finished
    again = [d for d in _lines(second / "run") if "arrive" in d]
    assert sorted((d["round"], d["arrive"], d["base"]) for d in again) == sorted(
        (d["round"], d["arrive"], d["base"]) for d in arrivals)
    a, _ = load_state(first / "run" / "final_model.fgt")
    b, _ = load_state(second / "run" / "final_model.fgt")
    cfg = _config(first)
    initial = build_model(cfg.model.name, cfg.model.kwargs, seed=cfg.rounds.seed).state_dict()
    assert a.keys() == b.keys()
    assert not all(torch.equal(a[k], initial[k]) for k in a)  # the buffers moved the model
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit: the replay contract
    rows2 = [json.loads(line) for line in (second / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["mean_train_loss"] for r in rows2] == [r["mean_train_loss"] for r in rows]
    assert all(r["outcome"] == "replayed" for r in rows2)


def test_buffers_go_through_dp_and_a_server_optimizer(tmp_path: Path) -> None:
    """Each buffer is one accountant step with its own q = contributors / N (z = noise / (S / M) = 1 here), and the
    pipeline's server optimizer runs on it."""
    pytest.importorskip("opacus", reason="the dp extra (Opacus) is not installed")
    from opacus.accountants import RDPAccountant

    n, m, rounds = 4, 2, 3
    cfg = server_config(tmp_path, rounds={"num_rounds": rounds, "clients_per_round": m, "mode": "buffered",
                                          "concurrency": 3, "min_available": n},
                        aggregation={"clip_norm": 1.0, "noise_sigma": 0.5, "weighted": False},
                        dp={"population": n, "delta": 1e-5}, server_optimizer={"name": "fedavgm"})
    sim = SimulationConfig(straggler="lognormal", straggler_delay_s=0.05, straggler_sigma=1.5)
    status, _ = run_federation(cfg, n, timeout=90, simulation=sim)
    assert status is not None and status.finished
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    acc, eps = RDPAccountant(), []
    for _ in rows:
        acc.step(noise_multiplier=1.0, sample_rate=m / n)
        eps.append(acc.get_epsilon(delta=1e-5))
    assert [r["dp_sample_rate"] for r in rows] == [m / n] * rounds
    assert [r["dp_noise_multiplier"] for r in rows] == [1.0] * rounds
    assert [r["dp_epsilon"] for r in rows] == pytest.approx(eps, rel=1e-9)
    assert all(r["metrics"]["num_updates"] == m for r in rows)
