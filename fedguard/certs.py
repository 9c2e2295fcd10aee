"""Certificate tooling for TLS, mutual TLS and signed requests (module and the ``fedguard-certs`` command).

Everything here is built on ``cryptography``. TLS certificates use ECDSA P-256 keys signed with SHA-256; the
per-client request-signing keys are Ed25519. Private keys are written unencrypted (PKCS#8 PEM) with mode 0600,
certificates and public files with mode 0644, always atomically (temporary file in the same directory, then
``os.replace``), so a reader never sees a half-written file.

A complete setup, TLS + mutual TLS + signed requests
------------------------------------------------------

1. A private certificate authority (keep ``ca/ca.key`` offline; only ``ca.pem`` is handed out)::

       fedguard-certs ca --out ca --name "fedguard CA" --days 365

2. The server certificate, with every name and address clients dial (each becomes a subjectAltName)::

       fedguard-certs server --ca ca --out server --host fl.example.org --host 10.0.0.5 --host ::1

3. One client certificate per client; the client id travels as the CN and as the URI SAN
   ``urn:fedguard:client:<id>``, and the server takes the client's identity from it::

       fedguard-certs client --ca ca --out clients --client-id alice --client-id bob

4. One Ed25519 request-signing key per client, its public key enrolled in the file the server reads::

       fedguard-certs keygen --out clients --client-id alice --client-id bob --enroll enrolled.json

5. Run the server (TLS with its certificate, client certificates required and checked against ``ca.pem``,
   requests checked against the enrolled public keys)::

       fedserver --tls-cert server/server.pem --tls-key server/server.key --client-ca ca/ca.pem \\
                 --client-keys enrolled.json ...

6. Run each client with the CA that signed the server certificate, its own certificate and key, and its
   signing key::

       fedclient --ca-cert ca/ca.pem --cert clients/alice.pem --key clients/alice.key \\
                 --signing-key clients/alice.ed25519 ...

7. Revoke a client's certificate: a certificate revocation list signed by the CA (the server, started with
   ``--crl clients.crl``, re-reads it when it changes and refuses the revoked certificate at its next call)::

       fedguard-certs revoke --ca ca --crl clients.crl clients/bob.pem

Plain TLS (no client certificates) is steps 1, 2 and 5 without ``--client-ca`` and a client with only
``--ca-cert``. ``fedguard-certs show FILE.pem`` prints what a certificate says (subject, SANs, client id,
validity, whether it is a CA); it never prints private keys.

Client ids follow :data:`fedcore.identity.CLIENT_ID_RULE` everywhere: in certificates, file names and the
enrollment file ``{"clients": {"<client_id>": "<base64 of the 32 raw public-key bytes>", ...}}``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedcore.about import VersionAction
from fedcore.identity import CLIENT_ID_RULE, valid_client_id

__all__ = [
    "CLIENT_URI_PREFIX",
    "CertError",
    "Issued",
    "client_identity",
    "enroll",
    "generate_signing_key",
    "issue_client_cert",
    "issue_server_cert",
    "load_enrollment",
    "load_signing_key",
    "main",
    "make_ca",
    "public_key_b64",
    "read_ca",
    "revoke",
    "write_ca",
    "write_private",
    "write_public",
]

StrPath: TypeAlias = str | os.PathLike[str]

CLIENT_URI_PREFIX = "urn:fedguard:client:"
CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
SERVER_CERT_FILE = "server.pem"
SERVER_KEY_FILE = "server.key"
SIGNING_KEY_SUFFIX = ".ed25519"
CLOCK_SKEW = dt.timedelta(minutes=5)
MAX_DAYS = 100 * 366
_CN_MAX = 64
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")

_CaKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CertError(ValueError):
    """Every refusal of this module: a bad client id or host, an unreadable or mismatched file, a CA that is not one."""


@dataclass(frozen=True)
class Issued:
    """PEM bytes of one certificate and its private key (the key is kept out of ``repr``)."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)


# ---------------------------------------------------------------------------------------------------------------
# Issuing certificates
# ---------------------------------------------------------------------------------------------------------------


def _utc(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:  # naive datetimes are taken as UTC, like cryptography does
        return now.replace(tzinfo=dt.UTC)
    return now.astimezone(dt.UTC)


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise CertError(f"days must be an integer from 1 to {MAX_DAYS}, got {days!r}")


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey | Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _spki(key: Any) -> bytes:
    der: bytes = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der


def _load_cert(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as e:
        raise CertError(f"{what}: not a PEM certificate") from e


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    if not bc.ca:
        return False
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ku.key_cert_sign


def _load_ca(ca: Issued) -> tuple[x509.Certificate, _CaKey]:
    cert = _load_cert(ca.cert_pem, "CA certificate")
    try:
        key = serialization.load_pem_private_key(ca.key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise CertError("CA key: not an unencrypted PEM private key") from e
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise CertError(f"CA key: unsupported key type {type(key).__name__} (ECDSA or RSA needed)")
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise CertError("CA key does not match the CA certificate")
    if not _is_ca(cert):
        raise CertError(f"not a CA certificate (no basicConstraints CA=true with keyCertSign): "
                        f"{cert.subject.rfc4514_string()}")
    return cert, key


def _ski(cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(cert.public_key())  # type: ignore[arg-type]
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def make_ca(name: str = "fedguard CA", days: int = 365, now: dt.datetime | None = None) -> Issued:
    """A self-signed CA (ECDSA P-256) that can sign leaf certificates only (path length 0)."""
    _check_days(days)
    if not name or len(name) > _CN_MAX or not name.isprintable():
        raise CertError(f"CA name must be 1-{_CN_MAX} printable characters, got {name!r}")
    t = _utc(now)
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(t - CLOCK_SKEW)
        .not_valid_after(t + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _leaf(ca: Issued, common_name: str, sans: list[x509.GeneralName], eku: x509.ObjectIdentifier, days: int,
          now: dt.datetime | None) -> Issued:
    _check_days(days)
    ca_cert, ca_key = _load_ca(ca)
    t = _utc(now)
    key = _new_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(t - CLOCK_SKEW)
        .not_valid_after(t + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_ski(ca_cert), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _host_san(host: str) -> tuple[str, x509.GeneralName]:
    """``(normalized host, SAN)`` for a DNS name or an IPv4/IPv6 literal (``[::1]`` brackets allowed)."""
    h = host.strip()
    literal = h[1:-1] if h.startswith("[") and h.endswith("]") else h
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        pass
    else:
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            raise CertError(f"bad host {host!r}: a scoped IPv6 address cannot go in a certificate")
        return str(ip), x509.IPAddress(ip)
    name = h.lower()[:-1] if h.endswith(".") else h.lower()  # one trailing root dot is dropped
    labels = name.split(".")
    if labels and labels[0] == "*" and len(labels) > 2:  # one leading wildcard label: *.example.org
        labels = labels[1:]
    if (not name or len(name) > 253 or not name.isascii()
            or not all(_DNS_LABEL.fullmatch(label) for label in labels)):
        raise CertError(f"bad host {host!r}: need a DNS name (ASCII letters, digits, '-', dots; IDNs as "
                        f"xn--) or an IP address")
    return name, x509.DNSName(name)


def issue_server_cert(ca: Issued, hosts: Sequence[str], days: int = 365, now: dt.datetime | None = None) -> Issued:
    """A server certificate for ``hosts`` (DNS names and/or IP literals, each a SAN); CN = the first host."""
    if isinstance(hosts, str):
        hosts = [hosts]
    seen: dict[str, x509.GeneralName] = {}
    for host in hosts:
        name, san = _host_san(host)
        seen.setdefault(name, san)
    if not seen:
        raise CertError("a server certificate needs at least one host")
    first = next(iter(seen))
    # The CN is informative only (TLS checks the SANs); a name longer than a CN may be gets a generic one.
    cn = first if len(first) <= _CN_MAX else "fedguard server"
    return _leaf(ca, cn, list(seen.values()), ExtendedKeyUsageOID.SERVER_AUTH, days, now)


def _check_client_id(client_id: str) -> str:
    if not isinstance(client_id, str) or not valid_client_id(client_id):
        raise CertError(f"invalid client id {client_id!r}: need {CLIENT_ID_RULE}")
    return client_id


def issue_client_cert(ca: Issued, client_id: str, days: int = 365, now: dt.datetime | None = None) -> Issued:
    """A client certificate: CN = ``client_id``, SAN URI ``urn:fedguard:client:<client_id>``, EKU clientAuth."""
    _check_client_id(client_id)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(CLIENT_URI_PREFIX + client_id)]
    return _leaf(ca, client_id, sans, ExtendedKeyUsageOID.CLIENT_AUTH, days, now)


def client_identity(cert_pem: bytes) -> str:
    """The client id a client certificate carries: from its ``urn:fedguard:client:`` URI SAN, else its CN.

    Refuses CA certificates, certificates whose extended key usage excludes clientAuth, several different
    ids, and ids outside :data:`fedcore.identity.CLIENT_ID_RULE`. It does not check the chain or the validity
    period: that is the TLS handshake's job.
    """
    if isinstance(cert_pem, str):
        cert_pem = cert_pem.encode("ascii", "replace")
    cert = _load_cert(cert_pem, "client certificate")
    if _is_ca(cert):
        raise CertError("a CA certificate is not a client certificate")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        pass
    else:
        if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
            raise CertError("not a client certificate (extended key usage lacks clientAuth)")
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    ids = sorted({u[len(CLIENT_URI_PREFIX):] for u in uris if u.startswith(CLIENT_URI_PREFIX)})
    if len(ids) > 1:
        raise CertError(f"client certificate carries {len(ids)} different client ids")
    if ids:
        source, value = "URI SAN", ids[0]
    else:
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if len(cns) != 1:
            raise CertError("client certificate carries no client id (no fedguard URI SAN and not exactly one CN)")
        raw = cns[0].value
        source, value = "CN", raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    if not valid_client_id(value):
        raise CertError(f"client certificate {source} is not a valid client id ({CLIENT_ID_RULE})")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Request-signing keys and the enrollment file
# ---------------------------------------------------------------------------------------------------------------


def public_key_b64(key: Ed25519PrivateKey) -> str:
    """Base64 of the 32 raw bytes of ``key``'s public key (the form the enrollment file holds)."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def generate_signing_key() -> tuple[bytes, str]:
    """A new Ed25519 request-signing key: ``(private key as PKCS#8 PEM, public key as base64 of 32 raw bytes)``."""
    key = Ed25519PrivateKey.generate()
    return _key_pem(key), public_key_b64(key)


def load_signing_key(path: StrPath) -> Ed25519PrivateKey:
    """The Ed25519 private key in the PEM file ``path``."""
    data = _read(path, "signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise CertError(f"signing key {os.fspath(path)}: not an unencrypted PEM private key") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise CertError(f"signing key {os.fspath(path)}: not an Ed25519 key ({type(key).__name__})")
    return key


def _public_from_b64(value: object, where: str) -> Ed25519PublicKey:
    if not isinstance(value, str):
        raise CertError(f"{where}: public key must be a base64 string")
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise CertError(f"{where}: public key is not valid base64") from e
    if len(raw) != 32:
        raise CertError(f"{where}: public key must be 32 raw bytes (Ed25519), got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise CertError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _read_enrollment(path: StrPath) -> dict[str, Any]:
    p = os.fspath(path)
    data = _read(path, "enrollment file")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except CertError as e:
        raise CertError(f"enrollment file {p}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CertError(f"enrollment file {p}: not JSON ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("clients"), dict):
        raise CertError(f'enrollment file {p}: expected {{"clients": {{"<client_id>": "<base64 key>", ...}}}}')
    return doc


def _parse_clients(clients: dict[str, Any], p: str) -> dict[str, Ed25519PublicKey]:
    out: dict[str, Ed25519PublicKey] = {}
    owner: dict[bytes, str] = {}
    for cid, value in clients.items():
        where = f"enrollment file {p}, entry {cid!r}"
        if not valid_client_id(cid):
            raise CertError(f"{where}: invalid client id ({CLIENT_ID_RULE})")
        pub = _public_from_b64(value, where)
        raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        if raw in owner:  # one key for two ids would let its holder speak for both
            raise CertError(f"{where}: same public key as entry {owner[raw]!r}")
        owner[raw] = cid
        out[cid] = pub
    return out


def load_enrollment(path: StrPath) -> dict[str, Ed25519PublicKey]:
    """The enrolled public keys, ``{client_id: key}``, of the JSON file ``path``; every entry is checked."""
    return _parse_clients(_read_enrollment(path)["clients"], os.fspath(path))


def enroll(path: StrPath, client_id: str, public_b64: str) -> None:
    """Add or replace ``client_id``'s public key in the enrollment file ``path`` (created if missing), atomically."""
    _check_client_id(client_id)
    p = os.fspath(path)
    _public_from_b64(public_b64, f"enrollment of {client_id!r}")
    doc: dict[str, Any] = _read_enrollment(path) if os.path.exists(p) else {"clients": {}}
    clients = dict(doc["clients"])
    clients[client_id] = public_b64.strip()
    _parse_clients(clients, p)  # all entries valid, no key shared by two ids
    doc["clients"] = dict(sorted(clients.items()))
    write_public(path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"))


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def _read(path: StrPath, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CertError(f"cannot read {what} {os.fspath(path)}: {e.strerror or e}") from e


def _write_atomic(path: StrPath, data: bytes, mode: int, dir_mode: int) -> None:
    target = Path(path)
    tmp: Path | None = None
    try:
        target.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        tmp = None
        with contextlib.suppress(OSError):  # make the rename durable where directories can be opened
            dfd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as e:
        raise CertError(f"cannot write {os.fspath(path)}: {e.strerror or e}") from e
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def write_private(path: StrPath, data: bytes) -> None:
    """Write a secret atomically: mode 0600 from creation on, missing parent directories created with 0700."""
    _write_atomic(path, data, 0o600, 0o700)


def write_public(path: StrPath, data: bytes) -> None:
    """Write a public file (certificate, enrollment file) atomically with mode 0644."""
    _write_atomic(path, data, 0o644, 0o755)


def write_ca(out_dir: StrPath, ca: Issued) -> None:
    """``out_dir/ca.key`` (0600) and ``out_dir/ca.pem`` (0644)."""
    write_private(Path(out_dir) / CA_KEY_FILE, ca.key_pem)
    write_public(Path(out_dir) / CA_CERT_FILE, ca.cert_pem)


def read_ca(ca_dir: StrPath) -> Issued:
    """The CA of ``ca_dir`` (``ca.pem`` + ``ca.key``), checked: the key matches and the certificate is a CA."""
    d = Path(ca_dir)
    ca = Issued(_read(d / CA_CERT_FILE, "CA certificate"), _read(d / CA_KEY_FILE, "CA key"))
    try:
        _load_ca(ca)
    except CertError as e:
        raise CertError(f"{d}: {e}") from None
    return ca


def revoke(ca: Issued, crl_path: StrPath, serials: Sequence[int], days: int = 30,
           now: dt.datetime | None = None) -> list[int]:
    """Add ``serials`` to the CRL at ``crl_path`` (created when missing; an existing one must be this CA's) and
    re-sign it with the CA key (next update in ``days``); the sorted revoked serials."""
    _check_days(days)
    ca_cert, ca_key = _load_ca(ca)
    when = _utc(now)
    revoked: dict[int, dt.datetime] = {}
    if os.path.exists(crl_path):
        data = _read(crl_path, "CRL")
        try:
            old = (x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----")
                   else x509.load_der_x509_crl(data))
        except ValueError as e:
            raise CertError(f"{os.fspath(crl_path)}: not a certificate revocation list") from e
        if not old.is_signature_valid(ca_cert.public_key()):  # type: ignore[arg-type]
            raise CertError(f"{os.fspath(crl_path)}: not signed by this CA; refusing to replace it")
        revoked = {r.serial_number: r.revocation_date_utc for r in old}
    for serial in serials:
        revoked.setdefault(serial, when)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(when)
               .next_update(when + dt.timedelta(days=days)))
    for serial, date in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(date).build())
    crl = builder.sign(ca_key, hashes.SHA256())
    write_public(crl_path, crl.public_bytes(serialization.Encoding.PEM))
    return sorted(revoked)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]  # "fedguard-certs client" -> "client"
        raise _UsageError(f"{command}: {message}" if command else message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedguard-certs", description="Certificates for fedguard TLS / mutual TLS and "
                "Ed25519 request-signing keys. Writes keys 0600 and certificates 0644, atomically.")
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("ca", help="create a certificate authority: DIR/ca.pem, DIR/ca.key")
    c.add_argument("--out", required=True, metavar="DIR")
    c.add_argument("--name", default="fedguard CA")
    c.add_argument("--days", type=int, default=365)
    c.add_argument("--force", action="store_true", help="overwrite an existing DIR/ca.key")

    s = sub.add_parser("server", help="issue a server certificate: DIR/server.pem, DIR/server.key")
    s.add_argument("--ca", required=True, metavar="DIR", help="directory with ca.pem and ca.key")
    s.add_argument("--out", required=True, metavar="DIR")
    s.add_argument("--host", required=True, action="append", metavar="H",
                   help="DNS name or IP address clients dial (repeatable; the first is the CN)")
    s.add_argument("--days", type=int, default=365)

    cl = sub.add_parser("client", help="issue client certificates: DIR/<id>.pem, DIR/<id>.key")
    cl.add_argument("--ca", required=True, metavar="DIR", help="directory with ca.pem and ca.key")
    cl.add_argument("--out", required=True, metavar="DIR")
    cl.add_argument("--client-id", required=True, action="append", metavar="ID", help="repeatable")
    cl.add_argument("--days", type=int, default=365)

    k = sub.add_parser("keygen", help="Ed25519 request-signing keys: DIR/<id>.ed25519")
    k.add_argument("--out", required=True, metavar="DIR")
    k.add_argument("--client-id", required=True, action="append", metavar="ID", help="repeatable")
    k.add_argument("--enroll", metavar="FILE", help="add the public keys to this enrollment file")
    k.add_argument("--force", action="store_true", help="overwrite existing DIR/<id>.ed25519 keys")

    r = sub.add_parser("revoke", help="revoke client certificates: add them to a CRL signed by the CA")
    r.add_argument("--ca", required=True, metavar="DIR", help="directory with ca.pem and ca.key")
    r.add_argument("--crl", required=True, metavar="FILE", help="the CRL to create or extend (fedserver --crl)")
    r.add_argument("cert", nargs="*", metavar="CERT.pem", help="client certificates to revoke")
    r.add_argument("--serial", action="append", default=[], metavar="HEX", help="a serial to revoke (repeatable)")
    r.add_argument("--days", type=int, default=30, help="days until the CRL's next update")

    sh = sub.add_parser("show", help="describe the certificate(s) in a PEM file")
    sh.add_argument("file", metavar="FILE.pem")
    return p


def _unique_ids(ids: Sequence[str]) -> list[str]:
    out = list(dict.fromkeys(ids))
    for cid in out:
        _check_client_id(cid)
    return out


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _cmd_ca(args: argparse.Namespace) -> list[Path]:
    out = Path(args.out)
    if (out / CA_KEY_FILE).exists() and not args.force:
        raise CertError(f"{out / CA_KEY_FILE} exists; use --force to replace the CA (every certificate it "
                        f"issued stops verifying)")
    write_ca(out, make_ca(args.name, days=args.days))
    return [out / CA_CERT_FILE, out / CA_KEY_FILE]


def _guard_ca_files(ca_dir: Path, targets: Sequence[Path]) -> None:
    for t in targets:
        if any(_same_file(t, ca_dir / f) for f in (CA_CERT_FILE, CA_KEY_FILE)):
            raise CertError(f"refusing to overwrite the CA's own file {t}")


def _cmd_server(args: argparse.Namespace) -> list[Path]:
    ca_dir, out = Path(args.ca), Path(args.out)
    ca = read_ca(ca_dir)
    issued = issue_server_cert(ca, args.host, days=args.days)
    cert_path, key_path = out / SERVER_CERT_FILE, out / SERVER_KEY_FILE
    _guard_ca_files(ca_dir, [cert_path, key_path])
    write_private(key_path, issued.key_pem)
    write_public(cert_path, issued.cert_pem)
    return [cert_path, key_path]


def _cmd_client(args: argparse.Namespace) -> list[Path]:
    ca_dir, out = Path(args.ca), Path(args.out)
    ids = _unique_ids(args.client_id)  # all ids checked before anything is written
    _check_days(args.days)
    ca = read_ca(ca_dir)
    _guard_ca_files(ca_dir, [out / f"{cid}{ext}" for cid in ids for ext in (".pem", ".key")])
    written: list[Path] = []
    for cid in ids:
        issued = issue_client_cert(ca, cid, days=args.days)
        write_private(out / f"{cid}.key", issued.key_pem)
        write_public(out / f"{cid}.pem", issued.cert_pem)
        written += [out / f"{cid}.pem", out / f"{cid}.key"]
    return written


def _cmd_keygen(args: argparse.Namespace) -> list[Path]:
    out = Path(args.out)
    ids = _unique_ids(args.client_id)
    paths = {cid: out / f"{cid}{SIGNING_KEY_SUFFIX}" for cid in ids}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not args.force:
        raise CertError(f"{', '.join(existing)} exists; use --force to replace (re-enroll the new public key)")
    if args.enroll and os.path.exists(args.enroll):
        load_enrollment(args.enroll)  # refuse a broken enrollment file before writing any key
    written: list[Path] = []
    for cid, path in paths.items():
        private_pem, public_b64 = generate_signing_key()
        write_private(path, private_pem)
        written.append(path)
        if args.enroll:
            enroll(args.enroll, cid, public_b64)
    if args.enroll and ids:
        written.append(Path(args.enroll))
    return written


_EKU_NAMES = {ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth", ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth"}


def _describe(cert: x509.Certificate) -> list[str]:
    lines = [f"subject:     {cert.subject.rfc4514_string()}", f"issuer:      {cert.issuer.rfc4514_string()}",
             f"serial:      {cert.serial_number:x}"]
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        ca = f"yes (path length {bc.path_length})" if bc.ca and bc.path_length is not None else (
            "yes" if bc.ca else "no")
    except x509.ExtensionNotFound:
        ca = "no"
    lines.append(f"CA:          {ca}")
    pub = cert.public_key()
    if isinstance(pub, ec.EllipticCurvePublicKey):
        key = f"ECDSA {pub.curve.name}"
    elif isinstance(pub, rsa.RSAPublicKey):
        key = f"RSA {pub.key_size}"
    else:
        key = type(pub).__name__
    lines.append(f"key:         {key}")
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [f"DNS:{v}" for v in sans.get_values_for_type(x509.DNSName)]
        names += [f"IP:{v}" for v in sans.get_values_for_type(x509.IPAddress)]
        names += [f"URI:{v}" for v in sans.get_values_for_type(x509.UniformResourceIdentifier)]
    except x509.ExtensionNotFound:
        names = []
    lines.append(f"SANs:        {', '.join(names) or '(none)'}")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        lines.append(f"key usage:   {', '.join(_EKU_NAMES.get(o, o.dotted_string) for o in eku)}")
    except x509.ExtensionNotFound:
        pass
    if ca == "no":
        with contextlib.suppress(CertError):
            lines.append(f"client id:   {client_identity(cert.public_bytes(serialization.Encoding.PEM))}")
    now = dt.datetime.now(dt.UTC)
    after = cert.not_valid_after_utc
    state = " (EXPIRED)" if after < now else (" (NOT YET VALID)" if cert.not_valid_before_utc > now else "")
    lines.append(f"not before:  {cert.not_valid_before_utc.isoformat()}")
    lines.append(f"not after:   {after.isoformat()}{state}")
    lines.append(f"sha256:      {cert.fingerprint(hashes.SHA256()).hex(':')}")
    return lines


def _cmd_show(args: argparse.Namespace) -> None:
    data = _read(args.file, "certificate")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise CertError(f"{args.file}: no PEM certificate in it") from e
    for i, cert in enumerate(certs):
        if i:
            print()
        print(f"file:        {args.file}" + (f" (certificate {i + 1} of {len(certs)})" if len(certs) > 1 else ""))
        print("\n".join(_describe(cert)))


def _cmd_revoke(args: argparse.Namespace) -> list[Path]:
    ca = read_ca(args.ca)
    serials: list[int] = []
    for path in args.cert:
        serials.append(_load_cert(_read(path, "certificate"), path).serial_number)
    for value in args.serial:
        try:
            serials.append(int(value.replace(":", ""), 16))
        except ValueError:
            raise CertError(f"--serial {value!r}: not a hexadecimal serial number") from None
    if not serials:
        raise CertError("revoke: name the certificates (CERT.pem) or --serial to revoke")
    revoked = revoke(ca, args.crl, serials, days=args.days)
    print(f"revoked {', '.join(f'{s:x}' for s in serials)} ({len(revoked)} serials in the list)")
    return [Path(args.crl)]


def main(argv: list[str] | None = None) -> int:
    """``fedguard-certs``: 0 on success, 2 on a refusal or bad usage (one line on stderr)."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "show":
            _cmd_show(args)
            return 0
        handler = {"ca": _cmd_ca, "server": _cmd_server, "client": _cmd_client, "keygen": _cmd_keygen,
                   "revoke": _cmd_revoke}
        for path in handler[args.command](args):
            print(f"wrote {path}")
        return 0
    except (CertError, _UsageError) as e:
        print(f"fedguard-certs: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
