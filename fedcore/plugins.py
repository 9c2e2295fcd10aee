"""Every plugin registry by the name of its list, with each plugin's one line, read without importing torch.

The built-in plugins are declared by name in the torch-free modules that hold their registries
(:meth:`fedcore.registry.Registry.declare`), so the command lines build their choice lists and help texts from the
registries themselves, at ``--help`` time, and the configuration reference (:mod:`fedcore.config_doc`) lists the same
plugins: a plugin registered or declared anywhere shows up everywhere, with nothing generated or kept by hand.
"""

from __future__ import annotations

from typing import Any

from fedcore.aggregation.config import RULES
from fedcore.attacks.config import ATTACKS
from fedcore.data.base import DATASETS
from fedcore.data.partition import PARTITION_KINDS
from fedcore.models.registry import MODELS
from fedcore.nfl.config import DETECTORS, MODES
from fedcore.registry import Registry
from fedcore.server_opt.config import SERVER_OPTIMIZERS
from fedcore.train.registry import TRAINERS

# The lists by name, in the order the configuration reference shows them (NFL_MODES is a fixed list, no registry).
KEYS = ("TRAINERS", "RULES", "DETECTORS", "ATTACKS", "PARTITIONS", "DATASETS", "MODELS", "NFL_MODES",
        "SERVER_OPTIMIZERS")


def registries() -> dict[str, Registry[Any]]:
    """The plugin registries by list name."""
    return {"TRAINERS": TRAINERS, "RULES": RULES, "DETECTORS": DETECTORS, "ATTACKS": ATTACKS,
            "PARTITIONS": PARTITION_KINDS, "DATASETS": DATASETS, "MODELS": MODELS,
            "SERVER_OPTIMIZERS": SERVER_OPTIMIZERS}


def names(key: str) -> tuple[str, ...]:
    """The names in list ``key`` now (registered or declared), sorted; NFL modes in their fixed order."""
    if key == "NFL_MODES":
        return tuple(MODES)
    return tuple(registries()[key].names())


def listed() -> dict[str, tuple[str, ...]]:
    """Every list by name."""
    return {key: names(key) for key in KEYS}


def summaries() -> dict[str, dict[str, str]]:
    """Each registry's one-line summaries, by name (registries without any left out)."""
    out: dict[str, dict[str, str]] = {}
    for key, reg in registries().items():
        lines = {name: line for name, line in reg.summaries().items() if line}
        if lines:
            out[key] = lines
    return out


def one_of(choices: tuple[str, ...]) -> str:
    """``a, b or c`` for a help text."""
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else "".join(choices)


def described(key: str) -> str:
    """``a: what a is; b: ...; c`` for a help text: the names of ``key`` with their one-line summaries."""
    lines = summaries().get(key, {})
    return "; ".join(f"{n}: {lines[n]}" if lines.get(n) else n for n in names(key))
