"""Aggregation rules and server-side DP chosen by configuration, end to end over gRPC."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from fedcore.config import ConfigError
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import mark_ready, pull_model, run_federation, server_config, stub, update_messages


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum", "knorm"])
def test_rule_and_dp_from_config_run_over_grpc(tmp_path: Path, rule: str) -> None:
    agg = {"rule": rule, "clip_norm": 15.0, "noise_sigma": 0.001}
    if rule == "trimmed_mean":
        agg["trim_m"] = 1
    cfg = server_config(tmp_path, rounds={"num_rounds": 2, "clients_per_round": 5}, aggregation=agg)
    status, _ = run_federation(cfg, 5)
    assert status is not None and status.outcome == "completed"
    for h in status.history:
        m = h.metrics
        assert h.accepted == 5 and m["num_updates"] == 5
        # N(0, sigma^2 I) over P = 4,554 parameters: ||noise|| ~ sigma * sqrt(P) ~ 0.067.
        assert 0.03 < m["noise_norm"] < 0.12
        assert "w_div" in m and math.isclose(m["delta"], m["w_div"] - m["noise_norm"], rel_tol=1e-6, abs_tol=1e-9)
    if rule == "krum":
        assert status.history[0].metrics["num_excluded"] == 4


def test_median_ignores_a_byzantine_update(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 5}, aggregation={"rule": "median"})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        ch, s = stub(srv.address)
        sessions = [s.Join(pb.JoinRequest(client_id=f"x{i}"), timeout=5).session_id for i in range(5)]
        mark_ready(s, sessions)
        _, state = pull_model(s, sessions[0])
        assert state is not None
        for sid in sessions[1:]:
            pull_model(s, sid)
        honest = {k: v + 0.01 for k, v in state.items()}
        evil = {k: v + 1e4 for k, v in state.items()}
        for i, sid in enumerate(sessions):
            assert s.PushUpdate(update_messages(sid, 1, evil if i == 0 else honest), timeout=10).accepted
        deadline = time.monotonic() + 10
        while srv.coordinator.state.phase != "finished" and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        new = srv.coordinator.global_state  # type: ignore[union-attr]
        for k in state:
            torch.testing.assert_close(new[k], honest[k])
        ch.close()
    finally:
        srv.stop()


def test_aggregator_rejects_an_update_over_the_norm_ceiling(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 2, "min_updates": 1},
                        aggregation={"max_update_norm": 100.0})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        ch, s = stub(srv.address)
        a, b = (s.Join(pb.JoinRequest(client_id=n), timeout=5).session_id for n in ("a", "b"))
        mark_ready(s, [a, b])
        _, state = pull_model(s, a)
        assert state is not None
        with pytest.raises(Exception) as e:
            s.PushUpdate(update_messages(a, 1, {k: v + 1e3 for k, v in state.items()}), timeout=10)
        assert "norm" in str(e.value)
        assert srv.coordinator.state.rejected == {"a": srv.coordinator.state.rejected["a"]}  # type: ignore[union-attr]
        ch.close()
    finally:
        srv.stop()


def test_impossible_aggregation_parameters_are_refused_at_config_time(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        server_config(tmp_path, rounds={"clients_per_round": 4}, aggregation={"rule": "krum", "krum_f": 2})
    assert e.value.field == "aggregation.options.krum_f"  # the old flat key, named by its new place
    with pytest.raises(ConfigError) as e:
        server_config(tmp_path, aggregation={"clip_norm": 0.0})
    assert e.value.field == "aggregation.clip_norm"
    cfg = server_config(tmp_path, rounds={"clients_per_round": 10},
                        aggregation={"rule": "krum", "memory_budget_bytes": 1000})
    with pytest.raises(ConfigError, match=r"K\*P\*4 = 10\*4554\*4 B"):
        ServerThread(cfg).start()
