"""Fuzz targets: every parser that takes bytes from the network or from disk, each as ``target(data: bytes)``.

A target feeds ``data`` to one parser and lets through only the errors that parser documents for bad input (a
:class:`~fedguard.framing.FrameError`, a protobuf ``DecodeError``, a :class:`~fedcore.errors.ConfigError`, ...):
anything else escaping is a finding. ``python -m tests.fuzz.run NAME`` runs one under atheris (coverage-guided,
when it is installed); ``tests/unit/test_fuzz_targets.py`` runs each over its committed seed corpus
(``tests/fuzz/corpus/NAME/``) and over seeded random mutations of it, so every finding stays a test.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from fedcore.config import ClientConfig, ConfigError, ServerConfig, from_dict
from fedcore.serialization import SerializationError, load_state
from fedguard import wire
from fedguard.framing import FrameError, FrameReader
from fedguard.signing import CLIENT, NONCE, SIGNATURE, TIMESTAMP, AuthError, ReplayGuard, sign_request, verify_request
from fedguard.v1 import fedguard_pb2 as pb

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


def config_toml(data: bytes) -> None:
    """A configuration file: TOML, decoded into the server's and the client's sections, then validated."""
    try:
        table = tomllib.loads(data.decode("utf-8", "replace"))
    except tomllib.TOMLDecodeError:
        return
    with contextlib.suppress(ConfigError):  # ConfigError names the field; anything else is a finding
        from_dict(ServerConfig, table).validate()
    with contextlib.suppress(ConfigError):
        from_dict(ClientConfig, table).validate()


_SCRATCH = Path(tempfile.gettempdir()) / f"fedguard-fuzz-{os.getpid()}.fgt"


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


TARGETS: dict[str, Callable[[bytes], None]] = {
    "frames": frames, "update_header": update_header, "session_request": session_request,
    "config_toml": config_toml, "fgt_file": fgt_file, "signed_request": signed_request,
}
