"""One registry type for every plugin: aggregation rules, trainers, NFL detectors, attacks, partitions, models.

A plugin registers a name, the factory that builds it, the frozen dataclass of its options and one line saying what
it is. The top-level configuration holds ``name + options`` per slot and hands the options to the plugin
(:meth:`Registry.parse_options`), so an error names the config field (``recovery.options.l_fb: ...``); the command
lines and the configuration reference list the names and the lines (:mod:`fedcore.config_doc`). A leaf module:
it imports only :mod:`fedcore.errors` and :mod:`fedcore.options`, so any part of fedcore can hold a registry without
an import circle.

Built-in plugins are *declared* (:meth:`Registry.declare`): their name, their one line and the module that
registers them, in the torch-free module that holds the registry. The names are then known without importing the
implementation (``--help``, configuration checks, ``import fedcore.config`` load no torch); the module is imported
when a plugin is first looked up, and registers it there with :meth:`Registry.add`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fedcore.errors import ConfigError
from fedcore.options import from_dict, join

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


@dataclass(frozen=True)
class Declared:
    """A plugin known by name before its module is imported (:meth:`Registry.declare`)."""

    module: str
    options: type | str | None
    summary: str
    options_at_registration: bool = False


class Registry(Generic[T]):
    """Maps names to plugins; unknown names raise ``error`` listing the known ones."""

    def __init__(self, kind: str, error: type[Exception] = KeyError) -> None:
        self.kind = kind
        self.error = error
        self._entries: dict[str, Plugin[T]] = {}
        # Declared, not yet registered: name -> what registers it, its options' dataclass and its one line.
        self._declared: dict[str, Declared] = {}

    def declare(self, name: str, module: str, *, options: type | str | None = None, summary: str,
                options_at_registration: bool = False) -> None:
        """Make ``name`` known before its implementation is imported: ``module`` registers it (:meth:`add`) when
        imported, which the first :meth:`plugin` / :meth:`get` of ``name`` does. ``options`` (its options'
        dataclass, best from a torch-free module, so that reading a configuration imports no implementation) and
        ``summary`` (its one line) are the plugin's; the registration in ``module`` gives neither again -- unless
        ``options_at_registration``: the options are made when it registers (a model's, from its factory's
        keywords), and asking for them imports ``module``."""
        if name in self._entries or name in self._declared:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._declared[name] = Declared(module, options, summary, options_at_registration)

    def add(self, name: str, entry: T, *, options: type | str | None = None, summary: str = "",
            replace: bool = False) -> None:
        """Register ``entry`` (a factory, a loader, a step function) under ``name``; a declared name takes its
        declared one line unless ``summary`` gives another."""
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        declared = self._declared.pop(name, None)
        if declared is not None:
            options = declared.options if options is None else options
            summary = summary or declared.summary
        self._entries[name] = Plugin(name, entry, options, summary)

    def remove(self, name: str) -> None:
        """Forget ``name`` (a plugin unloaded, a test's temporary entry); unknown names raise ``error``."""
        if self._declared.pop(name, None) is not None:
            return
        self.plugin(name)
        del self._entries[name]

    def register(self, name: str, *, options: type | str | None = None, summary: str = "") -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(entry: T) -> T:
            self.add(name, entry, options=options, summary=summary)
            return entry

        return deco

    def plugin(self, name: str) -> Plugin[T]:
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        declared = self._declared.get(name)
        if declared is None:
            raise self.error(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        importlib.import_module(declared.module)
        entry = self._entries.get(name)
        if entry is None:
            raise RuntimeError(f"{self.kind} {name!r} is declared in {declared.module}, which did not register it")
        return entry

    def options_type(self, name: str) -> type | None:
        """Plugin ``name``'s options dataclass (None: it takes none); a declared plugin's without importing it."""
        declared = self._declared.get(name)
        if declared is not None and not declared.options_at_registration:
            return Plugin(name, None, declared.options).options_type()
        return self.plugin(name).options_type()

    def get(self, name: str) -> T:
        """The factory registered under ``name``."""
        return self.plugin(name).factory

    def names(self) -> list[str]:
        """Every name, registered or declared (no implementation is imported)."""
        return sorted([*self._entries, *self._declared])

    def summaries(self) -> dict[str, str]:
        """Name -> the one line each plugin registered or was declared with, by name."""
        return {name: self._entries[name].summary if name in self._entries else self._declared[name].summary
                for name in self.names()}

    def declared_in(self, name: str) -> str | None:
        """The module a declared, not yet registered ``name`` is registered by (None once registered)."""
        declared = self._declared.get(name)
        return None if declared is None else declared.module

    def parse_options(self, name: str, table: Mapping[str, Any] | None, path: str) -> Any:
        """Plugin ``name``'s options decoded from ``table`` and validated by the plugin's dataclass (its
        ``validate()`` when it has one); every error is a :class:`ConfigError` naming ``path.<field>``."""
        options_type = self.options_type(name)
        if table is not None and not isinstance(table, Mapping):
            raise ConfigError(path, f"expected a table of {self.kind} {name!r}'s options, got {table!r}")
        table = dict(table or {})
        if options_type is None:
            if table:
                raise ConfigError(path, f"{self.kind} {name!r} takes no options, got {sorted(table)}")
            return None
        self._known_options(name, options_type, table, path)
        options: Any = from_dict(options_type, table, path)
        self.validate_options(name, options, path)
        return options

    def coerce_options(self, name: str, options: Any, path: str) -> Any:
        """Plugin ``name``'s options from what a constructor was given: None (the plugin's defaults), a table
        (decoded, not yet validated: :meth:`validate_options`) or the plugin's options dataclass itself. Another
        plugin's options are a :class:`ConfigError` naming ``path``. An unknown name leaves ``options`` as given."""
        if name not in self:
            return options
        options_type = self.options_type(name)
        if options is None or (isinstance(options, Mapping) and not options and options_type is None):
            return None if options_type is None else options_type()
        if isinstance(options, Mapping):
            if options_type is None:
                raise ConfigError(path, f"{self.kind} {name!r} takes no options, got {sorted(options)}")
            self._known_options(name, options_type, options, path)
            return from_dict(options_type, options, path)
        if options_type is None or not isinstance(options, options_type):
            wanted = "no options" if options_type is None else f"{options_type.__name__}"
            raise ConfigError(path, f"{self.kind} {name!r} takes {wanted}, got {type(options).__name__}")
        return options

    def _known_options(self, name: str, options_type: type, table: Mapping[str, Any], path: str) -> None:
        """Refuse an option plugin ``name`` does not declare, naming it and the ones it does."""
        declared = [f.name for f in dataclasses.fields(options_type) if f.init]
        for key in table:
            if key not in declared:
                raise ConfigError(join(path, str(key)), f"{self.kind} {name!r} has no option {key!r}; its options: "
                                                        f"{', '.join(declared)}")

    def validate_options(self, name: str, options: Any, path: str) -> None:
        """Run the ``validate()`` of plugin options (as :meth:`parse_options` does); errors name ``path.<field>``."""
        validate = getattr(options, "validate", None)
        if callable(validate):
            try:
                validate()
            except ConfigError as e:
                raise e.under(path) from None
            except ValueError as e:
                raise ConfigError(path, str(e)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._declared


def option_names(registry: Registry[Any], name: str) -> list[str]:
    """The option fields plugin ``name`` declares (none for an unknown name or a plugin without options)."""
    if name not in registry:
        return []
    options_type = registry.options_type(name)
    if options_type is None:
        return []
    return [f.name for f in dataclasses.fields(options_type) if f.init]


def _same(a: Any, b: Any) -> bool:
    """Equal as a config value: lists and tuples alike (a JSON round trip), NaN equal to NaN."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def fold_flat_options(registry: Registry[Any], name: Any, table: Mapping[str, Any], flat: Mapping[str, Any], *,
                      path: str, options_key: str = "options") -> dict[str, Any]:
    """``table`` (a config section naming plugin ``name``) with its old flat option keys moved into
    ``table[options_key]``: the backward-compatible reading of a section written before the plugin owned them.

    ``flat`` maps each old flat key to its old default. A flat key that plugin ``name`` declares as an option goes
    into its options (given there too with another value: refused); one it does not declare is refused, naming the
    new key and the plugin's options -- unless it holds the old default, which meant nothing for this plugin (a
    whole section written out by the old code) and is dropped. For a name not registered the keys are moved
    unchanged (the name's own error comes first)."""
    data = dict(table)
    moved = {key: data.pop(key) for key in list(data) if key in flat}
    if not moved:
        return data
    options = data.get(options_key)
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(join(path, options_key), f"expected a table, got {options!r}")
    options = dict(options)
    known = isinstance(name, str) and name in registry
    declared = option_names(registry, name) if known else list(moved)
    for key, value in moved.items():
        new_key = join(join(path, options_key), key)
        if key in declared:
            if key in options and not _same(options[key], value):
                raise ConfigError(new_key, f"given twice, as {new_key} = {options[key]!r} and as the old flat key "
                                           f"{join(path, key)} = {value!r}; keep one")
            options[key] = value
        elif not _same(value, flat[key]):
            has = ", ".join(declared) if declared else "none"
            raise ConfigError(new_key, f"{registry.kind} {name!r} has no option {key!r} (given as the old flat key "
                                       f"{join(path, key)}); its options: {has}")
    data[options_key] = options
    return data


def options_as(options: Any, cls: type[T], what: str) -> T:
    """``options`` as plugin options of type ``cls`` (a section's parsed options, read by the plugin that declared
    them); a :class:`TypeError` naming ``what`` when they are of another plugin."""
    if not isinstance(options, cls):
        raise TypeError(f"{what}: expected {cls.__name__} options, got {type(options).__name__}")
    return options


def deferred(path: str) -> Callable[..., Any]:
    """The callable at ``"package.module:attribute"``, imported on its first call: a plugin registered in a
    torch-free module whose implementation imports torch (a trainer's factory, an attack's update hook)."""
    module, sep, attribute = path.partition(":")
    if not (sep and module and attribute):
        raise ValueError(f"expected 'package.module:attribute', got {path!r}")

    def call(*args: Any, **kwargs: Any) -> Any:
        target: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
        return target(*args, **kwargs)

    call.__name__ = attribute
    call.__qualname__ = attribute
    return call
