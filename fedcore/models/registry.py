"""The model registry (names -> factories), torch-free: the built-in models are declared here by name and one
line, and registered (:func:`register_model`) by :mod:`fedcore.models.build` and :mod:`fedcore.models.zoo` when a
model is first looked up, so that a configuration is read and its model name checked without importing torch.

A model's options are its factory's keyword arguments (``model.kwargs`` in the config): at registration
:func:`options_of_factory` turns the factory's signature into a frozen options dataclass (one field per keyword,
its annotation as the type, its default as the default), registered with it, so ``model.kwargs`` is checked through
:meth:`fedcore.registry.Registry.parse_options` (an unknown keyword or a wrong type names ``model.kwargs.<name>``)
before the model is built.

A model may also declare what it takes (:class:`ModelInput`: the shape of one sample, each size a number or the
keyword that sets it, the dtype, the keyword that sets its number of classes), so that a configuration naming a
model that cannot take the dataset's samples is refused from the declarations alone, before any data is read or
any model built (:func:`model_input`, :mod:`fedcore.preflight`).
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcore.registry import Registry

if TYPE_CHECKING:
    from torch import nn

ModelFactory = Callable[..., "nn.Module"]


class ModelError(ValueError):
    """Unknown model name, bad factory path or bad model arguments."""


MODELS: Registry[ModelFactory] = Registry("model", ModelError)
# The built-in models, each with its one line (its factory's first sentence, shortened; the registration's own
# summary replaces it once the module is imported, and tests/unit/test_plugins.py checks that they agree).
_BUILD, _ZOO = "fedcore.models.build", "fedcore.models.zoo"
for _name, _module, _summary in (
        ("mlp", _BUILD, "A plain multi-layer perceptron: Linear+ReLU per hidden width, then a linear ..."),
        ("logreg", _BUILD, "Multinomial logistic regression (the FedProx synthetic-task model)"),
        ("char_lstm", _ZOO, "Embedding 80->8, 2 stacked LSTM layers of 256, linear 256->80 on the last step: ..."),
        ("cifar_cnn", _ZOO, "conv 3->32 5x5, ReLU, pool; conv 32->64 5x5, ReLU, pool; fc 1600->512, ReLU; fc ..."),
        ("fedntd_cnn", _ZOO, "FedNTD's plain CNN: :func:`hydra_ntd_cnn` without heads (MNIST 1,663,370, CIFAR ..."),
        ("har_cnn", _ZOO, "1-D CNN over [B, 6, 128] windows: BatchNorm of the raw 6 channels, then per ..."),
        ("hydra_ntd_cnn", _ZOO,
         "FedNTD's CNN (McMahan et al.'s MNIST CNN; HYDRA-FL §4.2, App. D) with HYDRA-FL's ..."),
        ("mlp_bn", _ZOO, ":func:`fedcore.models.mlp` with BatchNorm: per hidden width a block Linear (no ..."),
        ("mnist_cnn", _ZOO, "Small CNN: conv 1->16 5x5 pad 2, ReLU, pool; conv 16->32 5x5 pad 2, ReLU, pool; ..."),
        ("mnist_cnn_bn", _ZOO, ":func:`mnist_cnn` with BatchNorm after each conv (bias-free convs), for DistFL ..."),
        ("mnist_mlp", _ZOO, "McMahan et al.'s 2NN: flatten, fc 784->200, ReLU, fc 200->200, ReLU, fc 200->C ..."),
        ("moon_cnn", _ZOO, "MOON's CNN (MOON's CIFAR-10 base encoder + projection head; HYDRA-FL App. D) ..."),
        ("resnet18_cifar", _ZOO,
         "ResNet-18 for 32x32 inputs: 3x3 stem conv 64 + BN + ReLU (no max-pool), 4 stages ..."),
        ("vgg11_bn", _ZOO, "VGG-11 (configuration A) with BatchNorm after every conv; head = global average ..."),
):
    MODELS.declare(_name, _module, summary=_summary, options_at_registration=True)


@dataclass(frozen=True)
class ModelInput:
    """What a registered model takes, declared at registration (``register_model(name, takes=...)``).

    ``shape``: one sample without the batch dimension, each size an int or the name of the factory keyword that
    sets it (``("in_channels", "image_size", "image_size")``), read with the keyword's default unless
    ``model.kwargs`` sets it. ``dtype``: ``"float32"`` or ``"int64"`` (symbol indices). ``flat``: the model
    flattens its input first, so any sample with as many values fits. ``num_classes``: the keyword that sets the
    number of scores it answers with (or that number; None: not declared)."""

    shape: tuple[int | str, ...]
    dtype: str = "float32"
    flat: bool = False
    num_classes: int | str | None = "num_classes"


@dataclass(frozen=True)
class InputShape:
    """A model's declared input under given keyword arguments (:func:`model_input`): sizes resolved, plus the
    keywords that set them (``set_by``, in order) and the declaration itself (for a hint of what to set)."""

    shape: tuple[int, ...]
    dtype: str
    flat: bool
    num_classes: int | None
    set_by: tuple[str, ...]
    declared: ModelInput
    arguments: Mapping[str, Any]

    @property
    def size(self) -> int:
        """The number of values in one sample."""
        return math.prod(self.shape)

    def describe(self) -> str:
        """``[60] float32 (flattened: any shape of 60 values; set by model.kwargs.in_features)``."""
        notes = [f"flattened: any shape of {self.size} values"] if self.flat else []
        if self.set_by:
            notes.append("set by " + ", ".join(f"model.kwargs.{k}" for k in self.set_by))
        return f"{list(self.shape)} {self.dtype}" + (f" ({'; '.join(notes)})" if notes else "")


# name -> (the factory the declaration was registered with, the declaration); a name registered again without
# one, or re-registered with another factory, declares nothing
_INPUTS: dict[str, tuple[ModelFactory, ModelInput]] = {}


def _size(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def model_input(name: str, kwargs: Mapping[str, Any] | None = None) -> InputShape | None:
    """What registered model ``name`` takes under ``kwargs``, from its declaration alone (nothing is built): None
    for an import path, a model that declares nothing, or keyword arguments its factory would not take or that do
    not give whole sizes (building it will say why)."""
    if ":" in name or name not in MODELS:
        return None
    factory = MODELS.get(name)
    entry = _INPUTS.get(name)
    if entry is None or entry[0] is not factory:
        return None
    declared = entry[1]
    try:
        bound = inspect.signature(factory).bind(**dict(kwargs or {}))
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    shape: list[int] = []
    set_by: list[str] = []
    for dim in declared.shape:
        size = _size(arguments.get(dim)) if isinstance(dim, str) else _size(dim)
        if size is None:
            return None
        shape.append(size)
        if isinstance(dim, str) and dim not in set_by:
            set_by.append(dim)
    classes = declared.num_classes
    num_classes = _size(arguments.get(classes) if isinstance(classes, str) else classes)
    if classes is not None and num_classes is None:
        return None
    return InputShape(tuple(shape), declared.dtype, declared.flat, num_classes, tuple(set_by), declared, arguments)


def _field_type(tp: Any) -> Any:
    """An annotation as an options field type the config decoder checks: ``Sequence[X]`` is read as
    ``tuple[X, ...]`` (a TOML list), in unions too; everything else as annotated."""
    origin = typing.get_origin(tp)
    if origin is collections.abc.Sequence:
        args = typing.get_args(tp)
        return tuple[args[0], ...] if args else tuple  # type: ignore[valid-type]
    if origin in (typing.Union, types.UnionType):
        args = tuple(_field_type(a) for a in typing.get_args(tp))
        return typing.Union[args]  # noqa: UP007
    return tp


def _copier(value: Any) -> Callable[[], Any]:
    def fresh() -> Any:
        return copy.deepcopy(value)

    return fresh


def options_of_factory(name: str, factory: Callable[..., Any]) -> type | None:
    """A frozen dataclass of ``factory``'s keyword arguments (names, types from the annotations, defaults
    identical; a keyword without a default is a required field), or None when its keywords cannot be listed
    (``**kwargs``, positional-only parameters, no signature): such a factory is given its ``model.kwargs`` as is."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params.values()):
        return None
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # an annotation that does not resolve: the field takes any value
        hints = {}
    fields: list[tuple[str, Any, Any]] = []
    for p in params.values():
        tp = _field_type(hints.get(p.name, Any))
        if p.default is inspect.Parameter.empty:
            fields.append((p.name, tp, dataclasses.field()))
        elif isinstance(p.default, (list, dict, set)):  # a mutable default: a fresh copy of it each time
            fields.append((p.name, tp, dataclasses.field(default_factory=_copier(p.default))))
        else:
            fields.append((p.name, tp, dataclasses.field(default=p.default)))
    title = "".join(part.capitalize() for part in name.replace("-", "_").split("_")) or "Model"
    cls = dataclasses.make_dataclass(f"{title}Options", fields, frozen=True, kw_only=True)
    cls.__doc__ = f"The keyword arguments of model {name!r} ({getattr(factory, '__qualname__', factory)})."
    return cls


def _first_sentence(factory: Callable[..., Any], limit: int = 84) -> str:
    """The first sentence of ``factory``'s docstring (cut at a word to ``limit`` characters): its one line."""
    paragraph = " ".join((inspect.getdoc(factory) or "").split("\n\n")[0].split())
    sentence, cut = paragraph, 0
    while (cut := paragraph.find(". ", cut) + 1) > 0:  # the first ". " outside parentheses ("App. D")
        if paragraph.count("(", 0, cut) == paragraph.count(")", 0, cut):
            sentence = paragraph[:cut]
            break
    sentence = sentence.rstrip(".")
    if len(sentence) > limit:
        sentence = sentence[: limit - 3].rsplit(" ", 1)[0] + " ..."
    return sentence


def register_model(name: str, *, summary: str = "",
                   takes: ModelInput | None = None) -> Callable[[ModelFactory], ModelFactory]:
    """Register ``factory`` as model ``name`` with the options dataclass of its keyword arguments; ``takes``
    declares what it takes (:class:`ModelInput`; without it a preflight runs the model on one sample)."""

    def deco(factory: ModelFactory) -> ModelFactory:
        MODELS.add(name, factory, options=options_of_factory(name, factory),
                   summary=summary or _first_sentence(factory))
        if takes is not None:
            _INPUTS[name] = (factory, takes)
        else:
            _INPUTS.pop(name, None)
        return factory

    return deco


def check_model_kwargs(name: str, kwargs: Mapping[str, Any] | None, path: str = "model.kwargs") -> None:
    """Validate ``kwargs`` of registered model ``name`` through its options dataclass (:class:`ConfigError`
    naming ``path.<keyword>``); an import path or a model whose keywords cannot be listed is left to its factory."""
    if ":" in name or name not in MODELS:
        return
    if MODELS.options_type(name) is None:
        return
    MODELS.parse_options(name, kwargs, path)


def available_models() -> list[str]:
    return MODELS.names()


def is_registered_model(name: str) -> bool:
    """A model built in (or registered by this process's own code); never an import path."""
    return ":" not in name and name in MODELS.names()
