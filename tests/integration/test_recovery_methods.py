"""The server chooses the clients' recovery method ([recovery] method, announced at join); a client's own trainer
wins; a method or option the client does not know is refused; no method changes the update a client sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore.config import FederationInfo, TrainingConfig
from fedcore.trust import TrustError, announced_trainer
from tests.integration.test_nfl import N, _final_model, _rows, _run, server_config


def _cfg(tmp_path: Path, name: str, method: str, options: dict[str, Any] | None = None) -> Any:
    return server_config(tmp_path / name, rounds={"num_rounds": 3, "clients_per_round": N, "min_available": N,
                                                  "seed": 3},
                         nfl={"mode": "always-recover"}, recovery={"method": method, "options": options or {}})


def test_every_announced_method_runs_and_none_changes_the_global_model(tmp_path: Path) -> None:
    methods = ["vanilla", "flguard", "ditto", "apfl", "ft", "fb", "lindt-detached"]
    runs = {m: _cfg(tmp_path, m, m) for m in methods[:-1]}
    # LINDT trains the global copy on Eq. 10 (the local loss reaches it through the attaching modules) unless
    # detach_global: only then is its update the vanilla one.
    runs["lindt-detached"] = _cfg(tmp_path, "lindt-detached", "lindt", {"detach_global": True})
    runs["lindt"] = _cfg(tmp_path, "lindt", "lindt")
    summaries = {m: _run(cfg)[1] for m, cfg in runs.items()}
    # vanilla has no recovery method: nobody ever infers with a personal model; the others personalise from round 1
    # on and infer with the personal model from round 2.
    assert all(h["infers_adapted"] == 0.0 for s in summaries["vanilla"] for h in s.history)
    for m in methods[1:]:
        assert all([h["infers_adapted"] for h in s.history] == [0.0, 1.0, 1.0] for s in summaries[m]), m
    # Client compute relative to vanilla training, per round in rounds.jsonl: a personal model doubles the passes.
    assert [r.client_passes for r in _rows(runs["vanilla"])] == [1.0] * 3
    for m in methods[1:]:
        assert [r.client_passes for r in _rows(runs[m])] == [2.0] * 3, m
        assert all(r.client_seconds > 0 for r in _rows(runs[m]))
    # The update a client sends is the vanilla one whatever the method: the global models are bit-identical.
    base = _final_model(runs["vanilla"])
    for m in methods[1:]:
        other = _final_model(runs[m])
        assert all(torch.equal(other[k], v) for k, v in base.items()), m
    lindt = _final_model(runs["lindt"])
    assert not all(torch.equal(lindt[k], v) for k, v in base.items())
    assert all([h["infers_adapted"] for h in s.history] == [0.0, 1.0, 1.0] for s in summaries["lindt"])
    # A client's own trainer wins over the announcement.
    _, own = _run(_cfg(tmp_path, "own", "vanilla"), options={0: {"trainer": "ditto"}})
    assert [h["infers_adapted"] for h in own[0].history] == [0.0, 1.0, 1.0]
    assert all(h["infers_adapted"] == 0.0 for s in own[1:] for h in s.history)


def test_an_unknown_method_or_bad_options_are_refused_naming_the_field() -> None:
    fed = FederationInfo(federation_id="f", model_name="mlp", model_kwargs={}, model_fingerprint="", model_spec=(),
                         training=TrainingConfig(), dataset="synthetic", data_options={}, num_rounds=1, seed=0)
    assert announced_trainer(fed) == ("flguard", {})
    for changes, field in (({"recovery_method": "pkg.mod:trainer"}, "recovery_method"),
                           ({"recovery_options": {"l_fb": -1}}, "recovery_options_json"),
                           ({"recovery_options": {"nope": 1}}, "recovery_options_json")):
        with pytest.raises(TrustError) as e:
            announced_trainer(FederationInfo(**{**fed.__dict__, **changes}))
        assert e.value.field == field



def test_either_detector_starts_lindt_on_the_clients(tmp_path: Path) -> None:
    """LINDT's own pairing, the Δ detector (Δ > ε once with r′ = 0), reports NFL after round 1; the recovery flag
    in round 2's tasks makes the clients train the dual model in round 2 and infer with the local model from round
    3. FL-GUARD's β̂ detector with NR = 0 (round 1's received model is the untrained initial one, which every private
    model beats): the clients' individual-level measures, which use the same NR, start LINDT in round 1 already and
    the server reports NFL after it; long-term recovery keeps LINDT on after the report is cancelled in round 2."""
    cases: dict[str, tuple[dict[str, Any], list[float], list[float]]] = {
        "delta": ({"nr": 100, "epsilon": 1e-9, "r_prime": 0}, [0.0, 0.0, 1.0], [1.0, 2.0, 2.0]),
             "beta_hat": ({"nr": 0, "c": 1}, [0.0, 1.0, 1.0], [2.0, 2.0, 2.0])}
    for detector, (nfl, infers, passes) in cases.items():
        cfg = server_config(tmp_path / detector, rounds={"num_rounds": 3, "clients_per_round": N,
                                                         "min_available": N, "seed": 3},
                            nfl={"mode": "detect-and-recover", "detector": detector, **nfl},
                            recovery={"method": "lindt", "options": {}})
        _, summaries = _run(cfg)
        rows = _rows(cfg)
        assert rows[0].nfl == "reported" and [r.recovery for r in rows] == [True] * 3, detector
        assert all([h["infers_adapted"] for h in s.history] == infers for s in summaries), detector
        assert [r.client_passes for r in rows] == passes, detector
