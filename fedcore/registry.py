"""One registry type for every plugin: aggregation rules, trainers, NFL detectors, attacks, partitions, models.

A plugin registers a name, the factory that builds it, the frozen dataclass of its options and one line saying what
it is. The top-level configuration holds ``name + options`` per slot and hands the options to the plugin
(:meth:`Registry.parse_options`), so an error names the config field (``recovery.options.l_fb: ...``); the command
lines and the configuration reference list the names and the lines (:mod:`fedcore.names`,
:mod:`fedcore.config_doc`). A leaf module: it imports only :mod:`fedcore.errors` and :mod:`fedcore.options`, so
any part of fedcore can hold a registry without an import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fedcore.errors import ConfigError
from fedcore.options import from_dict

T = TypeVar("T")


@dataclass(frozen=True)
class Plugin(Generic[T]):
    """A registered entry: what builds it, its options' dataclass (None: it takes none) and one line about it.

    ``options`` may be given as ``"package.module:Class"`` for a plugin whose module is imported only when it is
    first built (a deferred trainer): :meth:`options_type` imports it then."""

    name: str
    factory: T
    options: type | str | None = None
    summary: str = ""

    def options_type(self) -> type | None:
        if isinstance(self.options, str):
            module, _, attribute = self.options.partition(":")
            found: type = getattr(importlib.import_module(module), attribute)
            return found
        return self.options


class Registry(Generic[T]):
    """Maps names to plugins; unknown names raise ``error`` listing the known ones."""

    def __init__(self, kind: str, error: type[Exception] = KeyError) -> None:
        self.kind = kind
        self.error = error
        self._entries: dict[str, Plugin[T]] = {}

    def add(self, name: str, entry: T, *, options: type | str | None = None, summary: str = "",
            replace: bool = False) -> None:
        """Register ``entry`` (a factory, a loader, a step function) under ``name``."""
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = Plugin(name, entry, options, summary)

    def remove(self, name: str) -> None:
        """Forget ``name`` (a plugin unloaded, a test's temporary entry); unknown names raise ``error``."""
        self.plugin(name)
        del self._entries[name]

    def register(self, name: str, *, options: type | str | None = None, summary: str = "") -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(entry: T) -> T:
            self.add(name, entry, options=options, summary=summary)
            return entry

        return deco

    def plugin(self, name: str) -> Plugin[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def get(self, name: str) -> T:
        """The factory registered under ``name``."""
        return self.plugin(name).factory

    def names(self) -> list[str]:
        return sorted(self._entries)

    def summaries(self) -> dict[str, str]:
        """Name -> the one line each plugin registered about itself, by name."""
        return {name: self._entries[name].summary for name in self.names()}

    def parse_options(self, name: str, table: Mapping[str, Any] | None, path: str) -> Any:
        """Plugin ``name``'s options decoded from ``table`` and validated by the plugin's dataclass (its
        ``validate()`` when it has one); every error is a :class:`ConfigError` naming ``path.<field>``."""
        options_type = self.plugin(name).options_type()
        table = dict(table or {})
        if options_type is None:
            if table:
                raise ConfigError(path, f"{self.kind} {name!r} takes no options, got {sorted(table)}")
            return None
        options: Any = from_dict(options_type, table, path)
        validate = getattr(options, "validate", None)
        if callable(validate):
            try:
                validate()
            except ConfigError as e:
                raise e.under(path) from None
            except ValueError as e:
                raise ConfigError(path, str(e)) from None
        return options

    def __contains__(self, name: object) -> bool:
        return name in self._entries
