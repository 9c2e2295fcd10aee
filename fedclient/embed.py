"""What an app embedding :class:`fedclient.FedClient` gets: the model to predict with, the client's NFL state,
per-round callbacks, and the state the client thread publishes for other threads (docs/embedding.md).

:class:`Published` is the one meeting point of the client thread (which writes) and the app's threads (which read):
everything in it is replaced under a lock, never modified in place -- the tensors it refers to are copies nobody
trains -- so a model built from it is consistent and safe to use while the client trains the next round.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from fedclient.local_round import InferenceView, LocalRound
from fedcore.client_state import ClientNflState, ClientRoundReport, next_nfl_state

ModelKind = Literal["global", "adapted"]
# Callbacks may return anything (it is ignored).
RoundEndCallback = Callable[[ClientRoundReport], object]
ModelCallback = Callable[[ModelKind, nn.Module], object]
StateChangeCallback = Callable[[ClientNflState, ClientNflState], object]


class ModelNotReady(RuntimeError):
    """The client has no model of the federation yet (it has not received its first task)."""


@dataclass(frozen=True)
class ServedModel:
    """The model an app predicts with, with what it is: ``kind`` "adapted" (the client's personal model vᵢ) or
    "global" (the federation's model as last received), of ``round`` (the round of the task that brought it)."""

    model: nn.Module
    kind: ModelKind
    round: int


class Callbacks:
    """The app's callbacks (any number of each). They run on the client's thread, in registration order; one that
    raises is logged (``callback.failed`` with the traceback) and the client carries on."""

    def __init__(self, log: Any, client_id: str) -> None:
        self._log, self._client_id = log, client_id
        self._lock = threading.Lock()
        self.round_end: list[RoundEndCallback] = []
        self.model: list[ModelCallback] = []
        self.state_change: list[StateChangeCallback] = []

    def add(self, kind: str, fn: Callable[..., object] | None) -> None:
        if fn is None:
            return
        if not callable(fn):
            raise TypeError(f"on_{kind}: expected a callable, got {type(fn).__name__}")
        with self._lock:
            getattr(self, kind).append(fn)

    def wants(self, kind: str) -> bool:
        return bool(getattr(self, kind))

    def fire(self, kind: str, *args: Any) -> None:
        with self._lock:
            fns = list(getattr(self, kind))
        for fn in fns:
            try:
                fn(*args)
            except Exception as e:  # an app's bug must not stop the federation client
                self._log.exception("callback.failed", client_id=self._client_id, callback=f"on_{kind}",
                                    error=f"{type(e).__name__}: {e}")


class Published:
    """The client thread's latest view for the app (thread-safe; see the module doc)."""

    def __init__(self, local: LocalRound, opt_out: bool) -> None:
        self._local = local
        self._lock = threading.Lock()
        self._template: nn.Module | None = None
        self._view: InferenceView | None = None
        self._nfl = ClientNflState(opt_out=opt_out)
        self._report: ClientRoundReport | None = None

    # ---- written by the client thread ----

    def set_template(self, model: nn.Module) -> None:
        """The client's model: :meth:`served` copies it for its architecture only (every weight and buffer is then
        replaced from the published tensors), so no copy is kept per client (a launcher runs 1,000 in a process)."""
        with self._lock:
            self._template = model

    def publish(self, view: InferenceView, nfl: ClientNflState) -> ClientNflState:
        """Publish ``view`` and ``nfl``; returns the previous NFL state."""
        with self._lock:
            old, self._view, self._nfl = self._nfl, view, nfl
        return old

    def report(self, report: ClientRoundReport) -> None:
        with self._lock:
            self._report = report

    # ---- read by any thread ----

    @property
    def nfl(self) -> ClientNflState:
        with self._lock:
            return self._nfl

    @property
    def latest_report(self) -> ClientRoundReport | None:
        with self._lock:
            return self._report

    def served(self, kind: ModelKind | None = None) -> ServedModel:
        """A fresh module (eval mode, CPU) of the model the client infers with (``kind`` None), or of ``kind``."""
        with self._lock:
            template, view = self._template, self._view
        if template is None or view is None:
            raise ModelNotReady("no model yet: the client has not received its first task from the federation "
                                "(wait for on_model, or for client.nfl_state.round > 0)")
        model = copy.deepcopy(template).to("cpu")  # the architecture; the client may be training the original
        model.zero_grad(set_to_none=True)
        model.load_state_dict(view.received)
        model.eval()
        want_adapted = view.serving_adapted if kind is None else kind == "adapted"
        if want_adapted and view.tstate is not None:
            personal = self._local.personal_module(view.tstate, model, view.received)
            if personal is not None:
                personal.eval()
                return ServedModel(personal.to("cpu"), "adapted", view.round)
        if kind == "adapted":
            raise ModelNotReady("no adapted model: this client has not run its recovery method yet")
        return ServedModel(model, "global", view.round)


class EmbeddingApi:
    """The embedding half of :class:`fedclient.FedClient` (it inherits this): models, state, callbacks, the
    eligibility check and ``run_async``. Methods marked thread-safe may be called from any thread at any time."""

    # Set by FedClient.__init__.
    client_id: str
    log: Any
    local: LocalRound
    published: Published
    callbacks: Callbacks
    can_train: Callable[[], bool] | None

    if TYPE_CHECKING:  # provided by FedClient (the lifecycle); declared here for run_async and the type checker

        def run(self) -> Any: ...

        def stop(self, timeout: float = 10.0) -> None: ...

    # ---- models and state (thread-safe) ----

    def inference_model(self) -> nn.Module:
        """A fresh module (CPU, eval mode) the app should predict with: the client's adapted/personal model vᵢ
        while it is recovering (and after its recovery stopped, unless ``infer_after_recovery = "global"``), the
        federation's model as last received otherwise; an opt-out holdout always gets the global model. It is the
        model the client's β̂ᵢ measures. Raises :class:`ModelNotReady` before the client's first task. Thread-safe;
        the module is the caller's (training never touches it)."""
        return self.published.served().model

    def served_model(self) -> ServedModel:
        """:meth:`inference_model` with what it is (``kind`` "adapted" or "global", and its round). Thread-safe."""
        return self.published.served()

    def global_model(self) -> nn.Module:
        """A fresh module of the federation's model (or this client's DistFL cluster model) as last received.
        Raises :class:`ModelNotReady` before the first task. Thread-safe."""
        return self.published.served("global").model

    @property
    def nfl_state(self) -> ClientNflState:
        """The client's NFL/recovery state (:class:`fedcore.client_state.ClientNflState`). Thread-safe."""
        return self.published.nfl

    @property
    def latest_report(self) -> ClientRoundReport | None:
        """The report of the last round the client trained (None before). Thread-safe."""
        return self.published.latest_report

    # ---- callbacks (registration is thread-safe; they run on the client's thread) ----

    def on_round_end(self, fn: RoundEndCallback) -> RoundEndCallback:
        """Call ``fn(report)`` after each round the client trained and sent (usable as a decorator)."""
        self.callbacks.add("round_end", fn)
        return fn

    def on_model(self, fn: ModelCallback) -> ModelCallback:
        """Call ``fn(kind, model)`` with a fresh module when a new global model arrives (``"global"``, at each task)
        and when the adapted model vᵢ was trained (``"adapted"``, after each round with recovery)."""
        self.callbacks.add("model", fn)
        return fn

    def on_state_change(self, fn: StateChangeCallback) -> StateChangeCallback:
        """Call ``fn(old, new)`` when the client's NFL state changes (recovering, serving vᵢ, the server's recovery
        flag, its own decision)."""
        self.callbacks.add("state_change", fn)
        return fn

    # ---- asyncio ----

    async def run_async(self) -> Any:
        """:meth:`run` for asyncio apps: the client runs in a worker thread; cancelling the awaiting task stops the
        client (the call in flight is cancelled, it leaves the federation) and waits for the thread to end."""
        import asyncio

        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self.run)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.stop(timeout=0.0)
            try:
                await fut
            except Exception as e:  # the client's own error after a cancel is logged, the cancel wins
                self.log.warning("client.stopped_with_error", client_id=self.client_id, error=str(e))
            raise

    # ---- the client thread's side ----

    def _eligible(self) -> bool:
        """The app's ``can_train()``; a predicate that raises counts as "no" (logged)."""
        if self.can_train is None:
            return True
        try:
            ok = bool(self.can_train())
        except Exception as e:
            self.log.exception("callback.failed", client_id=self.client_id, callback="can_train",
                               error=f"{type(e).__name__}: {e}", decision="declines work")
            ok = False
        return ok

    def _publish(self, view: InferenceView, beta_hat: float | None = None) -> None:
        old = self.published.nfl
        new = next_nfl_state(old, view.round, view.server_recovery, view.recovering, view.serving_adapted,
                             view.own_decision, beta_hat)
        self.published.publish(view, new)
        if not old.same_mode(new):
            self.log.info("client.nfl_state", client_id=self.client_id, round=view.round,
                          recovering=new.recovering, serving=("adapted" if new.serving_adapted else "global"),
                          server_recovery=new.server_recovery, own_decision=new.own_decision)
            self.callbacks.fire("state_change", old, new)

    def _task_received(self, round_: int, received: dict[str, Any], recovery_flag: bool, fed: Any,
                       model: nn.Module) -> None:
        """A task arrived (``model`` holds its weights): publish the new global model and the NFL state it implies
        (vᵢ kept in the state dir is served again from a restarted client's first task)."""
        self.local.ensure_trainer(fed)
        recovering, own = self.local.recovering(fed, recovery_flag)
        tstate = self.local.trainer_state(model)
        serving = self.local.serves_adapted(tstate.adapted is not None, recovering)
        self._publish(InferenceView(round_, received, tstate, recovery_flag, recovering, own, serving))
        if self.callbacks.wants("model"):
            self.callbacks.fire("model", "global", self.published.served("global").model)

    def _trained(self, beta_hat: float | None) -> None:
        """The round's training is done: publish vᵢ (the served model may switch here)."""
        view = self.local.view
        if view is None:
            return
        self._publish(view, beta_hat)
        if view.recovering and view.tstate is not None and view.tstate.adapted is not None \
                and self.callbacks.wants("model"):
            self.callbacks.fire("model", "adapted", self.published.served("adapted").model)

    def _reported(self, report: ClientRoundReport) -> None:
        self.published.report(report)
        self.callbacks.fire("round_end", report)
