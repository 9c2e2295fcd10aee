"""Server optimizers as pure functions: ``state = opt.init(params)``, ``params, state = opt.step(state, params, Δ)``.

``params`` and ``delta`` map parameter names to tensors; ``delta`` is the round's pseudo-gradient Δ = aggregate −
params, already a descent direction (the new model is params + something·Δ). Nothing is modified in place, not the
params, not Δ, not the state: :meth:`ServerOptimizer.step` returns new tensors and a new
:class:`ServerOptState`. There is no randomness and no clock, so the same inputs give the same bits.

The formulas, with t the step (1 on the first call), m and v starting at zero (as Flower does; Reddi et al. start
v at τ²), all arithmetic in the params' dtype:

- fedavgm (Hsu et al., "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
  Classification", 2019; the momentum of ``torch.optim.SGD``): v ← μ·v + Δ; x ← x + η·v. With μ = 0 and η = 1 it is
  plain FedAvg, x + Δ, bit for bit.
- fedadagrad, fedadam, fedyogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2):
  m ← β1·m + (1 − β1)·Δ, then
  fedadagrad: v ← v + Δ²;
  fedadam:    v ← β2·v + (1 − β2)·Δ²;
  fedyogi:    v ← v − (1 − β2)·Δ²·sign(v − Δ²);
  and x ← x + η·m/(√v + τ).
  With ``bias_correction`` (not in the paper; Adam's, Kingma & Ba 2015) m̂ = m/(1 − β1^t) and v̂ = v/(1 − β2^t)
  replace m and v in the update (fedadagrad's v has no β2: only m is corrected); the state keeps m and v.

The options and their defaults (and where those come from) are in :mod:`fedcore.server_opt.config`.

Saving: :meth:`ServerOptState.to_tensors` (flat names ``"<slot>/<param name>"``) with ``state.step`` kept beside
them; :meth:`ServerOptState.from_tensors` (or :meth:`ServerOptimizer.load`) checks every name, shape and dtype
against the model's params, so a resumed server never loads another model's state silently, and step → save →
load → step gives the same bits as two steps.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedcore.errors import ConfigError
from fedcore.server_opt.config import (
    SERVER_OPTIMIZERS,
    FedAdagradOptions,
    FedAdamOptions,
    FedAvgMOptions,
    FedYogiOptions,
)

Params = Mapping[str, torch.Tensor]
Slots = Mapping[str, Mapping[str, torch.Tensor]]

# The separator of a slot name and a parameter name in :meth:`ServerOptState.to_tensors` ("m/fc.weight").
SEPARATOR = "/"


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}"


def _check_params(params: Params, what: str = "params") -> None:
    """``params`` maps names to floating-point tensors."""
    if not isinstance(params, Mapping):
        raise ValueError(f"{what}: expected a mapping of names to tensors, got {type(params).__name__}")
    for name, p in params.items():
        if not isinstance(name, str):
            raise ValueError(f"{what}: parameter names must be strings, got {name!r}")
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{what}[{name!r}]: expected a tensor, got {type(p).__name__}")
        if not p.is_floating_point():
            raise ValueError(f"{what}[{name!r}]: a server optimizer needs floating-point tensors, got {p.dtype} "
                             f"(leave integer buffers out and take them from the aggregate)")


def _check_like(tensors: Params, params: Params, what: str) -> None:
    """``tensors`` has exactly ``params``' names, each with the same shape and dtype; ValueError naming the first
    difference (``what`` names the tensors, ``what`` + "/" + name each one)."""
    missing = [name for name in params if name not in tensors]
    if missing:
        raise ValueError(f"{what}: no tensor for the model's {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    extra = [name for name in tensors if name not in params]
    if extra:
        raise ValueError(f"{what}: {extra[0]!r} is not a parameter of the model"
                         f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
    for name, p in params.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}{SEPARATOR}{name}: expected a tensor, got {type(t).__name__}")
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(f"{what}{SEPARATOR}{name}: {_describe(t)}, but the model's {name!r} is {_describe(p)}")


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step: must be an integer >= 0, got {step!r}")
    return step


@dataclass(frozen=True, eq=False)
class ServerOptState:
    """A server optimizer's state: the steps taken (``step``; the next is ``step + 1``) and its slots, each a
    tensor per parameter (``{"m": {...}, "v": {...}}``; fedavgm has only "v"). Never modified in place.

    To save it: :meth:`to_tensors` and ``step`` (or :meth:`to_dict` for the scalar part); to load it:
    :meth:`from_tensors` / :meth:`from_dict`, which check it against the model's params."""

    step: int
    slots: Slots = field(default_factory=dict)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Every slot tensor by flat name ``"<slot>/<param name>"`` (the tensors themselves, not copies: do not
        modify them)."""
        return {f"{slot}{SEPARATOR}{name}": t for slot, tensors in self.slots.items() for name, t in tensors.items()}

    def to_dict(self) -> dict[str, Any]:
        """The scalar part (JSON): the step and the slot names; the tensors are :meth:`to_tensors`."""
        return {"step": self.step, "slots": list(self.slots)}

    @classmethod
    def from_tensors(cls, step: int, tensors: Mapping[str, torch.Tensor], params: Params,
                     slots: Iterable[str] | None = None) -> ServerOptState:
        """The state saved as :meth:`to_tensors` and ``step``, checked against the model's ``params``: every slot
        must hold exactly one tensor per parameter, of its shape and dtype (moved to its device); ``slots``, when
        given, are the slot names the optimizer keeps (:attr:`ServerOptimizer.slots`), none missing, none extra.
        :class:`ValueError` naming what is wrong."""
        step = _check_step(step)
        _check_params(params)
        if not isinstance(tensors, Mapping):
            raise ValueError(f"server optimizer state: expected a mapping of names to tensors, got "
                             f"{type(tensors).__name__}")
        found: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            slot, sep, name = key.partition(SEPARATOR) if isinstance(key, str) else ("", "", "")
            if not sep or not slot:
                raise ValueError(f"server optimizer state: {key!r} is not a '<slot>{SEPARATOR}<parameter name>' "
                                 f"name")
            found.setdefault(slot, {})[name] = t
        expected = list(found) if slots is None else list(slots)
        for slot in found:
            if slot not in expected:
                raise ValueError(f"server optimizer state: slot {slot!r} is not one this optimizer keeps "
                                 f"({', '.join(expected)})")
        for slot in expected:
            if slot not in found and params:
                raise ValueError(f"server optimizer state: slot {slot!r} is missing (it has "
                                 f"{', '.join(found) or 'none'})")
            _check_like(found.get(slot, {}), params, f"server optimizer state {slot}")
        return cls(step, {slot: {name: found[slot][name].to(device=p.device) for name, p in params.items()}
                          for slot in expected})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], params: Params) -> ServerOptState:
        """:meth:`from_tensors` with the step and slot names of :meth:`to_dict`'s output."""
        unknown = sorted(set(d) - {"step", "slots"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown server optimizer state field; known: slots, step")
        if "step" not in d or "slots" not in d:
            raise ValueError(f"{'step' if 'step' not in d else 'slots'}: missing from the server optimizer state")
        slots = d["slots"]
        if not isinstance(slots, (list, tuple)) or not all(isinstance(s, str) for s in slots):
            raise ValueError(f"slots: expected a list of slot names, got {slots!r}")
        return cls.from_tensors(d["step"], tensors, params, slots)


class ServerOptimizer(ABC):
    """A server optimizer: :meth:`init` makes its state for a model, :meth:`step` applies one round's
    pseudo-gradient. Pure: no input is modified, the results are new tensors and a new state."""

    # The registered name, the slots its state keeps and its (validated) options dataclass.
    name: ClassVar[str]
    slots: ClassVar[tuple[str, ...]]
    options: Any

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"

    def init(self, params: Params) -> ServerOptState:
        """The state before the first step: step 0, every slot zero (``torch.zeros_like`` each parameter)."""
        _check_params(params)
        return ServerOptState(0, {slot: {name: torch.zeros_like(p) for name, p in params.items()}
                                  for slot in self.slots})

    def step(self, state: ServerOptState, params: Params, delta: Params) -> tuple[dict[str, torch.Tensor],
                                                                               ServerOptState]:
        """The new params and state after applying ``delta`` (the aggregate minus ``params``) to ``params``.
        :class:`ValueError` when ``delta`` or the state does not match the params (names, shapes, dtypes)."""
        _check_params(params)
        _check_params(delta, "delta")
        _check_like(delta, params, "delta")
        if not isinstance(state, ServerOptState):
            raise ValueError(f"state: expected a ServerOptState, got {type(state).__name__}")
        t = _check_step(state.step) + 1
        if set(state.slots) != set(self.slots):
            raise ValueError(f"state: {self.name} keeps slots {', '.join(self.slots)}, the state has "
                             f"{', '.join(state.slots) or 'none'}")
        for slot in self.slots:
            _check_like(state.slots[slot], params, f"state {slot}")
        new_params: dict[str, torch.Tensor] = {}
        new_slots: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in self.slots}
        for name, x in params.items():
            new_x, moved = self._update(t, x, delta[name], {slot: state.slots[slot][name] for slot in self.slots})
            new_params[name] = new_x
            for slot in self.slots:
                new_slots[slot][name] = moved[slot]
        return new_params, ServerOptState(t, new_slots)

    def load(self, step: int, tensors: Mapping[str, torch.Tensor], params: Params) -> ServerOptState:
        """:meth:`ServerOptState.from_tensors` expecting exactly this optimizer's slots."""
        return ServerOptState.from_tensors(step, tensors, params, self.slots)

    @abstractmethod
    def _update(self, t: int, x: torch.Tensor, d: torch.Tensor,
                slots: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Step ``t`` (from 1) for one parameter ``x`` with pseudo-gradient ``d``: new x and new slot tensors, all
        new tensors (the inputs are left as they are)."""


def _options(options: Any, cls: type[Any], name: str) -> Any:
    """``options`` (None: the defaults) as ``cls``, validated."""
    if options is None:
        options = cls()
    if not isinstance(options, cls):
        raise ConfigError("options", f"server optimizer {name!r} takes {cls.__name__}, got {type(options).__name__}")
    options.validate()
    return options


class FedAvgM(ServerOptimizer):
    """v ← μ·v + Δ; x ← x + η·v (Hsu et al. 2019; ``torch.optim.SGD``'s momentum, without Nesterov)."""

    name = "fedavgm"
    slots = ("v",)

    def __init__(self, options: FedAvgMOptions | None = None) -> None:
        self.options: FedAvgMOptions = _options(options, FedAvgMOptions, self.name)

    def _update(self, t: int, x: torch.Tensor, d: torch.Tensor,
                slots: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        o = self.options
        # μ = 0: v = Δ exactly (0·v + Δ could turn a -0.0 of Δ into +0.0, or 0·inf into NaN); a copy, so that the
        # state never shares memory with the caller's Δ.
        v = d.clone() if o.momentum == 0 else torch.add(d, slots["v"], alpha=o.momentum)
        new_x = torch.add(x, v) if o.lr == 1 else torch.add(x, v, alpha=o.lr)
        return new_x, {"v": v}


class _Adaptive(ServerOptimizer):
    """Reddi et al., Algorithm 2: m ← β1·m + (1 − β1)·Δ; v by the subclass; x ← x + η·m̂/(√v̂ + τ)."""

    slots = ("m", "v")
    options: FedAdagradOptions | FedAdamOptions | FedYogiOptions

    @abstractmethod
    def _second_moment(self, v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """The new v (a new tensor) from the old ``v`` and the pseudo-gradient ``d``."""

    def _v_correction(self, t: int) -> float:
        """v̂ = v / this at step ``t``, when ``bias_correction`` (1 - β2^t; fedadagrad: 1)."""
        return 1.0

    def _update(self, t: int, x: torch.Tensor, d: torch.Tensor,
                slots: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        o = self.options
        m = torch.add(torch.mul(slots["m"], o.beta1), d, alpha=1.0 - o.beta1)
        v = self._second_moment(slots["v"], d)
        m_hat, v_hat = m, v
        if o.bias_correction:
            m_hat = torch.div(m, 1.0 - math.pow(o.beta1, t))
            v_correction = self._v_correction(t)
            if v_correction != 1.0:
                v_hat = torch.div(v, v_correction)
        ratio = torch.div(m_hat, torch.sqrt(v_hat).add_(o.tau))  # sqrt makes a new tensor: add_ touches no input
        return torch.add(x, ratio, alpha=o.lr), {"m": m, "v": v}


class FedAdagrad(_Adaptive):
    """v ← v + Δ² (Reddi et al., Algorithm 2, FedAdagrad)."""

    name = "fedadagrad"

    def __init__(self, options: FedAdagradOptions | None = None) -> None:
        self.options: FedAdagradOptions = _options(options, FedAdagradOptions, self.name)

    def _second_moment(self, v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return torch.add(v, torch.mul(d, d))


class FedAdam(_Adaptive):
    """v ← β2·v + (1 − β2)·Δ² (Reddi et al., Algorithm 2, FedAdam)."""

    name = "fedadam"

    def __init__(self, options: FedAdamOptions | None = None) -> None:
        self.options: FedAdamOptions = _options(options, FedAdamOptions, self.name)

    def _second_moment(self, v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        beta2 = self.options.beta2
        return torch.add(torch.mul(v, beta2), torch.mul(d, d), alpha=1.0 - beta2)

    def _v_correction(self, t: int) -> float:
        return 1.0 - math.pow(self.options.beta2, t)


class FedYogi(_Adaptive):
    """v ← v − (1 − β2)·Δ²·sign(v − Δ²) (Reddi et al., Algorithm 2, FedYogi; Zaheer et al. 2018)."""

    name = "fedyogi"

    def __init__(self, options: FedYogiOptions | None = None) -> None:
        self.options: FedYogiOptions = _options(options, FedYogiOptions, self.name)

    def _second_moment(self, v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        d2 = torch.mul(d, d)
        return torch.sub(v, torch.mul(d2, torch.sign(torch.sub(v, d2))), alpha=1.0 - self.options.beta2)

    def _v_correction(self, t: int) -> float:
        return 1.0 - math.pow(self.options.beta2, t)


def make(name: str, options: Mapping[str, Any] | object | None = None) -> ServerOptimizer:
    """The server optimizer registered as ``name`` (:data:`SERVER_OPTIMIZERS`) with ``options``: None (its
    defaults), a table (decoded and validated by its options dataclass) or that dataclass itself. An unknown name
    is a :class:`ValueError` listing the known ones; a bad option a :class:`ConfigError` naming the field
    (``lr: must be a finite number > 0, got -1``)."""
    plugin = SERVER_OPTIMIZERS.plugin(name)
    # A table's errors name its key ("lr: ..."); a dataclass of another optimizer is named "options".
    parsed = SERVER_OPTIMIZERS.coerce_options(name, options, "" if options is None or isinstance(options, Mapping)
                                              else "options")
    SERVER_OPTIMIZERS.validate_options(name, parsed, "")
    made = plugin.factory(parsed)
    if not isinstance(made, ServerOptimizer):
        raise TypeError(f"server optimizer {name!r}: its factory made a {type(made).__name__}, not a ServerOptimizer")
    return made
