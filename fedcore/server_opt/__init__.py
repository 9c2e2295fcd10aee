"""Server optimizers (FedAvgM; FedAdagrad, FedAdam, FedYogi of Reddi et al., ICLR 2021) as a pure functional core.

``opt = make("fedadam", {"lr": 0.1})``; ``state = opt.init(params)``; ``params, state = opt.step(state, params,
delta)`` with ``delta`` the aggregate minus ``params``. The formulas: :mod:`fedcore.server_opt.optimizers`; the
``[server_optimizer]`` section, the registry and the options with their defaults: :mod:`fedcore.server_opt.config`.

The configuration names are imported at once and import no torch; the optimizers (:func:`make`,
:class:`ServerOptState`, :class:`ServerOptimizer` and the optimizer classes) are imported on first use (PEP 562),
so that validating a configuration imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedcore.server_opt.config import (
    SERVER_OPTIMIZERS,
    FedAdagradOptions,
    FedAdamOptions,
    FedAvgMOptions,
    FedYogiOptions,
    ServerOptimizerConfig,
    ServerOptimizerFactory,
)

if TYPE_CHECKING:
    from fedcore.server_opt.optimizers import (
        FedAdagrad,
        FedAdam,
        FedAvgM,
        FedYogi,
        ServerOptimizer,
        ServerOptState,
        make,
    )

_LAZY = ("FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptState", "ServerOptimizer", "make")

__all__ = [
    "SERVER_OPTIMIZERS",
    "FedAdagrad",
    "FedAdagradOptions",
    "FedAdam",
    "FedAdamOptions",
    "FedAvgM",
    "FedAvgMOptions",
    "FedYogi",
    "FedYogiOptions",
    "ServerOptState",
    "ServerOptimizer",
    "ServerOptimizerConfig",
    "ServerOptimizerFactory",
    "make",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fedcore.server_opt' has no attribute {name!r}")
    return getattr(importlib.import_module("fedcore.server_opt.optimizers"), name)
