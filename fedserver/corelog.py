"""Refused TLS handshakes as structured events: gRPC Python has no hook for a handshake the server refused (the
client presented no certificate, one from another CA, an expired one...). gRPC's C core logs each on stderr,
e.g.::

    I1125 03:55:45.753879   16326 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL:
    error:100000c0:SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE: ...

:func:`capture_handshake_failures` puts a pipe in front of file descriptor 2 (the process's stderr: the C core,
Python and every library write there) and a thread that copies every byte to the original stderr unchanged, in
order, and parses complete lines: a ``Handshake failed`` line becomes a ``tls.handshake_refused`` event (with
``--log-json`` a JSON line) with its reason (the check that failed, named), rate-limited by
:class:`fedserver.auth.RefusalLog` (at most one a second per reason, 20 a second in all, the rest counted in
``suppressed``). The events are written by a second thread (a bounded queue between the two; when it is full
the event is dropped and counted), so the copying thread never writes to the pipe it drains. Bounded: lines
are read up to 8 KiB (longer ones are copied and not parsed), nothing is
buffered beyond the current line, and the thread only parses lines in the C core's format, so the events it
writes itself (to stderr, through the same pipe) are copied and never parsed again. The C core's line does not
carry the peer address, so the event's ``peer`` is ``"unknown"``; a refusal the servicer sees (a bad token, a
revoked certificate, a bad signature) is logged as ``rpc.refused`` with the peer address.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from typing import Any

from fedserver.auth import RefusalLog

_CORE_LINE = re.compile(rb"^[DIWE]\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\] (?P<msg>.*)$")
_HANDSHAKE = re.compile(rb"Handshake failed with error (?P<error>[A-Z_]+)(?::\s*(?P<detail>.*))?$")
# OpenSSL's reason codes, and the check each names.
_REASONS = (
    (b"PEER_DID_NOT_RETURN_A_CERTIFICATE", "client certificate required"),
    (b"certificate has expired", "expired client certificate"),
    (b"certificate is not yet valid", "client certificate not yet valid"),
    (b"unable to get local issuer certificate", "unknown CA (client certificate not signed by the client CA)"),
    (b"self signed certificate", "unknown CA (self-signed client certificate)"),
    (b"CERTIFICATE_VERIFY_FAILED", "client certificate did not verify"),
    (b"TLSV1_ALERT_UNKNOWN_CA", "the client does not trust this server's certificate (unknown CA)"),
    (b"WRONG_VERSION_NUMBER", "not TLS (a plaintext client?)"),
    (b"HTTP_REQUEST", "not TLS (a plaintext client?)"),
)
MAX_LINE = 8192


def check_named(detail: bytes) -> str | None:
    """The check an OpenSSL error text names (gRPC core's line, or Python's ``ssl.SSLError``), or None."""
    for needle, reason in _REASONS:
        if needle in detail:
            return reason
    return None


def handshake_reason(line: bytes) -> str | None:
    """The check a C-core ``Handshake failed`` line names, or None for any other line."""
    m = _CORE_LINE.match(line.rstrip(b"\r\n"))
    if m is None:
        return None
    h = _HANDSHAKE.search(m.group("msg"))
    if h is None:
        return None
    detail = h.group("detail") or b""
    named = check_named(detail)
    if named is not None:
        return named
    return f"TLS handshake failed ({h.group('error').decode('ascii', 'replace')}: " \
           f"{detail[-120:].decode('utf-8', 'replace')})"


class HandshakeCapture:
    """The running capture (see the module's docstring); :meth:`close` puts stderr back."""

    def __init__(self, log: Any) -> None:
        self.refusals = RefusalLog(log)
        self.seen = 0
        self.dropped = 0
        self._events: queue.Queue[str | None] = queue.Queue(maxsize=1000)
        self._saved = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read = read_fd
        self._thread = threading.Thread(target=self._pump, name="core-log", daemon=True)
        self._thread.start()
        self._emitter = threading.Thread(target=self._emit, name="core-log-events", daemon=True)
        self._emitter.start()

    def _emit(self) -> None:
        while (reason := self._events.get()) is not None:
            self.refusals.event("tls.handshake_refused", "unknown", reason, reason=reason,
                                source="grpc-core stderr")

    def _pump(self) -> None:
        pending = b""
        with os.fdopen(self._read, "rb", buffering=0) as src:
            while True:
                chunk = src.read(65536)
                if not chunk:
                    break
                os.write(self._saved, chunk)  # unchanged, first: nothing written to stderr is lost or delayed
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > MAX_LINE:
                    pending = b""
                for line in lines:
                    self._parse(line)

    def _parse(self, line: bytes) -> None:
        if len(line) > MAX_LINE:
            return
        try:
            reason = handshake_reason(line)
            if reason is not None:
                self.seen += 1
                self._events.put_nowait(reason)
        except queue.Full:
            self.dropped += 1
        except Exception:  # never let a parse problem stop the copying of stderr
            pass

    def close(self) -> None:
        """Put the original stderr back on descriptor 2; the thread copies what is left and ends."""
        os.dup2(self._saved, 2)
        self._events.put(None)


def capture_handshake_failures(log: Any) -> HandshakeCapture:
    return HandshakeCapture(log)


__all__ = ["HandshakeCapture", "capture_handshake_failures", "handshake_reason"]
