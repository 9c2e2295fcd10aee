"""FedClient: joins a federation, long-polls for tasks, trains locally and pushes updates.

Embeddable: ``FedClient(...).run()`` blocks until the federation finishes; ``start()`` runs it in a
background thread and ``stop()`` ends it cleanly (the in-flight call is cancelled, the client leaves);
``await client.run_async()`` is the asyncio form. The app-facing API (the model to predict with, the NFL state,
callbacks, the ``can_train`` eligibility check) is :class:`fedclient.embed.EmbeddingApi` (docs/embedding.md).

``FedClient`` only wires the client's parts together, each in its own module:

- :mod:`fedclient.connection` -- the transport, the session, retries with exponential backoff and full jitter,
  heartbeats, the call in flight that :meth:`stop` cancels;
- :mod:`fedclient.state` -- the state directory: identity, Pᵢ and the individual-level counters in one atomic,
  versioned state file (an old layout is migrated);
- :mod:`fedclient.setup` -- the model, data, method and private model, set up at the first join;
- :mod:`fedclient.runner` -- the round loop: pull, the local round through the client mods, push; declines;
  re-joins when the server forgot the session (for example after a restart);
- :mod:`fedclient.mods` -- what wraps the local round: the simulated device (stragglers, dropouts, crashes) and the
  attacks;
- :mod:`fedclient.local_round` -- one round on the device (β̂ᵢ, the individual-level measures, the trainer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedclient.connection import Backoff, Connection
from fedclient.embed import (
    Callbacks,
    EmbeddingApi,
    ModelCallback,
    Published,
    RoundEndCallback,
    StateChangeCallback,
)
from fedclient.errors import FedClientError, FedClientRefused, Stopped
from fedclient.local_round import LocalRound
from fedclient.runner import ClientSummary, RoundRunner
from fedclient.setup import ClientSetup, ModelSpec
from fedclient.simulation import DeviceGone, DeviceSimulation
from fedclient.state import ClientState, ClientStateError
from fedcore.config import ClientConfig, ConfigError, secret_token
from fedcore.data import ClientData
from fedcore.data.source import DataSource
from fedcore.log import get_logger
from fedcore.train import resolve_device


class FedClient(EmbeddingApi):
    """A federated-learning device client.

    ``model``: a registered name, a factory, a module, or None to build what the server announces.
    ``data``: the client's :class:`ClientData` (tensors), a :class:`fedcore.data.source.DataSource` (tensors, a
    ``Dataset`` or a data-loader factory, read once when the client starts), or None to derive its shard from the
    server's dataset (simulation: the shard index is ``config.data_index`` or, if negative, the index the server
    assigns). ``can_train``: the app's eligibility check, consulted before each task (False: the client declines
    it, the server counts it unavailable). ``on_round_end``/``on_model``/``on_state_change``: callbacks
    (:class:`fedclient.embed.EmbeddingApi`, which also registers more later).
    """

    def __init__(self, config: ClientConfig | None = None, model: ModelSpec = None,
                 data: ClientData | DataSource | None = None, *, can_train: Callable[[], bool] | None = None,
                 on_round_end: RoundEndCallback | None = None, on_model: ModelCallback | None = None,
                 on_state_change: StateChangeCallback | None = None, **overrides: Any) -> None:
        cfg = config or ClientConfig()
        if overrides:
            cfg = ClientConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg.validate()
        self.log = get_logger("fedclient", self.config.log_level)
        if can_train is not None and not callable(can_train):
            raise FedClientError(f"can_train: expected a callable returning bool, got {type(can_train).__name__}")
        self.can_train = can_train
        try:
            # The state dir: identity, P_i, individual counters (an old layout is migrated here, once).
            self.state = ClientState.open(self.config.state_dir, self.log)
            self.client_id = self.config.client_id or self.state.client_id()
            # The join secret: config.token, else token_file's first line (read once; never logged).
            token = secret_token(self.config.token, self.config.token_file)
        except (ClientStateError, ConfigError) as e:
            raise FedClientError(str(e)) from None
        self.summary = ClientSummary(self.client_id)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.connection = Connection(self.config, self.client_id, self.log, self._stop, on_retry=self._count_retry)
        # One round on the device: beta_hat_i, individual NFL measures, the trainer seam (no gRPC).
        self.local = LocalRound(self.config, self.client_id, self.log, self.state)
        self.setup = ClientSetup(self.config, self.client_id, self.log, model, data, self.state)
        # Simulated device behaviour (stragglers, dropouts, crashes, availability); inert by default.
        self.sim = DeviceSimulation(self.config.simulation, self.client_id, self.log)
        # What the app sees (thread-safe) and its callbacks (fedclient.embed).
        self.published = Published(self.local, self.config.opt_out)
        self.callbacks = Callbacks(self.log, self.client_id)
        self.callbacks.add("round_end", on_round_end)
        self.callbacks.add("model", on_model)
        self.callbacks.add("state_change", on_state_change)
        self.runner = RoundRunner(self.config, self.client_id, self.log, token, self.connection, self.setup,
                                  self.local, self.sim, self, self.summary)

    def _count_retry(self) -> None:
        self.summary.reconnects += 1

    # ---- what the parts hold, for the app and for tests ----

    @property
    def model(self) -> nn.Module | None:
        return self.setup.model

    @property
    def data(self) -> ClientData | None:
        return self.setup.data

    @property
    def private_accuracy(self) -> float | None:
        """Pᵢ, the accuracy of this client's stand-alone model (None until trained or loaded)."""
        return self.setup.private_accuracy

    # ---- lifecycle ----

    def run(self) -> ClientSummary:
        """Take part until the federation finishes or :meth:`stop` is called."""
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        try:
            self.setup.device = resolve_device(self.config.device)
        except ValueError as e:
            raise FedClientError(str(e)) from None
        self.connection.open()
        try:
            self.setup.load_data()
        except FedClientError:
            self.connection.close()
            raise
        self.sim.start()
        try:
            self.sim.wait_online(self.connection.sleep)
            self.log.debug("client.connecting", client_id=self.client_id, server=self.config.server)
            self.runner.join()
            self.runner.loop()
        except Stopped:
            self.log.info("client.stopped", client_id=self.client_id)
        except DeviceGone:
            self.connection.session = ""  # a vanished device says nothing: no leave
            self.summary.vanished = True
        finally:
            self.connection.leave(finished=self.summary.finished)
            self.connection.close()
        return self.summary

    def start(self) -> FedClient:
        """Run in a background thread; errors are re-raised by :meth:`join`."""

        def target() -> None:
            try:
                self.run()
            except BaseException as e:
                self._error = e
                self.log.error("client.failed", client_id=self.client_id, error=str(e))

        self._thread = threading.Thread(target=target, name=f"fedclient-{self.client_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the client to stop; cancels any call in flight and waits for the thread to end."""
        self._stop.set()
        self.connection.cancel_inflight()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> FedClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def join(self, timeout: float | None = None) -> ClientSummary:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._error is not None:
                raise self._error
        return self.summary

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


# Backoff, ClientSummary and the errors live in their parts; imported here as well (``fedclient.client.Backoff``).
__all__ = ["Backoff", "ClientSummary", "FedClient", "FedClientError", "FedClientRefused"]
