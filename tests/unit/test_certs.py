"""fedguard.certs: CA / server / client certificates, client identities, Ed25519 signing keys, the enrollment
file, atomic file writes with the right modes, and the ``fedguard-certs`` command line."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from fedguard.certs import (
    CertError,
    Issued,
    client_identity,
    enroll,
    generate_signing_key,
    issue_client_cert,
    issue_server_cert,
    load_enrollment,
    load_signing_key,
    main,
    make_ca,
    public_key_b64,
    read_ca,
    write_ca,
    write_private,
    write_public,
)

BAD_IDS = ["", "a b", "x" * 65, "../etc", "é", "-lead", "a/b", "a\nb"]


@pytest.fixture(scope="module")
def ca() -> Issued:
    return make_ca("test CA")


@pytest.fixture(scope="module")
def other_ca() -> Issued:
    return make_ca("other CA")


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    pub = issuer.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    assert cert.signature_hash_algorithm is not None
    try:
        pub.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    except InvalidSignature:
        return False
    return True


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ext(cert: x509.Certificate, kind: type[x509.ExtensionType]) -> x509.Extension[x509.ExtensionType]:
    return cert.extensions.get_extension_for_class(kind)


# ----------------------------------------------------------------------------------------------------------------
# Certificates
# ----------------------------------------------------------------------------------------------------------------


def test_ca_certificate(ca: Issued) -> None:
    cert = _cert(ca.cert_pem)
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "test CA"
    bc = _ext(cert, x509.BasicConstraints)
    assert bc.critical and isinstance(bc.value, x509.BasicConstraints)
    assert bc.value.ca and bc.value.path_length == 0
    ku = _ext(cert, x509.KeyUsage).value
    assert isinstance(ku, x509.KeyUsage) and ku.key_cert_sign and ku.crl_sign
    key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)
    assert _signed_by(cert, cert)
    assert b"PRIVATE KEY" not in repr(ca).encode()  # the key stays out of logs and tracebacks


def test_server_certificate(ca: Issued, other_ca: Issued) -> None:
    issued = issue_server_cert(ca, ["fl.example.org", "127.0.0.1", "[::1]", "localhost"], days=30)
    cert = _cert(issued.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "fl.example.org"
    assert cert.issuer == _cert(ca.cert_pem).subject
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert isinstance(san, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = _ext(cert, x509.ExtendedKeyUsage).value
    assert isinstance(eku, x509.ExtendedKeyUsage) and list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    bc = _ext(cert, x509.BasicConstraints).value
    assert isinstance(bc, x509.BasicConstraints) and not bc.ca
    ku = _ext(cert, x509.KeyUsage).value
    assert isinstance(ku, x509.KeyUsage) and ku.digital_signature and not ku.key_encipherment
    _ext(cert, x509.SubjectKeyIdentifier)
    _ext(cert, x509.AuthorityKeyIdentifier)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(days=30, minutes=5)
    assert _signed_by(cert, _cert(ca.cert_pem)) and not _signed_by(cert, _cert(other_ca.cert_pem))
    # The strict RFC 5280 verifier of cryptography accepts the chain for each name, and only for those names.
    builder = PolicyBuilder().store(Store([_cert(ca.cert_pem)]))
    for name in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("::1"))):
        assert len(builder.build_server_verifier(name).verify(cert, [])) == 2
    with pytest.raises(VerificationError):
        builder.build_server_verifier(x509.DNSName("evil.example.org")).verify(cert, [])
    with pytest.raises(VerificationError):
        builder.build_client_verifier().verify(cert, [])  # serverAuth only
    with pytest.raises(CertError):
        client_identity(issued.cert_pem)


def test_client_certificate(ca: Issued, other_ca: Issued) -> None:
    issued = issue_client_cert(ca, "alice-01.lab_2")
    cert = _cert(issued.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "alice-01.lab_2"
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert isinstance(san, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:fedguard:client:alice-01.lab_2"]
    eku = _ext(cert, x509.ExtendedKeyUsage).value
    assert isinstance(eku, x509.ExtendedKeyUsage) and list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert client_identity(issued.cert_pem) == "alice-01.lab_2"
    assert _signed_by(cert, _cert(ca.cert_pem))
    assert not _signed_by(cert, _cert(other_ca.cert_pem))
    assert not _signed_by(_cert(issue_client_cert(other_ca, "alice-01.lab_2").cert_pem), _cert(ca.cert_pem))
    verified = PolicyBuilder().store(Store([_cert(ca.cert_pem)])).build_client_verifier().verify(cert, [])
    assert verified.subjects == [x509.UniformResourceIdentifier("urn:fedguard:client:alice-01.lab_2")]
    with pytest.raises(VerificationError):
        PolicyBuilder().store(Store([_cert(other_ca.cert_pem)])).build_client_verifier().verify(cert, [])
    key = serialization.load_pem_private_key(issued.key_pem, password=None)
    cert_key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(cert_key, ec.EllipticCurvePublicKey)
    assert key.public_key().public_numbers() == cert_key.public_numbers()
    # Two certificates never share a key or a serial.
    again = _cert(issue_client_cert(ca, "alice-01.lab_2").cert_pem)
    assert again.serial_number != cert.serial_number and again.public_key() != cert.public_key()


def test_client_identity_falls_back_to_cn_and_refuses_the_rest(ca: Issued) -> None:
    ca_cert = _cert(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)

    def bare(cn: str, sans: list[x509.GeneralName]) -> bytes:
        now = dt.datetime.now(dt.UTC)
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(ca_cert.subject).public_key(ec.generate_private_key(ec.SECP256R1()).public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now)
             .not_valid_after(now + dt.timedelta(days=1)))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    assert client_identity(bare("bob", [])) == "bob"
    assert client_identity(bare("ignored", [x509.UniformResourceIdentifier("urn:fedguard:client:carol")])) == "carol"
    for pem in (bare("a b", []), bare("ok", [x509.UniformResourceIdentifier("urn:fedguard:client:../x")]),
                bare("ok", [x509.UniformResourceIdentifier("urn:fedguard:client:a"),
                            x509.UniformResourceIdentifier("urn:fedguard:client:b")])):
        with pytest.raises(CertError):
            client_identity(pem)
    with pytest.raises(CertError):
        client_identity(ca.cert_pem)  # a CA is nobody's identity
    with pytest.raises(CertError):
        client_identity(b"not a certificate")


def test_expired_certificate_via_now(ca: Issued) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    now = dt.datetime.now(dt.UTC)
    for issued in (issue_client_cert(ca, "late", days=1, now=past), issue_server_cert(ca, ["h"], days=1, now=past),
                   make_ca(days=1, now=past)):
        cert = _cert(issued.cert_pem)
        assert cert.not_valid_after_utc < now
        assert cert.not_valid_before_utc == (past - dt.timedelta(minutes=5)).replace(microsecond=0)
    naive = dt.datetime(2020, 1, 1, 12, 0)  # naive means UTC
    cert = _cert(issue_client_cert(ca, "old", days=2, now=naive).cert_pem)
    assert cert.not_valid_after_utc == dt.datetime(2020, 1, 3, 12, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize("bad", BAD_IDS)
def test_invalid_client_ids_refused(ca: Issued, bad: str) -> None:
    with pytest.raises(CertError, match="client id"):
        issue_client_cert(ca, bad)


def test_bad_days_hosts_and_names_refused(ca: Issued) -> None:
    for days in (0, -1):
        with pytest.raises(CertError):
            make_ca(days=days)
        with pytest.raises(CertError):
            issue_client_cert(ca, "a", days=days)
        with pytest.raises(CertError):
            issue_server_cert(ca, ["a"], days=days)
    with pytest.raises(CertError):
        make_ca(name="")
    with pytest.raises(CertError):
        make_ca(name="n" * 65)
    with pytest.raises(CertError, match="at least one host"):
        issue_server_cert(ca, [])
    for host in ("", "bad host", "a..b", "-a.org", "é.org", "a/b", "*.org", "fe80::1%eth0", "x" * 64 + ".org"):
        with pytest.raises(CertError, match="host"):
            issue_server_cert(ca, [host])
    ok = _cert(issue_server_cert(ca, ["Example.ORG.", "*.svc.local", "a" * 63 + "." + "b" * 63]).cert_pem)
    san = _ext(ok, x509.SubjectAlternativeName).value
    assert isinstance(san, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.DNSName) == ["example.org", "*.svc.local", "a" * 63 + "." + "b" * 63]


def test_ca_key_mismatch_and_non_ca_refused(ca: Issued, other_ca: Issued) -> None:
    mixed = Issued(ca.cert_pem, other_ca.key_pem)
    with pytest.raises(CertError, match="does not match"):
        issue_client_cert(mixed, "alice")
    with pytest.raises(CertError, match="does not match"):
        issue_server_cert(mixed, ["localhost"])
    leaf = issue_client_cert(ca, "alice")
    with pytest.raises(CertError, match="not a CA"):
        issue_client_cert(leaf, "bob")
    with pytest.raises(CertError, match="not a CA"):
        issue_server_cert(issue_server_cert(ca, ["h"]), ["h2"])
    with pytest.raises(CertError):
        issue_client_cert(Issued(b"garbage", ca.key_pem), "bob")
    with pytest.raises(CertError):
        issue_client_cert(Issued(ca.cert_pem, b"garbage"), "bob")
    ed_key = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(CertError):
        issue_client_cert(Issued(ca.cert_pem, ed_key), "bob")


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------


def test_file_modes_and_atomic_writes(tmp_path: Path, ca: Issued) -> None:
    old_umask = os.umask(0o077)  # the modes are exact whatever the umask
    try:
        write_private(tmp_path / "new" / "deep" / "k.key", b"secret")
        write_public(tmp_path / "pub" / "c.pem", b"public")
        write_ca(tmp_path / "ca", ca)
    finally:
        os.umask(old_umask)
    assert _mode(tmp_path / "new" / "deep" / "k.key") == 0o600
    assert _mode(tmp_path / "new") == 0o700 and _mode(tmp_path / "new" / "deep") == 0o700
    assert _mode(tmp_path / "pub" / "c.pem") == 0o644
    assert _mode(tmp_path / "ca" / "ca.key") == 0o600 and _mode(tmp_path / "ca" / "ca.pem") == 0o644
    # Replacing keeps the mode and content is swapped whole; no temporary files stay behind.
    (tmp_path / "loose.key").write_bytes(b"old")
    os.chmod(tmp_path / "loose.key", 0o666)
    write_private(tmp_path / "loose.key", b"new")
    assert (tmp_path / "loose.key").read_bytes() == b"new" and _mode(tmp_path / "loose.key") == 0o600
    write_public(tmp_path / "pub" / "c.pem", b"public 2")
    assert (tmp_path / "pub" / "c.pem").read_bytes() == b"public 2"
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert leftovers == []
    back = read_ca(tmp_path / "ca")
    assert back == ca


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()  # os.replace cannot put a file over a directory
    (tmp_path / "target" / "x").write_text("keep")
    with pytest.raises(CertError, match="target"):
        write_private(tmp_path / "target", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    with pytest.raises(CertError):
        write_public(tmp_path / "target" / "x" / "below-a-file", b"data")


def test_read_ca_refusals(tmp_path: Path, ca: Issued, other_ca: Issued) -> None:
    with pytest.raises(CertError, match=r"ca\.pem"):
        read_ca(tmp_path / "missing")
    write_ca(tmp_path / "mixed", Issued(ca.cert_pem, other_ca.key_pem))
    with pytest.raises(CertError, match="does not match"):
        read_ca(tmp_path / "mixed")
    write_ca(tmp_path / "leaf", issue_client_cert(ca, "alice"))
    with pytest.raises(CertError, match="not a CA"):
        read_ca(tmp_path / "leaf")


# ----------------------------------------------------------------------------------------------------------------
# Signing keys and enrollment
# ----------------------------------------------------------------------------------------------------------------


def test_signing_key_roundtrip(tmp_path: Path) -> None:
    private_pem, public_b64 = generate_signing_key()
    assert b"BEGIN PRIVATE KEY" in private_pem
    assert len(base64.b64decode(public_b64, validate=True)) == 32
    write_private(tmp_path / "alice.ed25519", private_pem)
    assert _mode(tmp_path / "alice.ed25519") == 0o600
    key = load_signing_key(tmp_path / "alice.ed25519")
    assert public_key_b64(key) == public_b64
    enroll(tmp_path / "enrolled.json", "alice", public_b64)
    public = load_enrollment(tmp_path / "enrolled.json")["alice"]
    signature = key.sign(b"round 3 update")
    public.verify(signature, b"round 3 update")
    with pytest.raises(InvalidSignature):
        public.verify(signature, b"round 4 update")
    other_public = load_enrollment(tmp_path / "enrolled.json")  # a second key does not verify alice's signature
    enroll(tmp_path / "enrolled.json", "bob", generate_signing_key()[1])
    with pytest.raises(InvalidSignature):
        load_enrollment(tmp_path / "enrolled.json")["bob"].verify(signature, b"round 3 update")
    assert set(other_public) == {"alice"}


def test_load_signing_key_refusals(tmp_path: Path, ca: Issued) -> None:
    with pytest.raises(CertError, match=re.escape(str(tmp_path / "nope"))):
        load_signing_key(tmp_path / "nope")
    (tmp_path / "garbage").write_bytes(b"xx")
    with pytest.raises(CertError, match="garbage"):
        load_signing_key(tmp_path / "garbage")
    (tmp_path / "ec.key").write_bytes(ca.key_pem)
    with pytest.raises(CertError, match="Ed25519"):
        load_signing_key(str(tmp_path / "ec.key"))


def test_enrollment_create_update(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "enrolled.json"
    _, pub_a = generate_signing_key()
    _, pub_b = generate_signing_key()
    _, pub_a2 = generate_signing_key()
    enroll(path, "alice", pub_a)
    assert _mode(path) == 0o644
    enroll(path, "bob", pub_b)
    enroll(path, "alice", pub_a2)  # re-enrolling replaces
    assert json.loads(path.read_text()) == {"clients": {"alice": pub_a2, "bob": pub_b}}
    keys = load_enrollment(path)
    assert sorted(keys) == ["alice", "bob"]
    raw = keys["alice"].public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert base64.b64encode(raw).decode() == pub_a2
    assert [p.name for p in path.parent.iterdir()] == ["enrolled.json"]
    with pytest.raises(CertError, match="client id"):
        enroll(path, "a b", pub_a)
    with pytest.raises(CertError, match="base64"):
        enroll(path, "carol", "***")
    with pytest.raises(CertError, match="'alice'"):  # one key for two ids
        enroll(path, "carol", pub_a2)
    assert json.loads(path.read_text()) == {"clients": {"alice": pub_a2, "bob": pub_b}}  # refusals changed nothing


@pytest.mark.parametrize(
    ("clients", "match"),
    [
        ({"alice": "not base64!"}, "'alice'.*base64"),
        ({"alice": base64.b64encode(b"x" * 31).decode()}, "'alice'.*32"),
        ({"alice": base64.b64encode(b"x" * 33).decode()}, "'alice'.*32"),
        ({"a b": base64.b64encode(b"x" * 32).decode()}, "'a b'.*client id"),
        ({"../etc": base64.b64encode(b"x" * 32).decode()}, "'../etc'.*client id"),
        ({"alice": 5}, "'alice'"),
    ],
)
def test_enrollment_bad_entries_named(tmp_path: Path, clients: dict[str, object], match: str) -> None:
    path = tmp_path / "enrolled.json"
    path.write_text(json.dumps({"clients": clients}))
    with pytest.raises(CertError, match=match):
        load_enrollment(path)


def test_enrollment_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "enrolled.json"
    with pytest.raises(CertError, match=r"enrolled\.json"):
        load_enrollment(path)
    for text in ("{", "[]", '{"clients": []}', '{"other": {}}'):
        path.write_text(text)
        with pytest.raises(CertError, match=r"enrolled\.json"):
            load_enrollment(path)
    key = base64.b64encode(b"k" * 32).decode()
    path.write_text(f'{{"clients": {{"alice": "{key}", "alice": "{key}"}}}}')
    with pytest.raises(CertError, match="duplicate"):
        load_enrollment(path)
    path.write_text('{"clients": {}}')
    assert load_enrollment(path) == {}


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca_dir, srv, cl = tmp_path / "ca", tmp_path / "srv", tmp_path / "clients"
    assert main(["ca", "--out", str(ca_dir), "--name", "cli CA", "--days", "30"]) == 0
    out = capsys.readouterr().out
    assert str(ca_dir / "ca.pem") in out and str(ca_dir / "ca.key") in out and "PRIVATE KEY" not in out
    assert _mode(ca_dir / "ca.key") == 0o600 and _mode(ca_dir / "ca.pem") == 0o644
    ca_cert = _cert((ca_dir / "ca.pem").read_bytes())

    assert main(["server", "--ca", str(ca_dir), "--out", str(srv), "--host", "localhost", "--host", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert str(srv / "server.pem") in out and str(srv / "server.key") in out
    server = _cert((srv / "server.pem").read_bytes())
    assert _signed_by(server, ca_cert) and _mode(srv / "server.key") == 0o600

    assert main(["client", "--ca", str(ca_dir), "--out", str(cl), "--client-id", "alice", "--client-id", "bob"]) == 0
    out = capsys.readouterr().out
    for cid in ("alice", "bob"):
        assert str(cl / f"{cid}.pem") in out and str(cl / f"{cid}.key") in out
        assert client_identity((cl / f"{cid}.pem").read_bytes()) == cid
        assert _signed_by(_cert((cl / f"{cid}.pem").read_bytes()), ca_cert)
        assert _mode(cl / f"{cid}.key") == 0o600 and _mode(cl / f"{cid}.pem") == 0o644

    enrolled = tmp_path / "enrolled.json"
    assert main(["keygen", "--out", str(cl), "--client-id", "alice", "--client-id", "bob",
                 "--enroll", str(enrolled)]) == 0
    out = capsys.readouterr().out
    assert str(cl / "alice.ed25519") in out and str(enrolled) in out and "PRIVATE KEY" not in out
    keys = load_enrollment(enrolled)
    for cid in ("alice", "bob"):
        assert _mode(cl / f"{cid}.ed25519") == 0o600
        key = load_signing_key(cl / f"{cid}.ed25519")
        keys[cid].verify(key.sign(b"msg"), b"msg")
    # keygen without --enroll only writes the key
    assert main(["keygen", "--out", str(tmp_path / "k"), "--client-id", "carol"]) == 0
    assert (tmp_path / "k" / "carol.ed25519").exists() and set(load_enrollment(enrolled)) == {"alice", "bob"}

    assert main(["show", str(cl / "alice.pem")]) == 0
    out = capsys.readouterr().out
    assert "CN=alice" in out and "urn:fedguard:client:alice" in out and "client id:   alice" in out
    assert "not before:" in out and "not after:" in out and "CA:          no" in out and "PRIVATE KEY" not in out
    assert main(["show", str(srv / "server.pem")]) == 0
    out = capsys.readouterr().out
    assert "DNS:localhost" in out and "IP:127.0.0.1" in out and "client id" not in out
    assert main(["show", str(ca_dir / "ca.pem")]) == 0
    assert "CA:          yes" in capsys.readouterr().out
    assert main(["show", str(ca_dir / "ca.key")]) == 2  # a key file is refused, and not printed
    captured = capsys.readouterr()
    assert "PRIVATE KEY" not in captured.out + captured.err and captured.err.startswith("fedguard-certs: ")


def test_cli_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca_dir = tmp_path / "ca"
    assert main(["ca", "--out", str(ca_dir)]) == 0
    first = (ca_dir / "ca.key").read_bytes()
    capsys.readouterr()

    def refused(argv: list[str], needle: str) -> None:
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("fedguard-certs: ") and captured.err.count("\n") == 1, captured.err
        assert needle in captured.err

    refused(["ca", "--out", str(ca_dir)], "--force")
    assert (ca_dir / "ca.key").read_bytes() == first
    assert main(["ca", "--out", str(ca_dir), "--force"]) == 0
    assert (ca_dir / "ca.key").read_bytes() != first
    capsys.readouterr()

    refused(["client", "--ca", str(ca_dir), "--out", str(tmp_path / "c"), "--client-id", "ok",
             "--client-id", "a b"], "invalid client id")
    assert not (tmp_path / "c").exists()  # nothing written when one id is bad
    refused(["keygen", "--out", str(tmp_path / "k"), "--client-id", "../etc"], "invalid client id")
    refused(["client", "--ca", str(ca_dir), "--out", str(ca_dir), "--client-id", "ca"], "CA's own file")
    refused(["server", "--ca", str(ca_dir), "--out", str(tmp_path / "s"), "--host", "bad host"], "bad host")
    refused(["server", "--ca", str(tmp_path / "nope"), "--out", str(tmp_path / "s"), "--host", "h"], "ca.pem")
    refused(["ca", "--out", str(tmp_path / "ca2"), "--days", "0"], "days")
    refused(["client", "--ca", str(ca_dir), "--out", str(tmp_path / "c")], "--client-id")
    refused(["frobnicate"], "invalid choice")
    refused([], "required")
    refused(["show", str(tmp_path / "missing.pem")], "missing.pem")

    assert main(["keygen", "--out", str(tmp_path / "k"), "--client-id", "alice"]) == 0
    key = (tmp_path / "k" / "alice.ed25519").read_bytes()
    refused(["keygen", "--out", str(tmp_path / "k"), "--client-id", "alice"], "--force")
    assert (tmp_path / "k" / "alice.ed25519").read_bytes() == key
    bad = tmp_path / "bad.json"
    bad.write_text('{"clients": {"a b": "x"}}')
    refused(["keygen", "--out", str(tmp_path / "k2"), "--client-id", "bob", "--enroll", str(bad)], "'a b'")
    assert not (tmp_path / "k2").exists()
