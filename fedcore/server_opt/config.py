"""The ``[server_optimizer]`` configuration section and the server-optimizer registry; torch-free.

A server optimizer turns the round's aggregate into the new global model: the pseudo-gradient
``Δ = aggregate − x`` (already a descent direction) goes through FedAvgM (Hsu et al. 2019) or one of the
adaptive optimizers of Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2 (FedAdagrad,
FedAdam, FedYogi) instead of being added as it is. :mod:`fedcore.server_opt.optimizers` holds the formulas.

This module holds what a configuration needs without torch: the registry :data:`SERVER_OPTIMIZERS` (kind "server
optimizer"), each optimizer's frozen options dataclass (its ``validate()`` raises
:class:`~fedcore.errors.ConfigError` naming the field: ``lr: must be a finite number > 0, got -1``), and
:class:`ServerOptimizerConfig` (``name = ""``: no optimizer stage, plain FedAvg, the model is the aggregate as
before). The optimizers are registered here by name with a factory that imports
:mod:`fedcore.server_opt.optimizers` (and so torch) when one is first made, so that validating a configuration
imports no torch and the registry is full whichever module is imported first.

Defaults. Flower's strategies (``flwr.server.strategy``: FedAdam, FedYogi, FedAdagrad, FedAvgM), which start m
and v at zero as here; Reddi et al. tune η and τ per task (their grids, App. D) and start v at τ² instead:

- fedadam: η = 0.1, β1 = 0.9, β2 = 0.99, τ = 1e-9 (Flower FedAdam).
- fedyogi: η = 0.01, β1 = 0.9, β2 = 0.99, τ = 1e-3 (Flower FedYogi's code; its docstring says η = 0.1,
  τ = 1e-9, the code has 1e-2 and 1e-3).
- fedadagrad: η = 0.1, τ = 1e-9 and β1 = 0 (Flower FedAdagrad passes β1 = 0: m = Δ, Adagrad without momentum);
  β1 is an option here, as in Algorithm 2.
- fedavgm: η = 1.0, momentum 0.9 (the issue's choice, the common momentum of Hsu et al.'s experiments; Flower's
  FedAvgM defaults to momentum 0, i.e. plain FedAvg).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcore.checks import is_finite_number
from fedcore.errors import require
from fedcore.options import decode_fields, join
from fedcore.registry import Registry

# A server optimizer's factory: its validated options dataclass -> the optimizer (a
# fedcore.server_opt.optimizers.ServerOptimizer, which make() checks; not named here, so that this torch-free module
# imports nothing of the implementation, not even for type checking).
ServerOptimizerFactory = Callable[[Any], Any]

# The server optimizers by name (``server_optimizer.name``); the built-in ones are registered at the end of this module.
SERVER_OPTIMIZERS: Registry[ServerOptimizerFactory] = Registry("server optimizer", ValueError)

# Where the optimizers live (imported on first use, with torch).
IMPLEMENTATION = "fedcore.server_opt.optimizers"


def _check_lr(lr: float) -> None:
    require(is_finite_number(lr) and lr > 0, "lr", f"must be a finite number > 0, got {lr!r}")


def _check_beta(name: str, beta: float) -> None:
    require(is_finite_number(beta) and 0.0 <= beta < 1.0, name, f"must be a number in [0, 1), got {beta!r}")


def _check_tau(tau: float) -> None:
    require(is_finite_number(tau) and tau > 0, "tau",
            f"must be a finite number > 0 (it keeps m / (sqrt(v) + tau) finite where v = 0), got {tau!r}")


def _check_bool(name: str, value: object) -> None:
    require(isinstance(value, bool), name, f"expected true or false, got {value!r}")


@dataclass(frozen=True)
class FedAvgMOptions:
    """fedavgm's options: v ← momentum·v + Δ; x ← x + lr·v (Hsu et al. 2019; torch.optim.SGD's momentum)."""

    # The server learning rate η (1 with momentum 0: plain FedAvg, x + Δ).
    lr: float = 1.0
    # The momentum factor, in [0, 1).
    momentum: float = 0.9

    def validate(self) -> None:
        _check_lr(self.lr)
        _check_beta("momentum", self.momentum)


@dataclass(frozen=True)
class FedAdagradOptions:
    """fedadagrad's options: m ← β1·m + (1−β1)·Δ; v ← v + Δ²; x ← x + lr·m/(√v + τ) (Reddi et al., Alg. 2)."""

    # The server learning rate η.
    lr: float = 0.1
    # The first-moment decay β1, in [0, 1); 0 (Flower's FedAdagrad): m = Δ.
    beta1: float = 0.0
    # The adaptivity τ > 0 added to √v.
    tau: float = 1e-9
    # Divide m by 1 − β1^t (t = the step, from 1) as Adam does; v has no β2 to correct. Off in the paper and Flower.
    bias_correction: bool = False

    def validate(self) -> None:
        _check_lr(self.lr)
        _check_beta("beta1", self.beta1)
        _check_tau(self.tau)
        _check_bool("bias_correction", self.bias_correction)


@dataclass(frozen=True)
class FedAdamOptions:
    """fedadam's options: m ← β1·m + (1−β1)·Δ; v ← β2·v + (1−β2)·Δ²; x ← x + lr·m/(√v + τ) (Reddi et al.)."""

    # The server learning rate η.
    lr: float = 0.1
    # The first-moment decay β1, in [0, 1).
    beta1: float = 0.9
    # The second-moment decay β2, in [0, 1).
    beta2: float = 0.99
    # The adaptivity τ > 0 added to √v.
    tau: float = 1e-9
    # Divide m by 1 − β1^t and v by 1 − β2^t (t = the step, from 1) as Adam does. Off in the paper and Flower.
    bias_correction: bool = False

    def validate(self) -> None:
        _check_lr(self.lr)
        _check_beta("beta1", self.beta1)
        _check_beta("beta2", self.beta2)
        _check_tau(self.tau)
        _check_bool("bias_correction", self.bias_correction)


@dataclass(frozen=True)
class FedYogiOptions(FedAdamOptions):
    """fedyogi's options: fedadam's fields and checks (β2 is the second-moment rate: v ← v − (1−β2)·Δ²·sign(v − Δ²);
    x ← x + lr·m/(√v + τ)), with Flower's FedYogi defaults lr = 0.01 and τ = 1e-3."""

    # The server learning rate η.
    lr: float = 0.01
    # The adaptivity τ > 0 added to √v.
    tau: float = 1e-3


@dataclass
class ServerOptimizerConfig:
    """The server optimizer applied to each round's aggregate (Reddi et al., "Adaptive Federated Optimization",
    ICLR 2021; FedAvgM: Hsu et al. 2019): the pseudo-gradient Δ = aggregate − global model goes through it instead
    of being added as it is. Its state (the step and the moments m, v) is saved with every snapshot."""

    # The server optimizer, by registered name: "fedavgm", "fedadagrad", "fedadam" or "fedyogi" (listed under
    # "Plugins" below). "" (the default): none, the new global model is the aggregate itself (plain FedAvg).
    name: str = ""
    # The optimizer's options (a table; e.g. {lr = 0.1, beta1 = 0.9, beta2 = 0.99, tau = 1e-9} for fedadam,
    # {lr = 1.0, momentum = 0.9} for fedavgm): the frozen options dataclass the optimizer registered, validated by
    # it. Empty: the optimizer's defaults. Must be empty when name is "".
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether a server optimizer stage runs (``name`` is not ``""``)."""
        return self.name != ""

    @classmethod
    def from_table(cls, data: Mapping[str, Any], path: str = "") -> ServerOptimizerConfig:
        """The section from a TOML table / dict; a registered optimizer's ``options`` are checked by it at once
        (:meth:`Registry.parse_options`: errors name ``<path>.options.<field>``). An unknown name is left to
        :meth:`validate`, which names it with the known ones."""
        config = decode_fields(cls, data, path)
        if isinstance(config.name, str) and config.name in SERVER_OPTIMIZERS:
            SERVER_OPTIMIZERS.parse_options(config.name, config.options, join(path, "options"))
        return config

    def validate(self, prefix: str = "server_optimizer") -> ServerOptimizerConfig:
        """Check both fields; :class:`ConfigError` naming ``<prefix>.name`` or ``<prefix>.options[.<field>]``.
        Returns ``self``."""
        name_path, options_path = join(prefix, "name"), join(prefix, "options")
        require(isinstance(self.name, str) and (self.name == "" or self.name in SERVER_OPTIMIZERS), name_path,
                f"unknown server optimizer {self.name!r}; known: {', '.join(SERVER_OPTIMIZERS.names())} "
                f"(or \"\" for none: plain FedAvg)")
        require(isinstance(self.options, Mapping), options_path, f"expected a table, got {self.options!r}")
        if not self.enabled:
            require(not self.options, options_path,
                    f"no server optimizer is named (name = \"\"), so no options apply; got {sorted(self.options)}")
            return self
        SERVER_OPTIMIZERS.parse_options(self.name, self.options, options_path)
        return self

    def parsed_options(self, prefix: str = "server_optimizer") -> Any:
        """The named optimizer's options dataclass (its defaults for an empty table), validated; None when no
        optimizer is named. :class:`ConfigError` as :meth:`validate`."""
        self.validate(prefix)
        if not self.enabled:
            return None
        return SERVER_OPTIMIZERS.parse_options(self.name, self.options, join(prefix, "options"))


def _deferred(attribute: str) -> ServerOptimizerFactory:
    """The optimizer class ``attribute`` of :data:`IMPLEMENTATION`, imported (with torch) on first use."""

    def factory(options: Any) -> Any:
        made: ServerOptimizerFactory = getattr(importlib.import_module(IMPLEMENTATION), attribute)
        return made(options)

    factory.__name__ = attribute
    return factory


SERVER_OPTIMIZERS.add("fedavgm", _deferred("FedAvgM"), options=FedAvgMOptions,
                      summary="FedAvgM (Hsu et al. 2019): server momentum, v ← μ·v + Δ, x ← x + η·v")
SERVER_OPTIMIZERS.add("fedadagrad", _deferred("FedAdagrad"), options=FedAdagradOptions,
                      summary="FedAdagrad (Reddi et al. 2021): x ← x + η·m/(√v + τ), v the running sum of Δ²")
SERVER_OPTIMIZERS.add("fedadam", _deferred("FedAdam"), options=FedAdamOptions,
                      summary="FedAdam (Reddi et al. 2021): Adam on the pseudo-gradient Δ, x ← x + η·m/(√v + τ)")
SERVER_OPTIMIZERS.add("fedyogi", _deferred("FedYogi"), options=FedYogiOptions,
                      summary="FedYogi (Reddi et al. 2021): Yogi's sign-controlled v, x ← x + η·m/(√v + τ)")
