"""Strict JSON for every file a run writes: ``null`` for a number that is not finite, never ``NaN``/``Infinity``.

Python's :mod:`json` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default; they are not JSON (RFC 8259), and
``jq``, JavaScript's ``JSON.parse``, Go's ``encoding/json`` and most other parsers refuse the whole line. Writers
go through :func:`dumps`, which turns every non-finite float (at any depth) into ``null`` and then serialises with
``allow_nan=False``, so a non-finite value that slipped through would raise instead of writing a bad file.

Readers (:func:`loads`) accept both: files written before this module (which may hold ``NaN``) and strict ones.
What ``null`` means is the reader's business: :meth:`fedcore.report.RoundReport.from_dict` and
:func:`number` read it back as NaN ("no value this round").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps", "finite_or_none", "loads", "number", "strict_loads"]


def finite_or_none(value: Any) -> Any:
    """``value`` with every float that is NaN or infinite replaced by None (dicts, lists and tuples walked)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text of ``value`` (non-finite floats as ``null``); keyword arguments as :func:`json.dumps`.

    The common case (every float finite, plain dicts and lists) is serialised as it is; only a value that
    ``allow_nan=False`` refuses (a non-finite float) or that json cannot take as it is (a non-dict mapping) is
    walked by :func:`finite_or_none` first: the same text, without a Python-level walk of every log line."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except (ValueError, TypeError):
        return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def loads(text: str | bytes) -> Any:
    """JSON text, strict or not (``NaN``/``Infinity`` of older files are read as floats)."""
    return json.loads(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def strict_loads(text: str | bytes) -> Any:
    """JSON text that must be strict: ``NaN``, ``Infinity`` and ``-Infinity`` raise :class:`ValueError`."""
    return json.loads(text, parse_constant=_refuse_constant)


def number(value: Any) -> float:
    """A JSON number as a float: ``null`` (or a missing value) is NaN."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number or null, got {value!r}")
    return float(value)
