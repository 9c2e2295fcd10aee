"""Client trainers behind one seam: pure functions over an explicit, persistable :class:`TrainerState`.

The shape follows optax's ``init``/``update`` pair: a :class:`Trainer` is a record of functions and keeps nothing
in attributes; everything it carries from one round to the next is in the :class:`TrainerState` it returns, which
the client saves in its state dir (:func:`save_trainer_state`, a fedguard tensor file, no pickle) and loads after a
restart (:func:`load_trainer_state`).

Trainers (:data:`TRAINERS`, built with :func:`make_trainer`):

- ``"vanilla"``: local SGD (FedProx with ``prox_mu > 0``), i.e. :func:`fedcore.train.train_local` itself. It has
  no recovery method: ``recovery=True`` changes nothing and its state never changes.
- ``"flguard"``: FL-GUARD model adaptation (FL-GUARD §4.2, Eq. 6–9). Without recovery it *is* ``train_local``
  (the same call); with recovery the client also trains an adapted model vᵢ in parallel with its copy of the
  global model w_iʳ, on the same batches, while w_iʳ's trajectory stays bit-identical to ``train_local``'s for the
  same seeds, so the update sent to the server does not change (FL-GUARD §4.3: "activating the model adaptation
  will not change the results of learning the global model").
- ``"fedntd"``, ``"moon"``, ``"hydra"``: knowledge-distillation objectives (FedNTD, MOON, HYDRA-FL; SPEC §10) in
  :mod:`fedcore.train.kd`, registered here by name; no recovery method (``recovery`` changes nothing).

Also here: FL-GUARD's adaptation weight λ (Eq. 6–8, :func:`lambda_weight`). The client's estimated performance
gain β̂ᵢ (Eq. 3) lives with the rest of NFL: :func:`fedcore.nfl.measure.client_beta_hat` on the round's first
training batch (:func:`fedcore.nfl.measure.first_batch`).

A client's round (see the module's users for the exact calls)::

    state = load_trainer_state(state_dir) or trainer.init(model)   # model holds the received w^{r-1}
    inf = trainer.inference_state(state, received)                 # None: infer with the received model
    beta = client_beta_hat(adapted_or_received_model, first_batch(x, y, batch_size, seeds.batches), P_i)
    result, state = trainer.train(model, state, x, y, config, seeds, recovery=flag)
    save_trainer_state(state_dir, state)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from fedcore.errors import ConfigError
from fedcore.models.zoo import HydraModel
from fedcore.options import from_dict
from fedcore.seeds import RoundSeeds, derive_seed
from fedcore.serialization import SerializationError, load_state, save_state
from fedcore.train import (
    Batches,
    TrainResult,
    deterministic_dropout,
    model_device,
    train_local,
)
from fedcore.train.loop import (
    Companion,
    LossMeter,
    Optimised,
    StepHooks,
    diverged,
    fill_missing_grads,
    sgd_step,
)
from fedcore.train.registry import TRAINERS as TRAINERS  # re-exported: the registry's old home
from fedcore.train.registry import TrainerFactory as TrainerFactory  # re-exported
from fedcore.training_config import TrainingConfig

# Seed purpose of the adapted model's dropout masks: derive_seed(seeds.dropout, ADAPT_DROPOUT).
ADAPT_DROPOUT = "adapt_dropout"
TRAINER_STATE_FILE = "trainer_state.fgt"
_STATE_FORMAT = "fedguard.trainer_state"
_STATE_VERSION = 1
# Tensor-name prefix of the kept models' tensors in a trainer state file: kept/<name>/<state-dict key>.
_KEPT_PREFIX = "kept/"
# Guard of Eq. 7's denominator: a zero gradient gives grad_div = 0 (σ = 1/2) instead of 0/0.
_GRAD_NORM_EPS = 1e-12


# ---- state ----

@dataclass(frozen=True)
class TrainerState:
    """What a trainer carries across rounds. Never mutated: trainers return a new one.

    - ``adapted``: FL-GUARD's adapted model vᵢ (a CPU state dict), ``None`` until adaptation first runs; kept when
      adaptation stops (FL-GUARD §5.1: "the adapted models are kept by the clients for local inference").
    - ``active``: whether the last trained round adapted (a record; the ``recovery`` argument of ``train`` decides).
    - ``frozen_keys``: state-dict keys of vᵢ's frozen lower layers (partial-layer adaptation, ``l_fb``); at
      inference they are taken from the received global model.
    - ``rounds_adapted``: rounds in which vᵢ was trained.
    - ``metrics``: the last round's adaptation statistics (``adapt_loss``, ``adapt_ce``, ``lambda_mean``,
      ``lambda_min``, ``lambda_max``, ``adapt_steps``, ``adapt_diverged``), empty for a round without adaptation.
    - ``scalars``: a trainer's own numbers carried across rounds (e.g. APFL's mixing weight α), persisted.
    - ``kept``: state dicts (CPU tensors) a trainer keeps across rounds that are not the inference model, by name,
      e.g. MOON's previous local model (``kept["previous"]``, :mod:`fedcore.train.kd`), persisted.
    """

    adapted: dict[str, torch.Tensor] | None = None
    active: bool = False
    frozen_keys: tuple[str, ...] = ()
    rounds_adapted: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    kept: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


class TrainerStateError(ValueError):
    """A saved trainer state that cannot be used (corrupt file, or an adapted model of another architecture)."""


def save_trainer_state(state_dir: str | os.PathLike[str], state: TrainerState) -> Path:
    """Write ``state`` to ``state_dir/trainer_state.fgt`` atomically (fedguard tensor file, no pickle).

    The tensors are vᵢ's under their state-dict keys (none when there is no adapted model) and each kept model's
    under ``kept/<name>/<key>``; the rest is JSON in the file header's extra (``kept``: name -> its keys in order).
    """
    path = Path(state_dir) / TRAINER_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    extra: dict[str, object] = {
        "format": _STATE_FORMAT,
        "version": _STATE_VERSION,
        "has_adapted": state.adapted is not None,
        "active": state.active,
        "frozen_keys": list(state.frozen_keys),
        "rounds_adapted": state.rounds_adapted,
        "metrics": {k: float(v) for k, v in state.metrics.items()},
        "scalars": {k: float(v) for k, v in state.scalars.items()},
    }
    tensors = {k: v.detach().cpu() for k, v in (state.adapted or {}).items()}
    if state.kept:
        extra["kept"] = {name: list(sd) for name, sd in state.kept.items()}
        for name, sd in state.kept.items():
            if not name or "/" in name:
                raise ValueError(f"kept model name {name!r}: must be non-empty and contain no '/'")
            for k, v in sd.items():
                key = f"{_KEPT_PREFIX}{name}/{k}"
                if key in tensors:
                    raise ValueError(f"kept model {name!r}: tensor name {key!r} collides with an adapted-model key")
                tensors[key] = v.detach().cpu()
    save_state(path, tensors, extra)
    return path


def load_trainer_state(state_dir: str | os.PathLike[str]) -> TrainerState | None:
    """The state saved in ``state_dir``, or ``None`` when there is none (the caller then uses ``trainer.init``).

    A file that exists but cannot be read raises :class:`TrainerStateError` naming the file and the reason: it holds
    the client's adapted model, which silently starting over would throw away (and silently change the model the
    client infers with); the caller decides whether to move it aside and start from ``init``.
    """
    path = Path(state_dir) / TRAINER_STATE_FILE
    if not path.exists():
        return None
    try:
        tensors, extra = load_state(path)
    except (SerializationError, OSError, ValueError, KeyError) as e:
        raise TrainerStateError(f"{path}: unreadable trainer state ({e})") from None
    if extra.get("format") != _STATE_FORMAT or extra.get("version") != _STATE_VERSION:
        raise TrainerStateError(f"{path}: not a version-{_STATE_VERSION} trainer state "
                                f"(format {extra.get('format')!r}, version {extra.get('version')!r})")
    has_adapted, active = extra.get("has_adapted"), extra.get("active")
    frozen, rounds, metrics = extra.get("frozen_keys"), extra.get("rounds_adapted"), extra.get("metrics")
    scalars = extra.get("scalars", {})  # absent in files written before trainers had scalars
    kept_keys = extra.get("kept", {})  # absent in files written before trainers kept models
    if not (isinstance(has_adapted, bool) and isinstance(active, bool) and isinstance(rounds, int)
            and isinstance(frozen, list) and all(isinstance(k, str) for k in frozen)
            and isinstance(metrics, dict) and all(isinstance(v, (int, float)) for v in metrics.values())
            and isinstance(scalars, dict) and all(isinstance(v, (int, float)) for v in scalars.values())
            and isinstance(kept_keys, dict)
            and all(isinstance(n, str) and n and "/" not in n and isinstance(ks, list)
                    and all(isinstance(k, str) for k in ks) for n, ks in kept_keys.items())):
        raise TrainerStateError(f"{path}: corrupt trainer state metadata")
    # load_state's tensors view one shared buffer: give each its own storage.
    rest = dict(tensors)
    kept: dict[str, dict[str, torch.Tensor]] = {}
    for name, keys in kept_keys.items():
        sd: dict[str, torch.Tensor] = {}
        for k in keys:
            t = rest.pop(f"{_KEPT_PREFIX}{name}/{k}", None)
            if t is None:
                raise TrainerStateError(f"{path}: corrupt trainer state (kept model {name!r} lacks tensor {k!r})")
            sd[k] = t.clone()
        kept[name] = sd
    if not has_adapted and rest:
        raise TrainerStateError(f"{path}: corrupt trainer state (tensors without an adapted model)")
    adapted = {k: v.clone() for k, v in rest.items()} if has_adapted else None
    return TrainerState(adapted=adapted, active=active, frozen_keys=tuple(frozen), rounds_adapted=rounds,
                        metrics={str(k): float(v) for k, v in metrics.items()},
                        scalars={str(k): float(v) for k, v in scalars.items()}, kept=kept)


def _check_adapted_matches(adapted: Mapping[str, torch.Tensor], model: nn.Module, what: str = "adapted model") -> None:
    """:class:`TrainerStateError` unless ``adapted`` has ``model``'s state-dict keys (in order), shapes and dtypes;
    ``what`` names the saved model in the message."""
    ref = model.state_dict()
    if list(adapted) != list(ref):
        missing, unexpected = sorted(set(ref) - set(adapted)), sorted(set(adapted) - set(ref))
        raise TrainerStateError(f"the saved {what} does not fit this model: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]} (delete {TRAINER_STATE_FILE} to start over)")
    for k, t in ref.items():
        if tuple(adapted[k].shape) != tuple(t.shape) or adapted[k].dtype != t.dtype:
            raise TrainerStateError(f"the saved {what} does not fit this model: {k} is "
                                    f"{adapted[k].dtype}{tuple(adapted[k].shape)}, the model has "
                                    f"{t.dtype}{tuple(t.shape)} (delete {TRAINER_STATE_FILE} to start over)")


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s state dict (what a :class:`TrainerState` keeps)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def personal_copy(model: nn.Module, start: Mapping[str, torch.Tensor] | None) -> nn.Module:
    """A trainable copy of ``model`` (same architecture and device) holding ``start``, or ``model``'s weights when
    ``start`` is None: the personal model of Ditto, APFL, FT/FB and LINDT's local model."""
    v = copy.deepcopy(model)
    if start is not None:
        _check_adapted_matches(start, model)
        v.load_state_dict(start)
    for p in v.parameters():
        p.grad = None
        p.requires_grad_(True)
    return v


# ---- the trainer seam ----

class TrainFn(Protocol):
    def __call__(self, model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor,
                 config: TrainingConfig, seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None,
                 epochs: int | None = None, batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        """Train ``model`` (the client's copy of the global model, in place) for one round."""
        ...


class InferenceFn(Protocol):
    def __call__(self, state: TrainerState, received: Mapping[str, torch.Tensor] | None = None) -> dict[
        str, torch.Tensor
    ] | None:
        """The weights to infer with, or ``None`` for the received global model."""
        ...


@dataclass(frozen=True)
class Trainer:
    """A client trainer as a record of pure functions (optax-style ``init``/``update``), no hidden attributes.

    - ``init(model) -> TrainerState``: the state of a client that has never trained (``model`` = the global model).
    - ``train(model, state, x, y, config, seeds, *, recovery, learning_rate=None, epochs=None, batches=None)
      -> (TrainResult, new state)``: one round. ``model`` is trained in place with the vanilla objective and is
      what the client sends; arguments as :func:`fedcore.train.train_local`'s (batches from ``batches(epoch)``
      when given, else a shuffle seeded with ``seeds.batches``; dropout from ``seeds.dropout``). ``recovery``
      says whether this round runs the trainer's recovery method (the caller's decision: system flag or
      individual measure, never for an opt-out client).
    - ``inference_state(state, received=None)``: the weights the client infers with (and computes β̂ᵢ with):
      the adapted model when one exists (during adaptation and after it stopped), else ``None`` meaning "the
      received global model".
    - ``inference_module(state, received_model)`` (optional): the module the client infers with, for methods
      whose inference is not the global architecture (LINDT's local model fed by the global one's layers).
    """

    name: str
    init: Callable[[nn.Module], TrainerState]
    train: TrainFn
    inference_state: InferenceFn
    # For a method whose inference model is not the global architecture with other weights (LINDT's dual model):
    # ``inference_module(state, received_model)`` builds the module the client infers with (or None: the received
    # model). When set, it is used instead of ``inference_state``.
    inference_module: Callable[[TrainerState, nn.Module], nn.Module | None] | None = None


def inference_state(state: TrainerState, received: Mapping[str, torch.Tensor] | None = None) -> dict[
    str, torch.Tensor
] | None:
    """vᵢ when the client has one (FL-GUARD §4.3: "once model adaptation is activated, each client utilizes the
    adapted model (instead of the learned global model) for its local inference"), else ``None``.

    With ``received`` (the global model of this round), vᵢ's frozen lower layers (``state.frozen_keys``) are taken
    from it: frozen layers follow the global model. Returns a new dict; the state is not modified."""
    if state.adapted is None:
        return None
    out = dict(state.adapted)
    if received is not None:
        for k in state.frozen_keys:
            out[k] = received[k]
    return out


def _vanilla_init(model: nn.Module) -> TrainerState:
    return TrainerState()


def _vanilla_train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                   seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None,
                   epochs: int | None = None, batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
    res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                      batches=batches, dropout_seed=seeds.dropout)
    return res, state


def vanilla_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """Plain local SGD / FedProx (:func:`fedcore.train.train_local`); no recovery method, state never changes."""
    if options:
        raise ConfigError("trainer", f"'vanilla' takes no options, got {sorted(options)}")
    return Trainer("vanilla", _vanilla_init, _vanilla_train, inference_state)


# ---- FL-GUARD model adaptation ----

@dataclass(frozen=True)
class FlGuardConfig:
    """FL-GUARD adaptation options. ``l_fb``: the number of lowest parameterised layers of vᵢ that are frozen and
    follow the global model (partial-layer adaptation, FL-GUARD §5.4, Table 10's L_fb); 0 adapts every layer."""

    l_fb: int = 0

    def validate(self, prefix: str = "") -> FlGuardConfig:
        if isinstance(self.l_fb, bool) or not isinstance(self.l_fb, int) or self.l_fb < 0:
            raise ConfigError(f"{prefix}l_fb", f"must be an integer >= 0, got {self.l_fb!r}")
        return self


def parameterised_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's parameterised layers, lowest first: every module that owns parameters itself (not through a
    child: ``Linear``, ``Conv2d``, ``BatchNorm2d``, ``Embedding``, ``LSTM`` ...), in ``named_modules()`` order,
    i.e. registration order, which is input-to-output order for ``nn.Sequential`` and the zoo's ``BlockModel``.
    A module with parameters of its own *and* children counts as one layer for its own parameters. A shared
    module counts once. The auxiliary heads of a :class:`~fedcore.models.zoo.HydraModel` (``heads.*``) are not on
    the inference path and are not layers here (so FB's top layer is the classifier, not a head)."""
    aux = "heads." if isinstance(model, HydraModel) else None
    return [(name, m) for name, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None and not (aux and name.startswith(aux))]


def frozen_layer_keys(model: nn.Module, l_fb: int) -> tuple[str, ...]:
    """State-dict keys (parameters and persistent buffers) of the lowest ``l_fb`` parameterised layers.

    :class:`ConfigError` on ``l_fb`` unless at least one parameterised layer is left to adapt."""
    FlGuardConfig(l_fb).validate()
    layers = parameterised_layers(model)
    if l_fb and l_fb >= len(layers):
        raise ConfigError("l_fb", f"must be < the model's {len(layers)} parameterised layers (at least one layer "
                                  f"must adapt), got {l_fb}")
    in_state = set(model.state_dict())
    keys: list[str] = []
    for name, m in layers[:l_fb]:
        prefix = f"{name}." if name else ""
        own = [n for n, _ in m.named_parameters(recurse=False)] + [n for n, _ in m.named_buffers(recurse=False)]
        keys.extend(prefix + n for n in own if prefix + n in in_state)
    return tuple(keys)


def _lambda_from(loss_v: torch.Tensor, loss_w: torch.Tensor, diffs: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """λ of FL-GUARD Eq. 6–8 as a 0-d tensor (no synchronisation with the device):

    loss_div = ℓ(vᵢ) − ℓ(w_iʳ) (Eq. 6); grad_div = ⟨vᵢ − w_iʳ, ∇_v ℓ(vᵢ)⟩ / ‖∇_v ℓ(vᵢ)‖ (Eq. 7);
    λ = σ(loss_div) · σ(grad_div) (Eq. 8). ``diffs`` are vᵢ − w_iʳ and ``grads`` ∇_v ℓ(vᵢ), tensor by tensor."""
    loss_div = loss_v.detach().float() - loss_w.detach().float()
    if diffs:
        dot = torch.stack([torch.dot(d.reshape(-1), g.reshape(-1)).float()
                           for d, g in zip(diffs, grads, strict=True)]).sum()
        gnorm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(list(grads))]))
        grad_div = dot / gnorm.clamp_min(_GRAD_NORM_EPS)
    else:
        grad_div = torch.zeros_like(loss_div)
    return torch.sigmoid(loss_div) * torch.sigmoid(grad_div)


def lambda_weight(v_model: nn.Module, w_model: nn.Module, xb: torch.Tensor, yb: torch.Tensor,
                  dropout_seed: int = 0) -> float:
    """FL-GUARD's adaptation weight λ (Eq. 6–8) of ``v_model`` against ``w_model`` on the batch (xb, yb), with the
    cross-entropy ℓ, over the parameters of ``v_model`` that require a gradient (and ``w_model``'s of the same
    names). The models run in their current mode (dropout masks, if in training mode, from generators seeded with
    ``dropout_seed``); no parameter changes and no gradient is left behind. The trainer computes the same
    quantity inline, from the losses of its training forward passes."""
    names = [n for n, p in v_model.named_parameters() if p.requires_grad]
    v_params = dict(v_model.named_parameters())
    w_params = dict(w_model.named_parameters())
    with deterministic_dropout(v_model, dropout_seed), deterministic_dropout(w_model, dropout_seed):
        loss_v = F.cross_entropy(v_model(xb), yb)
        with torch.no_grad():
            loss_w = F.cross_entropy(w_model(xb), yb)
    params = [v_params[n] for n in names]
    grads = torch.autograd.grad(loss_v, params, allow_unused=True)
    with torch.no_grad():
        gs = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        diffs = [v_params[n] - w_params[n] for n in names]
        return float(_lambda_from(loss_v, loss_w, diffs, gs))


@dataclass
class _Adapter:
    """vᵢ and what one round of its training needs (built per round, not kept): :meth:`step` is the
    ``after_backward`` hook of the global copy's :func:`~fedcore.train.train_local`, so vᵢ steps on each batch
    between w_iʳ's backward pass and w_iʳ's own step."""

    model: nn.Module
    optimised: Optimised  # vᵢ's trainable parameters, their SGD and clip
    anchors: list[torch.Tensor]  # w_iʳ's parameters of the same names (the live global copy)
    frozen: list[tuple[torch.Tensor, torch.Tensor]]  # (vᵢ tensor, w_iʳ tensor) of the frozen layers
    meter: LossMeter  # la (L_a), ce (ℓ(vᵢ)), lam (λ) summed over the round
    lam_min: torch.Tensor
    lam_max: torch.Tensor
    diffs: list[torch.Tensor] = field(default_factory=list)  # scratch for vᵢ − w_iʳ, allocated once per round

    @property
    def params(self) -> list[torch.Tensor]:
        return self.optimised.params

    def sync_frozen(self) -> None:
        with torch.no_grad():
            for tv, tw in self.frozen:
                tv.copy_(tw)

    def step(self, xb: torch.Tensor, yb: torch.Tensor, loss_w: torch.Tensor) -> None:
        """One adaptation step on the batch the global copy has just computed ``loss_w`` = ℓ(w_iʳ, b) on, with
        w_iʳ's weights as they are before its own step on that batch (Eq. 6–9)."""
        def adapt_gradient(loss_v: torch.Tensor) -> None:
            self._adapt_gradient(loss_v, loss_w)

        sgd_step(self.model, xb, yb, [self.optimised],
                 StepHooks(before_step=self.sync_frozen, grad_transform=adapt_gradient))

    def _adapt_gradient(self, loss_v: torch.Tensor, loss_w: torch.Tensor) -> None:
        """∇_v L_a = ∇_v ℓ(vᵢ) + 2λ(vᵢ − w_iʳ), λ and w_iʳ constants (Eq. 9): added to the gradient in place rather
        than by a second backward pass; λ from the same gradient (Eq. 6–8)."""
        grads = fill_missing_grads(self.params)
        if not self.diffs:
            self.diffs = [torch.empty_like(p) for p in self.params]
        diffs = self.diffs
        torch._foreach_copy_(diffs, self.params)
        torch._foreach_sub_(diffs, self.anchors)
        lam = _lambda_from(loss_v, loss_w, diffs, grads)
        sq = torch.stack([n.float() for n in torch._foreach_norm(diffs)]).pow(2).sum()
        torch._foreach_mul_(diffs, 2.0 * lam)
        torch._foreach_add_(grads, diffs)
        self.meter.add(la=loss_v.detach().float() + lam * sq, ce=loss_v, lam=lam)
        self.lam_min = torch.minimum(self.lam_min, lam.double())
        self.lam_max = torch.maximum(self.lam_max, lam.double())


def _make_adapter(model: nn.Module, state: TrainerState, frozen_keys: tuple[str, ...], lr: float,
                  config: TrainingConfig) -> _Adapter:
    v = copy.deepcopy(model)  # same architecture and device; equals the received global model
    if state.adapted is not None:
        _check_adapted_matches(state.adapted, model)
        v.load_state_dict(state.adapted)
    frozen_set = set(frozen_keys)
    w_named = dict(model.named_parameters())
    w_tensors = {**dict(model.named_buffers()), **w_named}
    params: list[torch.Tensor] = []
    anchors: list[torch.Tensor] = []
    for n, p in v.named_parameters():
        p.grad = None
        if n in frozen_set:
            p.requires_grad_(False)
        else:
            params.append(p)
            anchors.append(w_named[n])
    v_tensors = {**dict(v.named_buffers()), **dict(v.named_parameters())}
    frozen = [(v_tensors[k], w_tensors[k]) for k in frozen_keys]
    dev = model_device(model)
    return _Adapter(v, Optimised.sgd(params, lr, config), anchors, frozen, LossMeter(dev),
                    torch.full((), math.inf, dtype=torch.float64, device=dev),
                    torch.full((), -math.inf, dtype=torch.float64, device=dev))


def _train_with_adaptation(model: nn.Module, adapter: _Adapter, x: torch.Tensor, y: torch.Tensor,
                           config: TrainingConfig, lr: float, seeds: RoundSeeds, epochs: int | None,
                           batches: Batches | None) -> TrainResult:
    """:func:`fedcore.train.train_local` of the global copy (the same call as ``vanilla``'s, so its trajectory is
    bit-identical for the same seeds) with the adapter's step on each batch as its ``after_backward`` hook; vᵢ's
    dropout masks come from their own generator (``derive_seed(seeds.dropout, "adapt_dropout")``)."""
    res = train_local(model, x, y, config, learning_rate=lr, seed=seeds.batches, epochs=epochs, batches=batches,
                      dropout_seed=seeds.dropout, after_backward=adapter.step,
                      companions=[Companion(adapter.model, derive_seed(seeds.dropout, ADAPT_DROPOUT))])
    adapter.sync_frozen()  # frozen layers end equal to the trained global copy's
    return res


def flguard_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """FL-GUARD model adaptation (FL-GUARD §4.2, Eq. 6–9; partial-layer adaptation §5.4). Options: see
    :class:`FlGuardConfig` (``{"l_fb": 2}``).

    Per round with ``recovery=True``: vᵢ starts from the saved adapted model, or, the first time, from the received
    global model w^{r-1}. For every batch b of the round (the global copy's batches, same order):

    1. the global copy w_iʳ takes its vanilla step exactly as in ``train_local`` (its forward, FedProx term,
       backward, clip and SGD step are untouched, so the update sent to the server is the vanilla one);
    2. between w_iʳ's backward pass and its step, vᵢ takes one step on L_a = ℓ(vᵢ, b) + λ‖vᵢ − w_iʳ‖² (Eq. 9)
       with λ = σ(ℓ(vᵢ,b) − ℓ(w_iʳ,b)) · σ(⟨vᵢ − w_iʳ, ∇_v ℓ(vᵢ,b)⟩ / ‖∇_v ℓ(vᵢ,b)‖) (Eq. 6–8), computed without
       gradient. w_iʳ is the global copy *being trained* ("w_iʳ is initialized by w^{r-1} in each round", §4.2),
       read at the current step (before its update on b), detached; ℓ(w_iʳ, b) is the cross-entropy of its own
       training forward pass (no extra forward, as §4.1 suggests for EV). vᵢ's optimiser is SGD with the round's
       learning rate, the same momentum and weight decay (fresh each round, like the global copy's), and the same
       gradient-norm clip applied to ∇L_a; vᵢ has no FedProx term.
    3. Partial-layer adaptation: vᵢ's lowest ``l_fb`` parameterised layers (:func:`parameterised_layers`) are
       frozen: not trained (``requires_grad`` off, so the backward pass stops above them) and copied from w_iʳ
       before each step and at the end of the round; at inference they come from the received model.

    vᵢ's dropout masks come from a generator seeded with ``derive_seed(seeds.dropout, "adapt_dropout")``, never from
    torch's global RNG. If vᵢ's loss becomes non-finite the round's adaptation is discarded (vᵢ keeps its previous
    weights, ``metrics["adapt_diverged"] = 1``); the global copy's result is unaffected.

    With ``recovery=False`` the round is exactly ``train_local`` (the same call) and vᵢ, if any, is kept unchanged.
    """
    cfg = from_dict(FlGuardConfig, dict(options or {}), "").validate()

    def init(model: nn.Module) -> TrainerState:
        return TrainerState(frozen_keys=frozen_layer_keys(model, cfg.l_fb))

    def train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
              seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None, epochs: int | None = None,
              batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
        frozen_keys = frozen_layer_keys(model, cfg.l_fb)
        if not recovery:
            res = train_local(model, x, y, config, learning_rate=learning_rate, seed=seeds.batches, epochs=epochs,
                              batches=batches, dropout_seed=seeds.dropout)
            return res, dataclasses.replace(state, active=False, frozen_keys=frozen_keys, metrics={})
        lr = config.learning_rate if learning_rate is None else learning_rate
        adapter = _make_adapter(model, state, frozen_keys, lr, config)
        before = state.adapted
        if before is None:
            before = cpu_state(model)
        res = _train_with_adaptation(model, adapter, x, y, config, lr, seeds, epochs, batches)
        steps = res.steps
        la, ce = adapter.meter.mean("la", steps), adapter.meter.mean("ce", steps)
        adapt_diverged = diverged(steps, la, ce)
        metrics = {"adapt_loss": la, "adapt_ce": ce, "lambda_mean": adapter.meter.mean("lam", steps),
                   "lambda_min": float(adapter.lam_min) if steps else math.nan,
                   "lambda_max": float(adapter.lam_max) if steps else math.nan,
                   "adapt_steps": float(steps), "adapt_diverged": 1.0 if adapt_diverged else 0.0,
                   # per batch: the global copy's forward/backward plus vᵢ's (λ reuses vᵢ's gradient)
                   "passes": 1.0 + steps / max(res.steps, 1)}
        adapted = before if adapt_diverged else cpu_state(adapter.model)
        return res, TrainerState(adapted=adapted, active=True, frozen_keys=frozen_keys,
                                 rounds_adapted=state.rounds_adapted + 1, metrics=metrics)

    return Trainer("flguard", init, train, inference_state)


def _noop_train(model: nn.Module, state: TrainerState, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig,
                seeds: RoundSeeds, *, recovery: bool, learning_rate: float | None = None,
                epochs: int | None = None, batches: Batches | None = None) -> tuple[TrainResult, TrainerState]:
    return TrainResult(0.0, 0, 0), state


def noop_trainer(options: Mapping[str, Any] | None = None) -> Trainer:
    """Trains nothing: the client sends the received model back at once (benchmarks, protocol tests)."""
    if options:
        raise ConfigError("trainer", f"'noop' takes no options, got {sorted(options)}")
    return Trainer("noop", _vanilla_init, _noop_train, inference_state)


# The trainers of this module (declared, with their options and one lines, in fedcore.train.registry).
TRAINERS.add("vanilla", vanilla_trainer)
TRAINERS.add("flguard", flguard_trainer)
TRAINERS.add("noop", noop_trainer)


def make_trainer(name: str, options: Mapping[str, Any] | None = None) -> Trainer:
    """The registered trainer ``name`` built with ``options`` (errors name the unknown trainer or the field)."""
    made: Trainer = TRAINERS.get(name)(options)
    return made
