"""The framed Session transport (``server.framed_address``, fedguard/framing.py) over real sockets on loopback: the
same exchanges and checks as gRPC's Session stream, refusals as STATUS frames, TLS and mutual TLS with the
certificate's identity, a client that cannot reach the port falling back to gRPC, and bit-identical models."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedclient import ClientConfig, FedClient
from fedclient.framed import FramedError, FramedSession
from fedcore.config import ConfigError
from fedcore.serialization import Reassembler
from fedguard import framing, wire
from fedguard.v1 import fedguard_pb2 as pb
from fedlaunch.credentials import make_tls_dir
from fedserver import ServerThread
from tests.integration.helpers import mark_ready, server_config, stub, update_messages

TOKEN = "s3cret"


def _pull(fs: FramedSession, session: str, max_wait: float = 5.0) -> tuple[pb.TaskHeader | pb.Wait, Any]:
    fs.send([pb.SessionRequest(pull=pb.PullTaskRequest(session_id=session, max_wait_s=max_wait)).SerializeToString()])
    first = pb.SessionReply.FromString(fs.reply())
    if first.WhichOneof("kind") == "wait":
        return first.wait, None
    h = first.header
    asm = Reassembler(wire.metas_from_pb(h.tensors), h.total_bytes)
    while asm.received < asm.expected:
        m = pb.SessionReply.FromString(fs.reply())
        asm.feed(m.chunk.offset, m.chunk.data)
    return h, asm.finish()


def _push(fs: FramedSession, messages: Iterator[pb.UpdateMessage]) -> pb.SessionReply:
    fs.send([m.SerializeToString() for m in messages])  # UpdateMessage's fields are SessionRequest's
    return pb.SessionReply.FromString(fs.reply())


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[tuple[ServerThread, Any, int]]:
    cfg = server_config(tmp_path, server={"token": TOKEN, "chunk_bytes": 4096, "framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": 2, "clients_per_round": 2, "min_updates": 1, "round_timeout_s": 30.0})
    srv = ServerThread(cfg, linger_s=0.1).start()
    ch, s = stub(srv.address)
    port = s.Join(pb.JoinRequest(client_id="probe", token=TOKEN), timeout=5).framed_port
    assert port and port != srv.port  # announced at join
    yield srv, s, port
    ch.close()
    srv.stop()


def _connect(srv: ServerThread, port: int) -> FramedSession:
    return FramedSession.connect(ClientConfig(insecure=True, server=srv.address), port)


def _join(s: Any, name: str) -> str:
    return str(s.Join(pb.JoinRequest(client_id=name, token=TOKEN), timeout=5).session_id)


def test_a_round_on_the_framed_port(federation: tuple[ServerThread, Any, int]) -> None:
    """Pull, task, update, pushed on one framed connection per device, model chunks included (chunk_bytes 4 KiB);
    the round closes with both updates."""
    srv, s, port = federation
    sessions = {name: _join(s, name) for name in ("a", "b")}
    mark_ready(s, sessions.values())
    conns = {name: _connect(srv, port) for name in sessions}
    for name, fs in conns.items():
        header, state = _pull(fs, sessions[name], max_wait=10.0)
        assert isinstance(header, pb.TaskHeader) and header.round == 1
        reply = _push(fs, update_messages(sessions[name], 1, {k: v + 0.01 for k, v in state.items()}))
        assert reply.WhichOneof("kind") == "pushed" and reply.pushed.accepted
    srv.wait_for_round(1, timeout=20)
    assert [(r.round, r.accepted) for r in srv.status().history] == [(1, 2)]
    for fs in conns.values():
        fs.cancel()


@pytest.mark.parametrize(("case", "code", "text"), [
    ("wrong_shape", grpc.StatusCode.INVALID_ARGUMENT, "has shape [3, 3], expected"),
    ("other_session", grpc.StatusCode.UNAUTHENTICATED, "unknown session"),
    ("chunk_first", grpc.StatusCode.INVALID_ARGUMENT, "starts with a pull or an update header, not chunk"),
])
def test_a_refusal_arrives_as_its_status_and_is_recorded(federation: tuple[ServerThread, Any, int], case: str,
                                                         code: grpc.StatusCode, text: str) -> None:
    srv, s, port = federation
    sid, sid_b = _join(s, "a"), _join(s, "b")
    mark_ready(s, [sid, sid_b])
    fs = _connect(srv, port)
    header, state = _pull(fs, sid, max_wait=10.0)
    assert isinstance(header, pb.TaskHeader)
    bad = {k: v.clone() for k, v in state.items()}
    if case == "wrong_shape":
        bad[next(iter(bad))] = torch.zeros(3, 3)
    messages = list(update_messages("f" * 32 if case == "other_session" else sid, 1, bad))
    if case == "chunk_first":
        messages = messages[1:]
    with pytest.raises(FramedError) as e:
        _push(fs, iter(messages))
    assert e.value.code() == code and text in e.value.details(), e.value.details()
    assert fs.broken
    rejected = srv.call(lambda: dict(srv.coordinator.state.rejected))
    assert ("a" in rejected) == (case == "wrong_shape"), rejected  # recorded against a's update, as on gRPC
    again = _connect(srv, port)  # a new connection goes on: a's update, or (a's refused for the round) b's
    if case == "wrong_shape":
        header, state = _pull(again, sid_b, max_wait=10.0)
        assert isinstance(header, pb.TaskHeader)
    assert _push(again, update_messages(sid_b if case == "wrong_shape" else sid, 1, state)).pushed.accepted
    again.cancel()


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


@pytest.mark.parametrize("case", ["preamble", "oversized", "kind"])
def test_a_broken_format_is_refused_with_its_reason(federation: tuple[ServerThread, Any, int], case: str) -> None:
    """Not fedguard's preamble (a gRPC or HTTP client at the wrong port), a frame over server.max_message_bytes
    (refused on its header: nothing of it is sent, nothing buffered), an unknown frame kind: a STATUS frame says
    why, the connection closes, the refusal is counted and logged (rpc.refused)."""
    srv, _, port = federation
    before = srv.servicer.refused
    sock = _raw(port)
    bound = srv.config.server.max_message_bytes
    sock.sendall({"preamble": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                  "oversized": framing.MAGIC + framing.frame_header(framing.MESSAGE, bound + 1),
                  "kind": framing.MAGIC + framing.frame_header(9, 3) + b"abc"}[case])
    data = _read_all(sock)
    sock.close()
    assert data.startswith(framing.MAGIC)
    reader = framing.FrameReader(1 << 20)
    reader.feed(data)
    kind, payload = reader.frames.popleft()
    assert kind == framing.STATUS
    code, details = framing.parse_status(payload)
    assert (code, details.split(" (")[0].split(" of ")[0]) == {
        "preamble": ("INVALID_ARGUMENT", "not a fedguard framed session"),
        "oversized": ("RESOURCE_EXHAUSTED", "a frame"),
        "kind": ("INVALID_ARGUMENT", "unknown frame kind 9")}[case], details
    if case == "oversized":
        assert str(bound) in details
    assert srv.servicer.refused == before + 1


def test_connections_over_the_bound_are_refused_and_the_held_ones_go_on(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, server={"token": TOKEN, "framed_address": "127.0.0.1:0",
                                          "framed_max_connections": 2},
                        rounds={"num_rounds": 1, "clients_per_round": 2})
    with ServerThread(cfg, linger_s=0.1) as srv:
        ch, s = stub(srv.address)
        sid = _join(s, "a")
        held = [_connect(srv, srv.servicer.framed_port) for _ in range(2)]
        over = _connect(srv, srv.servicer.framed_port)
        with pytest.raises(FramedError) as e:
            _pull(over, sid, max_wait=0.1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.framed_max_connections" in e.value.details()
        for fs in held:  # the two held ones are served
            wait, _ = _pull(fs, sid, max_wait=0.1)
            assert isinstance(wait, pb.Wait)
            fs.cancel()
        deadline = time.monotonic() + 10
        while True:  # room again once the server has seen them close
            again = _connect(srv, srv.servicer.framed_port)
            try:
                assert isinstance(_pull(again, sid, max_wait=0.1)[0], pb.Wait)
                break
            except FramedError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        again.cancel()
        ch.close()


def test_a_connection_that_goes_away_ends_its_parked_poll(federation: tuple[ServerThread, Any, int]) -> None:
    """As a cancelled gRPC call does: the device's long-poll no longer counts as its contact."""
    srv, s, port = federation
    sid = _join(s, "a")
    fs = _connect(srv, port)
    fs.send([pb.SessionRequest(pull=pb.PullTaskRequest(session_id=sid, max_wait_s=30)).SerializeToString()])
    deadline = time.monotonic() + 10
    while "a" not in srv.call(srv.coordinator.polls.connected) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "a" in srv.call(srv.coordinator.polls.connected)
    fs.cancel()
    while "a" in srv.call(srv.coordinator.polls.connected) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "a" not in srv.call(srv.coordinator.polls.connected)


def test_a_connection_that_never_speaks_is_ended_within_the_stream_idle_timeout(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, server={"token": TOKEN, "stream_idle_timeout_s": 0.3,
                                          "framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": 1, "clients_per_round": 2, "round_timeout_s": 60.0})
    with ServerThread(cfg, linger_s=0.1) as srv:
        fs = _connect(srv, srv.servicer.framed_port)
        started = time.monotonic()
        with pytest.raises(FramedError) as e:
            fs.reply()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
        assert time.monotonic() - started < 10  # 0.3 s, not the 60 s round


def _federation(tmp_path: Path, framed: bool, **security: Any) -> tuple[torch.Tensor, list[Any], int]:
    """Three clients, three rounds; the global model, the clients' summaries, the framed connections served."""
    from fedserver import framed as framed_module

    served = []
    made = framed_module._Connection.connection_made

    def counting(self: Any, transport: Any) -> None:
        served.append(1)
        made(self, transport)

    sections: dict[str, Any] = {"security": security} if security else {}
    cfg = server_config(tmp_path, server={"framed_address": "127.0.0.1:0" if framed else ""},
                        rounds={"num_rounds": 3, "clients_per_round": 3, "seed": 5}, **sections)
    mp = pytest.MonkeyPatch()
    mp.setattr(framed_module._Connection, "connection_made", counting)
    try:
        with ServerThread(cfg, linger_s=0.5) as srv:
            clients = []
            for i in range(3):
                opts: dict[str, Any] = {"insecure": True}
                if security:
                    d = Path(security["client_ca"]).parent
                    opts = {"ca_cert": str(d / "ca.pem"), "cert": str(d / "clients" / f"client-{i}.pem"),
                            "key": str(d / "clients" / f"client-{i}.key"), "server_name": "localhost"}
                clients.append(FedClient(ClientConfig(server=srv.address, client_id=f"client-{i}", data_index=i,
                                                      long_poll_s=5.0, **opts)).start())
            status = srv.wait(90)
            assert status is not None and status.outcome == "completed", status
            summaries = [c.join(30) for c in clients]
            flat = torch.cat([t.reshape(-1) for t in srv.global_model().state_dict().values()])
    finally:
        mp.undo()
    return flat, summaries, len(served)


def test_the_framed_transport_changes_no_number(tmp_path: Path) -> None:
    """The same federation on the framed port and on gRPC's Session stream: bit-identical global models; every
    client's exchanges went over the framed port (one connection each, none refused or replaced)."""
    framed, summaries, served = _federation(tmp_path / "framed", True)
    grpc_only, _, none = _federation(tmp_path / "grpc", False)
    assert all(s.finished and s.rounds_trained == 3 and s.reconnects == 0 for s in summaries), summaries
    assert served == 3 and none == 0
    assert torch.equal(framed.view(torch.int32), grpc_only.view(torch.int32))


def test_mutual_tls_on_the_framed_port_holds_each_client_to_its_certificate(tmp_path: Path) -> None:
    """With mutual TLS the framed port asks for the client certificate as gRPC's does, and the certificate's id is
    the one the session must belong to: a federation of mTLS clients completes over it; alice's certificate with
    bob's session is refused PERMISSION_DENIED; no certificate, or one of another CA, fails the handshake."""
    d = make_tls_dir([f"client-{i}" for i in range(3)] + ["alice", "bob"], tmp_path / "pki")
    other = make_tls_dir(["alice"], tmp_path / "other")
    security = {"tls_cert": str(d / "server.pem"), "tls_key": str(d / "server.key"), "client_ca": str(d / "ca.pem")}
    _, summaries, served = _federation(tmp_path / "fed", True, **security)
    assert served == 3 and all(s.rounds_trained == 3 for s in summaries), summaries

    cfg = server_config(tmp_path / "single", server={"framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": 1, "clients_per_round": 2}, security=security)
    with ServerThread(cfg, linger_s=0.1) as srv:
        port = srv.servicer.framed_port

        def config(name: str, ca: Path = d) -> ClientConfig:
            return ClientConfig(server=srv.address, ca_cert=str(ca / "ca.pem"), server_name="localhost",
                                cert=str(ca / "clients" / f"{name}.pem"), key=str(ca / "clients" / f"{name}.key"))

        creds = grpc.ssl_channel_credentials((d / "ca.pem").read_bytes(), (d / "clients" / "bob.key").read_bytes(),
                                             (d / "clients" / "bob.pem").read_bytes())
        ch = grpc.secure_channel(srv.address, creds, options=[("grpc.ssl_target_name_override", "localhost")])
        from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

        bob = pb_grpc.FederationStub(ch).Join(pb.JoinRequest(client_id="bob"), timeout=10).session_id
        ch.close()
        with FramedSession.connect(config("alice"), port) as fs:
            with pytest.raises(FramedError) as e:
                _pull(fs, bob)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
            assert "authenticated client 'alice'" in e.value.details()
        with FramedSession.connect(config("bob"), port) as fs:
            wait, _ = _pull(fs, bob, max_wait=0.1)  # bob's own session: answered
            assert isinstance(wait, pb.Wait)
        refused: list[tuple[str, str, str]] = []
        event = srv.servicer.refusals.event

        def record(name: str, peer: str, kind: str, **fields: Any) -> bool:
            refused.append((name, peer, fields.get("reason", "")))
            return event(name, peer, kind, **fields)

        srv.servicer.refusals.event = record  # type: ignore[method-assign]
        for bad in (ClientConfig(server=srv.address, ca_cert=str(d / "ca.pem"), server_name="localhost"),
                    ClientConfig(server=srv.address, ca_cert=str(d / "ca.pem"), server_name="localhost",
                                 cert=str(other / "clients" / "alice.pem"), key=str(other / "clients" / "alice.key")),
                    config("alice", other)):
            with pytest.raises((OSError, FramedError)):  # the handshake, or the first read after it, fails
                fs = FramedSession.connect(bad, port)
                _pull(fs, bob, max_wait=0.1)
        deadline = time.monotonic() + 10
        while len(refused) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        # The server names each refused handshake, with the peer's address (gRPC's core line carries none).
        assert [(name, reason) for name, _, reason in refused] == [
            ("tls.handshake_refused", "client certificate required"),
            ("tls.handshake_refused", "unknown CA (client certificate not signed by the client CA)"),
            ("tls.handshake_refused", "the client does not trust this server's certificate (unknown CA)")], refused
        assert all(peer.startswith("ipv4:127.0.0.1:") for _, peer, _ in refused), refused
        # A plaintext peer (a client run with --insecure) on the TLS framed port: named, with its address.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" * 8)
            with contextlib.suppress(OSError):
                raw.recv(64)
        deadline = time.monotonic() + 10
        while len(refused) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused[3][0] == "tls.handshake_refused" and refused[3][1].startswith("ipv4:127.0.0.1:"), refused
        assert refused[3][2] == "not TLS (a plaintext client?)", refused


def test_a_client_that_cannot_reach_the_framed_port_uses_grpc(tmp_path: Path) -> None:
    """The announced port is not reachable from the client (here: nothing listens there): each client says so once
    (client.framed_off) and completes the federation on gRPC's Session stream."""
    events: list[str] = []
    cfg = server_config(tmp_path, server={"framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": 2, "clients_per_round": 2})
    with ServerThread(cfg, linger_s=0.5) as srv:
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            closed = probe.getsockname()[1]
        srv.call(lambda: setattr(srv.servicer, "framed_port", closed))
        clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                          long_poll_s=5.0)) for i in range(2)]
        for c in clients:
            log = c.connection.log

            class Recorder:
                def __getattr__(self, name: str, log: Any = log) -> Any:
                    method = getattr(log, name)

                    def record(event: str, *args: Any, **kw: Any) -> Any:
                        events.append(event)
                        return method(event, *args, **kw)

                    return record

            c.connection.log = Recorder()
            c.start()
        status = srv.wait(60)
        assert status is not None and status.outcome == "completed", status
        assert all(c.join(30).rounds_trained == 2 for c in clients)
    assert events.count("client.framed_off") == 2  # once per client


def test_a_framed_address_in_use_is_refused_naming_the_field(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = server_config(tmp_path, server={"framed_address": f"127.0.0.1:{port}"})
        with pytest.raises(ConfigError) as e:
            ServerThread(cfg).start()
        assert e.value.field == "server.framed_address" and "--framed-address" in str(e.value)
    with pytest.raises(ConfigError) as e:
        server_config(tmp_path, server={"framed_address": "nope"})
    assert e.value.field == "server.framed_address"


# ---- hostile bytes on the framed port, while honest clients train on it ----

HOSTILE_END = {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION",
               "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"}  # never UNKNOWN or INTERNAL


def _hostile_frames() -> Any:
    from hypothesis import strategies as st

    session = st.one_of(st.text(max_size=40), st.just("f" * 32))
    pull = st.builds(lambda s, w, d: pb.SessionRequest(pull=pb.PullTaskRequest(
        session_id=s, max_wait_s=w, declined=d)).SerializeToString(),
        session, st.floats(allow_nan=True, allow_infinity=True), st.booleans())
    header = st.builds(lambda s, r, n: next(update_messages(s, r, {"w": torch.zeros(3)}, announce=n))
                       .SerializeToString(), session, st.integers(0, 2**40),
                       st.one_of(st.none(), st.integers(0, 2**40)))
    payload = st.one_of(st.binary(max_size=300), pull, header)
    frame = st.builds(lambda k, p: framing.frame_header(k, len(p)) + p,
                      st.one_of(st.just(framing.MESSAGE), st.just(framing.STATUS), st.integers(0, 255)), payload)
    return st.builds(lambda frames, cut: b"".join(frames)[:cut] if cut is not None else b"".join(frames),
                     st.lists(frame, max_size=4), st.one_of(st.none(), st.integers(0, 600)))


def test_hostile_bytes_get_a_status_and_never_an_update_in(tmp_path: Path) -> None:
    """Random and half-valid frames (undecodable payloads, pulls and update headers of made-up sessions, unknown
    kinds, frames cut anywhere) from other connections while three honest clients train on the framed port: every
    hostile connection ends with a STATUS frame of an expected code (never INTERNAL or UNKNOWN), the server keeps
    serving, every round accepts exactly the honest updates. The federation is long enough never to end before the
    hostile connections do (on a loaded machine they take longer than a few short rounds); it is stopped after."""
    from hypothesis import HealthCheck, given, settings

    from fedcore.simulation import SimulationConfig

    cfg = server_config(tmp_path, server={"framed_address": "127.0.0.1:0", "stream_idle_timeout_s": 0.3},
                        rounds={"num_rounds": 10_000, "clients_per_round": 3, "min_available": 3})
    with ServerThread(cfg, linger_s=0.5) as srv:
        port = srv.servicer.framed_port
        clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                          long_poll_s=5.0, simulation=SimulationConfig(straggler_delay_s=0.5)))
                   for i in range(3)]  # the rounds last while the hostile connections come and go
        codes: list[str] = []

        @settings(deadline=None, derandomize=True, database=None, max_examples=50,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(data=_hostile_frames())
        def hostile(data: bytes) -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                with contextlib.suppress(OSError):  # the server may refuse and close before all is sent
                    sock.sendall(framing.MAGIC + data)
                got = b""
                reader = framing.FrameReader(1 << 20)
                while True:
                    try:
                        chunk = sock.recv(65536)
                    except ConnectionResetError:
                        break
                    if not chunk:
                        break
                    got += chunk
                reader.feed(got)
                statuses = [framing.parse_status(p) for k, p in reader.frames if k == framing.STATUS]
                assert statuses, (data[:80], got[:80])
                codes.append(statuses[-1][0])
                assert statuses[-1][0] in HOSTILE_END, statuses

        hostile_error: list[BaseException] = []
        for c in clients:
            c.start()
        try:
            hostile()
        except BaseException as e:  # re-raised once the clients are stopped
            hostile_error.append(e)
        if not hostile_error:
            srv.wait_for_round(2, timeout=120)  # the server kept serving: rounds go on after the hostile bytes
        for c in clients:
            c.stop()
        summaries = [c.summary for c in clients]
        srv.stop()
        status = srv.result
        if hostile_error:
            raise hostile_error[0]
        assert status is not None and len(status.history) >= 2, status
        assert all(r.accepted == 3 and r.rejected == 0 for r in status.history), status.history
        assert all(s.rounds_trained >= 2 for s in summaries), summaries
    assert len(codes) == 50 and {"INVALID_ARGUMENT", "UNAUTHENTICATED", "OK"} <= set(codes), codes


@pytest.mark.parametrize("loop", ["auto", "asyncio"])
def test_a_certificate_revoked_while_its_poll_is_parked_is_refused_on_the_framed_port(tmp_path: Path,
                                                                                    loop: str) -> None:
    """As on gRPC (docs/security.md, "Revocation"): a changed CRL ends the parked polls at once, and the device's
    next exchange on the same framed connection is refused, naming the revocation, within seconds. On uvloop (auto)
    and on asyncio's own loop: the framed port's TLS layer is asyncio's on both."""
    from cryptography import x509

    from fedguard.certs import read_ca, revoke
    from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

    d = make_tls_dir(["alice"], tmp_path / "pki")
    crl = tmp_path / "clients.crl"
    revoke(read_ca(d), crl, [1])  # a list that names someone else
    security = {"tls_cert": str(d / "server.pem"), "tls_key": str(d / "server.key"), "client_ca": str(d / "ca.pem"),
                "crl": str(crl)}
    cfg = server_config(tmp_path / "run", server={"framed_address": "127.0.0.1:0", "event_loop": loop},
                        rounds={"num_rounds": 1, "clients_per_round": 2}, security=security)
    alice = {"cert": str(d / "clients" / "alice.pem"), "key": str(d / "clients" / "alice.key")}
    with ServerThread(cfg, linger_s=0.1) as srv:
        creds = grpc.ssl_channel_credentials((d / "ca.pem").read_bytes(), (d / "clients" / "alice.key").read_bytes(),
                                             (d / "clients" / "alice.pem").read_bytes())
        ch = grpc.secure_channel(srv.address, creds, options=[("grpc.ssl_target_name_override", "localhost")])
        sid = pb_grpc.FederationStub(ch).Join(pb.JoinRequest(client_id="alice"), timeout=10).session_id
        ch.close()
        fs = FramedSession.connect(ClientConfig(server=srv.address, ca_cert=str(d / "ca.pem"),
                                                server_name="localhost", **alice), srv.servicer.framed_port)
        wait, _ = _pull(fs, sid, max_wait=0.1)
        assert isinstance(wait, pb.Wait)  # served before the revocation
        fs.send([pb.SessionRequest(pull=pb.PullTaskRequest(session_id=sid, max_wait_s=30)).SerializeToString()])
        deadline = time.monotonic() + 10
        while "alice" not in srv.call(srv.coordinator.polls.connected) and time.monotonic() < deadline:
            time.sleep(0.02)
        serial = x509.load_pem_x509_certificate((d / "clients" / "alice.pem").read_bytes()).serial_number
        revoked_at = time.monotonic()
        revoke(read_ca(d), crl, [serial])
        ended = pb.SessionReply.FromString(fs.reply())  # the parked poll, ended by the changed list
        assert ended.WhichOneof("kind") == "wait" and "revocation list changed" in ended.wait.reason, ended
        with pytest.raises(FramedError) as e:
            _pull(fs, sid, max_wait=0.1)
        assert e.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        assert "revoked" in e.value.details(), e.value.details()
        assert time.monotonic() - revoked_at < 5, time.monotonic() - revoked_at


def test_a_stopped_server_resumes_and_its_clients_come_back_on_the_framed_port(tmp_path: Path) -> None:
    """A graceful stop ends the framed connections (UNAVAILABLE: retry); the restarted server (the same gRPC
    address, a new framed port: port 0) announces its port at the clients' re-joins, they exchange there again, and
    the federation ends with the model of an uninterrupted run over gRPC, bit for bit."""
    from fedcore.serialization import load_state
    from fedserver import framed as framed_module

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def config(run: Path, framed: bool) -> Any:
        return server_config(run, server={"address": f"127.0.0.1:{port}",
                                          "framed_address": "127.0.0.1:0" if framed else ""},
                             rounds={"num_rounds": 4, "clients_per_round": 3, "min_available": 3, "seed": 3})

    def clients(address: str) -> list[FedClient]:
        return [FedClient(ClientConfig(insecure=True, server=address, client_id=f"client-{i}", data_index=i,
                                       long_poll_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.3,
                                       give_up_after_s=60)).start() for i in range(3)]

    with ServerThread(config(tmp_path / "grpc", False), linger_s=0.5) as srv:
        reference = clients(srv.address)
        assert srv.wait(120) is not None
        for c in reference:
            c.join(30)
    served: list[int] = []
    made = framed_module._Connection.connection_made

    def counting(self: Any, transport: Any) -> None:
        served.append(self.server.servicer.framed_port)
        made(self, transport)

    mp = pytest.MonkeyPatch()
    mp.setattr(framed_module._Connection, "connection_made", counting)
    try:
        cfg = config(tmp_path / "framed", True)
        srv = ServerThread(cfg, linger_s=0.5).start()
        first_port = srv.servicer.framed_port
        devices = clients(srv.address)
        deadline = time.monotonic() + 60
        while len(srv.status().history) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.stop()
        again = ServerThread(cfg, linger_s=1.0).start()
        status = again.wait(120)
        summaries = [c.join(30) for c in devices]
    finally:
        mp.undo()
    assert status is not None and status.outcome == "completed" and status.resumed_from >= 2
    assert all(s.finished and s.rejoins >= 1 for s in summaries), summaries
    second_port = again.servicer.framed_port
    assert served.count(first_port) >= 3 and served.count(second_port) >= 3, (served, first_port, second_port)
    ours = load_state(tmp_path / "framed" / "run" / "final_model.fgt")[0]
    theirs = load_state(tmp_path / "grpc" / "run" / "final_model.fgt")[0]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_client_that_stops_reading_is_refused_and_its_connection_reset(tmp_path: Path) -> None:
    """A peer that asks for a 17 MB model and reads nothing: the replies fill the kernel's buffers and the
    connection's (1 MiB), the handler waits for room at most stream_idle_timeout_s, the refusal is logged, the rest
    of the model is never written, and after the linger the connection is dropped with what it still buffered
    (a close would wait for the peer to read it)."""
    from fedserver import framed as framed_module

    cfg = server_config(tmp_path, server={"token": TOKEN, "framed_address": "127.0.0.1:0",
                                          "stream_idle_timeout_s": 0.3},
                        model={"kwargs": {"hidden": [2048, 2048]}},
                        rounds={"num_rounds": 1, "clients_per_round": 1, "round_timeout_s": 60.0})
    with ServerThread(cfg, linger_s=0.1) as srv:
        ch, s = stub(srv.address)
        sid = _join(s, "a")
        before = srv.servicer.refused
        sock = socket.create_connection(("127.0.0.1", srv.servicer.framed_port), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        pull = pb.SessionRequest(pull=pb.PullTaskRequest(session_id=sid, max_wait_s=10)).SerializeToString()
        sock.sendall(framing.MAGIC + framing.message_frame(pull))
        deadline = time.monotonic() + 20
        while srv.servicer.refused == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.servicer.refused == before + 1  # refused while the client still had not read a byte
        time.sleep(framed_module.LINGER_S + 1.0)  # nor does it during the linger: the server resets the connection
        got, reset = bytearray(), False
        try:
            while chunk := sock.recv(1 << 20):
                got += chunk
        except ConnectionResetError:
            reset = True
        sock.close()
        ch.close()
    model_bytes = 4 * (60 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10)
    # The rest of the model was never written, and the connection ended without the client doing anything (what
    # the kernels held came out, then the end: the status and what else sat in the connection's buffer went with it).
    assert len(got) < model_bytes, (len(got), model_bytes, reset)


def test_an_app_stopping_its_client_ends_a_framed_exchange_at_once(tmp_path: Path) -> None:
    """FedClient.stop() while the client's next poll is parked on the framed connection (sent with its update; the
    round waits for a second client that never sends): the socket is shut, the blocked read returns, and the client
    has stopped within seconds, not at the end of its 30 s long-poll."""
    cfg = server_config(tmp_path, server={"token": TOKEN, "framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": 2, "clients_per_round": 2, "min_available": 2, "round_timeout_s": 60.0})
    with ServerThread(cfg, linger_s=0.1) as srv:
        ch, s = stub(srv.address)
        mark_ready(s, [_join(s, "ghost")])  # selected with lone, never answers
        lone = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="lone", data_index=0,
                                      token=TOKEN, long_poll_s=30.0)).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stream = lone.connection._stream
            if isinstance(stream, FramedSession) and lone.summary.rounds_trained == 1 and \
                    "lone" in srv.call(srv.coordinator.polls.connected):
                break
            time.sleep(0.05)
        assert isinstance(lone.connection._stream, FramedSession), lone.connection._stream
        assert "lone" in srv.call(srv.coordinator.polls.connected)
        started = time.monotonic()
        lone.stop(10)
        assert time.monotonic() - started < 5
        assert not lone.running
        ch.close()


def _federate(tmp_path: Path, on_round_end: Any = None, rounds: int = 3) -> tuple[list[Any], list[str], Path]:
    """Two FedClients over the framed port; the kinds of the replies they read there, and the run dir."""
    kinds: list[str] = []
    read = FramedSession.reply

    def recording(self: FramedSession) -> bytes:
        data = read(self)
        kinds.append(str(pb.SessionReply.FromString(data).WhichOneof("kind")))
        return data

    cfg = server_config(tmp_path, server={"framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": rounds, "clients_per_round": 2, "min_available": 2, "seed": 5})
    mp = pytest.MonkeyPatch()
    mp.setattr(FramedSession, "reply", recording)
    try:
        with ServerThread(cfg, linger_s=0.5) as srv:
            clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}",
                                              data_index=i, long_poll_s=5.0), on_round_end=on_round_end).start()
                       for i in range(2)]
            status = srv.wait(60)
            assert status is not None and status.outcome == "completed", status
            summaries = [c.join(30) for c in clients]
    finally:
        mp.undo()
    return summaries, kinds, tmp_path / "run"


def test_a_devices_round_is_one_message_each_way_unless_the_app_wants_each_round_at_once(tmp_path: Path) -> None:
    """A client sends its update with its next pull and pushed_with_answer: the answer (the next task, or the end)
    is the update's acknowledgement, and no ``pushed`` message comes. An app with an on_round_end callback is told
    of each round as soon as the server took it: its client asks for ``pushed`` (the answer's wait could be a
    long-poll). The two give the same model, bit for bit, and every update is counted as taken."""
    from fedcore.serialization import load_state

    quiet, quiet_kinds, quiet_run = _federate(tmp_path / "quiet")
    assert all(s.finished and s.updates_accepted == 3 and s.updates_rejected == 0 for s in quiet), quiet
    assert "pushed" not in quiet_kinds and quiet_kinds.count("header") >= 4, quiet_kinds  # rounds 2-3: on the port
    told: list[tuple[int, bool]] = []
    eager, eager_kinds, eager_run = _federate(tmp_path / "eager", lambda r: told.append((r.round, r.accepted)))
    assert all(s.finished and s.updates_accepted == 3 and s.updates_rejected == 0 for s in eager), eager
    assert eager_kinds.count("pushed") >= 4, eager_kinds  # rounds 2 and 3 of each client at least
    assert sorted(told) == [(r, True) for r in (1, 1, 2, 2, 3, 3)], told
    ours = load_state(quiet_run / "final_model.fgt")[0]
    theirs = load_state(eager_run / "final_model.fgt")[0]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_an_update_whose_acknowledgement_was_lost_is_sent_again_and_counted_once(tmp_path: Path) -> None:
    """The connection breaks after the server took an update and before the answer that was to acknowledge it: the
    device cannot know, sends it again on a new connection, the server (whose round holds it) answers ALREADY_EXISTS
    and records nothing against it, and the device counts it as taken, once."""
    import asyncio

    from fedcore.simulation import SimulationConfig
    from fedserver import framed as framed_module
    from fedserver.servicer import FederationServicer

    conns: list[Any] = []
    made = framed_module._Connection.connection_made

    def recording(self: Any, transport: Any) -> None:
        conns.append(self)
        made(self, transport)

    poll = FederationServicer._poll
    broke: list[int] = []

    async def breaking(self: Any, request: Any, raw: bytes, method: str, context: Any) -> Any:
        state = self.coord.state
        if not broke and self.coord.members.client_of(request.session_id) == "fast" and "fast" in state.accepted:
            broke.append(state.round)  # the pull that came with fast's update: its connection goes, unanswered
            next(c for c in conns if getattr(c, "context", None) is context).transport.abort()
            await asyncio.Event().wait()  # cancelled as the connection is lost
        return await poll(self, request, raw, method, context)

    cfg = server_config(tmp_path, server={"framed_address": "127.0.0.1:0"},
                        rounds={"num_rounds": 2, "clients_per_round": 2, "min_available": 2,
                                "round_timeout_s": 60.0})
    mp = pytest.MonkeyPatch()
    mp.setattr(framed_module._Connection, "connection_made", recording)
    mp.setattr(FederationServicer, "_poll", breaking)
    try:
        with ServerThread(cfg, linger_s=0.5) as srv:
            fast = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="fast", data_index=0,
                                          long_poll_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.2)).start()
            # The other device takes 1.5 s a round: the round is still open when fast's copy arrives.
            slow = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="slow", data_index=1,
                                          long_poll_s=5.0, simulation=SimulationConfig(straggler_delay_s=1.5))).start()
            status = srv.wait(60)
            assert status is not None and status.outcome == "completed", status
            summaries = fast.join(30), slow.join(30)
            history = [(r.round, r.accepted, r.rejected) for r in srv.status().history]
    finally:
        mp.undo()
    assert broke == [1], broke
    assert history == [(1, 2, 0), (2, 2, 0)], history
    assert all(s.finished and s.updates_accepted == 2 and s.updates_rejected == 0 for s in summaries), summaries
