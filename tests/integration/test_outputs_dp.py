"""A real federation over loopback gRPC with server-side DP: the per-round epsilon (against Opacus' own accountant),
the budget stop, strict-JSON rounds.jsonl, the safetensors outputs, fedguard-export (CSV and TensorBoard read back),
fedguard-status of the run directory and of the live server, fedguard-plot's timeline."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fedguard
from fedcore.serialization import load_state
from fedlaunch import export, status
from fedserver import ServerThread
from tests.integration.helpers import run_federation, server_config

pytest.importorskip("opacus", reason="the dp extra (Opacus) is not installed")

# 4 clients, K = 2 per round, plain mean of updates clipped to S = 1, sigma = 0.5 on the mean: the sensitivity of
# the mean is S / 2, so z = 0.5 / 0.5 = 1.0; q = 2 / 4 (dp.population = 4).
Z, Q, DELTA = 1.0, 0.5, 1e-5


def _opacus_epsilons(rounds: int) -> list[float]:
    """Opacus' own RDPAccountant stepped once per round (the reference the server's figures must equal)."""
    from opacus.accountants import RDPAccountant

    acc, out = RDPAccountant(), []
    for _ in range(rounds):
        acc.step(noise_multiplier=Z, sample_rate=Q)
        out.append(acc.get_epsilon(delta=DELTA))
    return out


def _refuse(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


def test_dp_federation_outputs_export_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    eps = _opacus_epsilons(4)
    budget = (eps[2] + eps[3]) / 2  # crossed by round 4 of 6: the federation stops after round 4
    sections: dict[str, dict[str, Any]] = dict(rounds={"num_rounds": 6, "clients_per_round": 2, "min_available": 4},
                    aggregation={"clip_norm": 1.0, "noise_sigma": 0.5, "weighted": False},
                    dp={"population": 4, "delta": DELTA, "max_epsilon": budget, "on_budget": "stop"})
    cfg = server_config(tmp_path, **sections)
    final, _ = run_federation(cfg, 4)
    assert final is not None and final.finished and final.outcome == "dp_budget"
    assert [h.round for h in final.history] == [1, 2, 3, 4]
    run = tmp_path / "run"

    # rounds.jsonl: strict JSON (a NaN would be a parse error), epsilon per round as Opacus computes it
    lines = (run / "rounds.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=_refuse) for line in lines]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["beta"] is None  # no client reports P_i: beta has no value, written as null
    for r, e in zip(rows, eps, strict=True):
        assert r["dp_noise_multiplier"] == pytest.approx(Z, rel=1e-12) and r["dp_sample_rate"] == Q
        assert r["dp_epsilon"] == pytest.approx(e, rel=1e-9) and r["dp_delta"] == DELTA
    assert rows[2]["dp_epsilon"] <= budget < rows[3]["dp_epsilon"]
    json.loads((run / "config.json").read_text(), parse_constant=_refuse)

    # the safetensors output is the final model
    fgt, extra = load_state(run / "final_model.fgt")
    model = fedguard.load_model(run)
    assert extra["rounds"] == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fgt.items())
    meta = json.loads((run / "final_model.json").read_text(), parse_constant=_refuse)
    assert meta["round"] == 4 and meta["model"] == "mlp" and meta["config_hash"].startswith("sha256:")

    # a restart runs no further round: the budget is spent
    again = ServerThread(server_config(tmp_path, **sections), linger_s=0.2).start()
    st = again.wait(60)
    assert st is not None and st.outcome == "dp_budget" and len(st.history) == 4
    assert len((run / "rounds.jsonl").read_text().splitlines()) == 4

    # fedguard-export: CSV and TensorBoard event files, read back
    assert export.main([str(run), "--csv"]) == 0
    with open(run / "rounds.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["round"]) for r in table] == [1, 2, 3, 4]
    assert [float(r["dp_epsilon"]) for r in table] == [r["dp_epsilon"] for r in rows]
    assert [float(r["accuracy"]) for r in table] == [r["mean_test_accuracy"] for r in rows]
    assert all(t["beta"] == "" and t["nfl"] == r["nfl"] and t["recovery"] == str(int(r["recovery"]))
               for t, r in zip(table, rows, strict=True))
    assert [float(r["delta"]) for r in table] == pytest.approx([r["metrics"]["delta"] for r in rows], rel=1e-15)
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert export.main([str(run), "--tensorboard", str(tmp_path / "tb")]) == 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"dp/epsilon", "accuracy/local", "delta/delta", "nfl/state", "nfl/recovery"} <= tags
    assert "beta/all" not in tags  # no value in any round: no point written
    points = acc.Scalars("dp/epsilon")
    assert [p.step for p in points] == [1, 2, 3, 4]
    # event files hold float32
    assert [p.value for p in points] == pytest.approx([r["dp_epsilon"] for r in rows], rel=1e-6)

    # fedguard-status of the run directory
    capsys.readouterr()
    assert status.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "rounds 4 of 6" in out and "finished: final model after round 4" in out and "dp_eps" in out
    assert f"epsilon {rows[3]['dp_epsilon']:.4g} at delta 1e-05" in out


def test_status_of_a_live_server_needs_the_operator_token(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 2, "clients_per_round": 2})
    with ServerThread(cfg, linger_s=0.2) as srv:
        monkeypatch.delenv(status.OPERATOR_TOKEN_ENV, raising=False)
        assert status.main([srv.address, "--insecure"]) == 2
        assert "--operator-token-file" in capsys.readouterr().err
        assert status.main([srv.address, "--insecure", "--operator-token-file", str(tmp_path / "operator.token")]) == 0
        out = capsys.readouterr().out
        assert "round 1 of 2" in out and "0 known" in out and "no round completed yet" in out
        monkeypatch.setenv(status.OPERATOR_TOKEN_ENV, "wrong")
        assert status.main([srv.address, "--insecure"]) == 2
        assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_status_env_name_is_the_servers() -> None:
    from fedcore.config import OPERATOR_TOKEN_ENV

    assert status.OPERATOR_TOKEN_ENV == OPERATOR_TOKEN_ENV


def test_plot_timeline_marks_report_and_cancel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from fedlaunch import plot

    states = ["watching"] * 3 + ["reported"] * 4 + ["watching"] * 3
    rows = [{"round": i + 1, "beta_hat": -0.1 if s == "reported" else 0.1, "beta_hat_avg": math.nan,
             "nfl": s, "recovery": s == "reported", "metrics": {"delta": 0.01 * i}} for i, s in enumerate(states)]
    (tmp_path / "rounds.jsonl").write_text("\n".join(fedcore_dumps(r) for r in rows) + "\n")
    assert plot.transitions(export.read_rounds(tmp_path)) == ([4], [8])
    assert plot.main([str(tmp_path), "--timeline"]) == 0
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def fedcore_dumps(row: dict[str, object]) -> str:
    from fedcore.jsonio import dumps

    return dumps(row)
