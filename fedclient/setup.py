"""The device's side of a federation, set up once at the first join: the model (checked against the federation's
announced spec), the client's data, the federation's training method, and Pᵢ (its private model's accuracy, kept
in the state file so that a restarted client does not train it again).

Apart from the round loop because none of it depends on the round: it answers "can this device take part, and with
what?" -- and every refusal here (a model mismatch, an announcement the device does not trust, data it cannot load)
is a :class:`fedclient.errors.FedClientError` before any training.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fedclient.errors import FedClientError
from fedclient.local_round import LocalRound
from fedclient.state import ClientState
from fedcore.config import ClientConfig, FederationInfo
from fedcore.data import ClientData, DataError, load_client_data
from fedcore.data.source import DataSource
from fedcore.metrics import private_model_key, train_private_model
from fedcore.models import build_model, model_fingerprint, model_manifest
from fedcore.seeds import GLOBAL_RNG_LOCK, private_seed
from fedcore.trust import (
    TrustError,
    announced_data,
    announced_model,
    announced_trainer,
    build_announced_model,
    check_announcement,
    check_json,
)

ModelSpec = str | Callable[[], nn.Module] | nn.Module | None


class ClientSetup:
    """What the device trains with. ``model_spec``: a registered name, a factory, a module, or None to build what
    the server announces; ``data``: tensors, a :class:`DataSource` (read when the client starts) or None to derive
    the shard from the server's dataset (simulation)."""

    def __init__(self, config: ClientConfig, client_id: str, log: Any, model_spec: ModelSpec,
                 data: ClientData | DataSource | None, state: ClientState) -> None:
        self.config, self.client_id, self.log = config, client_id, log
        self.model_spec = model_spec
        self.data_source = data if isinstance(data, DataSource) else None
        self.data = data if isinstance(data, ClientData) else None
        if data is not None and self.data is None and self.data_source is None:
            raise FedClientError(f"data: expected ClientData, a DataSource or None, got {type(data).__name__}")
        self.state = state
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")  # resolved from config.device when the client runs
        # P_i, the accuracy of this client's stand-alone model (None until trained or loaded).
        self.private_accuracy: float | None = None

    def load_data(self) -> None:
        """Read the app's :class:`DataSource` (once, when the client starts)."""
        if self.data is None and self.data_source is not None:
            try:
                self.data = self.data_source.load()
            except DataError as e:
                raise FedClientError(str(e)) from None

    def prepare(self, fed: FederationInfo, client_index: int, local: LocalRound,
                keep_alive: Callable[[], AbstractContextManager[None]]) -> None:
        """Build model and data on first join, check the model against the server's spec, pick the federation's
        method (unless the client has its own trainer) and find Pᵢ (``keep_alive``: heartbeats while it trains)."""
        try:
            check_announcement(fed)
            if self.model is None:
                spec = self.model_spec
                if isinstance(spec, nn.Module):
                    self.model = spec
                elif spec is None:
                    # The announcement names a built-in model only; checked on the meta device first.
                    self.model = build_announced_model(fed, self.config.max_model_bytes)
                else:
                    # A user factory may draw from torch's global RNG: never while another thread's seeded
                    # section (a concurrent virtual client's private model) holds it.
                    with GLOBAL_RNG_LOCK:
                        self.model = self.model_factory(fed)()
                self.model.to(self.device)
            dataset, data_options = announced_data(fed, self.config.dataset, self.config.data_options)
            if not self.config.trainer:
                local.use_method(*announced_trainer(fed))
        except TrustError as e:
            raise FedClientError(f"refused the server's announcement: {e}") from None
        server_manifest = list(fed.model_spec)
        mine = model_manifest(self.model)
        if mine != server_manifest:
            raise FedClientError(
                f"model mismatch: this client's model has fingerprint {model_fingerprint(self.model)} "
                f"but the federation's is {fed.model_fingerprint}; {_first_difference(mine, server_manifest)}")
        if self.data is None:
            index = self.config.data_index if self.config.data_index >= 0 else client_index
            self.data = load_client_data(dataset, index, fed.seed, data_options)
        if self.config.private_epochs and self.private_accuracy is None:
            with keep_alive():  # heartbeats keep the session alive while the private model trains
                self.private_accuracy = self._private_model(fed)

    def model_factory(self, fed: FederationInfo) -> Callable[[], nn.Module]:
        """Fresh copies of this client's model (the private model is one): the client's own ``model``, or the
        announced built-in model (:func:`fedcore.trust.announced_model` refuses anything else)."""
        spec = self.model_spec
        if spec is None:
            name, kwargs = announced_model(fed, self.config.max_model_bytes)
            return lambda: build_model(name, kwargs)
        if isinstance(spec, str):
            # The client's own choice (--model): a built-in name or its own factory's import path, with the
            # server's arguments only for a built-in model (the fingerprint check guards the rest).
            check_json(fed.model_kwargs, "model_kwargs_json")
            own, own_kwargs = spec, dict(fed.model_kwargs)
            return lambda: build_model(own, own_kwargs)
        if isinstance(spec, nn.Module):
            template = copy.deepcopy(spec)
            return lambda: copy.deepcopy(template)
        return spec

    def _private_model(self, fed: FederationInfo) -> float:
        """P_i: accuracy of a stand-alone model trained on the clean local data (recorded in the state file)."""
        assert self.model is not None and self.data is not None
        # One implementation of "the private model's training": train_private_model drops prox_mu and decay.
        tc = dataclasses.replace(fed.training, local_epochs=1, lr_decay=1.0)
        seed = private_seed(fed.seed, self.client_id)
        trained_as = private_model_key(self.data, tc, self.config.private_epochs, seed)
        cached = self.state.private_accuracy(model_fingerprint(self.model), trained_as)
        if cached is not None:
            self.log.info("private_model.loaded", client_id=self.client_id, accuracy=round(cached, 4))
            return cached
        started = time.monotonic()
        state, acc = train_private_model(self.model_factory(fed), self.data, tc, self.config.private_epochs,
                                         seed=seed, device=self.device)
        self.state.record_private_model(state, acc, self.config.private_epochs, trained_as)
        self.log.info("private_model.trained", client_id=self.client_id, accuracy=round(acc, 4),
                      epochs=self.config.private_epochs, seconds=round(time.monotonic() - started, 2))
        return acc


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            return f"first difference: {a.name} {a.dtype}{list(a.shape)} vs {b.name} {b.dtype}{list(b.shape)}"
    return f"{len(mine)} tensors here vs {len(theirs)} in the federation"


__all__ = ["ClientSetup", "ModelSpec"]
