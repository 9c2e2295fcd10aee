"""The configuration error every part of fedcore raises, in a leaf module so that any part can import it.

It lives apart from :mod:`fedcore.config` because plugins (rules, trainers, detectors, attacks, partitions, models)
validate their own options and raise it, while the top-level config imports the plugins: keeping the error here is
what keeps the import graph free of circles. It imports nothing from fedcore.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message starts with the field's dotted path."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path

    def under(self, prefix: str) -> ConfigError:
        """The same error with its field path placed under ``prefix`` (a plugin's options inside a config slot)."""
        if not prefix:
            return self
        return ConfigError(f"{prefix}.{self.field}" if self.field else prefix, str(self)[len(self.field) + 2:])


def require(cond: bool, field_path: str, message: str) -> None:
    """Raise :class:`ConfigError` naming ``field_path`` unless ``cond``: the one check every config section uses."""
    if not cond:
        raise ConfigError(field_path, message)
