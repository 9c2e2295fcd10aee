"""Translation between the wire messages of ``fedguard.v1`` and fedcore's plain types (shared by both shells)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from fedcore.serialization import DEFAULT_CHUNK_BYTES, SerializationError, TensorMeta, iter_chunks
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


def meta_from_pb(p: pb.TensorMeta) -> TensorMeta:
    dtype = _PB_TO_DTYPE.get(p.dtype)
    if dtype is None:
        raise SerializationError(f"tensor {p.name!r}: unknown dtype code {p.dtype}")
    if any(d < 0 for d in p.shape):
        raise SerializationError(f"tensor {p.name!r}: negative dimension in shape {list(p.shape)}")
    m = TensorMeta(p.name, dtype, tuple(int(d) for d in p.shape))
    if p.nbytes != m.nbytes:
        raise SerializationError(f"tensor {p.name!r}: announces {p.nbytes} bytes, dtype and shape give {m.nbytes}")
    return m


def metas_from_pb(ps: Sequence[pb.TensorMeta]) -> list[TensorMeta]:
    return [meta_from_pb(p) for p in ps]


M = TypeVar("M", pb.TaskMessage, pb.UpdateMessage)


def chunk_frames(payload: bytes | bytearray | memoryview, message: type[M],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[M]:
    """Stream messages of type ``message`` whose ``chunk`` field carries consecutive slices of ``payload``.

    The chunk is written into the parent message in place: building a ``Chunk`` first and passing it to the
    parent's constructor copies every byte once more (3.5x slower in tools/bench_serialization.py).
    """
    for off, data in iter_chunks(payload, chunk_bytes):
        msg = message()
        msg.chunk.offset = off
        msg.chunk.data = bytes(data)
        yield msg
