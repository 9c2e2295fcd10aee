"""State dicts as raw little-endian tensor bytes, chunked for the wire and for files.

A state dict is described by a manifest (one :class:`TensorMeta` per tensor, in order) and carried as one
contiguous payload: the concatenation of every tensor's bytes in manifest order. The payload is cut into
chunks of at most ``chunk_bytes``. No pickle is involved at any point.

Zero-copy on both ends: a sender describes the payload as :class:`Payload`, memoryviews of the (contiguous, CPU)
tensors' own storage, so a chunk is copied once, into its wire frame (:func:`fedguard.wire.chunk_frames`); the
receiver (:class:`Reassembler`) allocates one ``torch.empty`` per tensor from the manifest and copies each
chunk's bytes once into the slices it covers (a chunk may span tensors and end inside an element), checking
every byte count; the tensors it returns are those buffers. With ``one_buffer`` the payload lands in one buffer and
the tensors are views of it, made when first asked for (:class:`ReceivedTensors`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
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
# numpy's name for each carried dtype it has (bfloat16 has none): tensors of these are viewed through numpy, whose
# slicing and dtype views cost a fraction of torch's per-call dispatch (a client's task read and update, every round).
_NUMPY: dict[torch.dtype, np.dtype] = {
    dt: np.dtype(name) for name, dt in DTYPES.items() if name != "bfloat16"
}


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


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview of the tensor's little-endian bytes: its own storage when it is a contiguous CPU
    tensor on a little-endian host (no copy; the view keeps the storage alive; through numpy where it has the
    dtype), else of a copy."""
    if (not _BIG_ENDIAN_HOST and t.layout == torch.strided and t.device.type == "cpu" and t.dtype in _NUMPY
            and t.is_contiguous() and not t.is_conj() and not t.is_neg()):
        return t.detach().numpy().data.cast("B")
    raw = _raw_bytes(t)
    return raw.numpy().data.cast("B")


class Payload:
    """The payload of a state dict as a sequence of byte segments (memoryviews of the tensors' storage, or one
    buffer) without joining them: what a sender chunks. ``len()`` is the payload's byte count."""

    def __init__(self, segments: Sequence[bytes | bytearray | memoryview]) -> None:
        self.segments = [memoryview(s).cast("B") for s in segments if len(s)]
        self.nbytes = sum(len(s) for s in self.segments)

    def __len__(self) -> int:
        return self.nbytes

    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[int, list[memoryview]]]:
        """(offset, pieces) per chunk of at most ``chunk_bytes``: the pieces are slices of the segments (several
        when a chunk spans tensors), their lengths add up to the chunk's. An empty payload yields nothing."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        pieces: list[memoryview] = []
        filled = 0
        offset = 0
        for seg in self.segments:
            pos = 0
            while pos < len(seg):
                take = min(chunk_bytes - filled, len(seg) - pos)
                pieces.append(seg[pos : pos + take])
                pos += take
                filled += take
                if filled == chunk_bytes:
                    yield offset, pieces
                    offset += filled
                    pieces, filled = [], 0
        if filled:
            yield offset, pieces

    def sha256(self) -> bytes:
        h = hashlib.sha256()
        for seg in self.segments:
            h.update(seg)
        return h.digest()

    def tobytes(self) -> bytes:
        """The whole payload joined (tests and files; the wire never needs it)."""
        return b"".join(self.segments)


def payload_of(state: Mapping[str, torch.Tensor]) -> tuple[list[TensorMeta], Payload]:
    """Manifest plus the payload as views of the tensors' own bytes (no copy for contiguous CPU tensors on a
    little-endian host). The tensors must not change while the payload is being sent."""
    manifest = manifest_of(state)
    return manifest, Payload([_byte_view(t) for meta, t in zip(manifest, state.values(), strict=True)
                              if meta.nbytes])


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


@dataclass(frozen=True, eq=False)
class _Layout:
    """What a manifest means to a receiver, worked out once per manifest (:func:`_layout`): its byte count,
    whether every tensor's payload offset is a multiple of its item size (views of one buffer are then possible),
    and (name, torch dtype, shape, offset, nbytes) per tensor in payload order."""

    expected: int
    aligned: bool
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]
    ends: tuple[int, ...]  # the end offset of every non-empty tensor, in payload order
    index: dict[str, int] = field(default_factory=dict)  # name -> position in entries
    # names -> (first byte, float32 count) of the run those tensors form, or None (ReceivedTensors.float32_run)
    runs: dict[tuple[str, ...], tuple[int, int] | None] = field(default_factory=dict)

    def float32_span(self, names: tuple[str, ...]) -> tuple[int, int] | None:
        """(first byte, count) when the tensors ``names`` are float32 and lie back to back in the payload in that
        order (empty ones anywhere), else None; worked out once per ``names``."""
        if names in self.runs:
            return self.runs[names]
        span: tuple[int, int] | None = None
        start = end = -1
        ok = self.aligned and all(n in self.index for n in names)
        for n in names if ok else ():
            _, dt, _, offset, nbytes = self.entries[self.index[n]]
            if dt != torch.float32:
                ok = False
                break
            if not nbytes:
                continue
            if start < 0:
                start = end = offset
            if offset != end:
                ok = False
                break
            end += nbytes
        if ok and start >= 0:
            span = (start, (end - start) // 4)
        if len(self.runs) < 16:  # one or two name lists per federation; bounded whatever callers pass
            self.runs[names] = span
        return span


@functools.lru_cache(maxsize=64)
def _layout(manifest: tuple[TensorMeta, ...]) -> _Layout:
    """The checked layout of ``manifest`` (raises :class:`SerializationError`; a failure is not cached). A server
    receives one manifest (its model's) over and over: the per-update cost is a dictionary lookup."""
    check_manifest(manifest)
    entries = []
    ends = []
    offset = 0
    aligned = True
    for m in manifest:
        n = m.nbytes
        aligned = aligned and offset % m.itemsize == 0
        entries.append((m.name, DTYPES[m.dtype], m.shape, offset, n))
        offset += n
        if n:
            ends.append(offset)
    return _Layout(offset, aligned, tuple(entries), tuple(ends), {e[0]: i for i, e in enumerate(entries)})


class ReceivedTensors(Mapping[str, torch.Tensor]):
    """The tensors a :class:`Reassembler` with ``one_buffer`` received: views of one byte buffer at their payload
    offsets, each made when first asked for (a server that only needs the float32 run, :meth:`float32_run`, makes
    none). Iterates in manifest order."""

    def __init__(self, buffer: torch.Tensor, layout: _Layout) -> None:
        self.buffer = buffer  # uint8 [expected]
        self._bytes = buffer.numpy()  # the same memory, sliced and viewed through numpy
        self._layout = layout
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._made.get(name)
        if t is None:
            _, dt, shape, offset, n = self._layout.entries[self._layout.index[name]]
            npdt = _NUMPY.get(dt)
            if not n:
                t = torch.empty(shape, dtype=dt)
            elif npdt is not None:
                t = torch.from_numpy(self._bytes[offset : offset + n].view(npdt).reshape(shape))
            else:
                t = self.buffer[offset : offset + n].view(dt).reshape(shape)
            self._made[name] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return (e[0] for e in self._layout.entries)

    def __len__(self) -> int:
        return len(self._layout.entries)

    def float32_run(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """The float32 vector that the tensors ``names`` form back to back in the buffer (a view, no copy), or
        None when they do not (another dtype, another order, a tensor between them)."""
        span = self._layout.float32_span(names)
        if span is None:
            return None
        start, count = span
        return torch.from_numpy(self._bytes[start : start + 4 * count].view(np.float32))


class Reassembler:
    """Receives the chunks of a manifest's payload straight into its tensors and checks every byte count.

    Uninitialised tensors are allocated from the manifest; :meth:`feed` copies a chunk's bytes once into the
    tensor slices it covers. ``max_bytes`` bounds what a remote party can make us allocate; it is checked against
    the manifest before any memory is reserved.

    ``one_buffer``: the tensors are views of one ``[expected]`` byte buffer at their payload offsets, made when
    first asked for (:meth:`finish` returns a :class:`ReceivedTensors`; when every offset is a multiple of its
    tensor's item size, otherwise one allocation per tensor, as without it), and a chunk is one copy whatever the
    tensors it spans. A model whose tensors are all float32 then arrives as one
    contiguous float32 vector: the server computes the update in that buffer
    (:meth:`fedserver.global_models.GlobalModels.flatten_update` with ``consume``) instead of allocating a second
    ``[P]`` copy.
    """

    def __init__(self, manifest: Sequence[TensorMeta], announced_bytes: int | None = None,
                 max_bytes: int | None = None, one_buffer: bool = False) -> None:
        try:
            layout = _layout(tuple(manifest))
        except TypeError:  # an unhashable manifest (a shape given as a list): worked out uncached
            layout = _layout.__wrapped__(tuple(manifest))
        self.manifest = list(manifest)
        self.expected = layout.expected
        if announced_bytes is not None and announced_bytes != self.expected:
            raise SerializationError(
                f"announced {announced_bytes} bytes but the manifest describes {self.expected}"
            )
        if max_bytes is not None and self.expected > max_bytes:
            raise SerializationError(f"payload of {self.expected} bytes exceeds the limit of {max_bytes}")
        # Uninitialised: every byte is written by feed() before finish() accepts the tensors.
        self._layout = layout
        self._buffer: torch.Tensor | None = None  # one_buffer: the payload's bytes, viewed by the tensors
        self._tensors: dict[str, torch.Tensor] = {}
        # Flat byte views of every non-empty segment, in payload order: one segment (the whole buffer) with
        # one_buffer, else one per tensor; ``_ends`` holds each segment's end offset in the payload.
        self._views: list[np.ndarray] = []
        if one_buffer and layout.aligned:
            self._buffer = torch.empty(self.expected, dtype=torch.uint8)
            self._ends: tuple[int, ...] = (self.expected,) if self.expected else ()
            if self.expected:
                self._views.append(self._buffer.numpy())
        else:
            for name, dt, shape, _, n in layout.entries:
                t = torch.empty(shape, dtype=dt)
                self._tensors[name] = t
                if n:
                    self._views.append(t.reshape(-1).view(torch.uint8).numpy())
            self._ends = layout.ends
        self._seg = 0  # the segment that holds byte ``received``
        self.received = 0

    def feed(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if offset != self.received:
            raise SerializationError(f"chunk at offset {offset}, expected offset {self.received}")
        if self.received + n > self.expected:
            raise SerializationError(
                f"received more bytes than announced ({self.received + n} > {self.expected})"
            )
        if not n:
            return
        src = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while pos < n:
            end = self._ends[self._seg]
            view = self._views[self._seg]
            at = self.received - (end - len(view))
            take = min(n - pos, end - self.received)
            view[at : at + take] = src[pos : pos + take]
            pos += take
            self.received += take
            if self.received == end and self._seg + 1 < len(self._ends):
                self._seg += 1

    def finish(self) -> Mapping[str, torch.Tensor]:
        """The received tensors (a :class:`ReceivedTensors` with ``one_buffer``, else a dict of one buffer per
        tensor), in manifest order; raises :class:`SerializationError` when bytes are missing."""
        if self.received != self.expected:
            raise SerializationError(f"received {self.received} of {self.expected} announced bytes")
        out: Mapping[str, torch.Tensor] = (ReceivedTensors(self._buffer, self._layout) if self._buffer is not None
                                            else self._tensors)
        if _BIG_ENDIAN_HOST:
            for m in self.manifest:
                t = out[m.name]
                if m.itemsize > 1 and m.nbytes:
                    raw = t.reshape(-1).view(torch.uint8)
                    raw.copy_(raw.reshape(-1, m.itemsize).flip(1).reshape(-1))
        self._buffer, self._tensors, self._views = None, {}, []
        return out


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


def roundtrip_chunks(state: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     one_buffer: bool = False) -> Mapping[str, torch.Tensor]:
    """Pack, chunk and reassemble: what a receiver gets (used in tests and benchmarks)."""
    manifest, payload = payload_of(state)
    r = Reassembler(manifest, total_bytes(manifest), one_buffer=one_buffer)
    for off, pieces in payload.chunks(chunk_bytes):
        for piece in pieces:
            r.feed(off, piece)
            off += len(piece)
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
        extra = header.get("extra", {})
        if not isinstance(extra, dict):
            raise TypeError(f"extra is a JSON {type(extra).__name__}, not an object")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deeply
        raise SerializationError(f"{path}: corrupt header ({e})") from None
    payload = bytearray(data[16 + hlen :])
    return unpack(manifest, payload), dict(extra)
