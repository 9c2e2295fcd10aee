"""Dataclasses from TOML tables: the one decoder for configs and plugin options, with the field path in every error.

A leaf module (it imports only :mod:`fedcore.errors`) so that plugins can decode their own options without
importing :mod:`fedcore.config`, which imports them.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Union

from fedcore.errors import ConfigError

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types are errors naming the field.

    A class with a ``from_table(data, path)`` classmethod decodes itself (a section that holds a plugin's name and
    options, and maps the old flat keys of those options into them); it calls :func:`decode_fields`."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected a table, got {type(data).__name__}")
    hook = getattr(cls, "from_table", None)
    if callable(hook):
        decoded: T = hook(data, path)
        return decoded
    return decode_fields(cls, data, path)


def decode_fields(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """:func:`from_dict` field by field, without the class's ``from_table`` hook."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        fpath = f"{path}.{key}" if path else key
        if key not in fields or not fields[key].init:
            raise ConfigError(fpath, f"unknown field; known: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(hints[key], value, fpath)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(path or "<root>", str(e)) from None


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_dict(tp, value, path)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path)
            except ConfigError:
                continue
        raise ConfigError(path, f"expected {tp}, got {value!r}")
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a table, got {value!r}")
        return dict(value)
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(path, f"expected a list, got {value!r}")
        item_types = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = [_coerce(item_types[0], v, f"{path}[{i}]") for i, v in enumerate(value)] if item_types else list(value)
        return tuple(items) if (origin or tp) is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(path, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {value!r}")
    return value


def join(path: str, key: str) -> str:
    """``path.key``, or ``key`` at the top level."""
    return f"{path}.{key}" if path else key


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain nested dicts (what a TOML table or a JSON record holds)."""
    return dataclasses.asdict(obj)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` with value read as a TOML literal (bare words are strings)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError("--set", f"expected section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().split("."), value
