"""The NFL shells without gRPC: the server's report and monitor (fedserver.finalize, fedserver.nfl_monitor) and the
client's round (fedclient.local_round)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from fedclient.local_round import LocalRound, LocalRoundError
from fedcore import rounds as rm
from fedcore.attacks import AttackConfig, AttackError
from fedcore.config import ClientConfig, FederationInfo, TrainingConfig
from fedcore.data import load_client_data
from fedcore.log import get_logger
from fedcore.models import build_model, model_manifest
from fedcore.nfl import NflConfig, NflSettings
from fedcore.report import RoundReport
from fedcore.train.trainers import TRAINER_STATE_FILE
from fedcore.update_report import UpdateReport
from fedserver.finalize import build_report
from fedserver.intake import RoundLog
from fedserver.nfl_monitor import NflMonitor

# ---- server: the round's median and the monitor ----


def _log(betas: dict[str, float | None], acc: float = 0.5, private: float = 0.7) -> RoundLog:
    log = RoundLog(round=1, started_at=0.0, selected=len(betas))
    for cid, b in betas.items():
        log.reports[cid] = UpdateReport(num_samples=10, train_loss=0.1, beta_hat=b, test_accuracy=acc,
                                        private_accuracy=private)
    return log


def test_a_minority_of_fabricated_beta_hats_does_not_move_the_median_out_of_the_honest_range() -> None:
    honest = {f"h{i}": -0.3 + 0.05 * i for i in range(6)}  # -0.30 .. -0.05
    fake = {f"f{i}": 1.0 for i in range(5)}  # 5 of 11 fabricate +1
    report = build_report(_log({**honest, **fake}), rm.RoundState(), "quorum", math.nan, {}, 0.0)
    assert report.beta_hat < 0 and min(honest.values()) <= report.beta_hat <= max(honest.values())
    # A majority can move it: the median is robust to a minority only.
    fake6 = {**fake, "f5": 1.0, "f6": 1.0}
    assert build_report(_log({**honest, **fake6}), rm.RoundState(), "quorum", math.nan, {}, 0.0).beta_hat == 1.0


def test_updates_without_beta_hat_do_not_count_for_the_median() -> None:
    report = build_report(_log({"a": -0.2, "b": None, "c": -0.4}), rm.RoundState(), "quorum", math.nan, {}, 0.0)
    assert report.beta_hat == pytest.approx(-0.3)
    none = build_report(_log({"a": None}), rm.RoundState(), "quorum", math.nan, {}, 0.0)
    assert math.isnan(none.beta_hat)
    # |beta_hat_i - beta_i| with beta_i = 0.5 - 0.7
    assert report.beta_hat_error == pytest.approx((abs(-0.2 + 0.2) + abs(-0.4 + 0.2)) / 2)


def test_monitor_completes_the_report_and_its_state_round_trips() -> None:
    cfg = NflConfig(detector="beta_hat", nr=1, c=2)
    mon = NflMonitor(cfg)
    r1, ev1 = mon.observe(RoundReport(round=1, beta_hat=-0.5))
    assert (r1.nfl, r1.nfl_count, r1.recovery, r1.beta_hat_avg, ev1) == ("watching", 1, False, -0.5, [])
    r2, ev2 = mon.observe(RoundReport(round=2, beta_hat=-0.1))
    assert r2.nfl == "reported" and r2.recovery and r2.beta_hat_avg == pytest.approx(-0.3)
    assert [e.kind for e in ev2] == ["nfl.reported"] and mon.recovery
    saved = mon.save()
    again = NflMonitor(cfg)
    again.load(saved)
    # Everything but the in-memory per-round trace round-trips (the rounds' history holds that, saved once).
    assert dataclasses.replace(again.state, history=mon.state.history) == mon.state and again.status() == mon.status()
    assert "history" not in mon.save() and again.state.history == []
    assert again.status().reported_round == 2 and again.status().state == "reported"
    # A replayed round (re-run after a restart) changes nothing.
    _, ev2b = again.observe(RoundReport(round=2, beta_hat=0.9))
    assert ev2b == [] and again.state.count == mon.state.count
    with pytest.raises(ValueError, match="detector 'beta_hat'"):
        NflMonitor(dataclasses.replace(cfg, detector="delta")).load(saved)


def test_monitor_feeds_delta_from_the_aggregation_metrics() -> None:
    cfg = NflConfig(detector="delta", nr=50, c=50, r_prime=0, epsilon=0.1)
    mon = NflMonitor(cfg)
    r, ev = mon.observe(RoundReport(round=1, metrics={"delta": 0.5}))
    assert [e.kind for e in ev] == ["nfl.reported"] and r.recovery and mon.status().delta == 0.5


def test_modes_show_as_off_and_always() -> None:
    assert NflMonitor(NflConfig(mode="off", nr=50, c=50)).observe(RoundReport(round=1, beta_hat=-1.0))[0].nfl == "off"
    r, _ = NflMonitor(NflConfig(mode="always-recover", nr=50, c=50)).observe(RoundReport(round=1, beta_hat=0.2))
    assert r.nfl == "always" and r.recovery


def test_fake_beta_hat_is_validated() -> None:
    assert AttackConfig(fake_beta_hat=-1.0).active and not AttackConfig().active
    with pytest.raises(AttackError, match=r"attack\.fake_beta_hat"):
        AttackConfig(fake_beta_hat=2.0)


# ---- client: one round ----

TC = TrainingConfig(local_epochs=1, batch_size=8, learning_rate=0.1)


def _fed(mode: str = "detect-and-recover", nr: int = 0, c: int = 2) -> FederationInfo:
    model = build_model("mlp", {})
    return FederationInfo(federation_id="f", model_name="mlp", model_kwargs={}, model_fingerprint="",
                          model_spec=tuple(model_manifest(model)), training=TC, dataset="synthetic",
                          data_options={}, num_rounds=10, seed=5, nfl=NflSettings(mode, nr, c))


def _round(local: LocalRound, fed: FederationInfo, start: dict[str, torch.Tensor], round_: int, flag: bool,
           private: float | None = 0.99) -> tuple[dict[str, torch.Tensor], UpdateReport, float | None]:
    """(the weights sent, the report sent, the measured beta_hat_i) of one LocalRound."""
    data = load_client_data("synthetic", 0, fed.seed, {})
    model = build_model("mlp", {})
    model.load_state_dict(start)
    out = local.run(model, data, data, fed, round_, flag, None, private)
    return {k: v.clone() for k, v in model.state_dict().items()}, out.report, out.beta_hat_measured


def test_adaptation_leaves_the_sent_update_unchanged_and_holdouts_never_adapt() -> None:
    start = build_model("mlp", {}, seed=1).state_dict()
    fed = _fed(nr=1000)
    log = get_logger("test")
    plain, m_plain, b_plain = _round(LocalRound(ClientConfig(), "c0", log), fed, start, 1, False)
    adapting = LocalRound(ClientConfig(), "c0", log)
    sent, m_adapt, b_adapt = _round(adapting, fed, start, 1, True)
    assert all(torch.equal(plain[k], sent[k]) for k in plain)  # the update is the global copy's result
    assert not m_plain.adapting and m_adapt.adapting and "lambda_mean" in m_adapt.extras
    assert m_plain.passes == 1.0 and m_adapt.passes == 2.0 and "passes" not in m_adapt.extras
    assert b_plain == b_adapt  # round 1: both infer with the received model
    # Round 2: the adapting client infers (and measures beta_hat_i) with v_i; the update is still unchanged.
    plain2, _, _ = _round(LocalRound(ClientConfig(), "c0", log), fed, plain, 2, False)
    sent2, m2, _ = _round(adapting, fed, sent, 2, True)
    assert all(torch.equal(plain2[k], sent2[k]) for k in plain2) and m2.infers_adapted
    holdout = LocalRound(ClientConfig(opt_out=True), "c0", log)
    for r in (1, 2, 3):
        _, m, b = _round(holdout, fed, start, r, True)
        assert not m.adapting and not m.infers_adapted and b is not None and m.beta_hat == b


def test_individual_measures_start_adaptation_and_survive_a_client_restart(tmp_path: Path) -> None:
    start = build_model("mlp", {}, seed=1).state_dict()
    fed = _fed(nr=0, c=50)  # the first round with beta_hat_i < 0 starts adaptation
    cfg = ClientConfig(state_dir=str(tmp_path))
    local = LocalRound(cfg, "c0", get_logger("test"))
    _, m, b = _round(local, fed, start, 1, False, private=1.0)  # P_i = 1: beta_hat_i < 0 for sure
    assert b is not None and b < 0 and m.adapting and local.adapting_on_its_own and m.private_accuracy == 1.0
    assert (tmp_path / TRAINER_STATE_FILE).exists()
    restarted = LocalRound(cfg, "c0", get_logger("test"))
    _, m2, _ = _round(restarted, fed, start, 2, False, private=1.0)
    assert m2.adapting and m2.infers_adapted and restarted.adapting_on_its_own
    # In mode off neither the individual measures nor the flag adapt.
    off = LocalRound(ClientConfig(), "c1", get_logger("test"))
    _, m3, _ = _round(off, _fed(mode="off", nr=0), start, 1, True, private=1.0)
    assert not m3.adapting


def test_the_local_round_sends_the_measured_beta_hat_attacks_are_mods(tmp_path: Path) -> None:
    """LocalRound plays no attack, even with one configured: the fabricated beta_hat_i is a client mod
    (tests/unit/test_client_mods.py)."""
    start = build_model("mlp", {}).state_dict()
    local = LocalRound(ClientConfig(attack=AttackConfig(fake_beta_hat=0.75)), "c0", get_logger("test"))
    _, m, measured = _round(local, _fed(nr=1000), start, 1, False)
    assert m.beta_hat == measured != 0.75


def test_a_corrupt_trainer_state_is_a_clear_error_and_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / TRAINER_STATE_FILE).write_bytes(b"not a tensor file")
    local = LocalRound(ClientConfig(state_dir=str(tmp_path)), "c0", get_logger("test"))
    with pytest.raises(LocalRoundError, match="unreadable trainer state"):
        _round(local, _fed(), build_model("mlp", {}).state_dict(), 1, False)
    assert (tmp_path / TRAINER_STATE_FILE).read_bytes() == b"not a tensor file"


def test_a_round_given_its_received_weights_runs_as_one_that_copies_them() -> None:
    # The runner hands LocalRound the task's own tensors (no copy of the model's); the round, its hook's w^{r-1}
    # and the inference view are what a round that copies the loaded model computes, and training leaves them be.
    fed = _fed(nr=0, c=1)  # adapting from the first round: vᵢ is built from the received weights too
    start = {k: v.clone() for k, v in build_model("mlp", {}, seed=1).state_dict().items()}
    data = load_client_data("synthetic", 0, fed.seed, {})
    runs = []
    for given in (False, True):
        local = LocalRound(ClientConfig(), "c0", get_logger("test"))
        weights = {k: v.clone() for k, v in start.items()}
        outs = []
        for round_ in (1, 2):
            model = build_model("mlp", {})
            model.load_state_dict(weights)
            out = local.run(model, data, data, fed, round_, True, None, 0.99,
                            received=weights if given else None)
            assert out.update is not None and local.view is not None
            assert all(torch.equal(out.update.received[k], weights[k]) for k in weights)
            assert all(torch.equal(local.view.received[k], weights[k]) for k in weights)
            assert not torch.equal(model.state_dict()["1.weight"], weights["1.weight"])  # training moved the model
            assert all(p.grad is None for p in model.parameters())  # an idle device keeps no gradients
            outs.append((out.report, {k: v.clone() for k, v in model.state_dict().items()}))
            weights = {k: v.clone() for k, v in model.state_dict().items()}
        runs.append(outs)
    for (report_a, sent_a), (report_b, sent_b) in zip(*runs, strict=True):
        assert report_a == report_b and all(torch.equal(sent_a[k], sent_b[k]) for k in sent_a)
