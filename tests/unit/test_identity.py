"""Units of issue 25's identity work: replay journal, join buckets, refusal log, CRL, refusal classification,
the C-core handshake line parser and the round machine's poll grace."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from fedclient.transport import Refused, check_own_certificate, classify_unauthenticated, classify_unavailable
from fedcore import rounds as rm
from fedcore.config import RoundsConfig
from fedguard.certs import issue_client_cert, make_ca, revoke
from fedguard.signing import AuthError, ReplayGuard, ReplayJournal
from fedserver.auth import RefusalLog, Revocations, TokenBuckets, peer_host
from fedserver.corelog import handshake_reason
from fedserver.errors import ProtocolError

NONCE = "0123456789abcdef" * 2


def test_replay_journal_outlives_the_guard_and_is_compacted(tmp_path: Path) -> None:
    path = tmp_path / "replay.journal"
    g = ReplayGuard(60, journal=ReplayJournal(path), now_ms=1_000_000)
    g.check("alice", NONCE, 1_000_000, 1_000_000)
    g.check("alice", "f" * 32, 1_000_500, 1_000_500)
    assert g.journal is not None
    g.journal.close()
    with open(path, "a") as f:
        f.write("1000600 bob cut-by-a-cra")  # a torn last line is skipped
    again = ReplayGuard(60, journal=ReplayJournal(path), now_ms=1_010_000)
    with pytest.raises(AuthError, match="replayed"):
        again.check("alice", NONCE, 1_000_000, 1_010_000)
    # Past the window, the journal forgets the nonce at start (compaction) and the window refuses the request.
    later = ReplayGuard(60, journal=ReplayJournal(path), now_ms=1_000_000 + 60_200)
    assert len(later) == 1 and path.read_text().count("\n") == 1
    with pytest.raises(AuthError, match="behind the server's clock"):
        later.check("alice", NONCE, 1_000_000, 1_000_000 + 60_200)


def test_token_buckets_and_peer_host() -> None:
    now = [0.0]
    b = TokenBuckets(rate=2.0, burst=4.0, clock=lambda: now[0])
    assert [b.take("k") for _ in range(5)] == [True] * 4 + [False]
    now[0] = 0.5
    assert b.take("k") and not b.take("k")
    assert b.take("other")
    assert peer_host("ipv4:10.0.0.5:5123") == "10.0.0.5" and peer_host("ipv6:[::1]:80") == "[::1]"


def test_refusal_log_is_rate_limited_per_peer_and_reason() -> None:
    lines: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            lines.append((event, kw))

    now = [0.0]
    r = RefusalLog(Log(), clock=lambda: now[0])
    for _ in range(100):
        r.event("rpc.refused", "ipv4:1.2.3.4:1000", "Join:UNAUTHENTICATED", reason="bad join token")
    assert len(lines) == 1 and r.suppressed == 99
    r.event("rpc.refused", "ipv4:5.6.7.8:1", "Join:UNAUTHENTICATED")
    now[0] = 1.5
    r.event("rpc.refused", "ipv4:1.2.3.4:1001", "Join:UNAUTHENTICATED")
    assert len(lines) == 3 and lines[1][1]["suppressed"] == 99 and "suppressed" not in lines[2][1]


def test_crl_revokes_and_is_reloaded_on_change(tmp_path: Path) -> None:
    ca, other = make_ca(), make_ca("other")
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    alice, bob = issue_client_cert(ca, "alice"), issue_client_cert(ca, "bob")
    crl = tmp_path / "clients.crl"
    revoke(ca, crl, [1])
    now = [0.0]
    rev = Revocations(str(crl), str(tmp_path / "ca.pem"), clock=lambda: now[0])
    changes: list[float] = []
    rev.on_change = lambda: changes.append(now[0])
    rev.check({"x509_pem_cert": [bob.cert_pem]})
    from cryptography import x509

    revoke(ca, crl, [x509.load_pem_x509_certificate(bob.cert_pem).serial_number])
    now[0] = 1.5
    assert rev.refresh() and changes == [1.5]  # found without a call (the server's watcher), on_change told
    now[0] = 3.0
    assert not rev.refresh() and changes == [1.5]  # unchanged: not again
    with pytest.raises(ProtocolError, match="revoked"):
        rev.check({"x509_pem_cert": [bob.cert_pem]})
    rev.check({"x509_pem_cert": [alice.cert_pem]})
    with pytest.raises(ValueError, match="not signed by this CA"):
        revoke(other, crl, [5])
    forged = tmp_path / "forged.crl"
    revoke(other, forged, [5])
    with pytest.raises(Exception, match="not signed by the client CA"):
        Revocations(str(forged), str(tmp_path / "ca.pem"))


def test_client_classifies_refusals_and_not_outages() -> None:
    refused, certain = classify_unavailable(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
        "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
        True, False)
    assert refused is not None and certain and refused.check == "unknown CA"
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"
    refused, certain = classify_unavailable(closed, True, False)
    assert refused is not None and not certain and refused.check == "client certificate required"
    assert classify_unavailable(closed, False, False) == (None, False)
    down = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused"
    assert classify_unavailable(down, True, True) == (None, False)
    assert classify_unauthenticated("bad join token").check == "bad token"
    assert classify_unauthenticated("signature refused: request timestamp is 600.0 s ahead of the server's clock "
                                    "(window 60 s)").check == "clock skew"
    assert classify_unauthenticated("client certificate revoked (serial 1f, x.crl)").check == "revoked"


def test_own_expired_certificate_is_refused_locally() -> None:
    ca = make_ca()
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    old = issue_client_cert(ca, "old", days=1, now=past)
    with pytest.raises(Refused, match="expired"):
        check_own_certificate(old.cert_pem, "old.pem")
    check_own_certificate(issue_client_cert(ca, "new").cert_pem, "new.pem")


def test_core_handshake_lines_are_parsed() -> None:
    line = (b"I1125 03:55:45.753879   16326 ssl_transport_security.cc:2563] Handshake failed with error "
            b"SSL_ERROR_SSL: error:100000c0:SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE: x")
    assert handshake_reason(line) == "client certificate required"
    assert handshake_reason(b'{"event": "Handshake failed with error SSL_ERROR_SSL"}') is None
    assert handshake_reason(b"I1125 03:55:45.753879   1 chttp2_server.cc:10] something else") is None


def test_poll_grace_neither_selects_nor_waits_for_silent_ids() -> None:
    cfg = RoundsConfig(num_rounds=5, clients_per_round=2)
    limits = rm.Limits(heartbeat_patience_s=30.0, poll_grace_s=3.0)
    s = rm.RoundState()
    # 50 made-up ids join and poll once (the round starts on two of them), then fall silent.
    for cid in (f"fake-{i:02d}" for i in range(50)):
        s, _ = rm.step_in_place(s, rm.Joined(cid, 0.0), cfg, limits)
        s, _ = rm.step_in_place(s, rm.Polled(cid, 0.0), cfg, limits)
    assert s.phase == rm.TRAINING and all(c.startswith("fake") for c in s.selected)
    for cid in ("h0", "h1"):  # the honest clients join and hold their polls
        s, _ = rm.step_in_place(s, rm.Joined(cid, 0.5), cfg, limits)
        s, _ = rm.step_in_place(s, rm.Polled(cid, 0.5), cfg, limits)
    for t in (1.0, 2.0):
        s, _ = rm.step_in_place(s, rm.Tick(t, frozenset({"h0", "h1"})), cfg, limits)
        assert s.phase == rm.TRAINING and s.attempt == 0
    # 3 s after the start the selected ids have not come for their task: not waited for, not ready; the other
    # fakes' one poll is older than the grace: the re-run selects the honest clients.
    s, events = rm.step_in_place(s, rm.Tick(3.5, frozenset({"h0", "h1"})), cfg, limits)
    assert any(isinstance(e, rm.RoundAbandoned) for e in events)
    assert s.phase == rm.TRAINING and s.attempt == 1 and sorted(s.selected) == ["h0", "h1"]
    assert s.available_ids() == ["h0", "h1"]
    # Without the grace (0: off), the silent ids are waited for until the heartbeat patience.
    off = rm.Limits(heartbeat_patience_s=30.0)
    s2 = rm.RoundState()
    for cid in ("fake-a", "fake-b"):
        s2, _ = rm.step_in_place(s2, rm.Joined(cid, 0.0), cfg, off)
        s2, _ = rm.step_in_place(s2, rm.Polled(cid, 0.0), cfg, off)
    s2, _ = rm.step_in_place(s2, rm.Tick(20.0), cfg, off)
    assert s2.phase == rm.TRAINING and s2.attempt == 0
