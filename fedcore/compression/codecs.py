"""The compressed-update codecs: pure functions on a float32 ``[P]`` update, and a streaming decoder.

A device encodes x = u_i + r (u_i = trained - received over the model's floating-point tensors in manifest order,
:func:`flat_update`; r its error-feedback residual) with :func:`encode`, which returns the payload's parts and the
new residual x - decode(encode(x)) (computed with the server's own :class:`Decoder`, so the device's view of what it
sent is the server's, bit for bit). The payload is described by a manifest of pseudo-tensors (:func:`layout`), as a
masked input is; what the server expects follows from the announced section and P alone, so every length is known
before a byte arrives.

Payload layouts (little-endian, in this order):

- ``fp16``: ``compression.fp16`` float16 [P]. Values beyond half's range (+-65504) are clamped at the device (the
  clamped excess stays in the residual with error feedback): the server never receives an infinity it did not
  get from a non-finite update.
- ``int8``: ``compression.int8_scales`` float32 [C], C = ceil(P / int8_chunk), then ``compression.int8`` int8 [P].
  Chunk c's scale is s_c = max|x| / 127 over its coordinates (float32); q = round-half-even(x / s_c) in
  [-127, 127] (0 where s_c = 0); decoded as q * s_c in float32. Scales first, so the coordinates decode as they
  arrive.
- ``topk``: ``compression.topk_indices`` int32 [k], strictly increasing in [0, P), then ``compression.topk_values``
  float32 [k]; k = :func:`~fedcore.compression.config.topk_count`. Every other coordinate decodes to 0.

:class:`Decoder` takes the payload's bytes in order, chunk by chunk (split anywhere, even inside an element), and
writes float32 into one preallocated ``[P]`` vector: no full-size copy of the payload and no float64 anywhere. It
refuses (:class:`CompressionError`) a wrong byte count, a scale that is not finite and non-negative, an int8 of
-128, an index out of range, repeated or out of order, naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from fedcore.compression.config import CODECS, FP16, INT8, MAX_TOPK_PARAMS, NONE, TOPK, CompressionConfig, topk_count
from fedcore.serialization import Payload, SerializationError, TensorMeta, total_bytes

FP16_TENSOR = "compression.fp16"
INT8_SCALES = "compression.int8_scales"
INT8_TENSOR = "compression.int8"
TOPK_INDICES = "compression.topk_indices"
TOPK_VALUES = "compression.topk_values"
FP16_MAX = 65504.0


class CompressionError(SerializationError):
    """A compressed payload (or an update to encode) that cannot be used; the message says what is wrong."""


def layout(cfg: CompressionConfig, num_params: int) -> list[TensorMeta]:
    """The manifest of a compressed update of ``num_params`` coordinates under ``cfg`` (what the header must
    announce); :class:`CompressionError` for kind none (no compressed payload) or a topk model too large for int32
    indices."""
    p = int(num_params)
    if cfg.kind == FP16:
        return [TensorMeta(FP16_TENSOR, "float16", (p,))]
    if cfg.kind == INT8:
        return [TensorMeta(INT8_SCALES, "float32", (-(-p // cfg.int8_chunk),)), TensorMeta(INT8_TENSOR, "int8", (p,))]
    if cfg.kind == TOPK:
        if p > MAX_TOPK_PARAMS:
            raise CompressionError(f"topk indices are int32: a model of {p} parameters is too large")
        k = topk_count(p, cfg.topk_fraction)
        return [TensorMeta(TOPK_INDICES, "int32", (k,)), TensorMeta(TOPK_VALUES, "float32", (k,))]
    raise CompressionError(f"compression kind {cfg.kind!r} has no compressed payload")


def payload_bytes(cfg: CompressionConfig, num_params: int) -> int:
    """The byte count of a compressed update (:func:`layout`'s total)."""
    return total_bytes(layout(cfg, num_params))


@dataclass(frozen=True)
class Encoded:
    """A device's encoded update: the manifest its header announces and the payload's parts (in order)."""

    kind: str
    manifest: list[TensorMeta]
    parts: tuple[npt.NDArray[np.generic], ...]

    @property
    def payload(self) -> Payload:
        """The parts as one payload (memoryviews of the arrays, no copy)."""
        return Payload([np.ascontiguousarray(a).data.cast("B") for a in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.parts)


def flat_update(received: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """u_i = trained - received over the floating-point tensors of ``trained`` in its order, as one float32 ``[P]``
    vector (the server's arithmetic: each tensor's float32 difference written into its slice)."""
    floats = [(k, t) for k, t in trained.items() if t.is_floating_point()]
    update = torch.empty(sum(t.numel() for _, t in floats), dtype=torch.float32)
    at = 0
    for k, t in floats:
        n = t.numel()
        torch.sub(t.detach().reshape(-1).to(torch.float32), received[k].detach().reshape(-1).to(torch.float32),
                  out=update[at:at + n])
        at += n
    return update


# ---- encoding ----

def _encode_fp16(x: torch.Tensor, cfg: CompressionConfig) -> tuple[npt.NDArray[np.generic], ...]:
    return (x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).numpy(),)


def _encode_int8(x: torch.Tensor, cfg: CompressionConfig) -> tuple[npt.NDArray[np.generic], ...]:
    p, b = x.numel(), cfg.int8_chunk
    c = -(-p // b)
    padded = torch.nn.functional.pad(x, (0, c * b - p)) if c * b != p else x
    blocks = padded.reshape(c, b)
    scales = blocks.abs().amax(dim=1) / 127.0 if p else torch.zeros(0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127.0, 127.0).to(torch.int8).reshape(-1)[:p]
    return scales.to(torch.float32).numpy(), q.numpy()


def _encode_topk(x: torch.Tensor, cfg: CompressionConfig) -> tuple[npt.NDArray[np.generic], ...]:
    p = x.numel()
    if p > MAX_TOPK_PARAMS:
        raise CompressionError(f"topk indices are int32: a model of {p} parameters is too large")
    k = topk_count(p, cfg.topk_fraction)
    idx = torch.topk(x.abs(), k, sorted=False).indices if k else torch.zeros(0, dtype=torch.int64)
    idx = torch.sort(idx).values
    return idx.to(torch.int32).numpy(), x[idx].to(torch.float32).numpy()


_ENCODERS: dict[str, Callable[[torch.Tensor, CompressionConfig], tuple[npt.NDArray[np.generic], ...]]] = {
    FP16: _encode_fp16, INT8: _encode_int8, TOPK: _encode_topk}


def _encode_x(x: torch.Tensor, cfg: CompressionConfig) -> tuple[Encoded, torch.Tensor]:
    """``x`` encoded, and what the server will decode it to."""
    if cfg.kind not in _ENCODERS:
        raise CompressionError(f"compression kind {cfg.kind!r} does not encode an update")
    if x.dtype != torch.float32 or x.dim() != 1:
        raise CompressionError(f"an update to encode is a float32 [P] vector, got {x.dtype} {tuple(x.shape)}")
    parts = _ENCODERS[cfg.kind](x.contiguous(), cfg)
    # little-endian on the wire whatever the host (a no-op view on a little-endian one)
    encoded = Encoded(cfg.kind, layout(cfg, x.numel()),
                      tuple(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for a in parts))
    dec = Decoder(cfg, x.numel())
    for part in encoded.parts:
        dec.feed(dec.received, part.data.cast("B"))
    return encoded, dec.finish()


def encode(update: torch.Tensor, residual: torch.Tensor | None,
           cfg: CompressionConfig) -> tuple[Encoded, torch.Tensor | None]:
    """Encode x = ``update`` + ``residual`` (float32 [P]; ``residual`` None: zero): the payload, and the new residual
    x - decode(encode(x)) when ``cfg.keeps_residual`` (else None). Pure: neither argument is modified."""
    x = update if residual is None or not cfg.keeps_residual else update + residual
    encoded, decoded = _encode_x(x, cfg)
    return encoded, (x - decoded) if cfg.keeps_residual else None


def roundtrip(update: torch.Tensor, residual: torch.Tensor | None,
              cfg: CompressionConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What :func:`encode` would make the server decode (float32 [P]), and the new residual: a secure-aggregation
    device masks these decoded values (docs/security.md, "Secure aggregation")."""
    x = update if residual is None or not cfg.keeps_residual else update + residual
    _, decoded = _encode_x(x, cfg)
    return decoded, (x - decoded) if cfg.keeps_residual else None


# ---- decoding, as the bytes arrive ----

@dataclass
class _Segment:
    name: str
    dtype: np.dtype[np.generic]
    count: int
    start: int  # byte offset in the payload


class Decoder:
    """Decodes a compressed payload chunk by chunk into a float32 ``[P]`` vector (``out``, or one allocated here).

    The interface of :class:`fedcore.serialization.Reassembler` (``expected``, ``received``, :meth:`feed` in order,
    :meth:`finish`), so a receiver feeds either the same way; every malformed value is a :class:`CompressionError`
    raised by the :meth:`feed` that brought it."""

    def __init__(self, cfg: CompressionConfig, num_params: int, announced_bytes: int | None = None,
                 out: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.num_params = p = int(num_params)
        metas = layout(cfg, p)
        self._segments: list[_Segment] = []
        at = 0
        for m in metas:
            self._segments.append(_Segment(m.name, np.dtype(_NP[m.dtype]), m.numel, at))
            at += m.nbytes
        self.expected = at
        if announced_bytes is not None and announced_bytes != self.expected:
            raise CompressionError(f"a {cfg.kind} update of {p} coordinates is {self.expected} bytes, "
                                   f"{announced_bytes} announced")
        if out is None:
            out = torch.zeros(p, dtype=torch.float32) if cfg.kind == TOPK else torch.empty(p, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (p,):
            raise ValueError(f"out must be float32 [{p}], got {out.dtype} {tuple(out.shape)}")
        elif cfg.kind == TOPK:
            out.zero_()
        self._out = out
        self._out_np: npt.NDArray[np.float32] = out.numpy()
        self.received = 0
        self._seg = 0
        self._carry = bytearray()  # the bytes of an element split between two chunks
        self._scales: npt.NDArray[np.float32] = np.empty(
            self._segments[0].count if cfg.kind == INT8 else 0, dtype=np.float32)
        self._indices: npt.NDArray[np.int64] = np.empty(
            self._segments[0].count if cfg.kind == TOPK else 0, dtype=np.int64)
        self._last_index = -1

    def feed(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if offset != self.received:
            raise CompressionError(f"chunk at offset {offset}, expected offset {self.received}")
        if self.received + n > self.expected:
            raise CompressionError(f"received more bytes than announced ({self.received + n} > {self.expected})")
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
        pos = 0
        while pos < n:
            seg = self._segments[self._seg]
            size = seg.dtype.itemsize
            seg_end = seg.start + seg.count * size
            take = min(n - pos, seg_end - self.received)
            first_elem = (self.received - seg.start) // size
            piece = view[pos:pos + take]
            if self._carry:  # complete the element split at the last chunk's end
                need = size - len(self._carry)
                self._carry += piece[:need]
                if len(self._carry) == size:
                    self._apply(self._seg, first_elem, np.frombuffer(bytes(self._carry), dtype=seg.dtype))
                    self._carry.clear()
                    first_elem += 1
                    piece = piece[need:]
                else:
                    piece = piece[len(piece):]
            whole = len(piece) // size
            if whole:
                self._apply(self._seg, first_elem, np.frombuffer(piece, dtype=seg.dtype, count=whole))
            rest = piece[whole * size:]
            if len(rest):
                self._carry += rest
            pos += take
            self.received += take
            if self.received == seg_end:
                self._seg += 1

    def finish(self) -> torch.Tensor:
        """The decoded ``[P]`` float32 update; :class:`CompressionError` when bytes are missing."""
        if self.received != self.expected:
            raise CompressionError(f"received {self.received} of {self.expected} announced bytes")
        return self._out

    # ---- per kind ----

    def _apply(self, seg: int, first: int, values: npt.NDArray[np.generic]) -> None:
        kind, out = self.cfg.kind, self._out_np
        if kind == FP16:
            out[first:first + len(values)] = values
        elif kind == INT8 and seg == 0:
            bad = ~(np.isfinite(values) & np.greater_equal(values, 0))
            if bool(bad.any()):
                j = int(np.argmax(bad))
                raise CompressionError(f"int8 scale {first + j} is {float(values[j])}: a scale must be finite "
                                       "and >= 0")
            self._scales[first:first + len(values)] = values
        elif kind == INT8:
            with np.errstate(over="ignore"):  # q * s beyond float32 is inf: refused on the decoded update
                self._dequantize(first, values.view(np.int8))
        elif seg == 0:
            self._take_indices(first, values)
        else:
            out[self._indices[first:first + len(values)]] = values

    def _dequantize(self, first: int, q: npt.NDArray[np.int8]) -> None:
        if bool((q == -128).any()):
            raise CompressionError(f"int8 coordinate {first + int(np.argmax(q == -128))} is -128: values are in "
                                   "[-127, 127]")
        b, n, out, scales = self.cfg.int8_chunk, len(q), self._out_np, self._scales
        i = 0
        while i < n:  # the head up to a chunk boundary, then whole chunks at once, then the tail
            at = first + i
            c = at // b
            if at % b == 0 and n - i >= b:
                m = (n - i) // b
                np.multiply(q[i:i + m * b].reshape(m, b), scales[c:c + m, None], out=out[at:at + m * b].reshape(m, b),
                            dtype=np.float32)
                i += m * b
                continue
            take = min(n - i, b - at % b)
            np.multiply(q[i:i + take], scales[c], out=out[at:at + take], dtype=np.float32)
            i += take

    def _take_indices(self, first: int, idx: npt.NDArray[np.generic]) -> None:
        if not len(idx):
            return
        wide = idx.astype(np.int64)
        if int(wide.min()) < 0 or int(wide.max()) >= self.num_params:
            bad = int(wide[(wide < 0) | (wide >= self.num_params)][0])
            raise CompressionError(f"topk index {bad} is outside [0, {self.num_params})")
        steps = np.diff(wide, prepend=self._last_index)
        if bool((steps <= 0).any()):
            j = int(np.argmax(steps <= 0))
            raise CompressionError(f"topk index {int(wide[j])} at position {first + j} repeats or is out of order: "
                                   "indices are strictly increasing")
        self._indices[first:first + len(wide)] = wide
        self._last_index = int(wide[-1])


# The payload's element types: little-endian whatever the host.
_NP = {"float16": "<f2", "float32": "<f4", "int8": "i1", "int32": "<i4"}


def decode(cfg: CompressionConfig, num_params: int, chunks: Sequence[bytes | bytearray | memoryview]) -> torch.Tensor:
    """A whole payload given as consecutive pieces, decoded (tests and tools; a receiver feeds a :class:`Decoder`)."""
    dec = Decoder(cfg, num_params)
    for piece in chunks:
        dec.feed(dec.received, piece)
    return dec.finish()


class _Codec:
    """A registered kind (:data:`fedcore.compression.config.CODECS`): its name, and whether it encodes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.encodes = name != NONE


for _name in (NONE, FP16, INT8, TOPK):
    CODECS.add(_name, _Codec(_name))

__all__ = ["FP16_TENSOR", "INT8_SCALES", "INT8_TENSOR", "TOPK_INDICES", "TOPK_VALUES", "CompressionError", "Decoder",
           "Encoded", "decode", "encode", "flat_update", "layout", "payload_bytes", "roundtrip"]
