"""Task dispatch: whether a client has work now, and which model it is handed.

Every client is handed the global model, or with DistFL its cluster's model (:meth:`TaskDispatcher.model_id_for`,
:mod:`fedserver.clusters`). Packed payloads are cached per (round, model id), so K pulls of the
same round serialize the model once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedcore import rounds as rm
from fedcore.config import TrainingConfig
from fedcore.serialization import TensorMeta, pack
from fedserver.global_models import GLOBAL, GlobalModels


@dataclass(frozen=True)
class Task:
    round: int
    deadline_s: float
    # A new list per pack of the model (once per round and model id, again after a restore): the servicer knows a
    # task header it serialized before by this list's identity (FederationServicer._task_header).
    manifest: list[TensorMeta]
    payload: bytearray
    learning_rate: float
    model_id: str = GLOBAL
    recovery: bool = False
    # The round's attempt (a restarted round is another attempt; secure aggregation binds its keys to it).
    attempt: int = 0


@dataclass(frozen=True)
class WaitInfo:
    retry_after_s: float
    finished: bool
    reason: str


class TaskDispatcher:
    def __init__(self, models: GlobalModels, training: TrainingConfig,
                 recovery: Callable[[], bool] = lambda: False,
                 model_id_for: Callable[[str], str] = lambda client_id: GLOBAL, timeout_s: float = 0.0) -> None:
        self.models = models
        self.training = training
        self._recovery = recovery  # the NFL monitor's flag: every task of the round carries it
        self._model_id_for = model_id_for  # DistFL's cluster membership (fedserver.clusters)
        self.timeout_s = timeout_s  # buffered rounds: a delivered task's deadline (rounds.round_timeout_s)
        self._cache: dict[str, tuple[int, list[TensorMeta], bytearray]] = {}
        # The current attempt's selected ids as a set (a list test would cost O(K) per pull: 30 µs at K = 1,000).
        self._selected: tuple[tuple[int, int, int], frozenset[str]] = ((0, 0, 0), frozenset())

    def model_id_for(self, client_id: str) -> str:
        """The model ``client_id`` trains and infers with: its DistFL cluster's, else the global model."""
        return self._model_id_for(client_id)

    def learning_rate(self, round_: int) -> float:
        return self.training.learning_rate * self.training.lr_decay ** (round_ - 1)

    def task_for(self, state: rm.RoundState, client_id: str, now: float) -> Task | None:
        """The task of ``client_id`` in the current round, or None when it has none (not selected, done)."""
        s = state
        if s.phase != rm.TRAINING:
            return None
        if s.buffered is not None:  # buffered rounds: a task granted and not fetched yet carries the current model
            b = s.buffered
            if b.flight.get(client_id) != s.round or client_id not in b.undelivered:
                return None
            return self._task(s, client_id, self.timeout_s)
        key = (s.round, s.attempt, id(s.selected))  # a new attempt assigns a new list
        if self._selected[0] != key:
            self._selected = (key, frozenset(s.selected))
        if client_id not in self._selected[1] or client_id in s.rejected or client_id in s.accepted:
            return None
        return self._task(s, client_id, max(0.0, s.deadline - now))

    def _task(self, s: rm.RoundState, client_id: str, deadline_s: float) -> Task:
        model_id = self.model_id_for(client_id)
        cached = self._cache.get(model_id)
        if cached is None or cached[0] != s.round:
            manifest, payload = pack(self.models.get(model_id))
            cached = (s.round, manifest, payload)
            self._cache[model_id] = cached
        _, manifest, payload = cached
        return Task(s.round, deadline_s, manifest, payload, self.learning_rate(s.round), model_id,
                    self._recovery(), s.attempt)

    def invalidate(self) -> None:
        """Forget cached payloads (the models changed outside a round, e.g. a restore)."""
        self._cache.clear()
