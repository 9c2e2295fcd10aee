"""A real federation over gRPC on loopback: server thread plus FedClient threads."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedclient import ClientConfig, FedClient, FedClientError
from fedcore.models import build_model
from fedcore.serialization import load_state
from fedcore.simulation import SimulationConfig
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import OPERATOR_MD, run_federation, server_config, stub


def _client(address: str, i: int, **kw: object) -> FedClient:
    return FedClient(ClientConfig(insecure=True, server=address, client_id=f"client-{i}", data_index=i, long_poll_s=5.0,
                                  **kw))  # type: ignore[arg-type]


def test_five_clients_three_rounds_accuracy_rises(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 3, "clients_per_round": 5},
                        training={"local_epochs": 2, "learning_rate": 0.05})
    status, summaries = run_federation(cfg, 5)
    assert status is not None and status.finished and status.outcome == "completed"
    hist = status.history
    assert [h.round for h in hist] == [1, 2, 3]
    assert all(h.accepted == 5 and h.rejected == 0 for h in hist)
    # Round r's accuracy is that of w^{r-1} on the clients' local test splits: it must rise.
    acc = [h.mean_test_accuracy for h in hist]
    assert acc[2] > acc[0] + 0.1, acc
    assert hist[2].mean_train_loss < hist[0].mean_train_loss
    assert all(s.finished and s.rounds_trained == 3 and s.updates_accepted == 3 for s in summaries)
    final, extra = load_state(tmp_path / "run" / "final_model.fgt")
    assert extra["rounds"] == 3
    assert not all(torch.equal(final[k], v) for k, v in build_model("mlp", seed=0).state_dict().items())
    lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == 3
    # A fresh federation in the same run directory starts its own record; the old one is moved aside.
    one_round = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    again = ServerThread(one_round, linger_s=0.5, fresh=True).start()
    extra = _client(again.address, 0).start()
    again.wait(60)
    extra.join(30)
    assert len((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()) == 1
    (old,) = (tmp_path / "run" / "previous").iterdir()
    assert len((old / "rounds.jsonl").read_text().splitlines()) == 3
    assert (old / "state").is_dir() and (old / "final_model.fgt").exists()


def test_client_cuts_its_update_to_the_servers_chunk_size(tmp_path: Path) -> None:
    # The model (18 KB) is larger than one message the server takes (8 KiB): both directions must chunk.
    cfg = server_config(tmp_path, server={"chunk_bytes": 4096, "max_message_bytes": 8192},
                        rounds={"num_rounds": 2, "clients_per_round": 2})
    status, summaries = run_federation(cfg, 2, timeout=60)
    assert status is not None and status.outcome == "completed"
    assert [h.accepted for h in status.history] == [2, 2]
    assert all(s.updates_accepted == 2 and s.updates_rejected == 0 for s in summaries)


def test_status_and_health_services(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 2})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        ch, s = stub(srv.address)
        # Operator-only: refused without the credential, and with a wrong one.
        for md in (None, (("fg-operator", "wrong"),)):
            with pytest.raises(grpc.RpcError) as refused:
                s.GetStatus(pb.StatusRequest(), timeout=5, metadata=md)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        st = s.GetStatus(pb.StatusRequest(), timeout=5, metadata=OPERATOR_MD)
        assert st.round == 1 and st.phase == pb.FEDERATION_PHASE_SAMPLING and st.num_rounds == 1
        assert st.clients_known == 0
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "fedguard.v1.Federation"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        sid = s.Join(pb.JoinRequest(client_id="x"), timeout=5).session_id
        assert s.GetStatus(pb.StatusRequest(), timeout=5, metadata=OPERATOR_MD).clients_known == 1
        # A client with its session sees the federation's progress and nothing about other clients.
        own = s.GetStatus(pb.StatusRequest(session_id=sid), timeout=5)
        assert own.round == 1 and own.num_rounds == 1 and own.clients_known == 0 and not own.history
        ch.close()
    finally:
        srv.stop()


def test_embedded_client_runs_in_a_thread_and_stops_cleanly(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1000, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        client = _client(srv.address, 0).start()
        deadline = time.monotonic() + 30
        while client.summary.updates_accepted < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.summary.updates_accepted >= 2
        t0 = time.monotonic()
        client.stop(timeout=10)
        assert not client.running
        assert time.monotonic() - t0 < 5
        assert not client.summary.finished
        # It left: the server no longer counts it as alive.
        assert srv.call(lambda: srv.coordinator.state.clients["client-0"].alive) is False  # type: ignore[union-attr]
    finally:
        srv.stop()


def test_client_refuses_a_model_that_does_not_match_the_federation(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        c = FedClient(ClientConfig(insecure=True,
                                   server=srv.address, client_id="odd"), model=build_model("mlp", {"hidden": [8]}))
        with pytest.raises(FedClientError, match=r"model mismatch.*fingerprint"):
            c.run()
    finally:
        srv.stop()


def test_client_gives_up_clearly_when_no_server_answers() -> None:
    c = FedClient(ClientConfig(insecure=True, server="127.0.0.1:9", give_up_after_s=1.0, backoff_initial_s=0.05,
                               backoff_max_s=0.2))
    t0 = time.monotonic()
    with pytest.raises(FedClientError, match="unreachable"):
        c.run()
    assert time.monotonic() - t0 < 10
    assert c.summary.reconnects >= 2


def test_client_rejoins_after_the_server_restarts(tmp_path: Path) -> None:
    from fedlaunch.supervise import free_server_port

    port = free_server_port()  # P + 1 free too: the server's "auto" framed port
    first = server_config(tmp_path, server={"address": f"127.0.0.1:{port}"},
                          rounds={"num_rounds": 1000, "clients_per_round": 1})
    srv = ServerThread(first, linger_s=0.1).start()
    client = FedClient(ClientConfig(insecure=True, server=f"127.0.0.1:{port}", client_id="phoenix", long_poll_s=1.0,
                                    backoff_initial_s=0.05, backoff_max_s=0.5)).start()
    deadline = time.monotonic() + 30
    while client.summary.updates_accepted < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.stop()
    second = server_config(tmp_path / "b", server={"address": f"127.0.0.1:{port}"},
                           rounds={"num_rounds": 2, "clients_per_round": 1})
    srv2 = ServerThread(second, linger_s=1.0).start()
    status = srv2.wait(60)
    client.join(30)
    assert status is not None and status.outcome == "completed"
    assert client.summary.finished and client.summary.rejoins >= 1
    assert "phoenix" in srv2.coordinator.state.clients  # type: ignore[union-attr]


def test_unreachable_min_clients_stalls_instead_of_waiting_forever(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 3, "sampling_timeout_s": 0.5})
    srv = ServerThread(cfg, linger_s=0.1).start()
    status = srv.wait(30)
    assert status is not None and status.outcome == "stalled" and status.finished
    assert math.isclose(len(status.history), 0)


def test_unknown_session_is_unauthenticated(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=0.1).start()
    try:
        ch, s = stub(srv.address)
        for call in (lambda: s.Heartbeat(pb.HeartbeatRequest(session_id="nope"), timeout=5),
                     lambda: list(s.PullTask(pb.PullTaskRequest(session_id="nope"), timeout=5)),
                     lambda: s.Leave(pb.LeaveRequest(session_id="nope"), timeout=5)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ch.close()
    finally:
        srv.stop()


def test_heartbeats_keep_a_slow_client_alive_past_the_patience(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, server={"heartbeat_interval_s": 0.2, "heartbeat_patience_s": 0.6},
                        rounds={"num_rounds": 2, "clients_per_round": 1, "round_timeout_s": 10.0})
    srv = ServerThread(cfg, linger_s=0.5).start()
    client = _client(srv.address, 0, simulation=SimulationConfig(straggler_delay_s=1.5)).start()
    status = srv.wait(60)
    client.join(10)
    assert status is not None and status.outcome == "completed"
    assert [h.accepted for h in status.history] == [1, 1]
    assert client.summary.updates_accepted == 2


def test_a_client_that_goes_silent_is_dropped_and_the_round_is_rerun(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, server={"heartbeat_interval_s": 0.2, "heartbeat_patience_s": 0.6},
                        rounds={"num_rounds": 1, "clients_per_round": 1, "round_timeout_s": 30.0})
    srv = ServerThread(cfg, linger_s=0.2).start()
    try:
        ch, s = stub(srv.address)
        ghost = s.Join(pb.JoinRequest(client_id="ghost"), timeout=5).session_id
        msgs = list(s.PullTask(pb.PullTaskRequest(session_id=ghost, max_wait_s=2), timeout=10))
        assert msgs[0].WhichOneof("kind") == "header"
        # The ghost never uploads nor heartbeats; a live client arrives and finishes the round instead.
        live = _client(srv.address, 1).start()
        status = srv.wait(30)
        live.join(10)
        assert status is not None and status.outcome == "completed"
        assert srv.coordinator.state.clients["ghost"].alive is False  # type: ignore[union-attr]
        assert live.summary.updates_accepted == 1
        ch.close()
    finally:
        srv.stop()


def test_client_identity_survives_a_restart_through_its_state_dir(tmp_path: Path) -> None:
    a = FedClient(ClientConfig(state_dir=str(tmp_path / "state")))
    b = FedClient(ClientConfig(state_dir=str(tmp_path / "state")))
    c = FedClient(ClientConfig(state_dir=str(tmp_path / "other")))
    assert a.client_id == b.client_id != c.client_id


def test_the_server_stays_until_a_client_told_that_the_federation_finished_has_left(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """"Finished" written is not "finished" read (ten thousand answers queued at once; a host of a thousand clients
    on two cores): the server stays, within its linger, until the client told has left, then stops at once. A
    server that stopped once it had *told* every client cut the late reader off, and that client retried a server
    that was gone until its give_up_after_s, then failed (a 10,000-client run, issue 30)."""
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=20.0).start()
    ch, s = stub(srv.address)
    try:
        # Joined, alive, never polled: not selectable, so the round is the worker's alone.
        late = s.Join(pb.JoinRequest(client_id="late"), timeout=5).session_id
        worker = _client(srv.address, 0).start()
        assert worker.join(60).finished
        (first,) = s.PullTask(pb.PullTaskRequest(session_id=late, max_wait_s=5.0), timeout=10)
        assert first.wait.finished
        time.sleep(1.0)  # the answer read late: the old server had stopped ~0.5 s after telling the last client
        s.Leave(pb.LeaveRequest(session_id=late, reason="done"), timeout=5)
        t0 = time.monotonic()
        status = srv.wait(15)
        assert status is not None and status.finished
        assert time.monotonic() - t0 < 5.0  # its Leave ended the linger, not the 20 s
    finally:
        ch.close()
        srv.stop()
    assert "federation.linger_ended" not in capsys.readouterr().err


def test_a_client_that_never_leaves_is_named_when_the_linger_ends(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=0.5).start()
    ch, s = stub(srv.address)
    try:
        s.Join(pb.JoinRequest(client_id="silent"), timeout=5)
        assert _client(srv.address, 0).start().join(60).finished
        status = srv.wait(15)
        assert status is not None and status.finished
    finally:
        ch.close()
        srv.stop()
    out = capsys.readouterr()
    line = next(x for x in (out.out + out.err).splitlines() if "federation.linger_ended" in x)
    assert "never_told=1" in line and "told_not_left=0" in line and "silent" in line, line


@pytest.mark.parametrize("bound", [3, 20_000])
def test_calls_that_arrive_while_the_server_is_busy_wait_for_it_up_to_max_pending_calls(tmp_path: Path,
                                                                                         bound: int) -> None:
    """A fleet acts at once (ten thousand joins; ten thousand Leaves when the federation ends) while the event loop is
    busy: the calls wait in gRPC's backlog until the loop takes them up. gRPC's own bound (1,000, random early
    cancelling to 3,000) answered CANCELLED before any check ran (a 10,000-client run: joins retried, Leaves lost);
    ``server.max_pending_calls`` is the one bound, and below it no call is cancelled."""
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1},
                        server={"max_pending_calls": bound})
    srv = ServerThread(cfg, linger_s=0.2).start()
    ch, _ = stub(srv.address)
    try:
        h = health_pb2_grpc.HealthStub(ch)
        h.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connected
        blocked = threading.Thread(target=srv.call, args=(lambda: time.sleep(1.5),), daemon=True)
        blocked.start()  # the loop is busy: what arrives now waits in gRPC's backlog
        time.sleep(0.2)
        calls = [h.Check.future(health_pb2.HealthCheckRequest(), timeout=20) for _ in range(12)]
        codes = []
        for c in calls:
            try:
                c.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        blocked.join()
    finally:
        ch.close()
        srv.stop()
    if bound > 12:
        assert codes == [grpc.StatusCode.OK] * 12
    else:  # beyond the bound: cancelled by gRPC (the client retries); the first ones waited and were answered
        assert codes.count(grpc.StatusCode.CANCELLED) >= 12 - bound - 4, codes
        assert codes.count(grpc.StatusCode.OK) >= 1, codes


def test_the_linger_waits_while_clients_keep_leaving(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``linger_s`` bounds the wait *between* two Leaves, not the whole: ten thousand clients take seconds to get
    through theirs, and a fixed total would name the slow tail as lost."""
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1})
    srv = ServerThread(cfg, linger_s=1.5).start()
    ch, s = stub(srv.address)
    try:
        late = [s.Join(pb.JoinRequest(client_id=f"late-{i}"), timeout=5).session_id for i in range(4)]
        assert _client(srv.address, 0).start().join(60).finished
        t0 = time.monotonic()
        for sid in late:  # told, then gone 0.5 s apart: 2 s in all, each well within the 1.5 s linger of the last
            (first,) = s.PullTask(pb.PullTaskRequest(session_id=sid, max_wait_s=5.0), timeout=10)
            assert first.wait.finished
            time.sleep(0.5)
            s.Leave(pb.LeaveRequest(session_id=sid, reason="done"), timeout=5)
        assert time.monotonic() - t0 > 1.5
        status = srv.wait(15)
        assert status is not None and status.finished
    finally:
        ch.close()
        srv.stop()
    assert "federation.linger_ended" not in capsys.readouterr().err
