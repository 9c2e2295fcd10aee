"""Security over real gRPC on loopback: the client's trust boundary, TLS and mutual TLS, identity bound to each
request (certificates and signed requests), bounded resources, and secrets kept out of the run dir."""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedclient import ClientConfig, FedClient, FedClientError
from fedclient.errors import FedClientRefused
from fedcore.config import FederationInfo, TrainingConfig
from fedcore.models import build_model, model_manifest
from fedcore.serialization import pack
from fedguard import wire
from fedguard.certs import enroll, generate_signing_key, issue_client_cert, read_ca, write_private, write_public
from fedguard.signing import sign_request
from fedguard.v1 import fedguard_pb2 as pb
from fedguard.v1 import fedguard_pb2_grpc as pb_grpc
from fedlaunch.credentials import make_tls_dir
from fedserver import ServerThread
from tests.integration.helpers import mark_ready, pull_model, server_config, stub, update_messages

JOIN = "/fedguard.v1.Federation/Join"


# ---- the trust boundary: a hostile server's announcement ----

def _fake_server(fed: FederationInfo) -> tuple[grpc.Server, str]:
    """A 'coordinator' that answers Join with ``fed`` (and nothing else)."""
    reply = pb.JoinReply(session_id="s" * 32, config=wire.federation_to_pb(fed), heartbeat_interval_s=1.0)

    def join(request: bytes, context: grpc.ServicerContext) -> bytes:
        return reply.SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "fedguard.v1.Federation", {"Join": grpc.unary_unary_rpc_method_handler(join)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _announcement(**changes: Any) -> FederationInfo:
    spec = tuple(model_manifest(build_model("mlp")))
    base = dict(federation_id="evil", model_name="mlp", model_kwargs={}, model_fingerprint="", model_spec=spec,
                training=TrainingConfig(), dataset="synthetic", data_options={}, num_rounds=1, seed=0)
    return FederationInfo(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "field"), [
    ({"model_name": "os:system", "model_kwargs": {"command": "touch {marker}"}}, "model_name"),
    ({"model_name": "tests.integration._evil_factory:factory"}, "model_name"),
    ({"dataset": "npz", "data_options": {"path": "{marker}"}}, "data_options_json.path"),
    ({"dataset": "cifar10", "data_options": {"source": "pickle"}}, "data_options_json.source"),
    ({"dataset": "cifar10", "data_options": {"data_dir": "{marker}"}}, "data_options_json.data_dir"),
    ({"dataset": "mnist", "data_options": {"download": True}}, "data_options_json.download"),
])
def test_a_hostile_announcement_is_refused_and_nothing_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            changes: dict[str, Any], field: str) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv("FEDGUARD_EVIL_MARKER", str(marker))
    text = json.dumps(changes).replace("{marker}", str(marker))
    server, address = _fake_server(_announcement(**json.loads(text)))
    try:
        client = FedClient(ClientConfig(insecure=True, server=address, client_id="victim", give_up_after_s=5))
        with pytest.raises(FedClientError, match=f"refused the server's announcement: FederationConfig.{field}"):
            client.run()
    finally:
        server.stop(0)
    assert not marker.exists()
    assert "tests.integration._evil_factory" not in sys.modules


def test_a_custom_model_is_named_by_the_client(tmp_path: Path) -> None:
    """The server may run a custom factory; the client names the same factory itself and is checked by
    fingerprint (the announcement alone would be refused)."""
    from tests.integration.helpers import run_federation

    name = "tests.integration.test_client_determinism:dropout_mlp"
    cfg = server_config(tmp_path, model={"name": name}, rounds={"num_rounds": 1, "clients_per_round": 1})
    status, summaries = run_federation(cfg, 1, timeout=60, linger_s=0.2, model=name)
    assert status is not None and getattr(status, "outcome", "") == "completed"
    assert summaries[0].finished


# ---- TLS and mutual TLS ----

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    good = make_tls_dir(["alice", "bob"], root / "good")
    other = make_tls_dir(["alice"], root / "other")
    ca = read_ca(good)
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    expired = issue_client_cert(ca, "alice", days=1, now=past)
    write_public(root / "expired.pem", expired.cert_pem)
    write_private(root / "expired.key", expired.key_pem)
    return {"good": good, "other": other, "root": root}


def _secure_stub(address: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> tuple[
    grpc.Channel, pb_grpc.FederationStub
]:
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes() if key else None,
                                         cert.read_bytes() if cert else None)
    ch = grpc.secure_channel(address, creds)
    return ch, pb_grpc.FederationStub(ch)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def mtls_server(pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    d = pki["good"]
    cfg = server_config(tmp_path_factory.mktemp("mtls"), rounds={"num_rounds": 3, "clients_per_round": 2},
                        security={"tls_cert": str(d / "server.pem"), "tls_key": str(d / "server.key"),
                                  "client_ca": str(d / "ca.pem")})
    srv = ServerThread(cfg, linger_s=0.1).start()
    yield srv
    srv.stop()


def test_mutual_tls_accepts_its_certificates_and_refuses_the_rest(pki: dict[str, Path],
                                                                  mtls_server: ServerThread) -> None:
    good, other, root = pki["good"], pki["other"], pki["root"]
    cid = good / "clients"
    ch, s = _secure_stub(mtls_server.address, good / "ca.pem", cid / "alice.pem", cid / "alice.key")
    assert s.Join(pb.JoinRequest(client_id="alice"), timeout=10).session_id
    ch.close()
    refused = {
        "another CA": (good / "ca.pem", other / "clients" / "alice.pem", other / "clients" / "alice.key"),
        "expired": (good / "ca.pem", root / "expired.pem", root / "expired.key"),
        "no certificate": (good / "ca.pem", None, None),
        "client does not trust the server": (other / "ca.pem", cid / "alice.pem", cid / "alice.key"),
    }
    for case, (ca, cert, key) in refused.items():
        ch, s = _secure_stub(mtls_server.address, ca, cert, key)
        with pytest.raises(grpc.RpcError) as e:
            s.Join(pb.JoinRequest(client_id="alice"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, case  # the handshake fails: no call is made
        ch.close()
    # Plaintext to a TLS server fails too.
    ch, s = stub(mtls_server.address)
    with pytest.raises(grpc.RpcError):
        s.Join(pb.JoinRequest(client_id="alice"), timeout=5)
    ch.close()


def test_with_mutual_tls_a_client_cannot_act_as_another(pki: dict[str, Path], mtls_server: ServerThread) -> None:
    cid = pki["good"] / "clients"
    ca = pki["good"] / "ca.pem"
    ch_a, alice = _secure_stub(mtls_server.address, ca, cid / "alice.pem", cid / "alice.key")
    ch_b, bob = _secure_stub(mtls_server.address, ca, cid / "bob.pem", cid / "bob.key")
    with pytest.raises(grpc.RpcError) as e:
        alice.Join(pb.JoinRequest(client_id="bob"), timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "authenticated client 'alice'" in str(
        e.value.details())
    bob_session = bob.Join(pb.JoinRequest(client_id="bob"), timeout=5).session_id
    # Alice holding Bob's session id gets nowhere with it.
    for call in (lambda: alice.Heartbeat(pb.HeartbeatRequest(session_id=bob_session), timeout=5),
                 lambda: list(alice.PullTask(pb.PullTaskRequest(session_id=bob_session, max_wait_s=0), timeout=5)),
                 lambda: alice.PushUpdate(update_messages(bob_session, 1, build_model("mlp").state_dict()),
                                          timeout=5),
                 lambda: alice.Leave(pb.LeaveRequest(session_id=bob_session), timeout=5)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert bob.Heartbeat(pb.HeartbeatRequest(session_id=bob_session), timeout=5) is not None
    ch_a.close()
    ch_b.close()


# ---- signed requests (no client certificates) ----

@pytest.fixture()
def signed(tmp_path: Path) -> Iterator[tuple[ServerThread, dict[str, Path]]]:
    keys: dict[str, Path] = {}
    for name in ("client-0", "client-1", "mallory"):
        private, public = generate_signing_key()
        write_private(tmp_path / f"{name}.ed25519", private)
        keys[name] = tmp_path / f"{name}.ed25519"
        if name != "mallory":
            enroll(tmp_path / "enrolled.json", name, public)
    cfg = server_config(tmp_path, rounds={"num_rounds": 2, "clients_per_round": 2, "min_available": 2},
                        security={"insecure": True, "client_keys": str(tmp_path / "enrolled.json")})
    srv = ServerThread(cfg, linger_s=0.5).start()
    yield srv, keys
    srv.stop()


def _signed_call(channel: grpc.Channel, key_path: Path, signer: str, request: Any, body: bytes | None = None,
                 metadata: list[tuple[str, str]] | None = None) -> tuple[Any, list[tuple[str, str]]]:
    from fedguard.certs import load_signing_key

    raw = request.SerializeToString()
    md = metadata or sign_request(load_signing_key(key_path), signer, JOIN, raw, time.time())
    call = channel.unary_unary(JOIN, None, pb.JoinReply.FromString)
    return call(body if body is not None else raw, metadata=md, timeout=5), md


def test_signed_clients_train_and_unsigned_replayed_or_forged_requests_are_refused(
        signed: tuple[ServerThread, dict[str, Path]]) -> None:
    srv, keys = signed
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=2.0, signing_key=str(keys[f"client-{i}"]))).start()
               for i in range(2)]
    ch, s = stub(srv.address)
    try:
        with pytest.raises(grpc.RpcError) as e:  # unsigned
            s.Join(pb.JoinRequest(client_id="client-0"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not signed" in str(e.value.details())
        req = pb.JoinRequest(client_id="client-1")
        _, md = _signed_call(ch, keys["client-1"], "client-1", req)  # a valid signed join (a re-join)
        for case, kwargs, code in [
            ("replayed", {"metadata": md}, grpc.StatusCode.UNAUTHENTICATED),
            ("another body", {"body": pb.JoinRequest(client_id="client-0").SerializeToString()},
             grpc.StatusCode.UNAUTHENTICATED),
            ("not enrolled", {"key_path": keys["mallory"], "signer": "mallory"}, grpc.StatusCode.UNAUTHENTICATED),
            ("wrong key", {"key_path": keys["mallory"], "signer": "client-1"}, grpc.StatusCode.UNAUTHENTICATED),
            ("as another id", {"request": pb.JoinRequest(client_id="client-0")}, grpc.StatusCode.PERMISSION_DENIED),
        ]:
            args: dict[str, Any] = {"key_path": keys["client-1"], "signer": "client-1", "request": req, **kwargs}
            with pytest.raises(grpc.RpcError) as e:
                _signed_call(ch, args.pop("key_path"), args.pop("signer"), args.pop("request"), **args)
            assert e.value.code() == code, (case, e.value.details())
        status = srv.wait(60)
        assert status is not None and status.finished and status.outcome == "completed"
        for c in clients:
            summary = c.join(30)
            assert summary.finished and summary.updates_accepted == 2
    finally:
        ch.close()
        for c in clients:
            c.stop()


@pytest.mark.parametrize("skew_s", [600.0, -600.0])
def test_a_client_clock_ten_minutes_off_is_refused_naming_the_skew(signed: tuple[ServerThread, dict[str, Path]],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  skew_s: float) -> None:
    """A real FedClient whose wall clock is 10 minutes ahead or behind the server's signs its requests with that
    clock: its join is refused for good (not retried), naming the skew and the server's window
    (security.replay_window_s, 60 s by default), within seconds."""
    import fedclient.transport as transport_module

    class SkewedClock:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def time() -> float:
            return time.time() + skew_s

    monkeypatch.setattr(transport_module, "time", SkewedClock())
    srv, keys = signed
    client = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="client-0", data_index=0,
                                    long_poll_s=2.0, signing_key=str(keys["client-0"]), give_up_after_s=60.0))
    t0 = time.monotonic()
    client.start()
    with pytest.raises(FedClientRefused) as e:
        client.join(60)
    seconds = time.monotonic() - t0
    message = str(e.value)
    assert message.startswith("refused: clock skew: "), message
    side = "ahead of" if skew_s > 0 else "behind"
    assert f"request timestamp is {abs(skew_s):.0f}" in message, message
    assert f"{side} the server's clock (window 60 s): set the client's clock (NTP)" in message, message
    assert seconds < 10.0, seconds
    print(f"\nCLOCK SKEW | {skew_s:+.0f} s | {seconds:.2f} s | {message}")


# ---- bounded resources ----

@pytest.fixture()
def bounded(tmp_path: Path) -> Iterator[ServerThread]:
    state = build_model("mlp").state_dict()
    _, payload = pack(state)
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 3, "min_available": 3,
                                          "round_timeout_s": 60.0},
                        server={"stream_idle_timeout_s": 1.0, "max_buffered_bytes": int(len(payload) * 1.5)})
    srv = ServerThread(cfg, linger_s=0.1).start()
    yield srv
    srv.stop()


def _stalling(session: str, state: dict[str, torch.Tensor], release: threading.Event) -> Iterator[pb.UpdateMessage]:
    """A header and the first chunk of an update, then nothing until ``release``."""
    msgs = update_messages(session, 1, state, chunk=1024)
    yield next(msgs)
    yield next(msgs)
    release.wait(10)


def test_stalled_and_concurrent_uploads_are_bounded_and_the_round_goes_on(bounded: ServerThread) -> None:
    srv = bounded
    assert srv.servicer is not None
    limits = srv.servicer.limits
    ch, s = stub(srv.address)
    sessions = {n: s.Join(pb.JoinRequest(client_id=n), timeout=5).session_id for n in ("slow", "good", "third")}
    mark_ready(s, list(sessions.values()))
    states = {n: pull_model(s, sid)[1] for n, sid in sessions.items()}
    release = threading.Event()
    pool = futures.ThreadPoolExecutor(4)
    try:
        stalled = pool.submit(s.PushUpdate, _stalling(sessions["slow"], states["slow"], release), timeout=30)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while srv.call(lambda: limits.uploads_in_flight) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # One upload per session: a second one while the first is in flight is refused.
        with pytest.raises(grpc.RpcError) as e:
            s.PushUpdate(update_messages(sessions["slow"], 1, states["slow"]), timeout=5)  # type: ignore[arg-type]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already in flight" in str(e.value.details())
        # The byte ceiling (1.5 updates): another client's upload waits for room.
        with pytest.raises(grpc.RpcError) as e:
            s.PushUpdate(update_messages(sessions["good"], 1, states["good"]), timeout=5)  # type: ignore[arg-type]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "buffering" in str(e.value.details())
        # The stalled upload is cancelled after the idle timeout, and its reservation freed.
        with pytest.raises(grpc.RpcError) as e:
            stalled.result(timeout=10)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in str(e.value.details())
        assert srv.call(lambda: (limits.buffered, limits.uploads_in_flight)) == (0, 0)
        release.set()
        # The round goes on: every client (the stalled one included, resending) gets its update in.
        for n in ("slow", "good", "third"):
            assert s.PushUpdate(update_messages(sessions[n], 1, states[n]), timeout=10).accepted  # type: ignore[arg-type]
        status = srv.wait(20)
        assert status is not None and status.outcome == "completed" and status.history[0].accepted == 3
    finally:
        release.set()
        pool.shutdown(wait=False)
        ch.close()


def test_undecodable_absurd_and_oversized_requests_are_refused_with_reasons(
        bounded: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    srv = bounded
    ch, s = stub(srv.address)
    try:
        raw = ch.unary_unary(JOIN, None, None)
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\xff\xff\xff\xff\x0f", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "undecodable JoinRequest" in str(
            e.value.details())
        huge = "x" * (7 << 20)
        with pytest.raises(grpc.RpcError) as e:
            s.Join(pb.JoinRequest(client_id=huge), timeout=10)
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert len(str(e.value.details())) < 400
        sid = s.Join(pb.JoinRequest(client_id="ok"), timeout=5).session_id
        for wait in (math.nan, math.inf, -1.0, 1e9):
            with pytest.raises(grpc.RpcError) as e:
                list(s.PullTask(pb.PullTaskRequest(session_id=sid, max_wait_s=wait), timeout=5))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_wait_s" in str(e.value.details())
        for bad in (pb.JoinRequest(client_id="a b"), pb.JoinRequest(client_id="é"),
                    pb.JoinRequest(client_id="ok", model_fingerprint="\x1b[2J"),
                    pb.JoinRequest(client_id="ok", capabilities=pb.Capabilities(num_train_samples=1 << 62))):
            with pytest.raises(grpc.RpcError) as e:
                s.Join(bad, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            s.Leave(pb.LeaveRequest(session_id=sid, reason="r" * 10_000), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        ch.close()
    logs = capsys.readouterr()
    lines = (logs.out + logs.err).splitlines()
    assert any("rpc.refused" in line for line in lines)
    assert max(len(line) for line in lines) < 2000 and huge[:1000] not in logs.err  # client strings never in full
    assert srv.servicer is not None and srv.servicer.refused >= 9


# ---- secrets ----

def test_the_join_secret_never_lands_in_the_run_dir_or_printed_config(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from fedserver.cli import main

    secret = "hunter2-" + "s" * 20
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    assert main(["--print-config", "--insecure", "--token", secret]) == 0
    printed = capsys.readouterr().out
    assert secret not in printed and '"token": "<redacted>"' in printed
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 1},
                        server={"token_file": str(token_file)})
    srv = ServerThread(cfg, linger_s=0.1).start()
    try:
        ch, s = stub(srv.address)
        with pytest.raises(grpc.RpcError) as e:
            s.Join(pb.JoinRequest(client_id="c", token="wrong"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert s.Join(pb.JoinRequest(client_id="c", token=secret), timeout=5).session_id
        ch.close()
    finally:
        srv.stop()
    for path in Path(cfg.server.run_dir).rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in capsys.readouterr().err


def test_a_client_that_cannot_verify_the_server_says_why(pki: dict[str, Path], mtls_server: ServerThread) -> None:
    cid = pki["good"] / "clients"
    client = FedClient(ClientConfig(server=mtls_server.address, client_id="alice", ca_cert=str(pki["other"] / "ca.pem"),
                                    cert=str(cid / "alice.pem"), key=str(cid / "alice.key"), give_up_after_s=1.0,
                                    backoff_initial_s=0.05, backoff_max_s=0.2))
    # A refusal, named at the first attempt (not an outage retried until give_up_after_s).
    with pytest.raises(FedClientError, match="refused: unknown CA: TLS handshake refused") as e:
        client.run()
    assert getattr(e.value, "check", None) == "unknown CA"
