"""FedClient: joins a federation, long-polls for tasks, trains locally and pushes updates.

Embeddable: ``FedClient(...).run()`` blocks until the federation finishes; ``start()`` runs it in a
background thread and ``stop()`` ends it cleanly (the in-flight call is cancelled, the client leaves);
``await client.run_async()`` is the asyncio form. The app-facing API (the model to predict with, the NFL state,
callbacks, the ``can_train`` eligibility check) is :class:`fedclient.embed.EmbeddingApi` (docs/embedding.md).
It reconnects with exponential backoff and full jitter, and re-joins when the server forgot its session
(for example after a restart).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from fedclient.embed import (
    Callbacks,
    EmbeddingApi,
    ModelCallback,
    Published,
    RoundEndCallback,
    StateChangeCallback,
)
from fedclient.local_round import LocalRound, LocalRoundError
from fedclient.simulation import DeviceGone, DeviceSimulation
from fedclient.transport import Refused, Transport, classify_unauthenticated, classify_unavailable
from fedcore.attacks import AttackError, backdoor_batches, poison_client_data
from fedcore.client_state import ClientRoundReport
from fedcore.config import ClientConfig, ConfigError, FederationInfo, secret_token
from fedcore.data import ClientData, DataError, load_client_data
from fedcore.data.source import DataSource
from fedcore.identity import shorten
from fedcore.log import get_logger
from fedcore.metrics import load_private_model, save_private_model, train_private_model
from fedcore.models import build_model, model_fingerprint, model_manifest
from fedcore.seeds import GLOBAL_RNG_LOCK, private_seed
from fedcore.serialization import (
    DEFAULT_CHUNK_BYTES,
    Reassembler,
    SerializationError,
    fingerprint,
    manifest_of,
    pack,
)
from fedcore.simulation import CRASH, DROP
from fedcore.train import resolve_device
from fedcore.trust import (
    TrustError,
    announced_data,
    announced_model,
    announced_trainer,
    build_announced_model,
    check_announcement,
    check_json,
)
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb

VERSION = "0.1.0"
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


# The longest a server's "come back later" makes the client wait (a server cannot park a client forever).
MAX_RETRY_AFTER_S = 60.0


class FedClientError(RuntimeError):
    """The client cannot take part (model mismatch, refused join, server unreachable for too long)."""


class FedClientRefused(FedClientError):
    """The server refuses this client for good (a TLS handshake or authentication check failed): retrying cannot
    help. ``check`` names the check; ``fedclient`` exits with status 4 and this one line."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(f"refused: {refused}")
        self.check = refused.check


# A handshake the server closes without naming the check ("Socket closed") counts as a refusal when it happens
# this many times in a row (a server shutting down closes sockets too).
HANDSHAKE_CLOSED_REPEATS = 3


class _Stopped(Exception):
    pass


class _SessionLost(Exception):
    pass


@dataclass
class ClientSummary:
    client_id: str
    rounds_trained: int = 0
    updates_accepted: int = 0
    updates_rejected: int = 0
    reconnects: int = 0
    # Joins after the first one (the server had forgotten the session, e.g. it restarted).
    rejoins: int = 0
    last_round: int = 0
    finished: bool = False
    # The simulated device left for good (a dropout that never returns, or its last availability window ended).
    vanished: bool = False
    history: list[dict[str, float]] = field(default_factory=list)


class Backoff:
    """Exponential backoff with full jitter: sleep U(0, min(max, initial·2^attempt))."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial, self.maximum = initial, maximum
        self.attempt = 0
        self.rng = rng or random.Random()

    def next_delay(self) -> float:
        cap = min(self.maximum, self.initial * (2 ** self.attempt))
        self.attempt += 1
        return self.rng.uniform(0, cap)

    def reset(self) -> None:
        self.attempt = 0


ModelSpec = str | Callable[[], nn.Module] | nn.Module | None


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
        self._model_spec = model
        self._data_source = data if isinstance(data, DataSource) else None
        self.data = data if isinstance(data, ClientData) else None
        if data is not None and self.data is None and self._data_source is None:
            raise FedClientError(f"data: expected ClientData, a DataSource or None, got {type(data).__name__}")
        if can_train is not None and not callable(can_train):
            raise FedClientError(f"can_train: expected a callable returning bool, got {type(can_train).__name__}")
        self.can_train = can_train
        self._ineligible_since = None
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")  # resolved from config.device when the client runs
        self.client_id = self._resolve_client_id()
        self.summary = ClientSummary(self.client_id)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call_lock = threading.Lock()
        self._inflight: Any = None
        self._transport: Transport | None = None
        self._session = ""
        self._fed: FederationInfo | None = None
        self._heartbeat_s = 5.0
        self._rng = random.Random(self.client_id)
        # The join secret: config.token, else token_file's first line (read once; never logged).
        try:
            self._token = secret_token(self.config.token, self.config.token_file)
        except ConfigError as e:
            raise FedClientError(str(e)) from None
        self._train_data: ClientData | None = None
        # P_i, the accuracy of this client's stand-alone model (None until trained or loaded).
        self.private_accuracy: float | None = None
        self._error: BaseException | None = None
        # One round on the device: beta_hat_i, individual NFL measures, the trainer seam (no gRPC).
        self.local = LocalRound(self.config, self.client_id, self.log)
        # Simulated device behaviour (stragglers, dropouts, crashes, availability); inert by default.
        self.sim = DeviceSimulation(self.config.simulation, self.client_id, self.log)
        # What the app sees (thread-safe) and its callbacks (fedclient.embed).
        self.published = Published(self.local, self.config.opt_out)
        self.callbacks = Callbacks(self.log, self.client_id)
        self.callbacks.add("round_end", on_round_end)
        self.callbacks.add("model", on_model)
        self.callbacks.add("state_change", on_state_change)

    # ---- identity ----

    def _resolve_client_id(self) -> str:
        if self.config.client_id:
            return self.config.client_id
        if self.config.state_dir:
            path = Path(self.config.state_dir) / "client.json"
            if path.exists():
                return str(json.loads(path.read_text())["client_id"])
            cid = f"client-{uuid.uuid4().hex[:12]}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"client_id": cid}))
            return cid
        return f"client-{uuid.uuid4().hex[:12]}"

    # ---- lifecycle ----

    def run(self) -> ClientSummary:
        """Take part until the federation finishes or :meth:`stop` is called."""
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        try:
            self.device = resolve_device(self.config.device)
        except ValueError as e:
            raise FedClientError(str(e)) from None
        try:
            self._transport = Transport(self.config, self.client_id, self.log)
        except ConfigError as e:
            raise FedClientError(str(e)) from None
        except Refused as e:  # checked locally before connecting (this client's own certificate)
            raise FedClientRefused(e) from None
        if self.data is None and self._data_source is not None:
            try:
                self.data = self._data_source.load()
            except DataError as e:
                self._transport.close()
                raise FedClientError(str(e)) from None
        self.sim.start()
        try:
            self.sim.wait_online(self._sleep)
            self.log.debug("client.connecting", client_id=self.client_id, server=self.config.server)
            self._join_with_retry()
            self._loop()
        except _Stopped:
            self.log.info("client.stopped", client_id=self.client_id)
        except DeviceGone:
            self._session = ""  # a vanished device says nothing: no leave
            self.summary.vanished = True
        finally:
            self._leave()
            if self._transport is not None:
                self._transport.close()
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
        with self._call_lock:
            if self._inflight is not None:
                self._inflight.cancel()
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

    # ---- transport ----

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stopped

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise _Stopped

    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` until it succeeds, backing off on transient errors; raises after give_up_after_s."""
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
        first_failure: float | None = None
        closed_handshakes = 0
        while True:
            self._check_stop()
            try:
                return fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if self._stop.is_set():
                    raise _Stopped from None
                details = str(e.details() if hasattr(e, "details") else "") or ""
                if code == grpc.StatusCode.UNAUTHENTICATED and what != "join":
                    raise _SessionLost from None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise FedClientRefused(classify_unauthenticated(shorten(details, 300))) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    refused, certain = classify_unavailable(details, not self.config.insecure,
                                                            bool(self.config.cert))
                    closed_handshakes = closed_handshakes + 1 if refused is not None else 0
                    if refused is not None and (certain or closed_handshakes >= HANDSHAKE_CLOSED_REPEATS):
                        raise FedClientRefused(refused) from None
                if code not in _RETRYABLE:
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                if self.config.give_up_after_s and now - first_failure > self.config.give_up_after_s:
                    # The last error's details say why.
                    raise FedClientError(f"server {self.config.server} unreachable for "
                                         f"{self.config.give_up_after_s:.0f} s ({what}: {code}: "
                                         f"{shorten(details, 300)})") from None
                delay = backoff.next_delay()
                self.summary.reconnects += 1
                self.log.info("client.retrying", client_id=self.client_id, call=what, code=str(code),
                              delay_s=round(delay, 3))
                self._sleep(delay)

    def _tracked(self, fut: Any) -> Any:
        """Wait for a call that :meth:`stop` can cancel."""
        with self._call_lock:
            self._inflight = fut
        try:
            return fut.result()
        finally:
            with self._call_lock:
                self._inflight = None

    # ---- protocol steps ----

    def _join_with_retry(self) -> None:
        def do_join() -> pb.JoinReply:
            assert self._transport is not None
            fp = model_fingerprint(self.model) if self.model is not None else ""
            req = pb.JoinRequest(client_id=self.client_id, token=self._token, model_fingerprint=fp,
                                 capabilities=pb.Capabilities(
                                     num_train_samples=self.data.num_train if self.data else 0,
                                     attacker=self.config.attack.active, opt_out=self.config.opt_out,
                                     version=VERSION))
            reply: pb.JoinReply = self._tracked(self._transport.future("Join", req, timeout=30.0))
            return reply

        try:
            reply: pb.JoinReply = self._retrying("join", do_join)
        except grpc.RpcError as e:
            raise FedClientError(f"join refused: {e.code()}: {e.details()}") from None
        try:
            fed = wire.federation_from_pb(reply.config)
        except SerializationError as e:
            raise FedClientError(f"the server announced a malformed federation: {e}") from None
        if self._session or self._fed is not None:
            self.summary.rejoins += 1
        self._session = reply.session_id
        self._fed = fed
        hb = reply.heartbeat_interval_s
        self._heartbeat_s = min(max(hb, 0.1), 600.0) if math.isfinite(hb) and hb > 0 else 5.0
        self._prepare(fed, int(reply.client_index))
        self.log.info("client.joined", client_id=self.client_id, federation=reply.config.federation_id,
                      index=reply.client_index, num_train=self.data.num_train if self.data else 0)

    def _prepare(self, fed: FederationInfo, client_index: int) -> None:
        """Build model and data on first join and check the model against the server's spec."""
        try:
            check_announcement(fed)
            if self.model is None:
                spec = self._model_spec
                if isinstance(spec, nn.Module):
                    self.model = spec
                elif spec is None:
                    # The announcement names a built-in model only; checked on the meta device first.
                    self.model = build_announced_model(fed, self.config.max_model_bytes)
                else:
                    # A user factory may draw from torch's global RNG: never while another thread's seeded
                    # section (a concurrent virtual client's private model) holds it.
                    with GLOBAL_RNG_LOCK:
                        self.model = self._model_factory(fed)()
                self.model.to(self.device)
                self.published.set_template(self.model)
            dataset, data_options = announced_data(fed, self.config.dataset, self.config.data_options)
            if not self.config.trainer:
                self.local.use_method(*announced_trainer(fed))
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
        attack = self.config.attack
        try:
            if attack.flips_labels and self._train_data is None:
                self._train_data = poison_client_data(self.data, attack)
            elif attack.kind == "backdoor":
                backdoor_batches(self.data, attack, 0)  # fails early if the data cannot carry the backdoor
        except AttackError as e:
            raise FedClientError(f"cannot run the {attack.kind} attack on this client's data: {e}") from None
        if self.config.private_epochs and self.private_accuracy is None:
            with self._heartbeating():  # heartbeats keep the session alive while the private model trains
                self.private_accuracy = self._private_model(fed)

    def _model_factory(self, fed: FederationInfo) -> Callable[[], nn.Module]:
        """Fresh copies of this client's model (the private model is one): the client's own ``model``, or the
        announced built-in model (:func:`fedcore.trust.announced_model` refuses anything else)."""
        spec = self._model_spec
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
        """P_i: accuracy of a stand-alone model trained on the clean local data (cached in the state dir)."""
        assert self.model is not None and self.data is not None
        fp = model_fingerprint(self.model)
        if self.config.state_dir:
            cached = load_private_model(self.config.state_dir)
            if cached is not None and fingerprint(manifest_of(cached[0])) == fp:
                self.log.info("private_model.loaded", client_id=self.client_id, accuracy=round(cached[1], 4))
                return cached[1]
        # One implementation of "the private model's training": train_private_model drops prox_mu and decay.
        tc = dataclasses.replace(fed.training, local_epochs=1, lr_decay=1.0)
        started = time.monotonic()
        state, acc = train_private_model(self._model_factory(fed), self.data, tc, self.config.private_epochs,
                                         seed=private_seed(fed.seed, self.client_id), device=self.device)
        if self.config.state_dir:
            save_private_model(self.config.state_dir, state, acc, {"epochs": self.config.private_epochs})
        self.log.info("private_model.trained", client_id=self.client_id, accuracy=round(acc, 4),
                      epochs=self.config.private_epochs, seconds=round(time.monotonic() - started, 2))
        return acc

    def _leave(self) -> None:
        if not self._session or self._transport is None:
            return
        with contextlib.suppress(grpc.RpcError):
            self._transport.call("Leave", pb.LeaveRequest(session_id=self._session, reason="done"), timeout=2.0)
        self._session = ""

    def _loop(self) -> None:
        while True:
            self._check_stop()
            self.sim.wait_online(self._sleep)
            try:
                if not self._eligible_now():
                    if self._decline():
                        return
                    continue
                task = self._retrying("pull", self._pull)
                if not isinstance(task, pb.Wait) and not self._eligible_now():
                    # The device stopped being eligible while the task was on its way: not trained.
                    if self._decline(int(task[0].round)):
                        return
                    continue
            except _SessionLost:
                self.log.info("client.rejoining", client_id=self.client_id, reason="session unknown to server")
                self._join_with_retry()
                continue
            if isinstance(task, pb.Wait):
                if task.finished:
                    self.summary.finished = True
                    self.log.info("client.finished", client_id=self.client_id, reason=task.reason,
                                  rounds_trained=self.summary.rounds_trained)
                    return
                if task.retry_after_s > 0:  # NaN is not > 0; the server's hint is capped
                    self._sleep(min(task.retry_after_s, MAX_RETRY_AFTER_S))
                continue
            header, state = task
            try:
                self._work(header, state)
            except _SessionLost:
                self._join_with_retry()

    def _eligible_now(self) -> bool:
        ok = self._eligible()
        if ok and self._ineligible_since is not None:
            self.log.info("client.eligible", client_id=self.client_id,
                          after_s=round(time.monotonic() - self._ineligible_since, 1))
            self._ineligible_since = None
        elif not ok and self._ineligible_since is None:
            self.log.info("client.ineligible", client_id=self.client_id, reason="can_train() said no: declining work")
            self._ineligible_since = time.monotonic()
        return ok

    def _decline(self, round_: int = 0) -> bool:
        """Tell the server the device declines work now (``PullTaskRequest.declined``; ``round_``: the task it got
        and does not train), then wait a heartbeat interval before asking ``can_train()`` again. True when the
        federation has finished."""

        def do_decline() -> pb.TaskMessage:
            assert self._transport is not None
            call = self._transport.pull(pb.PullTaskRequest(session_id=self._session, max_wait_s=0.0, declined=True),
                                        timeout=30.0)
            with self._call_lock:
                self._inflight = call
            try:
                first: pb.TaskMessage = next(iter(call))
                call.cancel()  # a server that predates ``declined`` may stream a task: not wanted
                return first
            finally:
                with self._call_lock:
                    self._inflight = None

        if round_:
            self.log.info("task.declined", client_id=self.client_id, round=round_)
        first = self._retrying("decline", do_decline)
        if first.WhichOneof("kind") == "wait" and first.wait.finished:
            self.summary.finished = True
            self.log.info("client.finished", client_id=self.client_id, reason=first.wait.reason,
                          rounds_trained=self.summary.rounds_trained)
            return True
        hint = first.wait.retry_after_s if first.WhichOneof("kind") == "wait" else 0.0
        self._sleep(min(hint, self._heartbeat_s) if hint > 0 else self._heartbeat_s)
        return False

    def _pull(self) -> pb.Wait | tuple[pb.TaskHeader, dict[str, torch.Tensor]]:
        assert self._transport is not None
        req = pb.PullTaskRequest(session_id=self._session, max_wait_s=self.config.long_poll_s)
        call = self._transport.pull(req, timeout=self.config.long_poll_s + 30.0)
        with self._call_lock:
            self._inflight = call
        try:
            it: Iterator[pb.TaskMessage] = iter(call)
            first = next(it)
            if first.WhichOneof("kind") == "wait":
                return first.wait
            header = first.header
            manifest = wire.metas_from_pb(header.tensors)
            assert self.model is not None
            if manifest != model_manifest(self.model):
                raise SerializationError("the task's tensors are not this client's model")
            asm = Reassembler(manifest, int(header.total_bytes))
            for msg in it:
                asm.feed(int(msg.chunk.offset), msg.chunk.data)
            return header, asm.finish()
        except SerializationError as e:
            raise FedClientError(f"server sent a malformed model: {e}") from None
        finally:
            with self._call_lock:
                self._inflight = None

    def _work(self, header: pb.TaskHeader, state: dict[str, torch.Tensor]) -> None:
        assert self.model is not None and self.data is not None and self._fed is not None
        round_ = int(header.round)
        fate = self.sim.fate(round_)
        if fate.outcome == DROP:
            self._drop_out(round_)
            return
        self.model.load_state_dict(state)
        started = time.monotonic()
        with self._heartbeating():
            try:
                self._task_received(round_, state, bool(header.recovery), self._fed, self.model)
                out = self.local.run(self.model, self.data, self._train_data or self.data, self._fed, round_,
                                     bool(header.recovery), header.learning_rate or None, self.private_accuracy)
            except LocalRoundError as e:
                raise FedClientError(str(e)) from None
            self._trained(out.metrics.get("beta_hat_measured"))
            if fate.delay_s and fate.outcome != CRASH:
                self._sleep(fate.delay_s)
        if fate.outcome == CRASH:
            self._crash(round_)
            return
        if not self.sim.online():
            self.log.info("simulation.window_closed", client_id=self.client_id, round=round_,
                          reason="the online window ended before the update was sent: never sent")
            return
        metrics = {**out.metrics, "train_seconds": time.monotonic() - started}
        self.summary.rounds_trained += 1
        self.summary.last_round = round_
        self.summary.history.append({"round": float(round_), **metrics, "train_loss": out.train_loss})
        accepted = self._push(round_, out.train_loss, out.beta_hat, metrics)
        self._reported(ClientRoundReport.of(round_, self.data.num_train, out.train_loss, out.beta_hat, metrics,
                                            accepted))

    def _drop_out(self, round_: int) -> None:
        """Simulated dropout: keep the task, never answer, stay silent, then come back (or vanish)."""
        back = self.config.simulation.dropout_return_s
        self.log.info("simulation.dropout", client_id=self.client_id, round=round_,
                      back_in_s=back if back >= 0 else None)
        if back < 0:
            raise DeviceGone
        self._sleep(back)

    def _crash(self, round_: int) -> None:
        """Simulated crash after training: the update and the session are lost; re-join after a pause, as a
        restarted process would (the state dir is kept)."""
        rejoin = self.config.simulation.crash_rejoin_s
        self.log.info("simulation.crash", client_id=self.client_id, round=round_, rejoin_in_s=rejoin)
        self._session = ""
        self._sleep(rejoin)
        self._join_with_retry()

    @contextlib.contextmanager
    def _heartbeating(self) -> Iterator[None]:
        """While the block runs (training, the private model), tell the server every heartbeat interval that the
        client is alive. Nothing runs outside it: an idle client's liveness is the long-poll it holds (the server
        counts a parked poll as contact), so no thread wakes while the client waits for work."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self._heartbeat_s) and not self._stop.is_set():
                if self._session and self._transport is not None:
                    with contextlib.suppress(grpc.RpcError):
                        self._transport.call("Heartbeat", pb.HeartbeatRequest(session_id=self._session),
                                             timeout=5.0)

        thread = threading.Thread(target=beat, name=f"heartbeat-{self.client_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()

    def _push(self, round_: int, train_loss: float, beta_hat: float | None, metrics: dict[str, float]) -> bool:
        assert self.model is not None and self._transport is not None and self.data is not None
        manifest, payload = pack(self.model.state_dict())
        chunk_bytes = (self._fed.chunk_bytes if self._fed is not None else 0) or DEFAULT_CHUNK_BYTES

        def do_push() -> pb.PushReply:
            assert self._transport is not None and self.data is not None
            header = pb.UpdateHeader(
                session_id=self._session, round=round_, num_samples=self.data.num_train, beta_hat=beta_hat,
                train_loss=train_loss, metrics=metrics, kind=pb.WEIGHTS, tensors=wire.metas_to_pb(manifest),
                total_bytes=len(payload))
            reply: pb.PushReply = self._tracked(self._transport.push(header, payload, chunk_bytes, timeout=120.0))
            return reply

        try:
            self._retrying("push", do_push)
            self.summary.updates_accepted += 1
            self.log.info("update.sent", client_id=self.client_id, round=round_, train_loss=round(train_loss, 5),
                          test_accuracy=round(metrics.get("test_accuracy", math.nan), 4),
                          beta_hat=None if beta_hat is None else round(beta_hat, 4),
                          adapting=bool(metrics.get("adapting", 0.0)))
            return True
        except grpc.RpcError as e:
            self.summary.updates_rejected += 1
            self.log.warning("update.refused", client_id=self.client_id, round=round_, code=str(e.code()),
                             reason=e.details())
            return False


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            return f"first difference: {a.name} {a.dtype}{list(a.shape)} vs {b.name} {b.dtype}{list(b.shape)}"
    return f"{len(mine)} tensors here vs {len(theirs)} in the federation"


__all__ = ["Backoff", "ClientSummary", "FedClient", "FedClientError", "FedClientRefused"]
