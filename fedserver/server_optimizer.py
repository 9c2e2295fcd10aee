"""The server-optimizer stage: the imperative shell around :mod:`fedcore.server_opt` (``[server_optimizer]``).

A model stage (:mod:`fedserver.pipeline`): each round the aggregate (DP noise included) becomes the pseudo-gradient
Δ = aggregate − w^{r-1}, and the optimizer's pure ``step(state, params, Δ)`` gives the model the round applies
(FedAvgM, FedAdagrad, FedAdam, FedYogi; Reddi et al., ICLR 2021, Algorithm 2). Its state -- the step count and the
moments m, v -- is saved with every snapshot (the step as JSON, the moments as one verified tensor file), so a
resumed server carries on bit for bit. Without ``[server_optimizer] name`` the stage is not in the pipeline at
all and the global model is the aggregate itself, as before the stage existed.
"""

from __future__ import annotations

from typing import Any

import torch

from fedcore.server_opt import ServerOptimizer, ServerOptState, make
from fedserver.global_models import GlobalModels
from fedserver.stage import JsonState, ModelStep, ServerParts, Stage, TensorState
from fedserver.store import StoreError

NAME = "server_optimizer"


class ServerOptimizerShell:
    """Holds the optimizer and its state between rounds; :meth:`__call__` is the model hook."""

    def __init__(self, optimizer: ServerOptimizer, models: GlobalModels) -> None:
        self.optimizer = optimizer
        self.models = models
        self.state: ServerOptState | None = None  # made at the first round (or loaded from a snapshot)
        self._saved_step = 0  # the step the snapshot's JSON part named, for its tensors

    def __call__(self, step: ModelStep) -> ModelStep:
        params = dict(step.previous)
        delta = {name: step.proposed[name] - x for name, x in params.items()}
        state = self.state if self.state is not None else self.optimizer.init(params)
        new_params, self.state = self.optimizer.step(state, params, delta)
        return ModelStep(step.round, step.previous, new_params, {"server_opt_step": float(self.state.step)})

    # ---- the snapshot ----

    def save(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.name, "step": 0 if self.state is None else self.state.step}

    def load(self, d: dict[str, Any]) -> None:
        if d.get("optimizer") != self.optimizer.name:
            raise ValueError(f"server_optimizer: the snapshot's state is for {d.get('optimizer')!r}, the "
                             f"configuration names {self.optimizer.name!r}")
        self._saved_step = int(d.get("step", 0))
        if self._saved_step == 0:
            self.state = None

    def save_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.state is None else self.state.to_tensors()

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            if self._saved_step > 0:  # a snapshot named a step but held no moments: never restart them silently
                raise StoreError(f"server_optimizer: the snapshot resumed from is at step {self._saved_step} but "
                                 "holds no optimizer tensors; nothing was changed. Ways on: restore the run "
                                 "directory's state/ from a copy, or start over with --fresh (the old state is moved "
                                 "aside)")
            return
        params = self.models.unflatten(self.models.flat())
        self.state = self.optimizer.load(self._saved_step, tensors, params)


def server_optimizer_stage(parts: ServerParts) -> Stage | None:
    """The stage when ``[server_optimizer] name`` is set; None otherwise (plain FedAvg: no model stage)."""
    cfg = parts.config.server_optimizer
    if not cfg.enabled:
        return None
    shell = ServerOptimizerShell(make(cfg.name, cfg.parsed_options()), parts.models)
    return Stage(NAME, model=shell, state=JsonState(shell.save, shell.load),
                 tensors=TensorState(shell.save_tensors, shell.load_tensors))
