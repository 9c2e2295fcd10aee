"""The ``[compression]`` section: how devices encode their update (no torch here).

The server announces the section at join (``FederationConfig.compression``); a device never chooses its own kind.
The kinds are declared by name in :data:`CODECS` (:mod:`fedcore.registry`), registered by
:mod:`fedcore.compression.codecs` when first looked up, so reading a configuration imports no torch.
:meth:`CompressionConfig.validate` raises :class:`fedcore.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fedcore.errors import require
from fedcore.registry import Registry

NONE, FP16, INT8, TOPK = "none", "fp16", "int8", "topk"
# Lossy kinds (every kind but none): error feedback applies to them.
LOSSY = (FP16, INT8, TOPK)
DEFAULT_INT8_CHUNK = 4096
MAX_INT8_CHUNK = 1 << 24
# Top-k indices travel as int32: a model of more floating-point parameters than this cannot use topk.
MAX_TOPK_PARAMS = (1 << 31) - 1

CODECS: Registry[Any] = Registry("compression kind", ValueError)
CODECS.declare(NONE, "fedcore.compression.codecs",
               summary="the device sends its new weights as they are (float32; today's wire, bit for bit)")
CODECS.declare(FP16, "fedcore.compression.codecs",
               summary="u_i as IEEE half floats (2 B/coordinate); beyond +-65504 clamped, the rest kept as residual")
CODECS.declare(INT8, "fedcore.compression.codecs",
               summary="u_i as int8 with one float32 scale max|x|/127 per int8_chunk coordinates (~1 B/coordinate)")
CODECS.declare(TOPK, "fedcore.compression.codecs",
               summary="the ceil(topk_fraction * P) largest |u_i| coordinates: int32 indices + float32 values")


@dataclass(frozen=True)
class CompressionConfig:
    """Compressed updates (docs/scaling.md, "Compressed updates"): what devices send instead of their weights.
    Every kind but ``none`` sends the update u_i = trained - received (float32, the model's floating-point tensors
    in manifest order) encoded; the server decodes it as it streams in, straight into a float32 [P] vector, and
    aggregates it as a plain update (sample counts, beta_hat_i and the report travel exactly)."""

    # "none" (the device sends its weights, float32, as without this section), "fp16", "int8" or "topk".
    kind: str = NONE
    # int8: coordinates per scale (each run of int8_chunk coordinates has its own float32 scale max|x| / 127).
    int8_chunk: int = DEFAULT_INT8_CHUNK
    # topk: the fraction of the P coordinates sent, k = ceil(topk_fraction * P) (the largest |x|; at least 1).
    topk_fraction: float = 0.01
    # Error feedback: what a lossy kind did not send this round (x - decode(encode(x)), x = u_i + the residual) stays
    # on the device, is added to its next update and is saved in its state dir (compression_residual.fgt), so a
    # restarted device keeps it; a change of model or kind starts it afresh. Off: each round's error is dropped.
    error_feedback: bool = True

    def validate(self, path: str = "compression") -> CompressionConfig:
        """Refuse unusable values (:class:`ConfigError` naming ``path.<field>``); returns ``self``."""
        require(self.kind in CODECS, f"{path}.kind",
                f"unknown compression kind {self.kind!r}; known: {', '.join(CODECS.names())}")
        require(isinstance(self.int8_chunk, int) and 1 <= self.int8_chunk <= MAX_INT8_CHUNK, f"{path}.int8_chunk",
                f"must be in [1, {MAX_INT8_CHUNK}], got {self.int8_chunk}")
        f = self.topk_fraction
        require(isinstance(f, (int, float)) and math.isfinite(f) and 0.0 < f <= 1.0, f"{path}.topk_fraction",
                f"must be in (0, 1], got {f}")
        return self

    @property
    def compressed(self) -> bool:
        """Whether devices send an encoded update (every kind but none)."""
        return self.kind != NONE

    @property
    def keeps_residual(self) -> bool:
        """Whether devices keep an error-feedback residual."""
        return self.kind in LOSSY and self.error_feedback


def topk_count(num_params: int, fraction: float) -> int:
    """k = ceil(fraction * P), at least 1 and at most P, in exact arithmetic on the fraction's shortest decimal form
    (0.07 * 100 is 7, not float's 7.000000000000001 -> 8); device and server compute the same k."""
    if num_params <= 0:
        return 0
    k = math.ceil(Fraction(repr(float(fraction))) * num_params)
    return min(num_params, max(1, k))


__all__ = ["CODECS", "DEFAULT_INT8_CHUNK", "FP16", "INT8", "LOSSY", "MAX_INT8_CHUNK", "MAX_TOPK_PARAMS", "NONE", "TOPK",
           "CompressionConfig", "topk_count"]
