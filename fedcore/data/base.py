"""Client data containers and the dataset registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedcore.registry import Registry


class DataError(ValueError):
    """Unknown dataset, bad options, or data that does not fit the model."""


@dataclass
class ClientData:
    """One client's local data, already split into train and test with the same distribution."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise DataError("features and labels differ in length")
        if len(self.x_train) == 0:
            raise DataError("a client needs at least one training sample")

    @property
    def num_train(self) -> int:
        return len(self.y_train)


ShardLoader = Callable[..., ClientData]
_REGISTRY: Registry[ShardLoader] = Registry("dataset", DataError)
# Per dataset, the options a remote party (the server's announcement) may set: never a path, a download or a
# file format; the client's own configuration sets those.
_REMOTE_OPTIONS: dict[str, frozenset[str]] = {}
OptionsCheck = Callable[[Mapping[str, Any]], "int | None"]
_CHECKS: dict[str, OptionsCheck] = {}


def register_dataset(name: str, remote_options: Collection[str] = (),
                     check: OptionsCheck | None = None) -> Callable[[ShardLoader], ShardLoader]:
    """Register a shard loader; ``remote_options`` are the options a server may announce for it.

    ``check(options)`` validates options without loading data and returns the number of clients the data will
    have when the options fix it (see :func:`check_dataset`); without one, the loader's keyword parameters are
    its options and the number of clients is open.
    """

    def deco(loader: ShardLoader) -> ShardLoader:
        _REGISTRY.add(name, loader)
        _REMOTE_OPTIONS[name] = frozenset(remote_options)
        if check is not None:
            _CHECKS[name] = check
        return loader

    return deco


def check_dataset(dataset: str, options: Mapping[str, Any] | None = None) -> int | None:
    """Check a dataset name and its options before any data is loaded (a server checks them before it listens).

    Raises :class:`DataError` for an unknown dataset or an option it does not take; returns the number of client
    shards the data will have when the options fix it, None when it is open (seeded synthetic clients) or known
    only once the data is read (natural partitions).
    """
    loader = _REGISTRY.get(dataset)
    opts = dict(options or {})
    check = _CHECKS.get(dataset)
    if check is not None:
        return check(opts)
    params = inspect.signature(loader).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        known = sorted(set(params) - {"client_index", "seed"})
        unknown = sorted(set(opts) - set(known))
        if unknown:
            raise DataError(f"dataset {dataset!r}: unknown option {unknown[0]!r}; known: {', '.join(known)}")
    return None


def remote_options(dataset: str) -> frozenset[str]:
    """The options of ``dataset`` a server may announce (:class:`DataError` for an unknown dataset)."""
    _REGISTRY.get(dataset)
    return _REMOTE_OPTIONS.get(dataset, frozenset())


def available_datasets() -> list[str]:
    return _REGISTRY.names()


def load_client_data(dataset: str, client_index: int, seed: int,
                     options: Mapping[str, Any] | None = None) -> ClientData:
    """The shard of client ``client_index``: deterministic in (dataset, options, seed, index)."""
    loader = _REGISTRY.get(dataset)
    if client_index < 0:
        raise DataError(f"client index must be >= 0, got {client_index}")
    try:
        return loader(client_index=client_index, seed=seed, **dict(options or {}))
    except TypeError as e:
        raise DataError(f"dataset {dataset!r} rejected its options {dict(options or {})}: {e}") from None


def split_train_test(x: torch.Tensor, y: torch.Tensor, num_classes: int, test_fraction: float,
                     generator: torch.Generator) -> ClientData:
    """Shuffle and split so that train and test follow the same distribution."""
    n = len(y)
    perm = torch.randperm(n, generator=generator)
    n_test = max(1, round(n * test_fraction)) if n > 1 else 0
    test, train = perm[:n_test], perm[n_test:]
    return ClientData(x[train], y[train], x[test], y[test], num_classes)
