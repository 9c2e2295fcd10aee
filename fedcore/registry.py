"""A named registry: models, datasets and aggregation rules plug in by name through one mechanism."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to entries (factories, loaders); unknown names raise ``error`` listing the known ones."""

    def __init__(self, kind: str, error: type[Exception] = KeyError) -> None:
        self.kind = kind
        self.error = error
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T, *, replace: bool = False) -> None:
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Forget ``name`` (a plugin unloaded, a test's temporary entry); unknown names raise ``error``."""
        self.get(name)
        del self._entries[name]

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(entry: T) -> T:
            self.add(name, entry)
            return entry

        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
