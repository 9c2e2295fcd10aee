"""NFL detection and recovery end to end over real gRPC on loopback (FL-GUARD §4, SPEC §6–§7).

The synthetic task with private models is an NFL environment at this scale (the clients' private models beat
the shared one: β < 0 from round 1), so a small NR reports NFL within a few rounds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedclient import ClientConfig, FedClient
from fedcore.attacks import AttackConfig
from fedcore.config import ServerConfig
from fedcore.report import FederationStatus, RoundReport
from fedcore.serialization import load_state
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import mark_ready, pull_model, server_config, stub, update_messages

N = 5


def _config(tmp_path: Path, name: str, rounds: int = 4, **nfl: Any) -> ServerConfig:
    return server_config(tmp_path / name, rounds={"num_rounds": rounds, "clients_per_round": N, "min_available": N,
                                                  "seed": 3},
                         nfl=nfl)


def _run(config: ServerConfig, options: dict[int, dict[str, Any]] | None = None,
         **common: Any) -> tuple[FederationStatus, list[Any]]:
    srv = ServerThread(config, linger_s=0.5).start()
    clients = [FedClient(ClientConfig(insecure=True,
                                      server=srv.address, client_id=f"client-{i}", data_index=i, long_poll_s=5.0,
                                      private_epochs=2, **{**common, **(options or {}).get(i, {})})).start()
               for i in range(N)]
    status = srv.wait(120)
    summaries = [c.join(30) for c in clients]
    assert isinstance(status, FederationStatus) and status.outcome == "completed", status
    return status, summaries


def _final_model(config: ServerConfig) -> dict[str, torch.Tensor]:
    tensors, _ = load_state(Path(config.server.run_dir) / "final_model.fgt")
    return tensors


def _rows(config: ServerConfig) -> list[RoundReport]:
    lines = (Path(config.server.run_dir) / "rounds.jsonl").read_text().splitlines()
    return [RoundReport.from_dict(json.loads(line)) for line in lines]


def test_off_unreported_detection_and_always_recover_give_bit_identical_global_models(tmp_path: Path) -> None:
    """No cost when healthy: detection that never reports changes nothing, and adaptation (always-recover) never
    changes the updates the clients send, so all three global-model trajectories are bit-identical."""
    runs = {mode: _config(tmp_path, mode, nr=1000, mode=mode) for mode in ("off", "detect-and-recover",
                                                                           "always-recover")}
    summaries = {}
    for mode, cfg in runs.items():
        _, summaries[mode] = _run(cfg)
    models = {mode: _final_model(cfg) for mode, cfg in runs.items()}
    for mode in ("detect-and-recover", "always-recover"):
        assert models[mode].keys() == models["off"].keys()
        for k, v in models["off"].items():
            assert torch.equal(models[mode][k], v), (mode, k)
    off_rows, always_rows = _rows(runs["off"]), _rows(runs["always-recover"])
    assert [r.mean_train_loss for r in off_rows] == [r.mean_train_loss for r in always_rows]
    assert all(r.nfl == "off" and not r.recovery and r.adapting == 0 for r in off_rows)
    assert all(r.nfl == "watching" and not r.recovery for r in _rows(runs["detect-and-recover"]))
    assert all(r.nfl == "always" and r.recovery and r.adapting == N for r in always_rows)
    # Every client adapted in every round and infers with v_i from round 2 on; beta_hat travels with each update.
    for s in summaries["always-recover"]:
        assert [h["adapting"] for h in s.history] == [1.0] * 4
        assert [h["infers_adapted"] for h in s.history] == [0.0, 1.0, 1.0, 1.0]
        assert all(-1.0 <= h["beta_hat_measured"] <= 1.0 for h in s.history)
    assert all(r.beta_hat == r.beta_hat for r in off_rows)  # the median is reported (not NaN) in every mode


def test_nfl_is_reported_recovery_reaches_the_clients_and_holdouts_never_adapt(tmp_path: Path) -> None:
    """NR = 1 (the paper's rule, detector beta_hat): the second round with a negative running beta_hat reports
    NFL; the next rounds' tasks carry the recovery flag; client-4 opts out and never adapts; client-0 fabricates
    beta_hat = +1 and the median holds."""
    cfg = _config(tmp_path, "nfl", rounds=5, nr=1, c=50, detector="beta_hat")  # the paper's rule as published
    options = {4: {"opt_out": True}, 0: {"attack": AttackConfig(fake_beta_hat=1.0)}}
    status, summaries = _run(cfg, options)
    rows = _rows(cfg)
    assert [r.nfl for r in rows[:2]] == ["watching", "reported"], [(r.round, r.beta_hat, r.nfl) for r in rows]
    assert rows[1].nfl_count == 2 and rows[1].recovery and rows[0].beta_hat < 0 and rows[1].beta_hat_avg < 0
    assert all(r.nfl == "reported" and r.recovery for r in rows[1:])
    # Rounds 3..5 ran with the system's recovery flag; in round 2 the clients had already started adapting on
    # their own (individual-level measures: their own beta_hat_i < 0 in 2 rounds > NR). The holdout never adapts.
    assert [r.adapting for r in rows] == [0, N - 1, N - 1, N - 1, N - 1]
    assert all(r.holdouts == 1 for r in rows)
    assert all(r.beta_holdout == r.beta_holdout and r.beta_adapting == r.beta_adapting for r in rows)
    by_id = {s.client_id: s for s in summaries}
    assert all(h["adapting"] == 0.0 and h["infers_adapted"] == 0.0 for h in by_id["client-4"].history)
    assert [h["adapting"] for h in by_id["client-1"].history] == [0.0, 1.0, 1.0, 1.0, 1.0]
    # GetStatus carries the detector's state.
    assert status.nfl.state == "reported" and status.nfl.reported_round == 2 and status.nfl.recovery
    assert status.nfl.mode == "detect-and-recover" and status.nfl.detector == "beta_hat"
    assert [h.nfl for h in status.history] == [r.nfl for r in rows]


def test_the_detector_state_survives_a_server_restart(tmp_path: Path) -> None:
    """3 rounds, a restart on the same run dir, 2 more: the same detector state as 5 rounds in one go. The paper's
    rule (beta_hat), whose negative count is already > 0 by then (the default's start-up guard may still be waiting
    at round 5; the guards' state across save/load is pinned in tests/unit/test_nfl_guard.py)."""
    straight = _config(tmp_path, "straight", rounds=5, nr=1000, detector="beta_hat")
    status_straight, _ = _run(straight)
    first = _config(tmp_path, "resumed", rounds=3, nr=1000, detector="beta_hat")
    _run(first)
    resumed = _config(tmp_path, "resumed", rounds=5, nr=1000, detector="beta_hat")
    status_resumed, _ = _run(resumed)
    assert status_resumed.resumed_from == 3
    assert status_resumed.nfl == status_straight.nfl
    assert status_resumed.nfl.count == status_straight.nfl.count > 0
    assert [r.beta_hat_avg for r in _rows(resumed)] == [r.beta_hat_avg for r in _rows(straight)]


def test_a_beta_hat_outside_minus_one_one_is_refused(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=0.1).start()
    ch, s = stub(srv.address)
    try:
        sid = s.Join(pb.JoinRequest(client_id="c", capabilities=pb.Capabilities(num_train_samples=10))).session_id
        mark_ready(s, [sid])
        header, state = pull_model(s, sid)
        assert isinstance(header, pb.TaskHeader) and state is not None
        with pytest.raises(grpc.RpcError) as err:
            s.PushUpdate(update_messages(sid, header.round, state, beta_hat=1.5), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "beta_hat must be in [-1, 1]" in (err.value.details() or "")
        # The same update with a valid beta_hat is accepted: nothing was lost.
        s.PushUpdate(update_messages(sid, header.round, state, beta_hat=-0.25), timeout=10)
    finally:
        ch.close()
        srv.stop()
