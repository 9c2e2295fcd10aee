"""Translation between the wire messages of ``fedguard.v1`` and fedcore's plain types (shared by both shells)."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from fedcore import rounds
from fedcore.compression.config import FP16, INT8, NONE, TOPK, CompressionConfig
from fedcore.config import FederationInfo, TrainingConfig
from fedcore.nfl import NflSettings
from fedcore.report import DistflStatus, FederationStatus, NflStatus, RoundReport
from fedcore.secagg import protocol as secagg
from fedcore.secagg.config import SecureAggregationConfig, SecureSettings
from fedcore.serialization import DEFAULT_CHUNK_BYTES, Payload, SerializationError, TensorMeta, iter_chunks
from fedcore.update_report import UpdateReport, from_metrics_map
from fedguard.v1 import fedguard_pb2 as pb

_DTYPE_TO_PB: dict[str, Any] = {
    "float32": pb.FLOAT32, "float16": pb.FLOAT16, "bfloat16": pb.BFLOAT16, "float64": pb.FLOAT64,
    "int64": pb.INT64, "int32": pb.INT32, "int16": pb.INT16, "int8": pb.INT8, "uint8": pb.UINT8,
    "bool": pb.BOOL,
}
_PB_TO_DTYPE: dict[Any, str] = {v: k for k, v in _DTYPE_TO_PB.items()}


def meta_to_pb(m: TensorMeta) -> pb.TensorMeta:
    return pb.TensorMeta(name=m.name, dtype=_DTYPE_TO_PB[m.dtype], shape=list(m.shape), nbytes=m.nbytes)


def metas_to_pb(manifest: Iterable[TensorMeta]) -> list[pb.TensorMeta]:
    return [meta_to_pb(m) for m in manifest]


# A remote party's tensor description is bounded before anything is computed from it (a shape of 10^5 dimensions
# of 2^62 would cost the event loop seconds in math.prod and produce integers too long to print).
MAX_DIMS = 32
MAX_DIM = 1 << 48


def meta_from_pb(p: pb.TensorMeta) -> TensorMeta:
    name = p.name[:80]
    dtype = _PB_TO_DTYPE.get(p.dtype)
    if dtype is None:
        raise SerializationError(f"tensor {name!r}: unknown dtype code {p.dtype}")
    if len(p.shape) > MAX_DIMS:
        raise SerializationError(f"tensor {name!r}: {len(p.shape)} dimensions, at most {MAX_DIMS}")
    if any(d < 0 or d > MAX_DIM for d in p.shape):
        raise SerializationError(f"tensor {name!r}: every dimension must be in [0, 2^48]")
    m = TensorMeta(p.name, dtype, tuple(int(d) for d in p.shape))
    if p.nbytes != m.nbytes:
        raise SerializationError(f"tensor {name!r}: announces {p.nbytes} bytes, which its dtype and shape do not give")
    return m


# Checked manifests by their wire bytes: a server reads its model's manifest in every update, a client in every
# task. Bounded in entries and in bytes (a remote party chooses what it sends: at most _MANIFESTS_MAX entries of at
# most _MANIFEST_KEY_BYTES each are kept, 4 MiB; a bigger manifest is decoded every time); a failure is never stored.
_MANIFESTS: dict[tuple[bytes, ...], tuple[TensorMeta, ...]] = {}
_MANIFESTS_MAX = 16
_MANIFEST_KEY_BYTES = 256 << 10


def metas_from_pb(ps: Sequence[pb.TensorMeta]) -> list[TensorMeta]:
    key = tuple([p.SerializeToString() for p in ps])  # a tuple: concatenated messages would merge
    got = _MANIFESTS.get(key)
    if got is None:
        got = tuple(meta_from_pb(p) for p in ps)
        if sum(map(len, key)) <= _MANIFEST_KEY_BYTES:
            if len(_MANIFESTS) >= _MANIFESTS_MAX:
                _MANIFESTS.clear()
            _MANIFESTS[key] = got
    return list(got)


M = TypeVar("M", pb.TaskMessage, pb.UpdateMessage)
# The stream messages that carry chunks.
Chunked = pb.TaskMessage | pb.UpdateMessage | pb.SessionReply | pb.SessionRequest


def chunk_frames(payload: bytes | bytearray | memoryview, message: type[M],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[M]:
    """Stream messages of type ``message`` whose ``chunk`` field carries consecutive slices of ``payload``.

    The chunk is written into the parent message in place: building a ``Chunk`` first and passing it to the
    parent's constructor copies every byte once more (3.5x slower in tools/bench/bench_serialization.py).
    """
    for off, data in iter_chunks(payload, chunk_bytes):
        msg = message()
        msg.chunk.offset = off
        msg.chunk.data = bytes(data)
        yield msg


# ---- chunk frames as bytes, zero-copy: the same bytes protobuf writes and reads, without its copies ----
# A chunk frame is ``message { chunk: Chunk { offset = 1 (varint, omitted when 0); data = 2 (bytes) } }``. The
# sender writes the few header bytes itself and joins them with the tensor bytes (one copy, into the frame);
# the receiver finds the data inside the frame and hands out a memoryview of it (no copy). Only the canonical
# layout is read this way; anything else (unknown or repeated fields, another order, an empty chunk) goes
# through protobuf's parser, so every frame means what protobuf says it means.

# The field number of ``chunk`` in each stream message.
_CHUNK_FIELD: dict[type, int] = {pb.TaskMessage: 3, pb.UpdateMessage: 2, pb.SessionReply: 3, pb.SessionRequest: 2}
_OFFSET_TAG = 0x08  # Chunk.offset: field 1, varint
_DATA_TAG = 0x12  # Chunk.data: field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int] | None:
    """(value, next position) of the varint at ``pos``, or None when it is cut off or longer than 64 bits."""
    value = 0
    for i in range(10):
        if pos + i >= end:
            return None
        b = buf[pos + i]
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return (value, pos + i + 1) if value < 1 << 64 else None
    return None


def fits_inline(header_bytes: int, total_bytes: int, chunk_bytes: int) -> bool:
    """Whether a payload of ``total_bytes`` rides inside its header (``TaskHeader.data``/``UpdateHeader.data``,
    one message instead of a header and chunks): the header, the data and their framing (16 bytes covers the field
    tags and length varints) fit in one chunk, so the message stays within what a chunk may be."""
    return total_bytes > 0 and header_bytes + total_bytes + 16 <= chunk_bytes


_HEADER_TAG = 0x12  # TaskMessage.header / SessionReply.header: field 2, length-delimited
_DEADLINE = struct.Struct("<Bd")  # TaskHeader.deadline_s: field 2, 64-bit (tag 0x11), little-endian double
DEADLINE_BYTES = _DEADLINE.size  # what the deadline adds to a serialized TaskHeader


def task_header_frame(header: bytes, deadline_s: float) -> bytes:
    """The serialized ``TaskMessage`` (and ``SessionReply``: the same field numbers) whose header is ``header`` (a
    serialized ``TaskHeader`` without ``deadline_s``) with ``deadline_s`` added: what ``TaskMessage(header=...)``
    with that deadline parses to. Each client's task differs only in its deadline (seconds left, from when it is
    handed out), so the header -- and the model inside it -- is serialized once per round, not once per client."""
    deadline = _DEADLINE.pack(0x11, deadline_s)
    return b"".join((bytes([_HEADER_TAG]), _varint(len(header) + len(deadline)), header, deadline))


def chunk_frame_bytes(payload: Payload | bytes | bytearray | memoryview, message: type[Chunked],
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized ``message`` frames whose ``chunk`` carries consecutive slices of ``payload``: byte for byte
    what ``chunk_frames(...)``'s messages serialize to, each chunk's bytes copied once (from the payload, e.g. a
    tensor's storage, into the frame)."""
    tag = bytes([(_CHUNK_FIELD[message] << 3) | 2])
    data_tag = bytes([_DATA_TAG])
    if not isinstance(payload, Payload):
        payload = Payload([payload])
    for off, pieces in payload.chunks(chunk_bytes):
        n = sum(map(len, pieces))
        head = (bytes([_OFFSET_TAG]) + _varint(off) if off else b"") + data_tag + _varint(n)
        parts: list[bytes | memoryview] = [tag, _varint(len(head) + n), head]
        parts.extend(pieces)
        yield b"".join(parts)


def read_chunk(raw: bytes | memoryview, message: type[Chunked]) -> tuple[int, memoryview] | None:
    """(offset, data) of a chunk frame in the canonical layout, ``data`` a view into ``raw`` (no copy); None for
    any other frame (a header, a wait, a non-canonical or malformed chunk: parse those with protobuf)."""
    buf = memoryview(raw)
    end = len(buf)
    if end < 2 or buf[0] != (_CHUNK_FIELD[message] << 3) | 2:
        return None
    got = _read_varint(buf, 1, end)
    if got is None or got[0] != end - got[1]:
        return None
    pos = got[1]
    offset = 0
    if pos < end and buf[pos] == _OFFSET_TAG:
        got = _read_varint(buf, pos + 1, end)
        if got is None:
            return None
        offset, pos = got
    if pos >= end or buf[pos] != _DATA_TAG:
        return None
    got = _read_varint(buf, pos + 1, end)
    if got is None or got[0] == 0 or got[0] != end - got[1]:
        return None
    return offset, buf[got[1] :]


# ---- configuration and reports: dataclass <-> protobuf, as pairs ----

def training_to_pb(t: TrainingConfig) -> pb.TrainingConfig:
    return pb.TrainingConfig(local_epochs=t.local_epochs, batch_size=t.batch_size, learning_rate=t.learning_rate,
                             momentum=t.momentum, weight_decay=t.weight_decay, lr_decay=t.lr_decay,
                             grad_clip_norm=t.grad_clip_norm, prox_mu=t.prox_mu)


def training_from_pb(p: pb.TrainingConfig) -> TrainingConfig:
    return TrainingConfig(local_epochs=int(p.local_epochs), batch_size=int(p.batch_size),
                          learning_rate=p.learning_rate, momentum=p.momentum, weight_decay=p.weight_decay,
                          lr_decay=p.lr_decay or 1.0, grad_clip_norm=p.grad_clip_norm, prox_mu=p.prox_mu)


def nfl_settings_to_pb(n: NflSettings) -> pb.NflSettings:
    return pb.NflSettings(mode=n.mode, nr=n.nr, c=n.c)


def nfl_settings_from_pb(p: pb.NflSettings) -> NflSettings:
    return NflSettings(p.mode, int(p.nr), int(p.c))


def federation_to_pb(f: FederationInfo) -> pb.FederationConfig:
    return pb.FederationConfig(
        federation_id=f.federation_id, model_name=f.model_name,
        model_kwargs_json=json.dumps(f.model_kwargs, sort_keys=True), model_fingerprint=f.model_fingerprint,
        model_spec=metas_to_pb(f.model_spec), training=training_to_pb(f.training), dataset=f.dataset,
        data_options_json=json.dumps(f.data_options, sort_keys=True), num_rounds=f.num_rounds, seed=f.seed,
        chunk_bytes=f.chunk_bytes, nfl=nfl_settings_to_pb(f.nfl),
        nfl_mode=f.nfl.mode, nfl_nr=f.nfl.nr, nfl_c=f.nfl.c,  # the flat fields, for clients older than `nfl`
        recovery_method=f.recovery_method, recovery_options_json=json.dumps(f.recovery_options, sort_keys=True),
        secure=secure_settings_to_pb(f.secure) if f.secure is not None else None,
        compression=compression_to_pb(f.compression) if f.compression.compressed else None)


def federation_from_pb(p: pb.FederationConfig) -> FederationInfo:
    """The server's announcement; :class:`SerializationError` for a malformed spec or JSON field."""
    return FederationInfo(
        federation_id=p.federation_id, model_name=p.model_name,
        model_kwargs=_json_object(p.model_kwargs_json, "model_kwargs_json"),
        model_fingerprint=p.model_fingerprint, model_spec=tuple(metas_from_pb(p.model_spec)),
        training=training_from_pb(p.training), dataset=p.dataset,
        data_options=_json_object(p.data_options_json, "data_options_json"), num_rounds=int(p.num_rounds),
        seed=int(p.seed), chunk_bytes=int(p.chunk_bytes),
        nfl=nfl_settings_from_pb(p.nfl) if p.HasField("nfl") else NflSettings(p.nfl_mode, int(p.nfl_nr), int(p.nfl_c)),
        recovery_method=p.recovery_method or "flguard",
        recovery_options=_json_object(p.recovery_options_json, "recovery_options_json"),
        secure=secure_settings_from_pb(p.secure) if p.HasField("secure") else None,
        compression=compression_from_pb(p.compression) if p.HasField("compression") else CompressionConfig())


# The compression kinds on the wire (UpdateHeader.compression, CompressionSettings.kind).
COMPRESSION_TO_PB: dict[str, Any] = {NONE: pb.COMPRESSION_NONE, FP16: pb.COMPRESSION_FP16,
                                     INT8: pb.COMPRESSION_INT8, TOPK: pb.COMPRESSION_TOPK}
_PB_TO_COMPRESSION: dict[Any, str] = {v: k for k, v in COMPRESSION_TO_PB.items()}


def compression_kind_from_pb(value: int) -> str:
    """A compression kind's name; :class:`SerializationError` for a value this version does not know."""
    try:
        return _PB_TO_COMPRESSION[value]
    except KeyError:
        raise SerializationError(f"unknown compression kind {value}") from None


def compression_to_pb(c: CompressionConfig) -> pb.CompressionSettings:
    return pb.CompressionSettings(kind=COMPRESSION_TO_PB[c.kind], int8_chunk=c.int8_chunk,
                                  topk_fraction=c.topk_fraction, error_feedback=c.error_feedback)


def compression_from_pb(p: pb.CompressionSettings) -> CompressionConfig:
    """The server's compression announcement; :class:`SerializationError` for a kind or values no config could hold."""
    config = CompressionConfig(kind=compression_kind_from_pb(p.kind), int8_chunk=int(p.int8_chunk),
                               topk_fraction=float(p.topk_fraction), error_feedback=bool(p.error_feedback))
    try:
        return config.validate()
    except ValueError as e:
        raise SerializationError(f"the server announced unusable compression settings: {e}") from None


def secure_settings_to_pb(s: SecureSettings) -> pb.SecureAggregationSettings:
    c = s.config
    return pb.SecureAggregationSettings(
        protocol=s.protocol, neighbours=c.neighbours, threshold=c.threshold, max_dropout=c.max_dropout,
        corrupt_fraction=c.corrupt_fraction, security_bits=c.security_bits, correctness_bits=c.correctness_bits,
        min_clients=c.min_clients, norm_bound=c.norm_bound, phase_timeout_s=c.phase_timeout_s,
        clip_norm=s.clip_norm or 0.0, weighted=s.weighted,
        max_update_norm=s.max_update_norm if s.max_update_norm != float("inf") else 0.0)


def secure_settings_from_pb(p: pb.SecureAggregationSettings) -> SecureSettings:
    """The server's secure-aggregation announcement; :class:`SerializationError` for values no config could hold."""
    config = SecureAggregationConfig(
        neighbours=int(p.neighbours), threshold=p.threshold, max_dropout=p.max_dropout,
        corrupt_fraction=p.corrupt_fraction, security_bits=int(p.security_bits),
        correctness_bits=int(p.correctness_bits), min_clients=int(p.min_clients), norm_bound=p.norm_bound,
        phase_timeout_s=p.phase_timeout_s)
    settings = SecureSettings(config, p.protocol, p.clip_norm or None, bool(p.weighted),
                              p.max_update_norm or float("inf"))
    try:
        return settings.validate()
    except ValueError as e:
        raise SerializationError(f"the server announced unusable secure-aggregation settings: {e}") from None


def _json_object(raw: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise SerializationError(f"FederationConfig.{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SerializationError(f"FederationConfig.{name} must be a JSON object")
    return value


# ---- status codes: a name in fedcore <-> an enum value on the wire, plus the value's name when no enum value
# holds it (a reply from a server older than the enum, or a value newer than this enum) ----

class StatusCode:
    """One status code's table: fedcore's name of each value <-> its protobuf enum number (never 0, the enum's
    UNSPECIFIED)."""

    def __init__(self, numbers: Mapping[str, int]) -> None:
        self.numbers = dict(numbers)
        self.names = {n: name for name, n in self.numbers.items()}

    def to_pb(self, name: str) -> tuple[int, str]:
        """(enum number, name field): the name travels only when the enum has no value for it."""
        number = self.numbers.get(name)
        return (number, "") if number is not None else (0, name)

    def from_pb(self, number: int, name: str) -> str:
        """The enum's value, else the name field (an older server's string, or a value newer than the enum)."""
        return self.names.get(number, "") or name


PHASES = StatusCode({rounds.SAMPLING: pb.FEDERATION_PHASE_SAMPLING, rounds.TRAINING: pb.FEDERATION_PHASE_TRAINING,
                     rounds.AGGREGATING: pb.FEDERATION_PHASE_AGGREGATING,
                     rounds.FINISHED: pb.FEDERATION_PHASE_FINISHED})
FEDERATION_OUTCOMES = StatusCode({"completed": pb.FEDERATION_OUTCOME_COMPLETED,
                                  "stalled": pb.FEDERATION_OUTCOME_STALLED,
                                  "dp_budget": pb.FEDERATION_OUTCOME_DP_BUDGET})
ROUND_OUTCOMES = StatusCode({"quorum": pb.ROUND_OUTCOME_QUORUM, "all_responded": pb.ROUND_OUTCOME_ALL_RESPONDED,
                             "deadline": pb.ROUND_OUTCOME_DEADLINE, "buffer_full": pb.ROUND_OUTCOME_BUFFER_FULL,
                             "replayed": pb.ROUND_OUTCOME_REPLAYED})
NFL_STATES = StatusCode({"off": pb.NFL_STATE_OFF, "always": pb.NFL_STATE_ALWAYS, "watching": pb.NFL_STATE_WATCHING,
                         "reported": pb.NFL_STATE_REPORTED})
NFL_MODES = StatusCode({"detect-and-recover": pb.NFL_MODE_DETECT_AND_RECOVER,
                        "always-recover": pb.NFL_MODE_ALWAYS_RECOVER, "off": pb.NFL_MODE_OFF})

# RoundReport's fields that travel as status codes: field -> its code table.
_REPORT_CODES: dict[str, StatusCode] = {"outcome": ROUND_OUTCOMES, "nfl": NFL_STATES}
# (name, type) of every other RoundReport field but the maps (metrics, clusters); the types from the defaults
# (int, float, str, bool).
_REPORT_FIELDS: tuple[tuple[str, Callable[[Any], Any]], ...] = tuple(
    (f.name, type(f.default) if f.name != "round" else int) for f in dataclasses.fields(RoundReport)
    if f.name not in ("metrics", "clusters", *_REPORT_CODES))


def _codes_to_pb(value: object, codes: Mapping[str, StatusCode]) -> dict[str, Any]:
    """The enum and name fields (``X`` and ``X_name``) of ``value``'s status-code attributes."""
    out: dict[str, Any] = {}
    for name, code in codes.items():
        out[name], out[f"{name}_name"] = code.to_pb(getattr(value, name))
    return out


def _codes_from_pb(p: Any, codes: Mapping[str, StatusCode]) -> dict[str, Any]:
    return {name: code.from_pb(getattr(p, name), getattr(p, f"{name}_name")) for name, code in codes.items()}


def report_to_pb(r: RoundReport) -> pb.RoundSummary:
    return pb.RoundSummary(metrics=dict(r.metrics), clusters=dict(r.clusters), **_codes_to_pb(r, _REPORT_CODES),
                           **{name: getattr(r, name) for name, _ in _REPORT_FIELDS})


def report_from_pb(p: pb.RoundSummary) -> RoundReport:
    """Every RoundReport field has a RoundSummary field of the same name (a unit test holds the two equal)."""
    return RoundReport(metrics=dict(p.metrics), clusters={k: int(v) for k, v in p.clusters.items()},
                       **_codes_from_pb(p, _REPORT_CODES),
                       **{name: tp(getattr(p, name)) for name, tp in _REPORT_FIELDS})


_STATUS_CODES: dict[str, StatusCode] = {"phase": PHASES, "outcome": FEDERATION_OUTCOMES}
_NFL_CODES: dict[str, StatusCode] = {"mode": NFL_MODES, "state": NFL_STATES}
_NFL_FIELDS = tuple(f for f in dataclasses.fields(NflStatus) if f.name not in _NFL_CODES)


def status_to_pb(s: FederationStatus) -> pb.StatusReply:
    return pb.StatusReply(
        federation_id=s.federation_id, round=s.round, num_rounds=s.num_rounds, **_codes_to_pb(s, _STATUS_CODES),
        clients_known=s.clients_known, clients_alive=s.clients_alive, selected=s.selected, accepted=s.accepted,
        rejected=s.rejected, rejected_total=s.rejected_total, history=[report_to_pb(r) for r in s.history],
        finished=s.finished, resumed_from=s.resumed_from, stopping=s.stopping, nfl=nfl_status_to_pb(s.nfl),
        distfl=distfl_status_to_pb(s.distfl))


def nfl_status_to_pb(n: NflStatus) -> pb.NflStatus:
    return pb.NflStatus(**_codes_to_pb(n, _NFL_CODES), **{f.name: getattr(n, f.name) for f in _NFL_FIELDS})


def nfl_status_from_pb(p: pb.NflStatus) -> NflStatus:
    return NflStatus(**_codes_from_pb(p, _NFL_CODES), **{f.name: getattr(p, f.name) for f in _NFL_FIELDS})


def distfl_status_to_pb(d: DistflStatus) -> pb.DistflStatus:
    return pb.DistflStatus(enabled=d.enabled, clustered_round=d.clustered_round, next_clustering=d.next_clustering,
                           probe=d.probe, clusters=dict(d.clusters), assignment=dict(d.assignment),
                           pending=d.pending)


def distfl_status_from_pb(p: pb.DistflStatus) -> DistflStatus:
    return DistflStatus(enabled=p.enabled, clustered_round=int(p.clustered_round),
                        next_clustering=int(p.next_clustering), probe=p.probe,
                        clusters={k: int(v) for k, v in p.clusters.items()}, assignment=dict(p.assignment),
                        pending=int(p.pending))


def status_from_pb(p: pb.StatusReply) -> FederationStatus:
    return FederationStatus(
        federation_id=p.federation_id, round=int(p.round), num_rounds=int(p.num_rounds),
        **_codes_from_pb(p, _STATUS_CODES), clients_known=int(p.clients_known), clients_alive=int(p.clients_alive),
        selected=int(p.selected), accepted=int(p.accepted), rejected=int(p.rejected),
        rejected_total=int(p.rejected_total), history=tuple(report_from_pb(r) for r in p.history),
        finished=p.finished, resumed_from=int(p.resumed_from), stopping=p.stopping,
        nfl=nfl_status_from_pb(p.nfl) if p.HasField("nfl") else NflStatus(),
        distfl=distfl_status_from_pb(p.distfl) if p.HasField("distfl") else DistflStatus())


# ---- the update report (fedcore.update_report): the UpdateReport message, field for field ----

# The record's fields that are None when not measured (optional fields on the wire).
_UPDATE_OPTIONAL = ("beta_hat", "test_accuracy", "test_loss", "private_accuracy")


def update_report_to_pb(r: UpdateReport) -> pb.UpdateReport:
    """The ``report`` field of the update header a client sends."""
    measured = {name: getattr(r, name) for name in _UPDATE_OPTIONAL if getattr(r, name) is not None}
    return pb.UpdateReport(num_samples=r.num_samples, train_loss=r.train_loss, adapting=r.adapting,
                           infers_adapted=r.infers_adapted, train_seconds=r.train_seconds, passes=r.passes,
                           extras=dict(r.extras), **measured)


def update_report_from_pb(h: pb.UpdateHeader) -> UpdateReport:
    """The report an update header carries: its ``report`` message, else (a client from before that message) its
    ``num_samples``/``train_loss``/``beta_hat`` and ``metrics`` map (:func:`fedcore.update_report.from_metrics_map`).
    Numbers are taken as sent; the server bounds them (:meth:`UpdateReport.bounds_error`)."""
    if not h.HasField("report"):
        return from_metrics_map(int(h.num_samples), h.train_loss, h.beta_hat if h.HasField("beta_hat") else None,
                                dict(h.metrics))
    p = h.report
    measured = {name: getattr(p, name) for name in _UPDATE_OPTIONAL if p.HasField(name)}
    return UpdateReport(num_samples=int(p.num_samples), train_loss=p.train_loss, adapting=p.adapting,
                        infers_adapted=p.infers_adapted, train_seconds=p.train_seconds,
                        passes=p.passes if p.HasField("passes") else 1.0, extras=dict(p.extras), **measured)


# ---- secure aggregation (fedcore.secagg.protocol): each message's pair; the federation, round and the sender or
# recipient come from the call (its session, its SecAggRequest / SecAggReply), not from the message body ----

def advertisement_to_pb(a: secagg.Advertisement) -> pb.SecAggAdvertisement:
    return pb.SecAggAdvertisement(client_id=a.client_id, c_pk=a.c_pk, s_pk=a.s_pk, signature=a.signature)


def advertisement_from_pb(p: pb.SecAggAdvertisement, federation_id: str, round_: int) -> secagg.Advertisement:
    return secagg.Advertisement(federation_id, round_, p.client_id, bytes(p.c_pk), bytes(p.s_pk), bytes(p.signature))


def _sealed_to_pb(shares: Iterable[secagg.EncryptedShare]) -> list[pb.SealedShare]:
    return [pb.SealedShare(sender=s.sender, recipient=s.recipient, ciphertext=s.ciphertext) for s in shares]


def _sealed_from_pb(ps: Iterable[pb.SealedShare]) -> tuple[secagg.EncryptedShare, ...]:
    return tuple(secagg.EncryptedShare(p.sender, p.recipient, bytes(p.ciphertext)) for p in ps)


def shares_to_pb(u: secagg.ShareUpload) -> pb.SecAggShares:
    return pb.SecAggShares(shares=_sealed_to_pb(u.shares), commitment=u.commitment)


def shares_from_pb(p: pb.SecAggShares, federation_id: str, round_: int, client_id: str) -> secagg.ShareUpload:
    return secagg.ShareUpload(federation_id, round_, client_id, _sealed_from_pb(p.shares), bytes(p.commitment))


def _revealed_to_pb(pairs: Iterable[tuple[str, bytes]]) -> list[pb.RevealedShare]:
    return [pb.RevealedShare(owner=o, share=b) for o, b in pairs]


def _revealed_from_pb(ps: Iterable[pb.RevealedShare]) -> tuple[tuple[str, bytes], ...]:
    return tuple((p.owner, bytes(p.share)) for p in ps)


def unmask_to_pb(u: secagg.UnmaskUpload) -> pb.SecAggUnmask:
    return pb.SecAggUnmask(self_mask_shares=_revealed_to_pb(u.self_mask_shares),
                           key_shares=_revealed_to_pb(u.key_shares))


def unmask_from_pb(p: pb.SecAggUnmask, federation_id: str, round_: int, client_id: str) -> secagg.UnmaskUpload:
    return secagg.UnmaskUpload(federation_id, round_, client_id, _revealed_from_pb(p.self_mask_shares),
                               _revealed_from_pb(p.key_shares))


def key_request_to_pb(r: secagg.KeyRequest) -> pb.SecAggKeyRequest:
    return pb.SecAggKeyRequest(participants=list(r.participants), neighbours=r.neighbours, threshold=r.threshold,
                               min_survivors=r.min_survivors, graph_seed=r.graph_seed, num_params=r.num_params,
                               num_extras=r.num_extras,
                               advertisements=[advertisement_to_pb(a) for a in r.advertisements])


def key_request_from_pb(p: pb.SecAggKeyRequest, federation_id: str, round_: int) -> secagg.KeyRequest:
    return secagg.KeyRequest(federation_id, round_, tuple(p.participants), int(p.neighbours), int(p.threshold),
                             int(p.min_survivors), int(p.graph_seed), int(p.num_params), int(p.num_extras),
                             tuple(advertisement_from_pb(a, federation_id, round_) for a in p.advertisements))


def mask_request_to_pb(r: secagg.MaskRequest) -> pb.SecAggMaskRequest:
    return pb.SecAggMaskRequest(shares=_sealed_to_pb(r.shares))


def mask_request_from_pb(p: pb.SecAggMaskRequest, federation_id: str, round_: int,
                         recipient: str) -> secagg.MaskRequest:
    return secagg.MaskRequest(federation_id, round_, recipient, _sealed_from_pb(p.shares))


def unmask_request_to_pb(r: secagg.UnmaskRequest) -> pb.SecAggUnmaskRequest:
    return pb.SecAggUnmaskRequest(survivors=list(r.survivors), reveal_self_mask=list(r.reveal_self_mask),
                                  reveal_key=list(r.reveal_key))


def unmask_request_from_pb(p: pb.SecAggUnmaskRequest, federation_id: str, round_: int,
                           recipient: str) -> secagg.UnmaskRequest:
    return secagg.UnmaskRequest(federation_id, round_, recipient, tuple(p.survivors), tuple(p.reveal_self_mask),
                                tuple(p.reveal_key))
