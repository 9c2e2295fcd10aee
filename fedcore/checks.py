"""Small value checks shared by the configuration sections and the state machines' ``from_dict``.

No imports beyond the standard library, so that every config module (which must not import
:mod:`fedcore.config` at import time) can use them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


def is_int(v: object) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v: object) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_known_fields(cls: type[Any], d: Mapping[str, Any], what: str) -> None:
    """Raise :class:`ValueError` naming the first key of ``d`` that is not a field of dataclass ``cls``."""
    known = {f.name for f in dataclasses.fields(cls)}
    for k in d:
        if k not in known:
            raise ValueError(f"{k}: unknown {what} field; known: {', '.join(sorted(known))}")
