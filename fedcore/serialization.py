"""State dicts as raw little-endian tensor bytes, chunked for the wire and for files.

A state dict is described by a manifest (one :class:`TensorMeta` per tensor, in order) and carried as one
contiguous payload: the concatenation of every tensor's bytes in manifest order. The payload is cut into
chunks of at most ``chunk_bytes``; the receiver writes each chunk at its offset into one preallocated buffer
and checks the byte counts before it builds a single tensor. No pickle is involved at any point.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

DEFAULT_CHUNK_BYTES = 1 << 20

# Wire names of the dtypes we carry, with their torch dtype and item size.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
_BIG_ENDIAN_HOST = sys.byteorder == "big"


class SerializationError(ValueError):
    """A manifest or payload that cannot describe a valid state dict."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise SerializationError(f"dtype {dtype} is not supported on the wire") from None


def manifest_of(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape)) for name, t in state.items()]


def fingerprint(manifest: Sequence[TensorMeta]) -> str:
    """A short, stable digest of parameter names, dtypes and shapes (not values)."""
    h = hashlib.sha256()
    for m in manifest:
        h.update(f"{m.name}|{m.dtype}|{','.join(map(str, m.shape))};".encode())
    return h.hexdigest()[:16]


def total_bytes(manifest: Sequence[TensorMeta]) -> int:
    return sum(m.nbytes for m in manifest)


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor, little-endian."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    if _BIG_ENDIAN_HOST and flat.element_size() > 1:
        raw = raw.reshape(-1, flat.element_size()).flip(1).reshape(-1)
    return raw


def pack(state: Mapping[str, torch.Tensor]) -> tuple[list[TensorMeta], bytearray]:
    """Manifest plus one contiguous little-endian payload of every tensor's bytes."""
    manifest = manifest_of(state)
    payload = bytearray(total_bytes(manifest))
    view = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    offset = 0
    for meta, t in zip(manifest, state.values(), strict=True):
        n = meta.nbytes
        if n:
            view[offset : offset + n].copy_(_raw_bytes(t))
        offset += n
    return manifest, payload


def iter_chunks(payload: bytes | bytearray | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[
    tuple[int, memoryview]
]:
    """(offset, slice) pairs covering the payload; an empty payload yields nothing."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    mv = memoryview(payload)
    for off in range(0, len(mv), chunk_bytes):
        yield off, mv[off : off + chunk_bytes]


def check_manifest(manifest: Sequence[TensorMeta]) -> None:
    seen: set[str] = set()
    for m in manifest:
        if not m.name:
            raise SerializationError("tensor with an empty name")
        if m.name in seen:
            raise SerializationError(f"tensor {m.name!r} appears twice")
        seen.add(m.name)
        if m.dtype not in DTYPES:
            raise SerializationError(f"tensor {m.name!r}: unsupported dtype {m.dtype!r}")
        if any(d < 0 for d in m.shape):
            raise SerializationError(f"tensor {m.name!r}: negative dimension in shape {list(m.shape)}")


class Reassembler:
    """Collects chunks for a manifest into one buffer and checks every byte count.

    ``max_bytes`` bounds what a remote party can make us allocate; it is checked against the manifest
    before any memory is reserved.
    """

    def __init__(self, manifest: Sequence[TensorMeta], announced_bytes: int | None = None,
                 max_bytes: int | None = None) -> None:
        check_manifest(manifest)
        self.manifest = list(manifest)
        self.expected = total_bytes(self.manifest)
        if announced_bytes is not None and announced_bytes != self.expected:
            raise SerializationError(
                f"announced {announced_bytes} bytes but the manifest describes {self.expected}"
            )
        if max_bytes is not None and self.expected > max_bytes:
            raise SerializationError(f"payload of {self.expected} bytes exceeds the limit of {max_bytes}")
        # Uninitialised: every byte is written by feed() before finish() accepts the buffer.
        self._buf = np.empty(self.expected, dtype=np.uint8)
        self.received = 0

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        if offset != self.received:
            raise SerializationError(f"chunk at offset {offset}, expected offset {self.received}")
        if self.received + n > self.expected:
            raise SerializationError(
                f"received more bytes than announced ({self.received + n} > {self.expected})"
            )
        self._buf[offset : offset + n] = np.frombuffer(data, dtype=np.uint8)
        self.received += n

    def finish(self) -> dict[str, torch.Tensor]:
        if self.received != self.expected:
            raise SerializationError(f"received {self.received} of {self.expected} announced bytes")
        return unpack(self.manifest, self._buf)


def unpack(manifest: Sequence[TensorMeta], payload: bytearray | np.ndarray) -> dict[str, torch.Tensor]:
    """Tensors viewing ``payload`` (no copy); ``payload`` must be exactly the manifest's size."""
    check_manifest(manifest)
    if len(payload) != total_bytes(manifest):
        raise SerializationError(f"payload has {len(payload)} bytes, manifest needs {total_bytes(manifest)}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for m in manifest:
        dt = DTYPES[m.dtype]
        n = m.nbytes
        if n == 0:
            out[m.name] = torch.empty(m.shape, dtype=dt)
            continue
        raw = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset)
        if _BIG_ENDIAN_HOST and m.itemsize > 1:
            raw = raw.reshape(-1, m.itemsize).flip(1).reshape(-1).clone()
        out[m.name] = raw.view(dt).reshape(m.shape)
        offset += n
    return out


def roundtrip_chunks(state: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[
    str, torch.Tensor
]:
    """Pack, chunk and reassemble: what a receiver gets (used in tests and benchmarks)."""
    manifest, payload = pack(state)
    r = Reassembler(manifest, total_bytes(manifest))
    for off, data in iter_chunks(payload, chunk_bytes):
        r.feed(off, data)
    return r.finish()


# ---- files: the same format on disk, written atomically ----

_MAGIC = b"FGTENS01"


def save_state(path: str | os.PathLike[str], state: Mapping[str, torch.Tensor],
               extra: Mapping[str, object] | None = None) -> None:
    """Write a state dict as magic + JSON header length + JSON header + raw payload, via temp + rename."""
    manifest, payload = pack(state)
    header = json.dumps({
        "tensors": [{"name": m.name, "dtype": m.dtype, "shape": list(m.shape)} for m in manifest],
        "extra": dict(extra or {}),
    }).encode()
    with atomic_write(path) as f:
        f.write(_MAGIC)
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        f.write(payload)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file that appears at ``path`` whole or not at all: written to a temp name unique to this
    process and thread, synced, then renamed over ``path`` (readers never see a partial file, and concurrent
    writers of the same path do not mix their bytes). On an error the temp file is removed."""
    target = Path(path)
    tmp = target.with_name(f"{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def load_state(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    data = Path(path).read_bytes()
    if data[:8] != _MAGIC:
        raise SerializationError(f"{path}: not a fedguard tensor file")
    hlen = int.from_bytes(data[8:16], "little")
    try:
        header = json.loads(data[16 : 16 + hlen])
        manifest = [TensorMeta(t["name"], t["dtype"], tuple(int(d) for d in t["shape"])) for t in header["tensors"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SerializationError(f"{path}: corrupt header ({e})") from None
    payload = bytearray(data[16 + hlen :])
    return unpack(manifest, payload), dict(header.get("extra", {}))
