"""Simulated device behaviour: seeded fates, lognormal stragglers, availability windows, traces, config checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedcore.config import ClientConfig, ConfigError, build_config
from fedcore.simulation import (
    ANSWER,
    CRASH,
    DROP,
    Fate,
    SimulationConfig,
    drawn_fate,
    load_trace,
    next_online,
    online_at,
    round_fate,
    trace_windows,
)


def test_fates_are_seeded_by_client_round_and_task_not_by_global_state() -> None:
    c = SimulationConfig(dropout=0.3, crash=0.1, straggler="lognormal", straggler_delay_s=1.0)
    np.random.seed(1)
    a = [round_fate(c, "client-7", r) for r in range(50)]
    np.random.seed(2)
    assert a == [round_fate(c, "client-7", r) for r in range(50)]
    assert a != [round_fate(c, "client-8", r) for r in range(50)]
    assert round_fate(c, "client-7", 3, 0) != round_fate(c, "client-7", 3, 1) or \
        round_fate(c, "client-7", 4, 0) != round_fate(c, "client-7", 4, 1)
    other_seed = SimulationConfig(dropout=0.3, crash=0.1, straggler="lognormal", straggler_delay_s=1.0, seed=1)
    assert a != [round_fate(other_seed, "client-7", r) for r in range(50)]


def test_dropout_and_crash_rates_match_their_probabilities() -> None:
    c = SimulationConfig(dropout=0.3, crash=0.2)
    fates = [round_fate(c, f"c{i}", r).outcome for i in range(100) for r in range(40)]
    drop, crash = fates.count(DROP) / len(fates), fates.count(CRASH) / len(fates)
    assert abs(drop - 0.3) < 0.02
    assert abs(crash - 0.7 * 0.2) < 0.02  # a crash needs the task to be answered first
    assert all(f.outcome == ANSWER and f.delay_s == 0 for f in (round_fate(SimulationConfig(), "c", r)
                                                                 for r in range(20)))


def test_lognormal_straggler_delay_has_the_configured_median_and_spread() -> None:
    c = SimulationConfig(straggler="lognormal", straggler_delay_s=2.0, straggler_sigma=0.5)
    d = np.array([round_fate(c, f"c{i}", r).delay_s for i in range(50) for r in range(40)])
    assert abs(np.median(d) / 2.0 - 1.0) < 0.05
    assert abs(np.std(np.log(d)) - 0.5) < 0.03
    fixed = SimulationConfig(straggler_delay_s=1.5)
    assert {round_fate(fixed, "c", r).delay_s for r in range(10)} == {1.5}


def test_availability_windows() -> None:
    c = SimulationConfig(availability=[[0, 10], [20, 30]])
    assert online_at(c, 0) and online_at(c, 9.9) and not online_at(c, 10) and not online_at(c, 15)
    assert online_at(c, 25) and not online_at(c, 30)
    assert next_online(c, 5) == 5 and next_online(c, 12) == 20 and next_online(c, 30) is None
    always = SimulationConfig()
    assert online_at(always, 1e9) and next_online(always, 7.0) == 7.0


@pytest.mark.parametrize(("field", "value", "message"), [
    ("straggler", "gamma", "one of fixed, lognormal"),
    ("straggler_delay_s", -1.0, "must be a finite number >= 0"),
    ("dropout", 1.5, "must be a probability in"),
    ("crash", -0.1, "must be a probability in"),
    ("dropout_return_s", math.inf, "must be a finite number"),
    ("availability", [[5, 2]], "window 0 must have 0 <= start_s < end_s"),
    ("availability", [[0, 5], [3, 8]], "window 1 starts before window 0 ends"),
    ("availability", [[0]], "window 0 must be"),
])
def test_bad_simulation_fields_are_refused_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        build_config(ClientConfig, None, [(["simulation", field], value)])
    assert e.value.field == f"simulation.{field}"


def test_availability_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"client-00001": [[0, 60], [120, 300]], "*": [[0, 1000]]}))
    trace = load_trace(path)
    assert trace_windows(trace, "client-00001") == [[0.0, 60.0], [120.0, 300.0]]
    assert trace_windows(trace, "client-00002") == [[0.0, 1000.0]]
    assert trace_windows({}, "client-00002") == []
    path.write_text(json.dumps({"clients": {"client-00003": [[10, 5]]}}))
    with pytest.raises(ValueError, match="client 'client-00003': window 0 must have"):
        load_trace(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_trace(path)


def test_an_inert_simulation_answers_every_task_at_once_without_a_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without dropouts, crashes or delay the draws cannot change a fate: the shortcut must give what they give
    # (drawn_fate) and make no generator; any active setting still draws.
    inert = [SimulationConfig(), SimulationConfig(straggler="lognormal", straggler_sigma=2.0, seed=5),
             SimulationConfig(dropout_return_s=-1.0, crash_rejoin_s=1.0, availability=[[0.0, 5.0]])]
    expected = {(i, r): drawn_fate(c, "client-3", r) for i, c in enumerate(inert) for r in range(20)}

    def no_generator(*args: object, **kwargs: object) -> None:
        raise AssertionError("an inert simulation drew a generator")

    monkeypatch.setattr(np.random, "default_rng", no_generator)
    for i, c in enumerate(inert):
        for r in range(20):
            assert round_fate(c, "client-3", r) == expected[i, r] == Fate(ANSWER, 0.0)
    with pytest.raises(AssertionError, match="drew a generator"):
        round_fate(SimulationConfig(dropout=0.01), "client-3", 0)
