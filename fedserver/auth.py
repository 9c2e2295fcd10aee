"""Who sent a request: the identity of a mutual-TLS certificate and/or of an enrolled signing key; the operator
credential; certificate revocation; join admission (rate and session bounds); rate-limited refusal events.

With ``security.client_ca`` (mutual TLS) the client id is the one its certificate carries (the URI SAN
``urn:fedguard:client:<id>``, else the common name); with ``security.client_keys`` every request must carry a
valid Ed25519 signature of an enrolled key (:mod:`fedguard.signing`), whose nonce is remembered for the replay
window in memory and in the run dir's ``replay.journal`` (so a request captured before a restart is refused
after it). With both, the two must name the same client. The servicer then holds the request to that identity: a
Join must be for the authenticated client id, and every later call's session must belong to it, so a client
cannot join, pull or push as another id, and a stolen session id is useless to anyone else.

With ``security.crl`` (``fedguard-certs revoke``) every call's peer certificate serial is looked up in the
certificate revocation list (re-read when the file changes): a revoked client is refused at its next call.
gRPC Python cannot check a CRL in the TLS handshake, so the check is per call, from the call's auth context
(``x509_pem_cert``, parsed once per distinct certificate and cached).

``GetStatus`` (client ids, clusters) is operator-only: the caller presents the operator token (metadata
``fg-operator``), from ``security.operator_token_file`` or ``FEDGUARD_OPERATOR_TOKEN``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedcore.config import MAX_TOKEN, OPERATOR_TOKEN_ENV, ConfigError, SecurityConfig
from fedcore.identity import valid_client_id
from fedcore.log import get_logger
from fedguard.signing import AuthError, ReplayGuard, ReplayJournal, verify_request
from fedserver.errors import ProtocolError

URI_PREFIX = "urn:fedguard:client:"
OPERATOR = "fg-operator"
REPLAY_JOURNAL = "replay.journal"


def certificate_identity(auth_context: dict[str, Any]) -> str | None:
    """The client id a verified peer certificate carries (gRPC's auth context of the call), or None."""
    for raw in auth_context.get("x509_subject_alternative_name", ()):
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if value.startswith(URI_PREFIX):
            return value[len(URI_PREFIX):]
    for raw in auth_context.get("x509_common_name", ()):
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return None


def peer_host(peer: str) -> str:
    """The address part of gRPC's peer string (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``), port dropped."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer[:64]


def operator_token(security: SecurityConfig) -> str:
    """The operator credential: ``security.operator_token_file``'s first line, else FEDGUARD_OPERATOR_TOKEN."""
    if security.operator_token_file:
        try:
            token = Path(security.operator_token_file).read_text().strip()
        except OSError as e:
            raise ConfigError("security.operator_token_file", f"cannot read: {e.strerror}") from None
        if not token:
            raise ConfigError("security.operator_token_file", "the file is empty")
    else:
        token = os.environ.get(OPERATOR_TOKEN_ENV, "").strip()
    if len(token) > MAX_TOKEN:
        raise ConfigError("security.operator_token_file", f"the token must be at most {MAX_TOKEN} characters")
    return token


class Revocations:
    """The client certificates a CRL (signed by ``security.client_ca``) revokes, re-read when the file changes
    (looked at no more than once a second: at a call's check, and by :meth:`refresh` from the server's watcher);
    each distinct peer certificate is parsed once (bounded cache). ``on_change`` runs when a reload changed the
    revoked set (the server ends its parked long-polls there, so a revoked client is refused at once instead of
    after its long-poll)."""

    CHECK_EVERY_S = 1.0
    MAX_CACHED = 100_000

    def __init__(self, path: str, ca_path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.clock = Path(path), clock
        try:
            cas = x509.load_pem_x509_certificates(Path(ca_path).read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError("security.client_ca", f"cannot read the CA certificate(s): {e}") from None
        self._ca_keys = [c.public_key() for c in cas]
        self._serials: frozenset[int] = frozenset()
        self._stamp: tuple[int, int] | None = None
        self._next_check = 0.0
        self._serial_of: OrderedDict[bytes, int] = OrderedDict()
        self.log = get_logger("fedserver")
        self.on_change: Callable[[], None] | None = None
        error = self._reload()
        if error:
            raise ConfigError("security.crl", error)

    def _reload(self) -> str:
        """Load the CRL if it changed; the reason when it cannot be used (the previous list stays in force)."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return ""
            data = self.path.read_bytes()
        except OSError as e:
            return f"cannot read {self.path}: {e.strerror}"
        try:
            crl = (x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----")
                   else x509.load_der_x509_crl(data))
        except ValueError as e:
            return f"{self.path} is not a certificate revocation list: {e}"
        if not any(_crl_signed_by(crl, key) for key in self._ca_keys):
            return f"{self.path} is not signed by the client CA (security.client_ca)"
        self._serials = frozenset(r.serial_number for r in crl)
        self._stamp = stamp
        self.log.info("crl.loaded", path=str(self.path), revoked=len(self._serials))
        return ""

    def refresh(self) -> bool:
        """Re-read the CRL if it is time (once per ``CHECK_EVERY_S``) and the file changed; True (after
        ``on_change``) when the revoked set changed. A CRL that cannot be used keeps the previous list in force."""
        now = self.clock()
        if now < self._next_check:
            return False
        self._next_check = now + self.CHECK_EVERY_S
        before = self._serials
        error = self._reload()
        if error:
            self.log.error("crl.unusable", reason=error, keeping=len(self._serials))
        if self._serials == before:
            return False
        if self.on_change is not None:
            self.on_change()
        return True

    def check(self, auth_context: dict[str, Any]) -> None:
        self.refresh()
        pems = auth_context.get("x509_pem_cert", ())
        if not pems:
            raise ProtocolError("UNAUTHENTICATED", "no client certificate")
        pem = pems[0] if isinstance(pems[0], bytes) else str(pems[0]).encode()
        serial = self._serial_of.get(pem)
        if serial is None:
            try:
                serial = x509.load_pem_x509_certificate(pem).serial_number
            except ValueError:
                raise ProtocolError("UNAUTHENTICATED", "unreadable client certificate") from None
            self._serial_of[pem] = serial
            if len(self._serial_of) > self.MAX_CACHED:
                self._serial_of.popitem(last=False)
        if serial in self._serials:
            raise ProtocolError("UNAUTHENTICATED", f"client certificate revoked (serial {serial:x}, "
                                                   f"{self.path.name})")


def _crl_signed_by(crl: x509.CertificateRevocationList, key: Any) -> bool:
    try:
        return bool(crl.is_signature_valid(key))
    except (TypeError, ValueError):
        return False


class TokenBuckets:
    """Per-key token buckets (``rate`` per second, holding ``burst``); bounded: beyond ``max_keys`` the least
    recently used bucket is forgotten (it was full, or is refilled by the time its key comes back)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 100_000) -> None:
        self.rate, self.burst, self.clock, self.max_keys = rate, burst, clock, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> bool:
        now = self.clock()
        level, since = self._buckets.pop(key, (self.burst, now))
        level = min(self.burst, level + (now - since) * self.rate)
        ok = level >= 1.0
        self._buckets[key] = (level - 1.0 if ok else level, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return ok


class RefusalLog:
    """Refusal events, rate-limited per (peer address, reason kind): at most one per ``every_s`` each and
    ``per_second`` in all; the ones left out are counted and reported by the next event (``suppressed``)."""

    def __init__(self, log: Any, every_s: float = 1.0, per_second: float = 20.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._all = TokenBuckets(per_second, per_second, clock, max_keys=1)
        self.suppressed = 0
        self.emitted = 0

    def event(self, name: str, peer: str, kind: str, **fields: Any) -> bool:
        now = self.clock()
        key = (peer_host(peer), kind)
        last = self._last.pop(key, None)
        if (last is not None and now - last < self.every_s) or not self._all.take(""):
            self._last[key] = last if last is not None else now
            self.suppressed += 1
            return False
        self._last[key] = now
        if len(self._last) > 10_000:
            self._last.popitem(last=False)
        extra = {"suppressed": self.suppressed} if self.suppressed else {}
        self.suppressed = 0
        self.emitted += 1
        self.log.warning(name, peer=peer[:64], **fields, **extra)
        return True


class Authenticator:
    def __init__(self, security: SecurityConfig, clock: Callable[[], float] = time.time,
                 run_dir: str | None = None) -> None:
        self.mtls = bool(security.client_ca)
        self.keys: dict[str, Ed25519PublicKey] | None = None
        journal = None
        if security.client_keys:
            from fedguard.certs import load_enrollment

            self.keys = load_enrollment(security.client_keys)
            if run_dir:
                journal = ReplayJournal(Path(run_dir) / REPLAY_JOURNAL)
        self.guard = ReplayGuard(security.replay_window_s, journal=journal, now_ms=int(clock() * 1000))
        self.clock = clock
        self.revocations = Revocations(security.crl, security.client_ca) if security.crl else None
        self._operator = hashlib.sha256(operator_token(security).encode()).digest() \
            if operator_token(security) else None
        rate_c, rate_p = security.join_rate_per_credential, security.join_rate_per_peer
        self._joins_by_credential = TokenBuckets(rate_c, max(1.0, 2 * rate_c))
        self._joins_by_peer = TokenBuckets(rate_p, max(1.0, 2 * rate_p))

    @property
    def signed(self) -> bool:
        return self.keys is not None

    @property
    def has_operator(self) -> bool:
        return self._operator is not None

    def identify(self, method: str, context: Any, body: bytes) -> str | None:
        """The authenticated client id of this call (None when neither mutual TLS nor keys are configured);
        raises ``UNAUTHENTICATED`` when the call does not prove one."""
        who: str | None = None
        if self.mtls:
            auth_context = context.auth_context()
            if self.revocations is not None:
                self.revocations.check(auth_context)
            who = certificate_identity(auth_context)
            if who is None or not valid_client_id(who):
                raise ProtocolError("UNAUTHENTICATED", "the client certificate carries no valid client id")
        if self.keys is not None:
            try:
                signer = verify_request(self.keys, self.guard, method, context.invocation_metadata() or (), body,
                                        self.clock())
            except AuthError as e:
                raise ProtocolError("UNAUTHENTICATED", f"signature refused: {e}") from None
            if who is not None and signer != who:
                raise ProtocolError("PERMISSION_DENIED", f"signed as {signer!r} over a certificate for {who!r}")
            who = signer
        return who

    def operator(self, context: Any) -> bool:
        """True when the call presents the operator credential; ``UNAUTHENTICATED`` when it presents a wrong one,
        False when it presents none."""
        given = [v for k, v in (context.invocation_metadata() or ()) if k == OPERATOR]
        if not given:
            return False
        value = given[0].encode() if isinstance(given[0], str) else bytes(given[0])
        # Digests compared in constant time: neither the content nor the length of the secret leaks.
        if self._operator is None or len(given) > 1 or \
                not secrets.compare_digest(hashlib.sha256(value).digest(), self._operator):
            raise ProtocolError("UNAUTHENTICATED", "bad operator credential")
        return True

    def admit_join(self, credential: str, peer: str) -> None:
        """Refuse (``RESOURCE_EXHAUSTED``) a join over the per-credential or per-peer-address rate."""
        if not self._joins_by_peer.take(peer_host(peer)):
            raise ProtocolError("RESOURCE_EXHAUSTED", "too many joins from this address "
                                                      "(security.join_rate_per_peer); retry later")
        if not self._joins_by_credential.take(credential):
            raise ProtocolError("RESOURCE_EXHAUSTED", "too many joins with this credential "
                                                      "(security.join_rate_per_credential); retry later")

    @staticmethod
    def require(identity: str | None, client_id: str, what: str) -> None:
        """Refuse (``PERMISSION_DENIED``) a call about ``client_id`` from another authenticated client (without
        naming that client: client ids never leave the server)."""
        if identity is not None and identity != client_id:
            raise ProtocolError("PERMISSION_DENIED", f"{what} belongs to another client, not to the "
                                                     f"authenticated client {identity!r}")
