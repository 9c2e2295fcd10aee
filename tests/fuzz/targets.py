"""Fuzz targets: every parser that takes bytes from the network or from disk, each as ``target(data: bytes)``.

A target feeds ``data`` to one parser and lets through only the errors that parser documents for bad input (a
:class:`~fedguard.framing.FrameError`, a protobuf ``DecodeError``, a :class:`~fedcore.errors.ConfigError`, a
:class:`~fedserver.store.StoreError`, ...): anything else escaping is a finding, and so is a result that breaks a
target's assertions (a chunk read in place that protobuf reads otherwise, tensors of another size than announced,
a resumed state with a field of another type). ``python -m tests.fuzz.run NAME`` runs one under atheris
(coverage-guided, when it is installed); ``tests/unit/test_fuzz_targets.py`` runs each over its committed seed
corpus (``tests/fuzz/corpus/NAME/``) and over seeded random mutations of it, and every finding is a test in
``tests/unit/test_fuzz_findings.py``. ``python -m tests.fuzz.make_corpus`` writes the generated seeds (:data:`SEEDS`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from fedcore import jsonio
from fedcore.config import ClientConfig, ConfigError, ServerConfig, from_dict, load_toml
from fedcore.outputs import MODEL_FILE, SIDECAR_FILE, ModelFileError, load_model
from fedcore.rounds import RoundsConfig
from fedcore.serialization import Reassembler, SerializationError, load_state
from fedguard import wire
from fedguard.framing import FrameError, FrameReader
from fedguard.signing import CLIENT, NONCE, SIGNATURE, TIMESTAMP, AuthError, ReplayGuard, sign_request, verify_request
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import bounds
from fedserver.errors import ProtocolError
from fedserver.persistence import decode_snapshot
from fedserver.snapshot_files import Unverified, parse_history, parse_state
from fedserver.store import Snapshot, StoreError
from tests.fuzz.run import scratch_root

MAX_FRAME = 1 << 16


def frames(data: bytes) -> None:
    """The framed transport's reader, fed ``data`` in pieces whose sizes come from the data itself."""
    reader = FrameReader(MAX_FRAME)
    step = 1 + (data[0] % 7 if data else 0)
    try:
        for i in range(0, len(data), step):
            reader.feed(data[i:i + step])
            while reader.frames:
                _kind, payload = reader.frames.popleft()
                assert len(payload) <= MAX_FRAME
    except FrameError:
        pass


def update_header(data: bytes) -> None:
    """An update's header as the server decodes it: the protobuf, the report's numbers and their bounds, the
    tensor manifest."""
    try:
        header = pb.UpdateHeader.FromString(data)
    except DecodeError:
        return
    report = wire.update_report_from_pb(header)
    report.bounds_error()
    with contextlib.suppress(ValueError):
        wire.metas_from_pb(header.tensors)


def session_request(data: bytes) -> None:
    """A Session stream request (a pull, an update's header or one of its chunks)."""
    try:
        request = pb.SessionRequest.FromString(data)
    except DecodeError:
        return
    if request.HasField("header"):
        update_header(request.header.SerializeToString())


_SCRATCH_DIR = scratch_root() / f"fedguard-fuzz-{os.getpid()}"
_SCRATCH = _SCRATCH_DIR.with_suffix(".fgt")


def config_toml(data: bytes) -> None:
    """A configuration file as ``--config`` reads it from disk (:func:`fedcore.config.load_toml`: TOML, or JSON
    when the data starts with ``{``), decoded into the server's and the client's sections, then validated."""
    path = _SCRATCH_DIR.with_suffix(".json" if data.lstrip().startswith(b"{") else ".toml")
    path.write_bytes(data)
    try:
        table = load_toml(path)
    except ConfigError:
        return
    with contextlib.suppress(ConfigError):  # ConfigError names the field; anything else is a finding
        from_dict(ServerConfig, table).validate()
    with contextlib.suppress(ConfigError):
        from_dict(ClientConfig, table).validate()


def fgt_file(data: bytes) -> None:
    """A ``.fgt`` tensor file (a snapshot's model, the final model) as the loader reads it from disk."""
    _SCRATCH.write_bytes(data)
    with contextlib.suppress(SerializationError):
        load_state(_SCRATCH)


# One enrolled client with a fixed key (the fuzzer explores what a forger controls: metadata and body, not the key).
_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
_KEYS = {"alice": _KEY.public_key()}
_METHOD = "/fedguard.v1.Federation/Join"
_NOW_S = 1_800_000_000.0
_NAMES = (CLIENT, TIMESTAMP, NONCE, SIGNATURE, "other")


def encode_request(metadata: list[tuple[str, str]], body: bytes) -> bytes:
    """The target's input format: per metadata entry, one byte naming the key (its index in ``_NAMES``), the value,
    and a 0 byte; then 0xff and the body."""
    out = bytearray()
    for k, v in metadata:
        out += bytes([_NAMES.index(k) if k in _NAMES else 4]) + v.encode() + b"\x00"
    return bytes(out) + b"\xff" + body


def signed_request(data: bytes) -> None:
    """Signed-request verification (fedguard.signing) of metadata and a body a forger chose."""
    head, _, body = data.partition(b"\xff")
    metadata = [(_NAMES[entry[0] % len(_NAMES)], entry[1:].decode("utf-8", "replace"))
                for entry in head.split(b"\x00") if entry]
    with contextlib.suppress(AuthError):
        verify_request(_KEYS, ReplayGuard(60), _METHOD, metadata, body, _NOW_S)


def signed_seed() -> bytes:
    """A valid signed request in the target's format (the seed the corpus holds)."""
    body = b"join me"
    return encode_request(list(sign_request(_KEY, "alice", _METHOD, body, _NOW_S)), body)


# ---- an update's chunks and their reassembly, as the server's Session stream receives them ----

# The fuzzer's max_update_bytes (the server's default is far larger: a target must not allocate gigabytes per input).
MAX_UPDATE = 1 << 16


def split_messages(data: bytes) -> list[bytes]:
    """The target's input format for a stream: per message a 2-byte little-endian length, then its bytes."""
    out, i = [], 0
    while i + 2 <= len(data):
        n = int.from_bytes(data[i:i + 2], "little")
        out.append(data[i + 2:i + 2 + n])
        i += 2 + n
    return out


def join_messages(messages: list[bytes]) -> bytes:
    return b"".join(len(m).to_bytes(2, "little") + m for m in messages)


def _decode_request(raw: bytes) -> tuple[pb.SessionRequest | None, tuple[int, memoryview] | None]:
    """A stream message as the servicer decodes it (fedserver.servicer._decoder): a chunk in the canonical layout
    read in place (checked here against what protobuf reads), else protobuf (None when it does not decode)."""
    chunk = wire.read_chunk(raw, pb.SessionRequest)
    if chunk is not None:
        msg = pb.SessionRequest.FromString(raw)
        assert msg.WhichOneof("kind") == "chunk", "read_chunk found a chunk where protobuf reads none"
        assert (msg.chunk.offset, msg.chunk.data) == (chunk[0], bytes(chunk[1])), "read_chunk misread a chunk"
        return None, chunk
    try:
        return pb.SessionRequest.FromString(raw), None
    except DecodeError:
        return None, None


def update_stream(data: bytes) -> None:
    """An update on a Session stream, without gRPC: its header (bounds, manifest, report), then its chunks read
    as the servicer reads them and fed to the :class:`~fedcore.serialization.Reassembler`, as
    ``FederationServicer._update`` does; whatever is accepted must be the announced tensors."""
    messages = split_messages(data)
    if not messages:
        return
    first, _ = _decode_request(messages[0])
    if first is None or first.WhichOneof("kind") != "header":
        return  # "an update stream must start with its header"
    h = first.header
    try:
        bounds.check_update_header(h)
        manifest = wire.metas_from_pb(h.tensors)
        wire.update_report_from_pb(h).bounds_error()
        asm = Reassembler(manifest, int(h.total_bytes), MAX_UPDATE, one_buffer=True)
        if h.data:
            if len(h.data) != asm.expected:
                raise SerializationError("the header's data is not its total_bytes")
            asm.feed(0, memoryview(h.data))
        for raw in messages[1:]:
            if asm.received >= asm.expected:
                break  # a Session stream's update ends with its announced bytes
            msg, chunk = _decode_request(raw)
            if chunk is not None:
                offset, piece = chunk
            elif msg is None:
                return  # undecodable: INVALID_ARGUMENT
            elif msg.WhichOneof("kind") != "chunk":
                raise SerializationError("a message other than a chunk inside an update")
            else:
                offset, piece = int(msg.chunk.offset), memoryview(msg.chunk.data)
            if not piece:
                raise SerializationError("an empty chunk")
            asm.feed(offset, piece)
        tensors = asm.finish()
    except (ProtocolError, SerializationError):
        return
    assert [m.name for m in manifest] == list(tensors), "the tensors are not the manifest's"
    for m in manifest:
        t = tensors[m.name]
        assert tuple(t.shape) == tuple(m.shape) and t.numel() * t.element_size() == m.nbytes, m


def update_stream_seeds() -> list[bytes]:
    """Valid updates in the target's format: chunked (16-byte chunks), inline in the header, and a masked-kind one."""
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(3, 2), "b": torch.tensor([1, -2, 3], dtype=torch.int64),
             "flag": torch.tensor([True, False])}
    from fedcore.serialization import pack

    manifest, payload = pack(state)
    report = pb.UpdateReport(num_samples=12, train_loss=0.5, beta_hat=0.25, train_seconds=1.5, passes=1.0)
    header = pb.UpdateHeader(session_id="s1", round=3, report=report, kind=pb.WEIGHTS,
                             tensors=wire.metas_to_pb(manifest), total_bytes=len(payload))
    chunked = [pb.SessionRequest(header=header).SerializeToString(),
               *wire.chunk_frame_bytes(bytes(payload), pb.SessionRequest, 16)]
    inline = pb.UpdateHeader()
    inline.CopyFrom(header)
    inline.data = bytes(payload)
    inline.kind = pb.DELTA
    return [join_messages(chunked), join_messages([pb.SessionRequest(header=inline).SerializeToString()])]


# ---- a run's final model: safetensors and its JSON sidecar (fedcore.outputs.load_model) ----

_MODEL_DIR = _SCRATCH_DIR.with_name(_SCRATCH_DIR.name + "-model")


def _tiny_model() -> torch.nn.Module:
    """A small module with fixed weights (no random initialisation: built on the meta device, then filled)."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2, device="meta"), torch.nn.ReLU(),
                            torch.nn.Linear(2, 1, device="meta")).to_empty(device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape))
    return m


_TINY = _tiny_model()


def encode_model(sidecar: bytes, weights: bytes) -> bytes:
    """The target's input format: the sidecar's length (2 bytes, little-endian), the sidecar, the weights."""
    return len(sidecar).to_bytes(2, "little") + sidecar + weights


def safetensors_model(data: bytes) -> None:
    """A run's final model as :func:`fedcore.outputs.load_model` loads it from disk: the JSON sidecar, the
    safetensors weights (header, tensors, the sidecar's fingerprint), the model the sidecar names built from the
    zoo (a sidecar naming ``"tiny"``, no registered model: a fixed module passed in) and ``load_state_dict``."""
    n = int.from_bytes(data[:2], "little")
    _MODEL_DIR.mkdir(exist_ok=True)
    (_MODEL_DIR / SIDECAR_FILE).write_bytes(data[2:2 + n])
    (_MODEL_DIR / MODEL_FILE).write_bytes(data[2 + n:])
    with contextlib.suppress(ModelFileError):
        load_model(_MODEL_DIR, model=_TINY if b'"tiny"' in data[2:2 + n] else None)


def safetensors_seeds() -> list[bytes]:
    """Valid models in the target's format, as fedcore.outputs.write_model writes them: the fixed module, and a
    registered model (``logreg``) with its options."""
    from fedcore.models import build_model
    from fedcore.outputs import write_model

    out = []
    for name, kwargs, state in [("tiny", {}, _tiny_model().state_dict()),
                                ("logreg", {"in_features": 4, "num_classes": 3},
                                 build_model("logreg", {"in_features": 4, "num_classes": 3}, seed=0).state_dict())]:
        with tempfile.TemporaryDirectory() as tmp:
            write_model(tmp, state, model_name=name, model_kwargs=kwargs, round_=3, config_sha="sha256:0")
            out.append(encode_model((Path(tmp) / SIDECAR_FILE).read_bytes(), (Path(tmp) / MODEL_FILE).read_bytes()))
    return out


# ---- the state store's snapshot rows, decoded as a resumed server decodes them ----

_ROUNDS = RoundsConfig(num_rounds=5)
_SEP = b"\x1e"


def encode_rows(completed_rounds: int, history_len: int, state: str, progress: str, history: list[str]) -> bytes:
    """The target's input format: a byte of ``completed_rounds``, a byte of ``history_len`` (0xff: -1, a schema-1
    snapshot), then the state record, the progress record (empty: none) and the history rows, 0x1e between."""
    return bytes([completed_rounds, history_len & 0xff]) + _SEP.join(
        [state.encode(), progress.encode(), *(h.encode() for h in history)])


def snapshot_rows(data: bytes) -> None:
    """A snapshot's rows as :meth:`fedserver.store.StateStore.load` reads them back from SQLite (the state and
    history JSON verified by :mod:`fedserver.snapshot_files`, the progress record) and as
    :meth:`fedserver.persistence.Persistence.restore` decodes them (:func:`fedserver.persistence.decode_snapshot`:
    the round machine's state, the history's reports), then the state re-saved and the rows re-written as the
    resumed server does."""
    if len(data) < 2:
        return
    completed_rounds, history_len = data[0], (-1 if data[1] == 0xff else data[1])
    state_text, progress_text, *history = [p.decode("utf-8", "replace") for p in data[2:].split(_SEP)] + [""]
    history = history[:-1]
    try:
        state = parse_state(state_text)
        rows = parse_history(list(enumerate(history)), history_len) if history_len >= 0 else []
    except Unverified:
        return
    progress = None
    with contextlib.suppress(ValueError, RecursionError):  # as StateStore.load: a bad progress record is ignored
        value = json.loads(progress_text) if progress_text else None
        progress = value if isinstance(value, dict) else None
    snap = Snapshot(completed_rounds, state, {}, history_len)
    try:
        round_state, reports = decode_snapshot(snap, rows, progress, _ROUNDS, 1.8e9, Path("state"))
    except StoreError:
        return
    json.dumps(round_state.to_saved(), allow_nan=False)
    for report in reports:
        jsonio.dumps(report.to_dict())
        assert isinstance(report.round, int) and not math.isnan(float(report.round))


def snapshot_seeds() -> list[bytes]:
    """Rows a real server writes: a snapshot with a progress record and two history rows, a schema-1 one (its
    history inside the state), and round 0 (the initial state)."""
    from fedcore import rounds as rm
    from fedcore.report import RoundReport

    st = rm.RoundState(round=3, attempt=1, phase=rm.TRAINING, selected=["a", "b"], accepted=["a"],
                       rejected={"c": "late"}, declined=["d"], rejected_total=2, late_total=1)
    st.clients = {"a": rm.ClientRecord("a", 0, 10), "b": rm.ClientRecord("b", 1, 20, attacker=True)}
    history = [RoundReport(round=1, selected=2, accepted=2).to_dict(),
               RoundReport(round=2, selected=2, accepted=1, metrics={"loss": 0.5}).to_dict()]
    state_text = json.dumps({"round_state": st.to_saved(), "slots": {"nfl": {"x": 1}}})
    progress = json.dumps({"round_state": st.to_saved()})
    hist = [jsonio.dumps(h) for h in history]
    schema1 = json.dumps({"round_state": st.to_dict(), "slots": {}, "history": history}, default=str)
    return [encode_rows(2, 2, state_text, progress, hist), encode_rows(2, 0xff, schema1, "", []),
            encode_rows(0, 0, json.dumps({"round_state": rm.RoundState().to_saved(), "slots": {}}), "", [])]


TARGETS: dict[str, Callable[[bytes], None]] = {
    "frames": frames, "update_header": update_header, "session_request": session_request,
    "config_toml": config_toml, "fgt_file": fgt_file, "signed_request": signed_request,
    "update_stream": update_stream, "safetensors_model": safetensors_model, "snapshot_rows": snapshot_rows,
}

# The seed corpora of the targets that have generated seeds (tests/fuzz/make_corpus.py writes them).
SEEDS: dict[str, Callable[[], list[bytes]]] = {
    "update_stream": update_stream_seeds, "safetensors_model": safetensors_seeds,
    "snapshot_rows": snapshot_seeds,
}
