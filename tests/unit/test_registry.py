"""The plugin registry: names, one-line summaries, and options validated by the plugin with the field's path."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fedcore.errors import ConfigError
from fedcore.registry import Registry


@dataclass(frozen=True)
class _Options:
    ratio: float = 0.1

    def validate(self) -> _Options:
        if not 0 <= self.ratio < 0.5:
            raise ValueError(f"ratio: must be in [0, 0.5), got {self.ratio}")
        return self


def _registry() -> Registry[str]:
    reg: Registry[str] = Registry("thing", ValueError)
    reg.add("plain", "p", summary="takes no options")
    reg.add("tuned", "t", options=_Options, summary="takes a ratio")
    return reg


def test_options_are_decoded_and_validated_by_the_plugin_naming_the_field() -> None:
    reg = _registry()
    assert reg.parse_options("tuned", {"ratio": 0.25}, "aggregation.options") == _Options(0.25)
    assert reg.parse_options("tuned", None, "aggregation.options") == _Options()
    with pytest.raises(ConfigError, match=r"^aggregation\.options\.ratio: expected a number"):
        reg.parse_options("tuned", {"ratio": "x"}, "aggregation.options")
    with pytest.raises(ConfigError,
                       match=r"^aggregation\.options\.nope: thing 'tuned' has no option 'nope'; its options: ratio"):
        reg.parse_options("tuned", {"nope": 1}, "aggregation.options")
    with pytest.raises(ConfigError, match=r"^aggregation\.options: ratio: must be in \[0, 0\.5\)"):
        reg.parse_options("tuned", {"ratio": 0.7}, "aggregation.options")
    with pytest.raises(ConfigError, match=r"^x\.options: thing 'plain' takes no options, got \['a'\]"):
        reg.parse_options("plain", {"a": 1}, "x.options")
    assert reg.parse_options("plain", {}, "x.options") is None


def test_options_named_by_path_are_imported_when_needed() -> None:
    reg: Registry[str] = Registry("thing", ValueError)
    reg.add("lazy", "l", options=f"{__name__}:_Options")
    assert reg.plugin("lazy").options_type() is _Options
    assert reg.parse_options("lazy", {"ratio": 0.3}, "x.options") == _Options(0.3)


def test_summaries_and_unknown_names() -> None:
    reg = _registry()
    assert reg.summaries() == {"plain": "takes no options", "tuned": "takes a ratio"}
    assert reg.plugin("tuned").options is _Options and reg.get("plain") == "p"
    with pytest.raises(ValueError, match="unknown thing 'x'; known: plain, tuned"):
        reg.get("x")


def test_a_config_error_moves_under_a_prefix() -> None:
    e = ConfigError("trim_m", "must be >= 0, got -1").under("aggregation.options")
    assert str(e) == "aggregation.options.trim_m: must be >= 0, got -1" and e.field == "aggregation.options.trim_m"
    assert str(e.under("")) == str(e)
