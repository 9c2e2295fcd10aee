"""Real processes: identity without holes, and refusals that say why within seconds (issue 25, items 4-5).

Each test starts ``python -m fedserver`` (and ``python -m fedclient`` where a client is the subject) and asserts
the outcome, the one message and the time to it: a client refused by a TLS handshake or an authentication check
exits with status 4 and one line naming the check within 10 s (a server that is simply down is retried until
``--give-up-after``). Certificates come from :mod:`fedguard.certs` (an expired one is issued with a past ``now``).
``pytest -s ... | grep IDENTITY`` prints one row per case for ``docs/results/reliability.md``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fedguard.certs import (
    generate_signing_key,
    issue_client_cert,
    issue_server_cert,
    make_ca,
    write_ca,
    write_private,
    write_public,
)
from fedguard.signing import sign_request
from fedguard.v1 import fedguard_pb2 as pb
from fedlaunch.supervise import free_server_port

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "/fedguard.v1.Federation/"
# A federation that waits for clients (never starts a round): the subject is who gets in, not the training.
WAITING = ["--rounds", "1", "-k", "1000", "--model", "mlp", "--dataset", "synthetic", "--set",
           "rounds.sampling_timeout_s=600", "--linger", "0.2"]
REFUSAL_S = 10.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDGUARD_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **extra}


def _port() -> int:
    return free_server_port()  # P + 1 free too: the server's "auto" framed port


def _record(case: str, rc: int | None, seconds: float, line: str) -> None:
    print(f"\nIDENTITY | {case} | exit {rc} | {seconds:.2f} s | {line[:170]}")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    log: Path
    run_dir: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def events(self) -> list[dict[str, object]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)


def _server(tmp: Path, *args: str, env: dict[str, str] | None = None, name: str = "server",
            run_dir: Path | None = None, port: int | None = None) -> Server:
    port = port or _port()
    run_dir = run_dir or tmp / f"{name}-run"
    log = tmp / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "fedserver", "--run-dir", str(run_dir), "--address",
                             f"127.0.0.1:{port}", "--log-json", *args],
                            cwd=ROOT, env=env or _env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"),  # noqa: SIM115
                            text=True)
    srv = Server(proc, port, log, run_dir)
    deadline = time.monotonic() + 240  # importing torch on the shared, loaded test machine can take a minute
    while not any(e.get("event") == "server.listening" for e in srv.events()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"server did not start (rc {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return srv


def _client(server: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[
    int, str, float
]:
    """Run ``fedclient`` to its end: (exit code, stderr, seconds from its first connection attempt to its exit).
    The clock starts at the client's ``client.connecting`` event, not at the process start: importing torch alone
    takes 1.5 s of CPU and, on the shared 2-core test machine, up to ~15 s of wall time."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "fedclient", "--server", server, "--client-id", "probe",
                        "--torch-threads", "1", "--log-json", "--log-level", "debug", *args],
                       cwd=ROOT, env=env or _env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    ended = time.time()
    process_s = time.monotonic() - t0
    for line in p.stderr.splitlines():
        if line.startswith("{") and '"client.connecting"' in line:
            started = dt.datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
            return p.returncode, p.stderr, ended - started
    return p.returncode, p.stderr, process_s  # refused before connecting (a local check)


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("fedclient: ")]
    assert len(lines) == 1, err
    return lines[0]


def _assert_refused(case: str, rc: int, err: str, seconds: float, check: str) -> None:
    line = _one_line(err)
    _record(case, rc, seconds, line)
    assert rc == 4, err
    assert line.startswith(f"fedclient: refused: {check}: "), line
    assert seconds < REFUSAL_S, (seconds, line)


# ---- certificates ----

@dataclass
class Pki:
    dir: Path
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path

    def client(self, cid: str) -> list[str]:
        return ["--ca-cert", str(self.ca), "--cert", str(self.dir / f"{cid}.pem"), "--key",
                str(self.dir / f"{cid}.key"), "--client-id", cid]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca("test CA"), make_ca("another CA")
    write_ca(d / "ca", ca)
    write_public(d / "other-ca.pem", other.cert_pem)
    srv = issue_server_cert(ca, ["localhost", "127.0.0.1"])
    write_public(d / "server.pem", srv.cert_pem)
    write_private(d / "server.key", srv.key_pem)
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    for cid, issued in (("alice", issue_client_cert(ca, "alice")), ("bob", issue_client_cert(ca, "bob")),
                        ("old", issue_client_cert(ca, "old", days=1, now=past))):
        write_public(d / f"{cid}.pem", issued.cert_pem)
        write_private(d / f"{cid}.key", issued.key_pem)
    return Pki(d, d / "ca" / "ca.pem", d / "other-ca.pem", d / "server.pem", d / "server.key")


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _server(tmp_path_factory.mktemp("tls"), "--tls-cert", str(pki.server_cert), "--tls-key",
                  str(pki.server_key), *WAITING)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    crl = pki.dir / "clients.crl"
    subprocess.run([sys.executable, "-m", "fedguard.certs", "revoke", "--ca", str(pki.dir / "ca"), "--crl", str(crl),
                    "--serial", "1"], cwd=ROOT, env=_env(), check=True, capture_output=True)
    srv = _server(tmp_path_factory.mktemp("mtls"), "--tls-cert", str(pki.server_cert), "--tls-key",
                  str(pki.server_key), "--client-ca", str(pki.ca), "--crl", str(crl), *WAITING,
                  "--set", "server.long_poll_s=60")
    yield srv
    srv.stop()


# ---- TLS misconfigurations: the client names the check, exit 4, within 10 s ----

def test_unknown_ca(tls_server: Server, pki: Pki) -> None:
    rc, err, s = _client(tls_server.address, "--ca-cert", str(pki.other_ca))
    _assert_refused("unknown CA (server cert from another CA)", rc, err, s, "unknown CA")


def test_hostname_mismatch(tls_server: Server, pki: Pki) -> None:
    rc, err, s = _client(tls_server.address, "--ca-cert", str(pki.ca), "--server-name", "fl.example.org")
    _assert_refused("hostname mismatch (--server-name not in the server cert)", rc, err, s, "hostname mismatch")


def test_expired_client_certificate_is_refused_before_connecting(mtls_server: Server, pki: Pki) -> None:
    rc, err, s = _client(mtls_server.address, *pki.client("old"))
    _assert_refused("expired client certificate (checked locally)", rc, err, s, "expired certificate")


def test_client_certificate_required(mtls_server: Server, pki: Pki) -> None:
    rc, err, s = _client(mtls_server.address, "--ca-cert", str(pki.ca))
    _assert_refused("client certificate required (mTLS server, no --cert)", rc, err, s,
                    "client certificate required")
    # The server wrote the refused handshake as a JSON event naming the check (parsed from gRPC-core's line).
    deadline = time.monotonic() + 5
    while not [e for e in mtls_server.events() if e.get("event") == "tls.handshake_refused"]:
        assert time.monotonic() < deadline, mtls_server.log.read_text()[-2000:]
        time.sleep(0.1)
    refused = [e for e in mtls_server.events() if e.get("event") == "tls.handshake_refused"]
    assert refused[0]["reason"] == "client certificate required"


PLAINTEXT_S = 3.0  # a plaintext client against a TLS server is told so within this long (issue 53, item 8)


def test_a_plaintext_client_against_a_tls_server_is_told_so_within_seconds(tls_server: Server) -> None:
    """``fedclient --insecure`` against a TLS server: its calls end in "Socket closed", which alone could be an
    outage; the client probes the port with a TLS handshake (nothing verified or kept), finds TLS, and exits 4 naming
    the mismatch and the fix, instead of retrying until --give-up-after. The server's log names the refused
    plaintext handshake (gRPC's core line carries no peer address)."""
    rc, err, s = _client(tls_server.address, "--insecure", "--give-up-after", "60")
    _assert_refused("plaintext client against a TLS server", rc, err, s, "plaintext against a TLS server")
    assert "drop --insecure and give --ca-cert" in _one_line(err)
    assert s < PLAINTEXT_S, s
    deadline = time.monotonic() + 5
    while not [e for e in tls_server.events() if e.get("event") == "tls.handshake_refused"
               and "plaintext" in str(e.get("reason"))]:
        assert time.monotonic() < deadline, tls_server.log.read_text()[-2000:]
        time.sleep(0.1)


def test_a_tls_client_against_a_plaintext_server_is_told_so(pki: Pki, tmp_path: Path) -> None:
    srv = _server(tmp_path, "--insecure", *WAITING)
    try:
        rc, err, s = _client(srv.address, "--ca-cert", str(pki.ca), "--give-up-after", "60")
        _assert_refused("TLS client against a plaintext server", rc, err, s, "TLS against a plaintext server")
        assert s < PLAINTEXT_S, s
    finally:
        srv.stop()


def test_a_proxy_without_its_server_is_an_outage_not_a_refused_certificate(pki: Pki, tmp_path: Path) -> None:
    """A TCP proxy (an L4 load balancer) whose server is not there closes every connection at once: "Socket
    closed" during the handshake, as a server refusing a client certificate does. The client probes the port, finds
    no TLS spoken, and retries as for any outage (exit 2 after --give-up-after), instead of exiting 4 with "client
    certificate refused"."""
    dead = _port()
    listen = f"127.0.0.1:{_port()}"
    proxy = subprocess.Popen([sys.executable, str(ROOT / "tests" / "system" / "netproxy.py"), listen,
                              f"127.0.0.1:{dead}", "--latency-ms", "0", "--no-upstream", "close"], cwd=ROOT, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "proxy.listening"
        rc, err, s = _client(listen, *pki.client("alice"), "--give-up-after", "4")
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.communicate(timeout=20)
    line = _one_line(err)
    _record("TLS client, proxy without its server (--give-up-after 4)", rc, s, line)
    assert rc == 2, err
    assert "unreachable for 4 s" in line and "refused" not in line, line


def test_the_tls_probe_tells_tls_from_plaintext_and_from_nothing(tls_server: Server) -> None:
    from fedclient.transport import speaks_tls

    assert speaks_tls(tls_server.address) is True
    with socket.socket() as listener:  # a plaintext peer: answers with bytes that are not TLS
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        import threading

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        assert speaks_tls(address) is False
        t.join(5)
    assert speaks_tls(f"127.0.0.1:{_port()}") is None  # nobody listens


def test_server_down_is_retried_not_refused(pki: Pki) -> None:
    """A server that is simply not there is an outage, not a refusal: retried until --give-up-after, exit 2."""
    rc, err, s = _client(f"127.0.0.1:{_port()}", "--ca-cert", str(pki.ca), "--give-up-after", "3")
    line = _one_line(err)
    _record("server down (retried, not a refusal)", rc, s, line)
    assert rc == 2 and "unreachable for 3 s" in line and s >= 3.0, err


# ---- revocation ----

def test_revoked_certificate_is_refused_at_once_even_when_parked_in_a_long_poll(mtls_server: Server,
                                                                               pki: Pki) -> None:
    """bob sits in a 60 s long-poll when his certificate is revoked: the server sees the changed CRL within a
    second (no call needed), ends the parked polls, and bob's next call is refused: exit 4 well inside 10 s."""
    bob = subprocess.Popen([sys.executable, "-m", "fedclient", "--server", mtls_server.address, *pki.client("bob"),
                            "--torch-threads", "1", "--log-level", "warning", "--long-poll", "60"],
                           cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not [e for e in mtls_server.events() if e.get("event") == "client.joined"
                   and e.get("client_id") == "bob"]:
            assert bob.poll() is None and time.monotonic() < deadline, bob.stderr.read() if bob.stderr else ""
            time.sleep(0.1)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "fedguard.certs", "revoke", "--ca", str(pki.dir / "ca"),
                              "--crl", str(pki.dir / "clients.crl"), str(pki.dir / "bob.pem")],
                             cwd=ROOT, env=_env(), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        rc = bob.wait(30)
        seconds = time.monotonic() - t0
        err = bob.stderr.read() if bob.stderr else ""
    finally:
        if bob.poll() is None:
            bob.kill()
            bob.wait(10)
    _assert_refused("revoked client certificate (parked in a 60 s long-poll)", rc, err, seconds, "revoked")
    assert any(e.get("event") == "crl.loaded" and e.get("revoked") == 2 for e in mtls_server.events())
    # alice, not revoked, still gets in (a client of a live federation: it is still running when stopped).
    alice = subprocess.Popen([sys.executable, "-m", "fedclient", "--server", mtls_server.address,
                              *pki.client("alice"), "--torch-threads", "1", "--log-level", "warning"],
                             cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not [e for e in mtls_server.events() if e.get("event") == "client.joined"
                   and e.get("client_id") == "alice"]:
            assert alice.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        alice.kill()
        alice.wait(10)


# ---- token file, bad token, operator-only GetStatus ----

def test_token_file_keeps_the_secret_out_of_argv_logs_and_run_dir(tmp_path: Path) -> None:
    secret = "s3cret-" + os.urandom(12).hex()
    token = tmp_path / "secrets" / "join.token"
    token.parent.mkdir()
    token.write_text(secret + "\n")
    token.chmod(0o600)
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "fedserver", "--run-dir", str(tmp_path / "run"), "--address",
                               f"127.0.0.1:{port}", "--log-json", "--insecure", "--token-file", str(token),
                               "--rounds", "2", "-k", "2", "--model", "mlp", "--dataset", "synthetic", "--linger",
                               "1"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    # A client with the wrong token is refused, says so in one line, exit 4 -- probed before the good clients start,
    # so the federation (two fast rounds) cannot finish and its server leave before the probe is answered.
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    rc, err, s = _client(f"127.0.0.1:{port}", "--insecure", "--token-file", str(wrong))
    _assert_refused("bad token (--token-file with another token)", rc, err, s, "bad token")
    clients = [subprocess.Popen([sys.executable, "-m", "fedclient", "--server", f"127.0.0.1:{port}", "--insecure",
                                 "--client-id", f"c{i}", "--data-index", str(i), "--token-file", str(token),
                                 "--state-dir", str(tmp_path / f"c{i}"), "--trainer", "noop", "--torch-threads",
                                 "1", "--log-json", "--log-level", "debug", "--give-up-after", "60"],
                                cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    argv = [Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in (server, *clients)]
    outs = [p.communicate(timeout=120) for p in (server, *clients)]
    assert [p.returncode for p in (server, *clients)] == [0, 0, 0], outs[0][1][-3000:]
    _record("token file on server and clients (federation completed)", 0, time.monotonic() - t0,
            "secret absent from argv, stdout/stderr of server and clients, and every run-dir file")
    for a in argv:
        assert secret.encode() not in a
    for out, err_ in outs:
        assert secret not in out and secret not in err_
    assert "not-the-token" not in outs[0][1]
    files = [f for f in (tmp_path / "run").rglob("*") if f.is_file()]
    assert files and all(secret.encode() not in f.read_bytes() for f in files)
    for i in range(2):
        assert all(secret.encode() not in f.read_bytes() for f in (tmp_path / f"c{i}").rglob("*") if f.is_file())
    # The refused join is a rate-limited JSON event with the peer address and the reason.
    events = [json.loads(x) for x in outs[0][1].splitlines() if x.startswith("{")]
    refused = [e for e in events if e.get("event") == "rpc.refused" and e.get("method") == "Join"]
    assert refused and refused[0]["code"] == "UNAUTHENTICATED" and refused[0]["reason"] == "bad join token"
    assert str(refused[0]["peer"]).startswith("ipv4:127.0.0.1:")


def test_get_status_needs_the_operator_credential(tmp_path: Path) -> None:
    operator = "op-" + os.urandom(12).hex()
    srv = _server(tmp_path, "--insecure", *WAITING, env=_env(FEDGUARD_OPERATOR_TOKEN=operator))
    try:
        with grpc.insecure_channel(srv.address) as ch:
            status = ch.unary_unary(SERVICE + "GetStatus", pb.StatusRequest.SerializeToString,
                                    pb.StatusReply.FromString)
            join = ch.unary_unary(SERVICE + "Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
            t0 = time.monotonic()
            for md in (None, (("fg-operator", "guess"),)):
                with pytest.raises(grpc.RpcError) as e:
                    status(pb.StatusRequest(), timeout=5, metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            _record("GetStatus without / with a wrong operator credential", None, time.monotonic() - t0,
                    f"UNAUTHENTICATED: {e.value.details()}")
            session = join(pb.JoinRequest(client_id="member-7"), timeout=5).session_id
            full = status(pb.StatusRequest(), timeout=5, metadata=(("fg-operator", operator),))
            assert full.clients_known == 1 and full.num_rounds == 1
            own = status(pb.StatusRequest(session_id=session), timeout=5)
            assert own.num_rounds == 1 and own.clients_known == 0 and not own.history
            assert b"member-7" not in own.SerializeToString()
            _record("GetStatus with the operator credential / with a client's session", None,
                    time.monotonic() - t0, "operator: everything; client: progress and its own record only")
    finally:
        srv.stop()
    assert operator not in srv.log.read_text()
    assert all(operator.encode() not in f.read_bytes() for f in srv.run_dir.rglob("*") if f.is_file())


# ---- replayed signed Join after a restart ----

def test_replayed_join_is_refused_after_a_restart(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    private_pem, public_b64 = generate_signing_key()
    enrolled = tmp_path / "enrolled.json"
    enrolled.write_text(json.dumps({"clients": {"alice": public_b64}}))
    key = serialization.load_pem_private_key(private_pem, password=None)
    body = pb.JoinRequest(client_id="alice").SerializeToString()
    md = sign_request(key, "alice", SERVICE + "Join", body, time.time())  # type: ignore[arg-type]
    port = _port()
    args = ("--insecure", "--client-keys", str(enrolled), *WAITING)
    srv = _server(tmp_path, *args, port=port)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            join = ch.unary_unary(SERVICE + "Join", None, pb.JoinReply.FromString)
            assert join(body, timeout=5, metadata=md).session_id
            with pytest.raises(grpc.RpcError) as e:
                join(body, timeout=5, metadata=md)
            assert "replayed" in (e.value.details() or "")
    finally:
        srv.stop()
    journal = srv.run_dir / "replay.journal"
    assert journal.exists() and md[2][1] in journal.read_text()
    srv = _server(tmp_path, *args, port=port, name="restarted", run_dir=srv.run_dir)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            join = ch.unary_unary(SERVICE + "Join", None, pb.JoinReply.FromString)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                join(body, timeout=5, metadata=md)
            _record("signed Join replayed after a server restart", None, time.monotonic() - t0,
                    f"{e.value.code().name}: {e.value.details()}")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "replayed request (nonce already used)" in (e.value.details() or "")
            # Outside the time window: refused whatever the nonce (the journal need not remember it).
            stale = sign_request(key, "alice", SERVICE + "Join", body, time.time() - 600)  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as e:
                join(body, timeout=5, metadata=stale)
            assert "behind the server's clock" in (e.value.details() or "")
            _record("signed Join 600 s old (clock skew)", None, time.monotonic() - t0,
                    f"{e.value.code().name}: {e.value.details()}")
            # A fresh signature still gets in.
            fresh = sign_request(key, "alice", SERVICE + "Join", body, time.time())  # type: ignore[arg-type]
            assert join(body, timeout=5, metadata=fresh).session_id
    finally:
        srv.stop()


# ---- join flood ----

def test_join_flood_does_not_stall_rounds_and_sessions_are_bounded(tmp_path: Path) -> None:
    """One token holder joins 500 made-up ids (each polls once, then falls silent) while two honest no-op
    clients train: rounds keep completing (no round waits for a silent id), and the per-credential session bound
    refuses the ids beyond it."""
    token = tmp_path / "token"
    token.write_text("flood-token\n")
    srv = _server(tmp_path, "--insecure", "--token-file", str(token), "--rounds", "100000", "-k", "2",
                  "--model", "mlp", "--dataset", "synthetic", "--set", "security.max_sessions_per_credential=300")
    honest = [subprocess.Popen([sys.executable, "-m", "fedclient", "--server", srv.address, "--insecure",
                                "--client-id", f"honest-{i}", "--data-index", str(i), "--token-file", str(token),
                                "--trainer", "noop", "--torch-threads", "1", "--log-level", "warning"],
                               cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for i in range(2)]

    def rounds() -> int:
        try:
            return len((srv.run_dir / "rounds.jsonl").read_text().splitlines())
        except OSError:
            return 0

    try:
        deadline = time.monotonic() + 90
        while rounds() < 5:
            assert time.monotonic() < deadline and srv.proc.poll() is None
            time.sleep(0.1)
        codes: dict[str, int] = {}
        before = rounds()
        t0 = time.monotonic()
        with grpc.insecure_channel(srv.address) as ch:
            join = ch.unary_unary(SERVICE + "Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
            pull = ch.unary_stream(SERVICE + "PullTask", pb.PullTaskRequest.SerializeToString,
                                   pb.TaskMessage.FromString)
            for i in range(500):
                try:
                    sid = join(pb.JoinRequest(client_id=f"fake-{i}", token="flood-token"), timeout=10).session_id
                    list(pull(pb.PullTaskRequest(session_id=sid, max_wait_s=0.0), timeout=10))
                    codes["OK"] = codes.get("OK", 0) + 1
                except grpc.RpcError as e:
                    codes[e.code().name] = codes.get(e.code().name, 0) + 1
        flood_s = time.monotonic() - t0
        after_flood = rounds()
        time.sleep(10.0)
        done = rounds() - before
        window = time.monotonic() - t0
    finally:
        for p in honest:
            p.kill()
        srv.stop()
        for p in honest:
            p.wait(10)
    rows = [json.loads(x) for x in (srv.run_dir / "rounds.jsonl").read_text().splitlines()]
    slowest = max(float(r["seconds"]) for r in rows[before:])
    _record("join flood: 500 made-up ids by one token holder", None, window,
            f"{codes} in {flood_s:.1f} s; {done} rounds completed in the {window:.0f} s from the flood's start "
            f"({after_flood - before} during it); slowest round {slowest:.2f} s")
    # The bound: 2 honest sessions + 298 made-up ones; the rest RESOURCE_EXHAUSTED.
    assert codes.get("OK") == 298 and codes.get("RESOURCE_EXHAUSTED") == 202, codes
    # Rounds keep going: no round waits for a silent id beyond the poll grace (3 s) plus a re-run.
    assert slowest < 8.0, slowest
    assert rounds() > after_flood and done >= 20, (done, after_flood - before)
