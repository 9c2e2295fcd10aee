from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fedcore.config import TrainingConfig
from fedcore.data import ClientData, load_client_data
from fedcore.metrics import (
    alpha_weights,
    asr_from_predictions,
    attack_success_rate,
    central_accuracy,
    client_gains,
    load_private_model,
    local_accuracy,
    overall_gain,
    performance_gain,
    pooled_test_set,
    private_model_key,
    save_private_model,
    train_private_model,
)
from fedcore.models import build_model


class FixedPredictor(nn.Module):
    """Predicts ``table[x[:, 0]]`` (x holds sample ids): a model whose outputs a test can choose."""

    def __init__(self, table: list[int], num_classes: int) -> None:
        super().__init__()
        self.table = torch.tensor(table)
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pred = self.table[x[:, 0].long()]
        return nn.functional.one_hot(pred, self.num_classes).float()


def test_beta_against_a_hand_example() -> None:
    v = {"a": 0.80, "b": 0.50, "c": 0.30, "evil": 0.10}
    p = {"a": 0.60, "b": 0.70, "c": 0.30, "evil": 0.90}
    sizes = {"a": 100, "b": 300, "c": 100, "evil": 500}
    rep = performance_gain(v, p, sizes, exclude={"evil"})
    assert rep.beta_i == pytest.approx({"a": 0.20, "b": -0.20, "c": 0.0, "evil": -0.80})
    # uniform alpha = 1/4: (0.2 - 0.2 + 0 - 0.8) / 4
    assert rep.beta == pytest.approx(-0.20)
    # by data size: (100*0.2 + 300*(-0.2) + 0 + 500*(-0.8)) / 1000
    assert rep.beta_weighted == pytest.approx(-0.44)
    # benign only, uniform: (0.2 - 0.2 + 0) / 3
    assert rep.beta_benign == pytest.approx(0.0)
    # benign only, by size: (100*0.2 - 300*0.2) / 500
    assert rep.beta_benign_weighted == pytest.approx(-0.08)
    assert (rep.num_clients, rep.num_benign) == (4, 3)
    assert math.isnan(performance_gain(v, p).beta_weighted)


def test_alpha_weights_and_gain_helpers() -> None:
    assert alpha_weights([1, 2, 3, 4]) == pytest.approx({1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25})
    assert alpha_weights([1, 2], {1: 1, 2: 3}) == pytest.approx({1: 0.25, 2: 0.75})
    assert overall_gain(client_gains({1: 0.9}, {1: 0.5}), {1: 1.0}) == pytest.approx(0.4)
    assert math.isnan(overall_gain({}, {}))
    with pytest.raises(KeyError, match="private-model"):
        client_gains({1: 0.5, 2: 0.5}, {1: 0.1})


def test_asr_against_a_hand_example() -> None:
    # DistFL Eq. 9 with two source classes: 0 -> 4 and 1 -> 5, averaged
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 4])
    preds = torch.tensor([4, 4, 0, 3, 5, 1, 4, 4])
    # class 0: 2 of 4 predicted as 4 -> 0.5; class 1: 1 of 2 predicted as 5 -> 0.5; class 2 is not a source
    assert asr_from_predictions(preds, labels, {0: 4, 1: 5}) == pytest.approx(0.5)
    assert asr_from_predictions(preds, labels, {0: 4}) == pytest.approx(0.5)
    assert asr_from_predictions(preds, labels, {2: 4}) == pytest.approx(1.0)
    assert math.isnan(asr_from_predictions(preds, labels, {7: 1}))  # no samples of the source class
    assert asr_from_predictions(preds, labels, {0: 4, 7: 1}) == pytest.approx(0.5)  # absent classes skipped

    x = torch.arange(8).float()[:, None]
    model = FixedPredictor(preds.tolist(), 10)
    assert attack_success_rate(model, x, labels, {0: 4, 1: 5}, batch_size=3) == pytest.approx(0.5)


def test_local_and_central_accuracy() -> None:
    x = torch.arange(6).float()[:, None]
    model = FixedPredictor([0, 1, 1, 1, 0, 0], 2)
    a = ClientData(x[:3], torch.tensor([0, 1, 1]), x[:3], torch.tensor([0, 1, 0]), 2)
    b = ClientData(x[3:], torch.tensor([1, 0, 0]), x[3:], torch.tensor([1, 0, 0]), 2)
    assert local_accuracy(model, a) == pytest.approx(2 / 3)
    assert local_accuracy(model, b) == pytest.approx(1.0)
    px, py = pooled_test_set([a, b])
    assert len(py) == 6 and central_accuracy(model, px, py) == pytest.approx(5 / 6)


def test_private_model_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    data = load_client_data("synthetic", 0, 0, {"min_samples": 120, "max_samples": 120})
    cfg = TrainingConfig(batch_size=10, learning_rate=0.05)

    def factory() -> nn.Module:
        return build_model("mlp", {"in_features": 60, "num_classes": 10, "hidden": [16]})

    state, acc = train_private_model(factory, data, cfg, epochs=3, seed=7)
    state2, acc2 = train_private_model(factory, data, cfg, epochs=3, seed=7)
    assert acc == acc2 and 0.0 <= acc <= 1.0
    assert all(torch.equal(state[k], state2[k]) for k in state)
    untrained = factory()
    assert acc >= local_accuracy(untrained, data) - 0.2  # it learned something, not nothing
    assert load_private_model(tmp_path / "client") is None
    path = save_private_model(tmp_path / "client", state, acc, {"epochs": 3})
    assert path.exists() and path.read_bytes()[:8] == b"FGTENS01"  # fedguard tensor file, not pickle
    loaded = load_private_model(tmp_path / "client")
    assert loaded is not None
    loaded_state, loaded_acc = loaded
    assert loaded_acc == acc and all(torch.equal(loaded_state[k], state[k]) for k in state)
    model = factory()
    model.load_state_dict(loaded_state)
    assert local_accuracy(model, data) == pytest.approx(acc)


def test_the_private_model_key_names_what_the_private_model_is_a_function_of() -> None:
    data = load_client_data("synthetic", 0, 0, {"min_samples": 60, "max_samples": 60})
    other = load_client_data("synthetic", 1, 0, {"min_samples": 60, "max_samples": 60})
    cfg = TrainingConfig(batch_size=10, learning_rate=0.05)
    key = private_model_key(data, cfg, 3, 7)
    assert key == private_model_key(data, TrainingConfig(batch_size=10, learning_rate=0.05), 3, 7)
    changed = [private_model_key(other, cfg, 3, 7), private_model_key(data, cfg, 4, 7),
               private_model_key(data, cfg, 3, 8), private_model_key(data, TrainingConfig(batch_size=20,
                                                                                          learning_rate=0.05), 3, 7)]
    assert len({key, *changed}) == 5
    # One label changed is other data.
    y = data.y_train.clone()
    y[0] = (y[0] + 1) % data.num_classes
    relabelled = ClientData(data.x_train, y, data.x_test, data.y_test, data.num_classes)
    assert private_model_key(relabelled, cfg, 3, 7) != key
