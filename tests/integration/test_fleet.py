"""Cross-device fleets over real gRPC on loopback: stragglers, dropouts, crashes and availability windows against
the default round rules (issue 13)."""

from __future__ import annotations

import time
from pathlib import Path

from fedclient import ClientConfig, FedClient
from fedcore.simulation import SimulationConfig
from fedserver import ServerThread
from tests.integration.helpers import server_config


def _client(address: str, i: int, **sim: object) -> FedClient:
    return FedClient(ClientConfig(insecure=True, server=address, client_id=f"client-{i}", data_index=i, long_poll_s=2.0,
                                  trainer="noop", simulation=SimulationConfig(**sim)))  # type: ignore[arg-type]


def _run(cfg: object, sims: list[dict[str, object]], timeout: float = 120.0) -> tuple[object, list[FedClient]]:
    srv = ServerThread(cfg, linger_s=1.0).start()  # type: ignore[arg-type]
    clients = [_client(srv.address, i, **sim).start() for i, sim in enumerate(sims)]
    status = srv.wait(timeout)
    for c in clients:
        c.stop(5)
    return status, clients


def test_a_round_closes_at_its_deadline_with_stragglers_and_aggregates_only_the_on_time_updates(
        tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 2, "clients_per_round": 4, "round_timeout_s": 1.5})
    sims: list[dict[str, object]] = [{}, {}, {}, {"straggler_delay_s": 2.5}]
    status, clients = _run(cfg, sims)
    assert status is not None and status.outcome == "completed"  # type: ignore[attr-defined]
    history = status.history  # type: ignore[attr-defined]
    assert [h.outcome for h in history] == ["deadline", "deadline"]
    assert [h.accepted for h in history] == [3, 3]
    assert [h.metrics["num_updates"] for h in history] == [3.0, 3.0]  # the straggler's update is not in the model
    assert clients[3].summary.updates_rejected >= 1
    # the straggler's round-1 update arrives 1 s after the deadline: refused as late
    assert history[-1].late_total >= 1


def test_thirty_percent_dropout_and_lognormal_stragglers_complete_every_round_with_the_default_round_rules(
        tmp_path: Path) -> None:
    # Default over_select, min_updates (ceil(K/2)) and min_available; only the clocks are shortened for a test.
    cfg = server_config(tmp_path, rounds={"num_rounds": 6, "clients_per_round": 10, "round_timeout_s": 2.0},
                        server={"heartbeat_interval_s": 0.2, "heartbeat_patience_s": 1.0})
    sims: list[dict[str, object]] = [{"dropout": 0.3, "dropout_return_s": 1.5, "straggler": "lognormal",
                                      "straggler_delay_s": 0.2, "straggler_sigma": 1.0, "seed": 3}] * 10
    started = time.monotonic()
    status, _ = _run(cfg, sims, timeout=150)
    assert status is not None and status.outcome == "completed"  # type: ignore[attr-defined]
    history = status.history  # type: ignore[attr-defined]
    assert len(history) == 6 and all(h.accepted >= 5 for h in history)
    assert any(h.accepted < 10 for h in history)  # dropouts did happen
    assert time.monotonic() - started < 120


def test_a_crashed_client_rejoins_and_the_run_completes(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 4, "clients_per_round": 3, "round_timeout_s": 2.0},
                        server={"heartbeat_interval_s": 0.2, "heartbeat_patience_s": 1.0})
    sims: list[dict[str, object]] = [{}, {}, {"crash": 0.5, "crash_rejoin_s": 0.3, "seed": 1}]
    status, clients = _run(cfg, sims)
    assert status is not None and status.outcome == "completed"  # type: ignore[attr-defined]
    crashed = clients[2].summary
    assert crashed.rejoins >= 1  # it crashed at least once (seeded) and came back with a new session
    assert crashed.updates_accepted >= 1  # and took part again afterwards


def test_availability_windows_are_followed(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 3, "clients_per_round": 2, "min_available": 2,
                                          "round_timeout_s": 2.0},
                        server={"heartbeat_interval_s": 0.2, "heartbeat_patience_s": 1.0})
    srv = ServerThread(cfg, linger_s=1.0).start()
    try:
        late = _client(srv.address, 2, availability=[[2.0, 1000.0]]).start()
        short = _client(srv.address, 3, availability=[[0.0, 0.5]], straggler_delay_s=1.0).start()
        time.sleep(1.0)
        coord = srv.coordinator
        assert coord is not None
        known = srv.call(lambda: sorted(coord.state.clients))
        assert "client-2" not in known  # offline until 2 s after it started: no contact at all
        assert "client-3" in known
        short.join(20)
        assert not short.running
        # client-3's window closed before it could upload anything: nothing sent, and it is gone (no leave)
        assert short.summary.updates_accepted == 0 and not short.summary.finished
        steady = _client(srv.address, 0).start()
        status = srv.wait(90)
        assert status is not None and status.outcome == "completed"
        assert late.summary.updates_accepted >= 1  # it came online and took part
        steady.stop(5)
        late.stop(5)
    finally:
        srv.stop()
