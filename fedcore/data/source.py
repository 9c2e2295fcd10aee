"""A client's own data given the way an app holds it: tensors, a ``torch.utils.data.Dataset``, or a data-loader
factory (a callable returning an iterable of ``(x, y)`` batches, e.g. ``lambda: DataLoader(ds, batch_size=64)``).

:meth:`DataSource.load` reads each split once, in order, into the :class:`ClientData` tensors every trainer uses,
so training stays the seeded, reproducible loop over tensors (the same samples in the same order give bit-identical
models whichever way they were given). It is meant for on-device data (what one device holds fits in its memory).
Errors name the field (``data.train`` / ``data.test``) and what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from fedcore.data.base import ClientData, DataError

BatchFactory = Callable[[], Iterable[Any]]
Samples = tuple[torch.Tensor, torch.Tensor] | Dataset[Any] | BatchFactory


@dataclass(frozen=True)
class DataSource:
    """``train`` and ``test``: a pair of tensors ``(x, y)``, a map-style or iterable ``Dataset`` of ``(x, y)``
    samples, or a callable returning an iterable of ``(x, y)`` batches; labels are class indices below
    ``num_classes``."""

    train: Samples
    test: Samples
    num_classes: int

    def load(self) -> ClientData:
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise DataError(f"data.num_classes: must be an integer >= 1, got {self.num_classes!r}")
        x_train, y_train = read_samples(self.train, "data.train", self.num_classes)
        x_test, y_test = read_samples(self.test, "data.test", self.num_classes)
        if x_train.shape[1:] != x_test.shape[1:]:
            raise DataError(f"data.test: samples of shape {list(x_test.shape[1:])}, but data.train's are "
                            f"{list(x_train.shape[1:])}")
        return ClientData(x_train, y_train, x_test, y_test, self.num_classes)


def read_samples(src: Samples, field: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``src`` as ``(x, y)`` tensors: x stacked along a new first dimension, y as int64 class indices."""
    if isinstance(src, tuple):
        if len(src) != 2 or not all(isinstance(t, torch.Tensor) for t in src):
            raise DataError(f"{field}: expected (x, y) tensors, a Dataset or a batch factory")
        x, y = src
        return _checked(x, y, field, num_classes)
    if isinstance(src, Dataset) and not isinstance(src, IterableDataset) and hasattr(src, "__len__"):
        return _from_samples((src[i] for i in range(len(src))), field, num_classes)
    if isinstance(src, IterableDataset):
        return _from_samples(iter(src), field, num_classes)
    if callable(src):
        try:
            batches = src()
        except Exception as e:
            raise DataError(f"{field}: the batch factory failed: {type(e).__name__}: {e}") from None
        return _from_batches(batches, field, num_classes)
    raise DataError(f"{field}: expected (x, y) tensors, a Dataset or a batch factory, got {type(src).__name__}")


def _pair(item: Any, field: str, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise DataError(f"{field}: each {what} must be an (x, y) pair, got {type(item).__name__}")
    x, y = item
    return torch.as_tensor(x), torch.as_tensor(y)


def _from_samples(items: Iterable[Any], field: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for item in items:
        x, y = _pair(item, field, "sample")
        xs.append(x)
        ys.append(y.reshape(()) if y.numel() == 1 else y)
    if not xs:
        raise DataError(f"{field}: the dataset is empty")
    try:
        return _checked(torch.stack(xs), torch.stack(ys), field, num_classes)
    except RuntimeError as e:
        raise DataError(f"{field}: samples of different shapes ({e})") from None


def _from_batches(batches: Iterable[Any], field: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for batch in batches:
        x, y = _pair(batch, field, "batch")
        xs.append(x)
        ys.append(y.reshape(-1))
    if not xs:
        raise DataError(f"{field}: the batch factory yielded no batch")
    try:
        return _checked(torch.cat(xs), torch.cat(ys), field, num_classes)
    except RuntimeError as e:
        raise DataError(f"{field}: batches of different sample shapes ({e})") from None


def _checked(x: torch.Tensor, y: torch.Tensor, field: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    if y.dim() != 1 or len(x) != len(y):
        raise DataError(f"{field}: need x of shape [N, ...] and y of shape [N], got {list(x.shape)} and "
                        f"{list(y.shape)}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise DataError(f"{field}: labels must be integer class indices, got {y.dtype}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{field}: labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    return x, y.to(torch.int64)
