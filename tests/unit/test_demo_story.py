"""The demo's task (the synthetic task's shared concept) and the demo-story table (tools/experiments/demo_story.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcore.data import DataError, load_client_data
from tools.experiments.demo_story import demo_args, figures, recorded_command, table, verdict


def _agreement_with_common_concept(shared: float, seed: int = 3, clients: int = 8) -> float:
    """The share of the clients' samples whose label is the common concept's argmax(x W' + b) ((W, b): the draws the
    ``iid`` task shares, from the seed's common generator)."""
    common = np.random.default_rng([seed, 0x5A5A])
    w = common.normal(0.0, 1.0, (10, 60))
    b = common.normal(0.0, 1.0, 10)
    hits = total = 0
    for k in range(clients):
        d = load_client_data("synthetic", k, seed=seed, options={"shared": shared})
        x = torch.cat([d.x_train, d.x_test]).double().numpy()
        y = torch.cat([d.y_train, d.y_test]).numpy()
        hits += int((np.argmax(x @ w.T + b, axis=1) == y).sum())
        total += len(y)
    return hits / total


def test_shared_zero_is_fedprox_task_bit_for_bit() -> None:
    for k in (0, 5):
        a = load_client_data("synthetic", k, seed=2)
        b = load_client_data("synthetic", k, seed=2, options={"shared": 0.0})
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
        assert torch.equal(a.x_test, b.x_test) and torch.equal(a.y_test, b.y_test)


def test_shared_one_is_one_concept_and_the_share_grows_with_s() -> None:
    # s = 1: every label is the common concept's, up to float32 rounding of x near a tie (none expected at this size)
    assert _agreement_with_common_concept(1.0) == 1.0
    a0, a5, a9 = (_agreement_with_common_concept(s) for s in (0.0, 0.5, 0.9))
    # s = 0: independent concepts agree with the common one by chance only (seed 3: 0.147; 1/10 for uniform
    # labels, more since each client's labels crowd on a few classes); agreement then grows with s (0.323, 0.718)
    assert a0 < 0.25 and a0 < a5 < a9 < 1.0, (a0, a5, a9)


def test_shared_keeps_the_features_and_sizes() -> None:
    a = load_client_data("synthetic", 4, seed=1)
    b = load_client_data("synthetic", 4, seed=1, options={"shared": 0.7})
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.x_test, b.x_test)


def test_without_feature_shift_every_client_draws_x_around_zero() -> None:
    shifted = [load_client_data("synthetic", k, seed=1) for k in range(6)]
    centred = [load_client_data("synthetic", k, seed=1, options={"feature_shift": False}) for k in range(6)]
    for a, b in zip(shifted, centred, strict=True):
        assert a.x_train.shape == b.x_train.shape  # the same sizes: the draws before x are the same
    # x's first feature has variance 1 (Sigma_11 = 1): over >= 45 training samples its mean is within 0.4 (>= 2.7
    # standard errors of 1/sqrt(45)) of v_k1, which is 0 without the shift and N(B_k, 1) with it (|v_k1| > 0.4 on
    # about 2 clients in 3)
    assert all(abs(float(b.x_train[:, 0].mean())) < 0.4 for b in centred)
    assert sum(abs(float(a.x_train[:, 0].mean())) > 0.4 for a in shifted) >= 3


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_shared_outside_zero_one_is_refused(bad: float) -> None:
    with pytest.raises(DataError, match="shared must be in"):
        load_client_data("synthetic", 0, 0, {"shared": bad})


def test_demo_args_are_the_demo_scripts_launcher_command() -> None:
    args = demo_args()
    assert args[0] == "--clients" and "--private-epochs" in args and "data.options.feature_shift=false" in args
    assert "--run-dir" not in args and "$@" not in args and "--seed" not in args and "--nfl-mode" not in args


def _rows(betas: list[float], reported: int = 6) -> list[dict[str, object]]:
    return [{"round": r, "beta_adapting": b, "test_accuracy_adapting": 0.5,
             "nfl": "reported" if r >= reported else "watching", "adapting": 10 if r > reported else 0}
            for r, b in enumerate(betas, start=1)]


def test_figures_are_the_last_ten_rounds_mean() -> None:
    betas = [-0.5] * 20 + [0.01 * i for i in range(10)]  # last ten: 0.00 .. 0.09, mean 0.045
    f = figures(_rows(betas))
    assert f.rounds == 30 and f.reported == 6 and f.first_adapting == 7
    assert abs(f.beta_last - 0.045) < 1e-12
    assert figures([]).reported is None and math.isnan(figures([]).beta_last)


def test_verdict_each_target() -> None:
    ok = verdict([0.03, 0.01, 0.05], [-0.1, -0.2, -0.01])
    assert [h for _, h, _ in ok] == [True, True, True]
    assert [h for _, h, _ in verdict([0.03, 0.0, 0.05], [-0.1])] == [False, True, True]  # 0 is not > 0
    assert [h for _, h, _ in verdict([0.01, 0.02, 0.02], [-0.1])] == [True, False, True]  # mean 0.0167 < 0.02
    assert [h for _, h, _ in verdict([0.03], [-0.1, 0.0])] == [True, True, False]  # 0 is not < 0


def test_table_reads_run_directories(tmp_path: object) -> None:
    import json
    from pathlib import Path

    out = Path(str(tmp_path))
    for mode, shift in (("on", 0.05), ("off", -0.1)):
        d = out / f"{mode}-s1"
        d.mkdir(parents=True)
        rows = _rows([shift] * 30)
        (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, ok = table(out, [1])
    assert "| 1 | +0.050 | -0.100 |" in text
    assert not ok and "not every run has finished" in text  # no final model, no server log: not finished
    assert recorded_command(out / "on-s1") == "-"  # no record
    from tools.runs import write_record

    write_record(out / "on-s1", {"spec": {}, "sittings": [{"command": ["/x/bin/python3", "-m", "fedguard.launch",
                                                                      "--seed", "1"]}]})
    assert recorded_command(out / "on-s1") == "python -m fedguard.launch --seed 1"
