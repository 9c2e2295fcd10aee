from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedcore.config import ConfigError, TrainingConfig
from fedcore.data import load_client_data
from fedcore.models import build_model
from fedcore.seeds import derive_seed, round_seeds
from fedcore.train import train_local
from fedcore.train.lindt import (
    LINDT_TRAINERS,
    DualModel,
    LindtConfig,
    attach,
    inference_module,
    lindt_trainer,
    split_blocks,
)
from fedcore.train.trainers import TrainerState, load_trainer_state, save_trainer_state

SEEDS = round_seeds(7, "client-a", 3)
CFG = TrainingConfig(local_epochs=2, batch_size=8, learning_rate=0.1, momentum=0.9, weight_decay=1e-3,
                     grad_clip_norm=1.0, prox_mu=0.1)
SMALL_LSTM = {"num_classes": 7, "vocab_size": 7, "embed_dim": 4, "hidden": 6, "num_lstm_layers": 2,
              "seq_len": 5, "dropout": 0.2}


def _mlp(seed: int = 0) -> nn.Module:
    # Dropout so that the dropout generators are exercised.
    torch.manual_seed(seed)  # tests only: a fixed initialisation
    return nn.Sequential(nn.Flatten(), nn.Linear(60, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 12), nn.ReLU(),
                         nn.Linear(12, 8))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    d = load_client_data("synthetic", 0, 0)
    return d.x_train, d.y_train


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- attach (Eq. 8–9) ----

def test_attach_hand_example() -> None:
    l = torch.tensor([[1.0, 0.0]])  # noqa: E741
    g = torch.tensor([[2.0, 3.0]])
    s = torch.sigmoid(torch.tensor(2.0))  # <L, G> / ||L|| = 2 / 1
    h = attach(g, l)
    assert torch.allclose(h, s * g + (1 - s) * l)
    # A second sample with ||L|| = 2: score = sigmoid((2*1 + 0*1) / 2) = sigmoid(1).
    l2 = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    g2 = torch.tensor([[2.0, 3.0], [1.0, 1.0]])
    s2 = torch.sigmoid(torch.tensor([2.0, 1.0])).unsqueeze(1)
    assert torch.allclose(attach(g2, l2), s2 * g2 + (1 - s2) * l2)


def test_attach_zero_local_norm_gives_half_and_finite_grads() -> None:
    l = torch.zeros(2, 3, requires_grad=True)  # noqa: E741
    g = torch.randn(2, 3, requires_grad=True)
    h = attach(g, l)
    assert torch.isfinite(h).all()
    assert torch.allclose(h, 0.5 * g)
    h.sum().backward()
    assert l.grad is not None and g.grad is not None
    assert torch.isfinite(l.grad).all() and torch.isfinite(g.grad).all()


@pytest.mark.parametrize("shape", [(4, 5), (4, 3, 6, 6), (4, 7, 5)])
def test_attach_shapes(shape: tuple[int, ...]) -> None:
    g, l = torch.randn(shape), torch.randn(shape)  # noqa: E741
    assert attach(g, l).shape == shape
    assert attach(g, l, sequence=True).shape == shape


def test_attach_conv_scores_whole_sample() -> None:
    g, l = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)  # noqa: E741
    gf, lf = g.flatten(1), l.flatten(1)
    s = torch.sigmoid((gf * lf).sum(1) / lf.norm(dim=1)).view(3, 1, 1, 1)
    assert torch.allclose(attach(g, l), s * g + (1 - s) * l, atol=1e-6)


def test_attach_sequence_scores_per_time_step() -> None:
    g, l = torch.randn(2, 5, 3), torch.randn(2, 5, 3)  # noqa: E741
    s = torch.sigmoid((g * l).sum(-1) / l.norm(dim=-1)).unsqueeze(-1)  # [B, T, 1]
    assert torch.allclose(attach(g, l, sequence=True), s * g + (1 - s) * l, atol=1e-6)
    # Per step differs from the flattened per-sample score.
    assert not torch.allclose(attach(g, l, sequence=True), attach(g, l))


def test_attach_detach_global() -> None:
    g = torch.randn(3, 4, requires_grad=True)
    l = torch.randn(3, 4, requires_grad=True)  # noqa: E741
    attach(g, l, detach_global=True).sum().backward()
    assert g.grad is None and l.grad is not None
    with pytest.raises(ValueError, match="shape"):
        attach(torch.randn(2, 3), torch.randn(2, 4))


# ---- split_blocks ----

def test_split_blocks_zoo_models() -> None:
    mlp = build_model("mnist_mlp", {"hidden": [8, 8]}, seed=0)
    assert len(split_blocks(mlp)) == 3
    cnn = build_model("mnist_cnn", {"channels": [2, 3], "hidden": 8}, seed=0)
    assert len(split_blocks(cnn)) == 4
    lstm = build_model("char_lstm", SMALL_LSTM, seed=0)
    blocks = split_blocks(lstm)
    assert len(blocks) == 4  # embedding, 2 LSTM layers, head
    assert all(b is o for b, o in zip(blocks, lstm.blocks, strict=True))


def test_split_blocks_sequential() -> None:
    seq = build_model("mlp", {"hidden": [8, 8]}, seed=0)
    assert isinstance(seq, nn.Sequential)
    blocks = split_blocks(seq)
    assert len(blocks) == 3
    first = blocks[0]
    assert isinstance(first, nn.Sequential)
    assert [type(m) for m in first] == [nn.Flatten, nn.Linear, nn.ReLU]  # the leading Flatten joins block 1
    assert isinstance(blocks[2], nn.Linear)
    # The blocks share the model's modules and compose to its forward.
    assert first[1] is seq[1]
    x = torch.randn(3, 60)
    h = x
    for b in blocks:
        h = b(h)
    assert torch.equal(h, seq(x))
    # The activation, pool, dropout and flatten that follow a conv belong to its block.
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.1), nn.Flatten(),
                         nn.Linear(2 * 3 * 3, 4))
    cb = split_blocks(conv)
    assert [len(b) if isinstance(b, nn.Sequential) else 1 for b in cb] == [5, 1]
    assert DualModel(conv, copy.deepcopy(conv))(torch.randn(2, 1, 8, 8)).shape == (2, 4)


@pytest.mark.parametrize("model", [nn.Linear(3, 2), nn.Sequential(nn.Flatten(), nn.Linear(3, 2))],
                         ids=["bare-linear", "one-layer-sequential"])
def test_split_blocks_refuses(model: nn.Module) -> None:
    with pytest.raises(ConfigError, match="LINDT needs a model made of blocks") as e:
        split_blocks(model)
    assert type(model).__name__ in str(e.value)
    assert e.value.field == "trainer"


def test_split_blocks_refuses_custom_module_and_logreg() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))  # type: ignore[no-any-return]

    with pytest.raises(ConfigError, match="Net cannot be split"):
        split_blocks(Net())
    with pytest.raises(ConfigError, match="cannot be split"):
        split_blocks(build_model("logreg", seed=0))
    with pytest.raises(ConfigError, match="cannot be split"):
        lindt_trainer().init(Net())


# ---- DualModel ----

@pytest.mark.parametrize("name,kwargs,x,classes", [
    ("mnist_mlp", {"hidden": [8, 6]}, torch.randn(3, 1, 28, 28), 10),
    ("mnist_cnn", {"channels": [2, 3], "hidden": 8}, torch.randn(3, 1, 28, 28), 10),
    ("char_lstm", SMALL_LSTM, torch.randint(0, 7, (3, 5)), 7),
    ("mlp", {"hidden": [8]}, torch.randn(3, 60), 10),
])
def test_dual_model_forward_shapes(name: str, kwargs: dict[str, object], x: torch.Tensor, classes: int) -> None:
    g = build_model(name, kwargs, seed=0)
    v = build_model(name, kwargs, seed=1)
    dual = DualModel(g, v).eval()
    gm, lm = dual.forward_both(x)
    assert gm.shape == lm.shape == (3, classes)
    assert torch.equal(gm, g.eval()(x))  # G runs normally on x
    assert torch.equal(dual(x), lm)  # forward = the local logits
    assert not torch.allclose(lm, v.eval()(x))  # the local model is fed the mixes


def test_dual_model_matches_hand_composition() -> None:
    g, v = _mlp(0).eval(), _mlp(1).eval()
    x = torch.randn(4, 60)
    g1 = g[2](g[1](g[0](x)))
    g2 = g[5](g[4](g[3](g1)))
    l1 = v[2](v[1](v[0](x)))
    l2 = v[5](v[4](v[3](attach(g1, l1))))
    l3 = v[6](attach(g2, l2))
    assert torch.allclose(DualModel(g, v)(x), l3)


def test_dual_model_refuses_other_architectures() -> None:
    with pytest.raises(ValueError, match="architecture"):
        DualModel(build_model("mlp", {"hidden": [8]}, seed=0), build_model("mlp", {"hidden": [9]}, seed=0))
    with pytest.raises(ValueError, match="layers"):
        DualModel(build_model("mlp", {"hidden": [8]}, seed=0), build_model("mlp", {"hidden": [8, 8]}, seed=0))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("detach", [False, True])
def test_eq10_gradients(detach: bool) -> None:
    x, y = _data()
    g, v = _mlp(0).eval(), _mlp(1).eval()
    dual = DualModel(g, v, detach_global=detach)
    gm, lm = dual.forward_both(x)
    (F.cross_entropy(gm, y) + F.cross_entropy(lm, y)).backward()
    both_g, both_v = _grads(g), _grads(v)
    assert all(t.abs().sum() > 0 for t in both_g) and all(t.abs().sum() > 0 for t in both_v)
    g.zero_grad(set_to_none=True)
    v.zero_grad(set_to_none=True)
    gm, _ = dual.forward_both(x)
    F.cross_entropy(gm, y).backward()
    alone = _grads(g)
    same = all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(both_g, alone, strict=True))
    assert same is detach  # the local CE reaches w only without detach_global


# ---- the trainer ----

def test_options_validated() -> None:
    assert LindtConfig().detach_global is False
    assert lindt_trainer({"detach_global": True}).name == "lindt"
    with pytest.raises(ConfigError, match="detach_global"):
        lindt_trainer({"detach_global": "yes"})
    with pytest.raises(ConfigError, match="unknown field"):
        lindt_trainer({"lam": 0.1})
    with pytest.raises(ConfigError, match="detach_global"):
        LindtConfig(detach_global=1).validate()  # type: ignore[arg-type]
    assert list(LINDT_TRAINERS) == ["lindt"] and LINDT_TRAINERS["lindt"] is lindt_trainer


def test_no_recovery_is_train_local_and_keeps_state() -> None:
    x, y = _data()
    a, b = _mlp(0), _mlp(0)
    trainer = lindt_trainer()
    state = TrainerState(adapted=_state(_mlp(1)), active=True, rounds_adapted=2, metrics={"passes": 2.0})
    res, new = trainer.train(a, state, x, y, CFG, SEEDS, recovery=False)
    ref = train_local(b, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    assert res == ref
    assert _equal(a.state_dict(), b.state_dict())
    assert new.adapted is state.adapted and new.rounds_adapted == 2 and not new.active and new.metrics == {}
    fresh = trainer.init(_mlp(0))
    _, again = trainer.train(_mlp(0), fresh, x, y, CFG, SEEDS, recovery=False)
    assert again == fresh


def test_recovery_trains_both_and_changes_global_update() -> None:
    x, y = _data()
    a, b = _mlp(0), _mlp(0)
    trainer = lindt_trainer()
    state = trainer.init(a)
    received = _state(a)
    res, new = trainer.train(a, state, x, y, CFG, SEEDS, recovery=True)
    ref = train_local(b, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    assert res.steps == ref.steps and res.num_samples == ref.num_samples
    assert not _equal(a.state_dict(), b.state_dict())  # the local loss reaches w (Eq. 10)
    assert new.active and new.rounds_adapted == 1 and new.adapted is not None
    assert not _equal(new.adapted, received) and not _equal(new.adapted, _state(a))
    assert all(t.device.type == "cpu" for t in new.adapted.values())
    assert set(new.metrics) == {"lindt_local_ce", "lindt_global_ce", "passes", "personal_seconds"}
    assert new.metrics["passes"] == 2.0
    assert all(math.isfinite(v) for v in new.metrics.values())
    # A second round starts from the saved local model.
    _, newer = trainer.train(a, new, x, y, CFG, SEEDS, recovery=True)
    assert newer.rounds_adapted == 2 and not _equal(newer.adapted or {}, new.adapted)


def test_detach_global_keeps_global_trajectory_bit_identical() -> None:
    x, y = _data()
    a, b = _mlp(0), _mlp(0)
    trainer = lindt_trainer({"detach_global": True})
    res, new = trainer.train(a, trainer.init(a), x, y, CFG, SEEDS, recovery=True)
    ref = train_local(b, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    assert res == ref
    assert _equal(a.state_dict(), b.state_dict())
    assert new.metrics["lindt_global_ce"] <= res.loss  # the loss also holds the FedProx term
    # With a batches override too (epochs and learning rate as given).
    c, d = _mlp(0), _mlp(0)
    stream = [(x[:20], y[:20]), (x[20:], y[20:])]

    def batches(_: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return stream

    r1, _ = trainer.train(c, TrainerState(), x, y, CFG, SEEDS, recovery=True, learning_rate=0.05, epochs=1,
                          batches=batches)
    r2 = train_local(d, x, y, CFG, learning_rate=0.05, epochs=1, batches=batches, dropout_seed=SEEDS.dropout)
    assert r1 == r2 and r1.steps == 2
    assert _equal(c.state_dict(), d.state_dict())


def test_recovery_is_deterministic_and_seeded() -> None:
    x, y = _data()
    trainer = lindt_trainer()
    out = []
    for _ in range(2):
        m = _mlp(0)
        _, st = trainer.train(m, TrainerState(), x, y, CFG, SEEDS, recovery=True)
        out.append((st.adapted or {}, _state(m)))
    assert _equal(out[0][0], out[1][0]) and _equal(out[0][1], out[1][1])
    other = dataclasses.replace(SEEDS, dropout=derive_seed(SEEDS.dropout, "other"))
    _, st = trainer.train(_mlp(0), TrainerState(), x, y, CFG, other, recovery=True)
    assert not _equal(st.adapted or {}, out[0][0])


def test_lstm_recovery_round() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 7, (12, 5), generator=g), torch.randint(0, 7, (12,), generator=g)
    model = build_model("char_lstm", SMALL_LSTM, seed=0)
    res, st = lindt_trainer().train(model, TrainerState(), x, y, CFG, SEEDS, recovery=True)
    assert res.steps == 4 and st.adapted is not None and math.isfinite(res.loss)


def test_non_finite_loss_raises() -> None:
    x, y = _data()
    bad = dataclasses.replace(CFG, learning_rate=1e30, grad_clip_norm=0.0, momentum=0.0)
    with pytest.raises(FloatingPointError, match="diverged"):
        lindt_trainer().train(_mlp(0), TrainerState(), x * 1e30, y, bad, SEEDS, recovery=True)


def test_state_round_trip_and_inference_module(tmp_path: Path) -> None:
    x, y = _data()
    trainer = lindt_trainer()
    received = _mlp(0)
    assert trainer.inference_module is inference_module
    assert inference_module(TrainerState(), received) is None
    model = copy.deepcopy(received)
    _, st = trainer.train(model, TrainerState(), x, y, CFG, SEEDS, recovery=True)
    save_trainer_state(tmp_path, st)
    loaded = load_trainer_state(tmp_path)
    assert loaded is not None and loaded.adapted is not None and st.adapted is not None
    assert _equal(loaded.adapted, st.adapted)
    assert loaded.rounds_adapted == 1 and loaded.active and loaded.metrics == st.metrics
    before = _state(received)
    module = inference_module(loaded, received)
    assert isinstance(module, DualModel) and not module.training
    assert _equal(_state(received), before)  # the received model is copied, not modified
    assert module.global_model is not received
    local = _mlp(5)
    local.load_state_dict(loaded.adapted)
    expected = DualModel(copy.deepcopy(received), local).eval().forward_both(x)[1]
    with torch.no_grad():
        out = module(x)
        assert torch.equal(out, expected)  # the local model's output, fed by the received global model
        assert not torch.allclose(out, received.eval()(x))
