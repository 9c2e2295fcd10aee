"""Bounds on every field a client sends, checked before anything else reads it.

Strings are bounded in length and alphabet (and shown in logs only through :func:`fedcore.identity.shorten`);
numbers must be finite, non-negative where a count, and below a ceiling no honest client reaches. Each check
raises :class:`ProtocolError` ``INVALID_ARGUMENT`` whose reason names the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fedcore.config import MAX_TOKEN
from fedcore.identity import CLIENT_ID_RULE, shorten, valid_client_id
from fedguard.v1 import fedguard_pb2 as pb
from fedserver.errors import ProtocolError

MAX_SESSION_ID = 64
MAX_SAMPLES = 1 << 40
MAX_ROUND = 1 << 40
MAX_LOSS = 1e12
MAX_METRICS = 64
MAX_METRIC_NAME = 64
MAX_METRIC_VALUE = 1e15
MAX_REASON = 256
MAX_VERSION = 64
MAX_FINGERPRINT = 128
MAX_TENSORS = 100_000
MAX_TENSOR_NAME = 512
MAX_WAIT_S = 3600.0


def _bad(field: str, message: str) -> ProtocolError:
    return ProtocolError("INVALID_ARGUMENT", f"{field}: {message}")


def _text(value: str, field: str, limit: int) -> None:
    if len(value) > limit:
        raise _bad(field, f"at most {limit} characters, got {len(value)}")
    if not value.isprintable():
        raise _bad(field, f"must be printable text, got {shorten(value)!r}")


def check_session(value: str) -> None:
    """Only bounded: a session id is looked up, never logged (an unknown one is UNAUTHENTICATED)."""
    if len(value) > MAX_SESSION_ID:
        raise _bad("session_id", f"at most {MAX_SESSION_ID} characters")


def _count(value: int, field: str, ceiling: int) -> None:
    if value > ceiling:
        raise _bad(field, f"{value} exceeds {ceiling}")


def _number(value: float, field: str, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise _bad(field, f"must be a finite number in [{low:g}, {high:g}], got {value}")


def check_join(r: pb.JoinRequest) -> None:
    if not valid_client_id(r.client_id):
        raise _bad("client_id", f"{shorten(r.client_id)!r} is not a valid client id ({CLIENT_ID_RULE})")
    if len(r.token) > MAX_TOKEN:
        raise _bad("token", f"at most {MAX_TOKEN} characters")
    _text(r.model_fingerprint, "model_fingerprint", MAX_FINGERPRINT)
    _text(r.capabilities.version, "capabilities.version", MAX_VERSION)
    _count(r.capabilities.num_train_samples, "capabilities.num_train_samples", MAX_SAMPLES)


def check_pull(r: pb.PullTaskRequest) -> None:
    check_session(r.session_id)
    _number(r.max_wait_s, "max_wait_s", 0.0, MAX_WAIT_S)


def check_heartbeat(r: pb.HeartbeatRequest) -> None:
    check_session(r.session_id)


def check_leave(r: pb.LeaveRequest) -> None:
    check_session(r.session_id)
    _text(r.reason, "reason", MAX_REASON)


def check_metrics(metrics: Mapping[str, float], field: str = "metrics") -> None:
    if len(metrics) > MAX_METRICS:
        raise _bad(field, f"at most {MAX_METRICS} entries, got {len(metrics)}")
    for name, value in metrics.items():
        if len(name) > MAX_METRIC_NAME or not name.replace(".", "_").isidentifier():
            raise _bad(field, f"metric name {shorten(name, 40)!r} must be an identifier of at most "
                              f"{MAX_METRIC_NAME} characters")
        _number(value, f"{field}[{name}]", -MAX_METRIC_VALUE, MAX_METRIC_VALUE)


# UpdateReport's double fields other than train_loss (read from the message's descriptor: a field added to the
# message is bounded without a change here).
_REPORT_DOUBLES = tuple(f.name for f in pb.UpdateReport.DESCRIPTOR.fields
                        if f.type == f.TYPE_DOUBLE and f.name != "train_loss")


def check_update_report(r: pb.UpdateReport) -> None:
    """The sizes of an :class:`~fedcore.update_report.UpdateReport` message; the ranges of its numbers are the
    intake's (:meth:`UpdateReport.bounds_error`, recorded against the round)."""
    _count(r.num_samples, "report.num_samples", MAX_SAMPLES)
    _number(r.train_loss, "report.train_loss", -MAX_LOSS, MAX_LOSS)
    for name in _REPORT_DOUBLES:  # an absent one reads 0.0, inside the bounds
        value = getattr(r, name)
        if not -MAX_METRIC_VALUE <= value <= MAX_METRIC_VALUE:  # NaN fails it too
            _number(value, f"report.{name}", -MAX_METRIC_VALUE, MAX_METRIC_VALUE)
    if r.extras:
        check_metrics(r.extras, "report.extras")


def check_update_header(h: pb.UpdateHeader) -> None:
    check_session(h.session_id)
    _count(h.round, "round", MAX_ROUND)
    # A client from before the UpdateReport message sends these three (read only when `report` is absent).
    _count(h.num_samples, "num_samples", MAX_SAMPLES)
    _number(h.train_loss, "train_loss", -MAX_LOSS, MAX_LOSS)  # beta_hat's range is the intake's (recorded)
    check_metrics(h.metrics)
    if h.HasField("report"):
        check_update_report(h.report)
    if len(h.tensors) > MAX_TENSORS:
        raise _bad("tensors", f"at most {MAX_TENSORS} tensors")
    for t in h.tensors:
        _text(t.name, "tensors.name", MAX_TENSOR_NAME)
    if h.kind not in (pb.UPDATE_KIND_UNSPECIFIED, pb.WEIGHTS, pb.DELTA, pb.MASKED):
        raise _bad("kind", f"unknown update kind {h.kind}")
    if h.compression not in (pb.COMPRESSION_NONE, pb.COMPRESSION_FP16, pb.COMPRESSION_INT8, pb.COMPRESSION_TOPK):
        raise _bad("compression", f"unknown compression kind {h.compression}")
    if h.payload_sha256 and len(h.payload_sha256) != 32:
        raise _bad("payload_sha256", f"must be 32 bytes, got {len(h.payload_sha256)}")


MAX_SECAGG_ITEMS = 1 << 16  # shares or revealed shares in one message: at most one per neighbour, k < 2^16
MAX_SECAGG_BYTES = 256  # a key, a signature, a commitment, a sealed or revealed share


def check_secagg(r: pb.SecAggRequest) -> None:
    """A secure-aggregation message's sizes; its content is checked by the protocol (fedcore.secagg.protocol)."""
    check_session(r.session_id)
    _count(r.round, "round", MAX_ROUND)
    _number(r.max_wait_s, "max_wait_s", 0.0, MAX_WAIT_S)
    kind = r.WhichOneof("kind")
    blobs: list[tuple[str, bytes]] = []
    ids: list[tuple[str, str]] = []
    if kind == "advertisement":
        a = r.advertisement
        blobs = [("advertisement.c_pk", a.c_pk), ("advertisement.s_pk", a.s_pk),
                 ("advertisement.signature", a.signature)]
        ids = [("advertisement.client_id", a.client_id)]
    elif kind == "shares":
        _count(len(r.shares.shares), "shares.shares", MAX_SECAGG_ITEMS)
        blobs = [("shares.commitment", r.shares.commitment),
                 *(("shares.shares.ciphertext", s.ciphertext) for s in r.shares.shares)]
        ids = [(f"shares.shares.{f}", getattr(s, f)) for s in r.shares.shares for f in ("sender", "recipient")]
    elif kind == "unmask":
        pairs = [*r.unmask.self_mask_shares, *r.unmask.key_shares]
        _count(len(pairs), "unmask", MAX_SECAGG_ITEMS)
        blobs = [("unmask.share", p.share) for p in pairs]
        ids = [("unmask.owner", p.owner) for p in pairs]
    for name, blob in blobs:
        if len(blob) > MAX_SECAGG_BYTES:
            raise _bad(name, f"at most {MAX_SECAGG_BYTES} bytes, got {len(blob)}")
    for name, value in ids:
        if not valid_client_id(value):
            raise _bad(name, f"{shorten(value)!r} is not a valid client id ({CLIENT_ID_RULE})")
