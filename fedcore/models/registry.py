"""The model registry (names -> factories), a leaf of :mod:`fedcore.models`: the zoo registers into it without
importing the package that imports the zoo (no import circle)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fedcore.registry import Registry

ModelFactory = Callable[..., nn.Module]


class ModelError(ValueError):
    """Unknown model name, bad factory path or bad model arguments."""


MODELS: Registry[ModelFactory] = Registry("model", ModelError)


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    return MODELS.register(name)


def available_models() -> list[str]:
    return MODELS.names()


def is_registered_model(name: str) -> bool:
    """A model built in (or registered by this process's own code); never an import path."""
    return ":" not in name and name in MODELS.names()
