"""``aggregation.secure`` and ``[secagg]``: off by default; everything that needs each update is refused at start,
naming the field and the reason; the announcement to the devices round-trips through the wire."""

from __future__ import annotations

from typing import Any

import pytest

from fedcore.config import ConfigError, ServerConfig, build_config, effective_aggregation
from fedcore.secagg.config import SecureAggregationConfig, SecureSettings
from fedguard import wire
from fedserver.secure_round import settings_of

SECURE = (["aggregation", "secure"], "secagg+")


def _config(*overrides: tuple[list[str], Any]) -> ServerConfig:
    return build_config(ServerConfig, None, [(["security", "insecure"], True), *overrides])


def test_off_by_default_and_announced_only_when_on() -> None:
    assert _config().aggregation.secure == "off"
    assert settings_of(_config()) is None
    on = _config(SECURE, (["aggregation", "clip_norm"], 2.0), (["aggregation", "weighted"], False),
                 (["secagg", "norm_bound"], 5.0))
    s = settings_of(on)
    assert s is not None and s.clip_norm == 2.0 and not s.weighted and s.config.norm_bound == 5.0
    assert wire.secure_settings_from_pb(wire.secure_settings_to_pb(s)) == s


@pytest.mark.parametrize(("overrides", "field", "words"), [
    ([(["aggregation", "rule"], "median")], "aggregation.secure", "rule 'median' needs each update"),
    ([(["aggregation", "rule"], "trimmed_mean")], "aggregation.secure", "robust rules are impossible"),
    ([(["aggregation", "rule"], "krum"), (["rounds", "clients_per_round"], 10)], "aggregation.secure", "'krum'"),
    ([(["aggregation", "rule"], "multi_krum"), (["rounds", "clients_per_round"], 10)], "aggregation.secure",
     "'multi_krum'"),
    ([(["aggregation", "rule"], "bulyan"), (["rounds", "clients_per_round"], 12)], "aggregation.secure",
     "'bulyan'"),
    ([(["aggregation", "rule"], "knorm")], "aggregation.secure", "'knorm'"),
    ([(["aggregation", "exact_metrics"], True)], "aggregation.secure", "exact_metrics keeps every update"),
    ([(["distfl", "enabled"], True)], "aggregation.secure", "DistFL clusters the individual models"),
    ([(["adaptive_clip", "enabled"], True)], "aggregation.secure",
     "adaptive clipping"),
    ([(["rounds", "clients_per_round"], 2)], "aggregation.secure", "at least secagg.min_clients = 3"),
    ([(["rounds", "over_select"], 2.0)], "rounds.over_select", "at most secagg.max_dropout of the 20 selected (6)"),
    ([(["secagg", "neighbours"], 3)], "secagg.neighbours", "even integer"),
    ([(["secagg", "max_dropout"], 0.6)], "secagg.max_dropout", "[0, 0.5)"),
    ([(["secagg", "phase_timeout_s"], 0.0)], "secagg.phase_timeout_s", "> 0"),
])
def test_refused_at_start_naming_the_field_and_the_reason(overrides: list[tuple[list[str], Any]], field: str,
                                                          words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(SECURE, *overrides).validate()
    assert err.value.field == field
    assert words in str(err.value)


def test_over_selection_within_the_dropouts_is_allowed() -> None:
    c = _config(SECURE, (["rounds", "over_select"], 1.3)).validate()
    assert c.rounds.num_selected == 13


def test_unknown_protocol_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"aggregation\.secure: one of 'off', 'secagg\+'"):
        _config((["aggregation", "secure"], "homomorphic")).validate()


def test_the_delta_detector_runs_on_the_sum_without_exact_metrics() -> None:
    c = _config(SECURE, (["nfl", "detector"], "delta")).validate()
    assert not effective_aggregation(c).exact_metrics
    assert effective_aggregation(_config((["nfl", "detector"], "delta"))).exact_metrics


def test_announced_settings_are_checked_by_the_device() -> None:
    bad = wire.secure_settings_to_pb(SecureSettings(SecureAggregationConfig()))
    bad.max_dropout = 0.7
    with pytest.raises(wire.SerializationError, match="max_dropout"):
        wire.secure_settings_from_pb(bad)
