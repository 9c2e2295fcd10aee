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


def test_the_announced_method_runs_and_never_changes_the_global_model(tmp_path: Path) -> None:
    runs = {"vanilla": _cfg(tmp_path, "vanilla", "vanilla"), "flguard": _cfg(tmp_path, "flguard", "flguard")}
    summaries = {m: _run(cfg)[1] for m, cfg in runs.items()}
    # vanilla has no recovery method: nobody ever infers with a personal model; flguard adapts from round 1.
    assert all(h["infers_adapted"] == 0.0 for s in summaries["vanilla"] for h in s.history)
    assert all([h["infers_adapted"] for h in s.history] == [0.0, 1.0, 1.0] for s in summaries["flguard"])
    # Client compute relative to vanilla training, per round in rounds.jsonl: adaptation doubles the passes.
    assert [r.client_passes for r in _rows(runs["vanilla"])] == [1.0] * 3
    assert [r.client_passes for r in _rows(runs["flguard"])] == [2.0] * 3
    assert all(r.client_seconds > 0 for r in _rows(runs["flguard"]))
    base = _final_model(runs["vanilla"])
    other = _final_model(runs["flguard"])
    assert all(torch.equal(other[k], v) for k, v in base.items())
    # A client's own trainer wins over the announcement.
    cfg = _cfg(tmp_path, "own", "vanilla")
    _, own = _run(cfg, options={0: {"trainer": "flguard"}})
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
