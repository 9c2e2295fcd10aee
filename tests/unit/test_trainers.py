from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fedcore.config import ConfigError, TrainingConfig
from fedcore.nfl.measure import client_beta_hat, first_batch
from fedcore.seeds import RoundSeeds, round_seeds
from fedcore.train import train_local
from fedcore.train.trainers import (
    TRAINER_STATE_FILE,
    TRAINERS,
    FlGuardConfig,
    TrainerState,
    TrainerStateError,
    frozen_layer_keys,
    inference_state,
    lambda_weight,
    load_trainer_state,
    make_trainer,
    parameterised_layers,
    save_trainer_state,
)

SEEDS = round_seeds(7, "client-a", 3)


def _data(n: int = 23, d: int = 6, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _net(seed: int = 0, dropout: float = 0.3, bn: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)  # tests only: a fixed initialisation
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16) if bn else nn.Identity(), nn.ReLU(),
                         nn.Dropout(dropout), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))


def _perturbed(model: nn.Module, scale: float = 0.3, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
    return out


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


CFG = TrainingConfig(local_epochs=2, batch_size=5, learning_rate=0.1, momentum=0.9, weight_decay=1e-3,
                     grad_clip_norm=1.0, prox_mu=0.1)


# ---- λ (Eq. 6-8) ----

def _linear(w: list[list[float]], b: list[float]) -> nn.Linear:
    m = nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(w))
        m.bias.copy_(torch.tensor(b))
    return m


def _ce_and_grad(w: list[list[float]], b: list[float], xs: list[list[float]], ys: list[int]) -> tuple[
    float, list[float]
]:
    """Mean cross-entropy of a 2x2 linear model and its gradient (w00, w01, w10, w11, b0, b1), by hand."""
    loss, grad = 0.0, [0.0] * 6
    for x, y in zip(xs, ys, strict=True):
        z = [w[k][0] * x[0] + w[k][1] * x[1] + b[k] for k in range(2)]
        e = [math.exp(v) for v in z]
        p = [v / sum(e) for v in e]
        loss += -math.log(p[y])
        for k in range(2):
            r = p[k] - (1.0 if k == y else 0.0)
            grad[2 * k] += r * x[0]
            grad[2 * k + 1] += r * x[1]
            grad[4 + k] += r
    n = len(ys)
    return loss / n, [g / n for g in grad]


def _sigmoid(t: float) -> float:
    return 1.0 / (1.0 + math.exp(-t))


def test_lambda_matches_a_hand_computation() -> None:
    vw, vb = [[0.5, -0.2], [0.1, 0.3]], [0.05, -0.1]
    ww, wb = [[-0.3, 0.4], [0.2, -0.1]], [0.0, 0.2]
    xs, ys = [[1.0, 2.0], [-1.0, 0.5], [0.3, -0.7]], [0, 1, 1]
    lv, gv = _ce_and_grad(vw, vb, xs, ys)
    lw, _ = _ce_and_grad(ww, wb, xs, ys)
    diff = [vw[0][0] - ww[0][0], vw[0][1] - ww[0][1], vw[1][0] - ww[1][0], vw[1][1] - ww[1][1],
            vb[0] - wb[0], vb[1] - wb[1]]
    grad_div = sum(d * g for d, g in zip(diff, gv, strict=True)) / math.sqrt(sum(g * g for g in gv))
    expected = _sigmoid(lv - lw) * _sigmoid(grad_div)
    got = lambda_weight(_linear(vw, vb), _linear(ww, wb), torch.tensor(xs), torch.tensor(ys))
    assert got == pytest.approx(expected, rel=1e-5)
    # identical models: loss_div = 0 and grad_div = 0, so lambda = 1/4
    assert lambda_weight(_linear(ww, wb), _linear(ww, wb), torch.tensor(xs), torch.tensor(ys)) == pytest.approx(0.25)


def test_trainer_uses_the_same_lambda_as_the_helper() -> None:
    x, y = _data(n=5)
    model = _net(dropout=0.0, bn=False)
    start = _perturbed(model)
    v = _net(dropout=0.0, bn=False)
    v.load_state_dict(start)
    expected = lambda_weight(v, model, x, y)
    cfg = TrainingConfig(local_epochs=1, batch_size=5, learning_rate=0.1)
    trainer = make_trainer("flguard")
    _, st = trainer.train(model, TrainerState(adapted=start), x, y, cfg, SEEDS, recovery=True)
    assert st.metrics["adapt_steps"] == 1
    assert st.metrics["lambda_mean"] == pytest.approx(expected, rel=1e-5)
    assert 0.0 < st.metrics["lambda_min"] <= st.metrics["lambda_max"] < 1.0


# ---- the global copy is unchanged by adaptation ----

def test_adaptation_leaves_the_global_copy_bit_identical_to_train_local() -> None:
    x, y = _data()
    ref, dual = _net(), _net()
    res_ref = train_local(ref, x, y, CFG, learning_rate=0.07, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    trainer = make_trainer("flguard", {"l_fb": 1})
    rng = torch.get_rng_state()
    state = TrainerState(adapted=_perturbed(dual))  # a previous round's vᵢ, far from w
    res, st = trainer.train(dual, state, x, y, CFG, SEEDS, recovery=True, learning_rate=0.07)
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn from the global RNG
    assert _states_equal(ref.state_dict(), dual.state_dict())
    assert res == res_ref
    assert st.active and st.rounds_adapted == 1 and st.metrics["adapt_diverged"] == 0.0
    assert st.adapted is not None and not _states_equal(st.adapted, dual.state_dict())


def test_first_round_adaptation_and_batches_override_keep_the_global_copy_identical() -> None:
    x, y = _data()
    stream = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 20, 4)]
    ref, dual = _net(), _net()
    train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout, epochs=3,
                batches=lambda e: iter(stream))
    trainer = make_trainer("flguard")
    _, st = trainer.train(dual, trainer.init(dual), x, y, CFG, SEEDS, recovery=True, epochs=3,
                          batches=lambda e: iter(stream))
    assert _states_equal(ref.state_dict(), dual.state_dict())
    assert st.metrics["adapt_steps"] == 15


def test_without_recovery_flguard_and_vanilla_are_train_local() -> None:
    x, y = _data()
    ref = _net()
    res_ref = train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    kept = _perturbed(ref)
    for name, state in (("vanilla", TrainerState()), ("flguard", TrainerState(adapted=kept, active=True))):
        m = _net()
        res, st = make_trainer(name).train(m, state, x, y, CFG, SEEDS, recovery=False)
        assert res == res_ref and _states_equal(m.state_dict(), ref.state_dict())
        assert not st.active and st.adapted is state.adapted  # vᵢ kept, untouched
    m = _net()
    st0 = TrainerState()
    _, st = make_trainer("vanilla").train(m, st0, x, y, CFG, SEEDS, recovery=True)  # vanilla: no recovery method
    assert st is st0 and _states_equal(m.state_dict(), ref.state_dict())


def test_adaptation_is_deterministic() -> None:
    x, y = _data()
    outs = []
    for _ in range(2):
        m = _net()
        _, st = make_trainer("flguard").train(m, TrainerState(), x, y, CFG, SEEDS, recovery=True)
        assert st.adapted is not None
        outs.append(st.adapted)
    assert _states_equal(outs[0], outs[1])
    m = _net()
    _, other = make_trainer("flguard").train(m, TrainerState(), x, y, CFG, RoundSeeds(SEEDS.batches, 99, 0),
                                             recovery=True)
    assert other.adapted is not None and not _states_equal(outs[0], other.adapted)  # dropout seed matters


def test_a_diverging_adapted_model_is_discarded_not_the_update() -> None:
    x, y = _data()
    ref, m = _net(), _net()
    train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    bad = _perturbed(m)
    bad["6.weight"] = torch.full_like(bad["6.weight"], float("nan"))
    _, st = make_trainer("flguard").train(m, TrainerState(adapted=bad), x, y, CFG, SEEDS, recovery=True)
    assert st.metrics["adapt_diverged"] == 1.0 and st.adapted is bad
    assert _states_equal(m.state_dict(), ref.state_dict())


# ---- partial-layer adaptation ----

def test_parameterised_layers_and_frozen_keys() -> None:
    m = _net()
    assert [n for n, _ in parameterised_layers(m)] == ["0", "1", "4", "6"]
    assert frozen_layer_keys(m, 0) == ()
    assert frozen_layer_keys(m, 2) == ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                       "1.running_var", "1.num_batches_tracked")
    with pytest.raises(ConfigError, match=r"^l_fb: must be < the model's 4 parameterised layers"):
        frozen_layer_keys(m, 4)
    with pytest.raises(ConfigError, match=r"^l_fb: must be an integer >= 0"):
        FlGuardConfig(l_fb=-1).validate()
    with pytest.raises(ConfigError, match=r"^l_fb: expected an integer"):
        make_trainer("flguard", {"l_fb": "2"})
    with pytest.raises(ConfigError, match=r"^bogus: unknown field"):
        make_trainer("flguard", {"bogus": 1})
    with pytest.raises(ConfigError, match="l_fb: must be < the model's 4"):
        make_trainer("flguard", {"l_fb": 4}).init(m)
    with pytest.raises(ConfigError, match="vanilla' takes no options"):
        make_trainer("vanilla", {"l_fb": 1})
    with pytest.raises(ValueError,
                       match="unknown trainer 'lindt2'; known: apfl, ditto, fb, fedntd, flguard, ft, hydra, lindt, "
                             "moon, noop, vanilla"):
        make_trainer("lindt2")
    assert TRAINERS.names() == ["apfl", "ditto", "fb", "fedntd", "flguard", "ft", "hydra", "lindt", "moon", "noop",
                               "vanilla"]


def test_frozen_layers_follow_the_global_copy_and_the_others_adapt() -> None:
    x, y = _data()
    m = _net()
    trainer = make_trainer("flguard", {"l_fb": 2})
    state = trainer.init(m)
    assert state.frozen_keys == frozen_layer_keys(m, 2) and state.adapted is None
    state = dataclasses.replace(state, adapted=_perturbed(m))
    for _ in range(2):
        _, state = trainer.train(m, state, x, y, CFG, SEEDS, recovery=True)
        assert state.adapted is not None
        w = m.state_dict()
        for k in w:
            same = torch.equal(state.adapted[k], w[k])
            assert same == (k in state.frozen_keys), k


# ---- inference model ----

def test_inference_state_none_before_adaptation_then_adapted_kept_after_stop() -> None:
    x, y = _data()
    m = _net()
    trainer = make_trainer("flguard", {"l_fb": 1})
    state = trainer.init(m)
    assert trainer.inference_state(state) is None
    _, state = trainer.train(m, state, x, y, CFG, SEEDS, recovery=False)
    assert trainer.inference_state(state) is None  # no adaptation yet: infer with the received model
    _, state = trainer.train(m, state, x, y, CFG, SEEDS, recovery=True)
    assert state.adapted is not None
    adapted = state.adapted
    inf = trainer.inference_state(state)
    assert inf is not None and _states_equal(inf, adapted)
    _, state = trainer.train(m, state, x, y, CFG, round_seeds(7, "client-a", 4), recovery=False)  # stopped
    assert not state.active and state.adapted is adapted
    received = _perturbed(m, seed=5)
    inf = trainer.inference_state(state, received)
    assert inf is not None
    for k in inf:  # frozen lower layers follow the received global model, the rest is vᵢ
        assert torch.equal(inf[k], received[k] if k in ("0.weight", "0.bias") else adapted[k]), k
    assert inference_state(TrainerState()) is None


# ---- persistence ----

def test_trainer_state_save_load_round_trip(tmp_path: Path) -> None:
    assert load_trainer_state(tmp_path) is None
    x, y = _data()
    m = _net()
    trainer = make_trainer("flguard", {"l_fb": 1})
    _, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=True)
    save_trainer_state(tmp_path, st)
    back = load_trainer_state(tmp_path)
    assert back is not None and back.adapted is not None and st.adapted is not None
    assert _states_equal(back.adapted, st.adapted)
    assert (back.active, back.frozen_keys, back.rounds_adapted, back.metrics) == (
        st.active, st.frozen_keys, st.rounds_adapted, st.metrics)
    # the loaded state trains on exactly like the in-memory one (a client restart)
    m1, m2 = _net(seed=3), _net(seed=3)
    _, a = trainer.train(m1, st, x, y, CFG, SEEDS, recovery=True)
    _, b = trainer.train(m2, back, x, y, CFG, SEEDS, recovery=True)
    assert a.adapted is not None and b.adapted is not None and _states_equal(a.adapted, b.adapted)

    save_trainer_state(tmp_path, TrainerState())
    empty = load_trainer_state(tmp_path)
    assert empty == TrainerState()


def test_corrupt_or_mismatched_trainer_state_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / TRAINER_STATE_FILE).write_bytes(b"not a tensor file")
    with pytest.raises(TrainerStateError, match=r"trainer_state\.fgt: unreadable trainer state"):
        load_trainer_state(tmp_path)
    m = _net()
    small = nn.Sequential(nn.Linear(6, 4))
    save_trainer_state(tmp_path, TrainerState(adapted=dict(small.state_dict())))
    st = load_trainer_state(tmp_path)
    assert st is not None
    x, y = _data()
    with pytest.raises(TrainerStateError, match="does not fit this model"):
        make_trainer("flguard").train(m, st, x, y, CFG, SEEDS, recovery=True)


# ---- β̂ᵢ (Eq. 3) and the first batch ----

def test_beta_hat_by_hand() -> None:
    model = _linear([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0])  # predicts argmax of the input
    xb = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.5], [4.0, 5.0]])
    yb = torch.tensor([0, 1, 1, 0])  # correct, correct, wrong, wrong
    assert client_beta_hat(model, (xb, yb), 0.3) == pytest.approx(0.5 - 0.3)
    assert client_beta_hat(model, (xb[:2], yb[:2]), 0.75) == pytest.approx(0.25)


def test_first_batch_is_train_locals_first_batch() -> None:
    x, y = _data(n=23)
    seen: list[torch.Tensor] = []
    m = _net(dropout=0.0)
    m[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    train_local(m, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    xb, yb = first_batch(x, y, CFG.batch_size, SEEDS.batches)
    assert torch.equal(xb, seen[0]) and len(yb) == CFG.batch_size
    rows = [int((x == r).all(dim=1).nonzero()) for r in xb]
    assert torch.equal(yb, y[rows])
    with pytest.raises(ValueError, match="no training data"):
        first_batch(x[:0], y[:0], 5, 1)
