"""A device's side of compressed updates: the error-feedback residual as explicit state, kept between rounds.

As optax's transformations keep their state outside the update function, the residual is a value the codec
functions take and return (:func:`fedcore.compression.codecs.encode`); :class:`DeviceCompressor` only holds it for
the device and writes it through to the device's state (a :class:`ResidualStore`: ``fedclient.state.ClientState``
keeps it in ``compression_residual.fgt``) each time it changes, so a restarted device carries on with it. A residual
saved for another model (fingerprint or P) or another kind is not used: it starts afresh (zero), said in the log.

The residual is committed when the update is encoded: an update the server then refuses loses what it carried, as
a plain update would be lost whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedcore.compression.codecs import Encoded, encode, roundtrip
from fedcore.compression.config import CompressionConfig


class ResidualStore(Protocol):
    """Where a device keeps its residual (its state dir)."""

    def load_residual(self) -> tuple[torch.Tensor, dict[str, object]] | None: ...

    def save_residual(self, residual: torch.Tensor | None, meta: Mapping[str, object]) -> None: ...


@dataclass(frozen=True)
class ResidualKey:
    """What a residual belongs to: the kind that made it and the model (its fingerprint and P)."""

    kind: str
    fingerprint: str
    num_params: int

    def meta(self) -> dict[str, object]:
        return {"kind": self.kind, "model_fingerprint": self.fingerprint, "num_params": self.num_params}

    def matches(self, meta: Mapping[str, object], residual: torch.Tensor) -> bool:
        return (meta.get("kind") == self.kind and meta.get("model_fingerprint") == self.fingerprint
                and meta.get("num_params") == self.num_params and residual.dtype == torch.float32
                and tuple(residual.shape) == (self.num_params,) and bool(torch.isfinite(residual).all()))


class DeviceCompressor:
    """One device's encoder for the announced ``cfg``, with its residual (restored from ``store`` when it was saved
    for the same kind and model)."""

    def __init__(self, cfg: CompressionConfig, fingerprint: str, num_params: int, store: ResidualStore | None = None,
                 log: Any = None) -> None:
        self.cfg = cfg
        self.key = ResidualKey(cfg.kind, fingerprint, int(num_params))
        self._store = store
        self.residual: torch.Tensor | None = None
        self.restored = False  # the residual came from the store
        if not cfg.keeps_residual or store is None:
            return
        loaded = store.load_residual()
        if loaded is None:
            return
        residual, meta = loaded
        if self.key.matches(meta, residual):
            self.residual, self.restored = residual, True
            if log is not None:
                log.info("compression.residual_restored", kind=cfg.kind, norm=round(float(residual.norm()), 6))
            return
        if log is not None:
            log.info("compression.residual_reset", kind=cfg.kind, saved_kind=meta.get("kind"),
                     reason="the saved residual is of another kind or model: starting from zero")
        store.save_residual(None, self.key.meta())

    def encode(self, update: torch.Tensor) -> Encoded:
        """``update`` (float32 [P]) plus the residual, encoded; the new residual is kept (and saved)."""
        self._check(update)
        encoded, residual = encode(update, self.residual, self.cfg)
        self._commit(residual)
        return encoded

    def roundtrip(self, update: torch.Tensor) -> torch.Tensor:
        """What the server would decode of ``update`` plus the residual (float32 [P]); the new residual is kept:
        a secure-aggregation device masks these values."""
        self._check(update)
        decoded, residual = roundtrip(update, self.residual, self.cfg)
        self._commit(residual)
        return decoded

    def _check(self, update: torch.Tensor) -> None:
        if tuple(update.shape) != (self.key.num_params,):
            raise ValueError(f"an update of {tuple(update.shape)} coordinates for a model of {self.key.num_params}")

    def _commit(self, residual: torch.Tensor | None) -> None:
        self.residual = residual
        if self._store is not None and self.cfg.keeps_residual:
            self._store.save_residual(residual, self.key.meta())


__all__ = ["DeviceCompressor", "ResidualKey", "ResidualStore"]
