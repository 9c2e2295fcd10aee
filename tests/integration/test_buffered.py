"""Buffered asynchronous rounds over real gRPC on loopback: a timing-dependent run (lognormal stragglers), then a
second run that follows its arrival log (rounds.replay) and must give bit-identical models."""

from __future__ import annotations

import json
import math
import time
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


def test_a_robust_rule_runs_on_the_buffer_of_staleness_weighted_updates(tmp_path: Path) -> None:
    """The coordinate-wise median takes the buffer after each update was scaled by its staleness weight: a buffer of
    an attacker's -1e4, a fresh +0.02 and a one-buffer-stale +0.01 (weighted 1/sqrt(2) by FedBuff's default) moves
    the model by the stale update's 0.01/sqrt(2), not by the attacker's, and not by the unweighted +0.01."""
    from fedguard.v1 import fedguard_pb2 as pb
    from fedserver import ServerThread
    from tests.integration.helpers import mark_ready, pull_model, stub, update_messages

    cfg = server_config(tmp_path, rounds={"num_rounds": 2, "clients_per_round": 3, "mode": "buffered",
                                          "concurrency": 4, "min_available": 4, "max_staleness": 2},
                        aggregation={"rule": "median"})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        ch, s = stub(srv.address)
        x0, x1, x2, x3 = (s.Join(pb.JoinRequest(client_id=f"x{i}"), timeout=5).session_id for i in range(4))
        mark_ready(s, [x0, x1, x2, x3])
        tasks = {sid: pull_model(s, sid) for sid in (x0, x1, x2, x3)}
        assert all(isinstance(h, pb.TaskHeader) and h.round == 1 and w is not None for h, w in tasks.values())
        w0 = tasks[x0][1]
        assert w0 is not None
        # Buffer 1 (every update fresh): the median drops the attacker's +1e4.
        for sid, shift in ((x0, 1e4), (x1, 0.01), (x2, 0.01)):
            assert s.PushUpdate(update_messages(sid, 1, {k: v + shift for k, v in w0.items()}), timeout=10).accepted
        # x3 still trains from round 1's model; x0 and x1 are handed round 2's.
        h0, w1 = pull_model(s, x0)
        h1, w1b = pull_model(s, x1)
        assert isinstance(h0, pb.TaskHeader) and h0.round == 2 and isinstance(h1, pb.TaskHeader) and h1.round == 2
        assert w1 is not None and w1b is not None
        for k in w0:
            torch.testing.assert_close(w1[k], w0[k] + 0.01)
        # Buffer 2: -1e4 (fresh), +0.02 (fresh), +0.01 from round 1's model (stale by 1: weight 2^-1/2).
        assert s.PushUpdate(update_messages(x0, 2, {k: v - 1e4 for k, v in w1.items()}), timeout=10).accepted
        assert s.PushUpdate(update_messages(x1, 2, {k: v + 0.02 for k, v in w1.items()}), timeout=10).accepted
        assert s.PushUpdate(update_messages(x3, 1, {k: v + 0.01 for k, v in w0.items()}), timeout=10).accepted
        deadline = time.monotonic() + 10
        while srv.coordinator.state.phase != "finished" and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        final = srv.coordinator.global_state  # type: ignore[union-attr]
        # float32 throughout: each coordinate is a few float32 roundings of magnitude <= |w| + 0.02, well inside
        # assert_close's float32 tolerance (rtol 1.3e-6, atol 1e-5); the alternatives differ by >= 2.9e-3.
        for k in w0:
            torch.testing.assert_close(final[k], w1[k] + 0.01 / math.sqrt(2.0))
        ch.close()
    finally:
        srv.stop()
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], r["staleness_max"]) for r in rows] == [(1, 0), (2, 1)]
