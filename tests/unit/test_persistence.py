"""fedserver.persistence without gRPC: slots, identity checks, rounds.jsonl reconciliation, fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore import rounds as rm
from fedcore.config import ConfigError, ServerConfig, build_config
from fedcore.models import build_model
from fedcore.report import RoundReport
from fedserver.global_models import GlobalModels
from fedserver.persistence import Persistence, check_identity
from fedserver.store import StoreError


def _config(run_dir: Path, **sections: dict[str, Any]) -> ServerConfig:
    overrides: list[tuple[list[str], Any]] = [(["server", "run_dir"], str(run_dir)), (["security", "insecure"], True)]
    for section, values in sections.items():
        overrides += [([section, k], v) for k, v in values.items()]
    return build_config(ServerConfig, None, overrides)


def _models(seed: int = 0) -> GlobalModels:
    return GlobalModels.of(build_model("mlp", seed=seed))


def _completed(p: Persistence, models: GlobalModels, rounds: int) -> list[RoundReport]:
    """Simulate ``rounds`` completed rounds: the model moves, a report is written and a snapshot taken."""
    history: list[RoundReport] = []
    for r in range(1, rounds + 1):
        models.apply_flat(models.flat() + 0.01 * r)
        history.append(RoundReport(round=r, accepted=3, metrics={"num_updates": 3.0}))
        p.snapshot(rm.RoundState(round=r, phase=rm.AGGREGATING), history, r)
        with open(p.run_dir / "rounds.jsonl", "a") as f:
            f.write(json.dumps(history[-1].to_dict()) + "\n")
    return history


def test_a_new_run_dir_starts_a_new_federation_and_a_second_start_resumes_it(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    models = _models()
    p = Persistence(cfg, models)
    assert p.restore(now=0.0) is None
    assert json.loads((tmp_path / "run" / "config.json").read_text())["rounds"]["seed"] == 0
    _completed(p, models, 2)
    p.close()

    again = _models()
    p2 = Persistence(cfg, again)
    restored = p2.restore(now=9.0)
    assert restored is not None and restored.completed_rounds == 2
    assert (restored.round_state.round, restored.round_state.phase) == (3, rm.SAMPLING)
    assert [r.round for r in restored.history] == [1, 2]
    assert torch.equal(again.flat(), models.flat())
    p2.close()


def test_slots_travel_with_every_snapshot(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    detector = {"negative_rounds": 0}
    p = Persistence(cfg, _models())
    p.register_slot("detector", lambda: dict(detector), lambda d: detector.update(d))
    with pytest.raises(ValueError, match="already registered"):
        p.register_slot("detector", dict, lambda d: None)
    p.restore(now=0.0)
    detector["negative_rounds"] = 7
    _completed(p, p.models, 1)
    p.close()

    seen: dict[str, Any] = {}
    p2 = Persistence(cfg, _models())
    p2.register_slot("detector", dict, seen.update)
    assert p2.restore(now=0.0) is not None
    assert seen == {"negative_rounds": 7}
    p2.close()


def test_rounds_missing_from_rounds_jsonl_are_appended_and_nothing_is_truncated(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    p = Persistence(cfg, _models())
    p.restore(now=0.0)
    _completed(p, p.models, 3)
    p.close()
    path = tmp_path / "run" / "rounds.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1]) + "\n")  # as if the server died after committing rounds 2 and 3
    p2 = Persistence(cfg, _models())
    p2.restore(now=0.0)
    p2.close()
    assert [json.loads(x)["round"] for x in path.read_text().splitlines()] == [1, 2, 3]


def _tree(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_a_corrupt_newest_snapshot_stops_the_server_unless_told_to_fall_back(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    models = _models()
    p = Persistence(cfg, models)
    p.restore(now=0.0)
    _completed(p, models, 2)
    p.close()
    newest = max((tmp_path / "run" / "state" / "models").glob("r000002-*.fgt"))
    newest.write_bytes(newest.read_bytes()[:100])  # half-written
    before = _tree(tmp_path / "run")
    p2 = Persistence(cfg, _models())
    with pytest.raises(StoreError, match=r"the newest snapshot does not verify \(snapshot of round 2 skipped: "
                                         r"model 'global' .* truncated or half-written\).*--fall-back to resume "
                                         r"from round 1"):
        p2.restore(now=0.0)
    p2.close()
    assert _tree(tmp_path / "run") == before  # nothing changed
    p3 = Persistence(_config(tmp_path / "run", persistence={"fall_back": True}), _models())
    restored = p3.restore(now=0.0)
    p3.close()
    assert restored is not None and restored.completed_rounds == 1 and restored.round_state.round == 2
    assert [r.round for r in restored.history] == [1]
    (kept,) = (tmp_path / "run" / "state" / "quarantine").glob("*/r000002-*.fgt")
    assert kept.read_bytes() == before[str(newest.relative_to(tmp_path / "run"))]


def test_no_verifiable_snapshot_or_rounds_without_state_never_start_a_new_federation(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    models = _models()
    p = Persistence(cfg, models)
    p.restore(now=0.0)
    _completed(p, models, 1)
    p.close()
    for f in (tmp_path / "run" / "state" / "models").glob("*.fgt"):
        f.write_bytes(b"x")
    before = _tree(tmp_path / "run")
    with pytest.raises(StoreError, match=r"no snapshot verifies .*--fresh"):
        Persistence(cfg, _models()).restore(now=0.0)
    assert _tree(tmp_path / "run") == before
    # The state is gone but rounds.jsonl holds rounds: a new federation would mix two in one file.
    (tmp_path / "run" / "state").rename(tmp_path / "elsewhere")
    with pytest.raises(StoreError, match=r"rounds.jsonl holds 1 rounds of a federation whose state"):
        Persistence(cfg, _models()).restore(now=0.0)


def test_a_snapshot_appends_only_the_new_history(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    models = _models()
    p = Persistence(cfg, models)
    p.restore(now=0.0)
    history = _completed(p, models, 3)
    assert p.store is not None
    rows = p.store._conn.execute("SELECT seq, report FROM history ORDER BY seq").fetchall()
    assert [json.loads(r[1])["round"] for r in rows] == [1, 2, 3]
    state_json = p.store._conn.execute("SELECT state FROM snapshots ORDER BY id DESC LIMIT 1").fetchone()[0]
    assert "history" not in json.loads(state_json)
    p.close()
    restored = Persistence(cfg, _models()).restore(now=0.0)
    assert restored is not None
    assert [json.dumps(r.to_dict()) for r in restored.history] == [json.dumps(h.to_dict()) for h in history]


@pytest.mark.parametrize(("section", "values", "field"), [
    ("rounds", {"seed": 1}, "rounds.seed"),
    ("rounds", {"clients_per_round": 5}, "rounds.clients_per_round"),
    ("model", {"name": "logreg"}, "model.name"),
    ("data", {"dataset": "other"}, "data.dataset"),
    ("aggregation", {"rule": "median"}, "aggregation.rule"),
    ("training", {"learning_rate": 0.5}, "training.learning_rate"),
])
def test_a_change_that_would_break_the_federation_is_refused_naming_the_field(
        tmp_path: Path, section: str, values: dict[str, Any], field: str) -> None:
    cfg = _config(tmp_path / "run")
    p = Persistence(cfg, _models())
    p.restore(now=0.0)
    p.close()
    changed = _config(tmp_path / "run", **{section: values})
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        check_identity(stored, json.loads(json.dumps(__import__("dataclasses").asdict(changed))))
    assert e.value.field == field and "--fresh" in str(e.value)


def test_more_rounds_and_other_timeouts_are_allowed_on_resume(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run", rounds={"num_rounds": 2})
    p = Persistence(cfg, _models())
    p.restore(now=0.0)
    _completed(p, p.models, 2)
    p.close()
    longer = _config(tmp_path / "run", rounds={"num_rounds": 4, "round_timeout_s": 5.0})
    p2 = Persistence(longer, _models())
    restored = p2.restore(now=0.0)
    p2.close()
    assert restored is not None and (restored.round_state.round, restored.round_state.phase) == (3, rm.SAMPLING)


def test_fresh_moves_the_old_federation_aside(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    p = Persistence(cfg, _models())
    p.restore(now=0.0)
    _completed(p, p.models, 1)
    p.close()
    moved = Persistence.start_fresh(tmp_path / "run")
    assert moved is not None and (moved / "state").is_dir() and (moved / "rounds.jsonl").exists()
    p2 = Persistence(cfg, _models())
    assert p2.restore(now=0.0) is None
    p2.close()
    assert (tmp_path / "run" / "rounds.jsonl").read_text() == ""


def test_persistence_off_writes_no_state(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run", persistence={"enabled": False})
    p = Persistence(cfg, _models())
    assert p.restore(now=0.0) is None
    _completed(p, p.models, 1)
    assert not (tmp_path / "run" / "state").exists()


def test_a_snapshot_reuses_the_registrys_text_until_a_join_changes_it(tmp_path: Path) -> None:
    """A snapshot's state text is ``json.dumps`` of its body, character for character, with the registry serialized
    again only when step changed it (``RoundState.registry_version``: a new client, or a re-join with other samples or
    flags): through joins, re-joins, polls and rounds the text equals a fresh dump every time, the cached registry is
    reused in most snapshots, and a restart reads the registry as it was last written."""
    cfg = _config(tmp_path / "run", rounds={"clients_per_round": 2, "num_rounds": 100})
    rounds_cfg = cfg.rounds
    limits = rm.Limits(heartbeat_patience_s=60.0)
    p = Persistence(cfg, _models())
    p.restore(now=0.0)
    p.register_slot("detector", lambda: {"n": 1}, lambda d: None)
    s, reused = rm.RoundState(), 0
    for i in range(60):
        cid = f"c{i % 7}"
        if i % 5 == 0:  # a new client (some with a record's defaults), or a re-join with other samples or flags
            joined = rm.Joined(cid, float(i), num_samples=10 + i % 3 if i % 4 else 0, opt_out=i % 10 == 0 and i > 30)
            s, _ = rm.step_in_place(s, joined, rounds_cfg, limits)
        s, _ = rm.step_in_place(s, rm.Polled(cid, float(i)), rounds_cfg, limits)
        body = {"round_state": s.to_saved(), "slots": {"detector": {"n": 1}}}
        before = p._registry
        assert p.state_text(s, body) == json.dumps(body), i
        reused += before is not None and p._registry is before
    assert reused > 30, reused
    p.snapshot(s, [RoundReport(round=1)], 1)
    p.close()
    restored = Persistence(cfg, _models())
    restored.register_slot("detector", lambda: {}, lambda d: None)
    back = restored.restore(now=0.0)
    assert back is not None
    assert back.round_state.saved_registry() == s.saved_registry()
    restored.close()
    odd = {"slots": {}, "round_state": {"clients": []}}  # not a snapshot's layout: a plain dump
    assert p.state_text(s, odd) == json.dumps(odd)
