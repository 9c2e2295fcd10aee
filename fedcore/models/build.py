"""Build a ``torch.nn.Module`` by registered name (:mod:`fedcore.models.registry`) or from a user factory given as
"pkg.mod:factory", load weights into it, and fingerprint it; the two small built-in models (mlp, logreg)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fedcore.errors import ConfigError
from fedcore.models.registry import MODELS as _REGISTRY
from fedcore.models.registry import ModelError, ModelFactory, ModelInput, check_model_kwargs, register_model
from fedcore.seeds import GLOBAL_RNG_LOCK
from fedcore.serialization import TensorMeta, fingerprint, manifest_of
from fedcore.torch_rng import seeded_global_rng


def resolve_factory(name: str) -> ModelFactory:
    """A registered model, or the factory an import path "pkg.mod:factory" names.

    Import paths are for a party's *own* configuration only (the server operator's ``model.name``, a client's
    ``--model``): a name a remote party announced goes through :func:`is_registered_model` first.
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ModelError(f"cannot import model factory module {module_name!r}: {e}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ModelError(f"{name!r}: {module_name} has no callable {attr!r}")
        return factory  # type: ignore[no-any-return]
    return _REGISTRY.get(name)


def build_model(name: str, kwargs: Mapping[str, Any] | None = None, seed: int | None = None) -> nn.Module:
    """Instantiate a model; with ``seed`` the initial weights are deterministic, also under concurrency.

    ``nn`` initialisers draw from torch's process-global RNG, so the factory always runs under
    :data:`fedcore.seeds.GLOBAL_RNG_LOCK`: with ``seed``, inside :func:`fedcore.torch_rng.seeded_global_rng` (the
    global RNG forked, seeded with ``seed`` and restored afterwards); without, it draws from the global RNG as
    is, but never in the middle of another thread's seeded construction.
    """
    factory = resolve_factory(name)
    try:  # a registered model's keywords, through its options dataclass (an import path: as its factory takes them)
        check_model_kwargs(name, kwargs)
    except ConfigError as e:
        raise ModelError(f"model {name!r} rejected its arguments {dict(kwargs or {})}: {e}") from None
    with seeded_global_rng(seed) if seed is not None else GLOBAL_RNG_LOCK:
        try:
            model = factory(**dict(kwargs or {}))
        except TypeError as e:
            raise ModelError(f"model {name!r} rejected its arguments {dict(kwargs or {})}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def model_manifest(model: nn.Module) -> list[TensorMeta]:
    return manifest_of(model.state_dict())


def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(weights)`` (strict), each tensor copied straight into the model's own when nothing
    else takes part in loading -- no state-dict or load hooks, no module's own ``_load_from_state_dict``, no lazy or
    meta tensors, tensors swapped rather than copied (``torch.__future__``) -- and ``weights`` holds exactly the
    model's tensors with their shapes: what ``load_state_dict`` does then, for about half its cost (a client loads
    every round's model: ``tools/bench/bench_rounds.py --cpu-breakdown``). Anything else goes to ``load_state_dict``
    itself, with its checks and errors."""
    if type(model).load_state_dict is nn.Module.load_state_dict and type(model).state_dict is nn.Module.state_dict \
            and not torch.__future__.get_swap_module_params_on_conversion() \
            and all(_plain_loading(m) for m in model.modules()):
        own = model.state_dict()
        if own.keys() == weights.keys():
            pairs = [(t, weights[k]) for k, t in own.items()]
            if all(isinstance(src, torch.Tensor) and src.shape == t.shape and not t.is_meta
                   and not nn.parameter.is_lazy(t) for t, src in pairs):
                with torch.no_grad():
                    for t, src in pairs:
                        t.copy_(src)
                return
    model.load_state_dict(weights)


def _plain_loading(module: nn.Module) -> bool:
    """Whether ``module`` loads and lists its tensors as :class:`torch.nn.Module` does, with no hook."""
    cls = type(module)
    return not (module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks
                or module._state_dict_hooks or module._state_dict_pre_hooks) \
        and cls._load_from_state_dict is nn.Module._load_from_state_dict \
        and cls._save_to_state_dict is nn.Module._save_to_state_dict


def model_fingerprint(model: nn.Module) -> str:
    return fingerprint(model_manifest(model))


@register_model("mlp", takes=ModelInput(("in_features",), flat=True))
def mlp(in_features: int = 60, num_classes: int = 10, hidden: tuple[int, ...] | list[int] = (64,)) -> nn.Module:
    """A plain multi-layer perceptron: Linear+ReLU per hidden width, then a linear classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


@register_model("logreg", takes=ModelInput(("in_features",), flat=True))
def logreg(in_features: int = 60, num_classes: int = 10) -> nn.Module:
    """Multinomial logistic regression (the FedProx synthetic-task model)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))
