"""The client's side of the trust boundary: what it accepts from a server's announcement.

A server (or anyone on the path to it) chooses the ``FederationConfig`` a client receives when it joins. The
client never lets that announcement pick code, files or downloads:

- ``model_name`` must be a model built into fedguard (or registered by the client's own code); an import path
  "pkg.mod:factory" is refused. A custom model is named by the client itself (``--model`` / ``FedClient(model=)``)
  and the server only checks its fingerprint. ``model_kwargs`` are plain JSON values, and the model they build
  is checked on torch's ``meta`` device (no memory) against the announced ``model_spec`` before it is built for
  real, so an announcement cannot make the client allocate more than ``max_model_bytes``.
- ``dataset`` must be registered in the client's process; ``data_options`` pass the dataset's allow-list
  (:func:`fedcore.data.remote_options`): partition and shape options only, never a path, a data directory, a
  download or a file format (such as CIFAR-10's pickled batches). The client's own ``data_options`` (its data
  directory, source, cache) are merged over the announced ones; a client that names its own ``dataset`` uses
  only its own options.
- Numbers (training hyper-parameters, chunk size, NR and c) must be finite and in range.

Every refusal is a :class:`TrustError` naming the ``FederationConfig`` field.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fedcore.config import ConfigError, FederationInfo, validate_training_config
from fedcore.data import available_datasets, remote_options
from fedcore.models.build import build_model, resolve_factory
from fedcore.models.registry import ModelError, is_registered_model
from fedcore.serialization import TensorMeta, manifest_of, total_bytes
from fedcore.torch_rng import seeded_global_rng
from fedcore.train.registry import TRAINERS
from fedcore.train.trainers import make_trainer

MAX_JSON_DEPTH = 4
MAX_JSON_ITEMS = 4096
MAX_JSON_STRING = 256
MAX_CHUNK_BYTES = 64 << 20


class TrustError(ValueError):
    """A server announcement the client refuses; ``field`` names the ``FederationConfig`` field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"FederationConfig.{field}: {message}")
        self.field = field
        self.message = message


def check_json(value: Any, field: str, depth: int = 0) -> None:
    """Plain JSON data only: bounded depth, sizes and strings; finite numbers."""
    if depth > MAX_JSON_DEPTH:
        raise TrustError(field, f"nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > 2**53:
            raise TrustError(field, f"integer {value} out of range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TrustError(field, f"{value} is not a finite number")
        return
    if isinstance(value, str):
        if len(value) > MAX_JSON_STRING or not value.isprintable():
            raise TrustError(field, f"strings must be at most {MAX_JSON_STRING} printable characters")
        return
    if isinstance(value, list):
        if len(value) > MAX_JSON_ITEMS:
            raise TrustError(field, f"more than {MAX_JSON_ITEMS} items")
        for i, v in enumerate(value):
            check_json(v, f"{field}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        if len(value) > MAX_JSON_ITEMS:
            raise TrustError(field, f"more than {MAX_JSON_ITEMS} items")
        for k, v in value.items():
            if not isinstance(k, str) or not k.isidentifier():
                raise TrustError(field, f"key {str(k)[:40]!r} is not an identifier")
            check_json(v, f"{field}.{k}", depth + 1)
        return
    raise TrustError(field, f"unsupported value of type {type(value).__name__}")


def announced_model(fed: FederationInfo, max_model_bytes: int) -> tuple[str, dict[str, Any]]:
    """The built-in model and arguments the server announces (:class:`TrustError` if the client must refuse)."""
    name = fed.model_name
    if not is_registered_model(name):
        why = "an import path" if ":" in name else "not a built-in model"
        raise TrustError("model_name", f"{name[:80]!r} is {why}; a client builds only built-in models from an "
                         "announcement. To use a custom model, name its factory on the client "
                         "(--model pkg.mod:factory, or FedClient(model=...)); the server checks its "
                         "fingerprint")
    check_json(fed.model_kwargs, "model_kwargs_json")
    check_model_size(fed.model_spec, max_model_bytes)
    return name, dict(fed.model_kwargs)


def check_model_size(spec: tuple[Any, ...] | list[Any], max_model_bytes: int) -> None:
    size = total_bytes(list(spec))
    if size > max_model_bytes:
        raise TrustError("model_spec", f"the announced model has {size} bytes of tensors, more than this client's "
                         f"max_model_bytes ({max_model_bytes})")


# Announcements whose meta-device build matched their model_spec, keyed by (factory, kwargs JSON, spec): a host of
# many virtual clients checks one federation's announcement once (the check is a pure function of the key; it was
# ~0.5 ms of every virtual client's ~6 ms join).
_VERIFIED: set[tuple[Any, str, tuple[TensorMeta, ...]]] = set()
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 64


def build_announced_model(fed: FederationInfo, max_model_bytes: int) -> nn.Module:
    """Build the announced built-in model, after checking on the ``meta`` device that it is the model the
    announcement's ``model_spec`` describes (so no announcement makes the client allocate more)."""
    name, kwargs = announced_model(fed, max_model_bytes)
    factory = resolve_factory(name)
    key = (factory, json.dumps(kwargs, sort_keys=True), tuple(fed.model_spec))
    with _VERIFIED_LOCK:
        verified = key in _VERIFIED
    if not verified:
        _check_on_meta(fed, name, kwargs, factory)
        with _VERIFIED_LOCK:
            if len(_VERIFIED) >= _VERIFIED_MAX:
                _VERIFIED.clear()
            _VERIFIED.add(key)
    return build_model(name, kwargs)


def _check_on_meta(fed: FederationInfo, name: str, kwargs: dict[str, Any], factory: Any) -> None:
    """Build the model on the ``meta`` device and compare its tensors with the announced ``model_spec``."""
    try:
        # The meta build draws nothing, but a factory may touch torch's global RNG: fork and restore it.
        with seeded_global_rng(0), torch.device("meta"):
            meta = factory(**kwargs)
    except (TypeError, ValueError, ModelError, RuntimeError) as e:
        raise TrustError("model_kwargs_json", f"model {name!r} rejected its arguments: {e}") from None
    if not isinstance(meta, nn.Module):
        raise TrustError("model_name", f"model {name!r} did not build a torch.nn.Module")
    got: list[TensorMeta] = manifest_of(meta.state_dict())
    if got != list(fed.model_spec):
        raise TrustError("model_spec", f"model {name!r} with the announced arguments does not build the announced "
                         f"tensors ({len(got)} tensors, {total_bytes(got)} bytes here vs {len(fed.model_spec)}, "
                         f"{total_bytes(list(fed.model_spec))} announced)")


def announced_data(fed: FederationInfo, own_dataset: str = "",
                   own_options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The dataset and options this client loads its shard with.

    With ``own_dataset`` the client names its data itself: only ``own_options`` apply. Otherwise the announced
    dataset must be registered here and its options pass the dataset's allow-list; ``own_options`` (the
    client's data directory, source, cache ...) are merged over them.
    """
    own = dict(own_options or {})
    if own_dataset:
        return own_dataset, own
    name = fed.dataset
    if name not in available_datasets():
        raise TrustError("dataset", f"{name[:80]!r} is not a dataset this client knows "
                         f"({', '.join(available_datasets())}); a client can name its own with --dataset")
    allowed = remote_options(name)
    for key in fed.data_options:
        if key not in allowed:
            raise TrustError(f"data_options_json.{key[:40]}",
                             f"a server may not set {key[:40]!r} for dataset {name!r}: paths, data directories, "
                             "downloads and file formats are the client's own choice (--data-options). "
                             f"Allowed: {', '.join(sorted(allowed)) or 'none'}")
    check_json(fed.data_options, "data_options_json")
    return name, {**fed.data_options, **own}


def announced_trainer(fed: FederationInfo) -> tuple[str, dict[str, Any]]:
    """The recovery method (a trainer registered on this client) and options the server announces."""
    name = fed.recovery_method
    if name not in TRAINERS:
        raise TrustError("recovery_method", f"{name[:80]!r} is not a trainer this client knows "
                         f"({', '.join(TRAINERS.names())}); a client can name its own with --trainer")
    check_json(fed.recovery_options, "recovery_options_json")
    try:
        make_trainer(name, fed.recovery_options)
    except (ConfigError, ValueError) as e:
        raise TrustError("recovery_options_json", str(e)) from None
    return name, dict(fed.recovery_options)


def check_announcement(fed: FederationInfo) -> None:
    """Numbers of the announcement in range (model and data are checked where they are used)."""
    try:
        validate_training_config(fed.training)
    except ConfigError as e:
        raise TrustError(e.field, str(e).partition(": ")[2]) from None
    t = fed.training
    if t.local_epochs > 10_000 or t.batch_size > 1 << 20:
        raise TrustError("training", f"local_epochs ({t.local_epochs}) or batch_size ({t.batch_size}) out of range")
    if fed.chunk_bytes > MAX_CHUNK_BYTES:
        raise TrustError("chunk_bytes", f"{fed.chunk_bytes} exceeds {MAX_CHUNK_BYTES}")
    for name, number in (("nfl.nr", fed.nfl.nr), ("nfl.c", fed.nfl.c), ("num_rounds", fed.num_rounds)):
        if not 0 <= number <= 10_000_000:
            raise TrustError(name, f"{number} out of range [0, 1e7]")
    for name, value in (("federation_id", fed.federation_id), ("nfl.mode", fed.nfl.mode)):
        if len(value) > 128 or not value.isprintable():
            raise TrustError(name, "must be at most 128 printable characters")


__all__ = ["TrustError", "announced_data", "announced_model", "announced_trainer", "build_announced_model",
           "check_announcement", "check_json", "check_model_size"]
