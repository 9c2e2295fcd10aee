from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedcore.config import ConfigError, TrainingConfig
from fedcore.data import load_client_data
from fedcore.models import build_model
from fedcore.seeds import RoundSeeds, derive_seed, round_seeds
from fedcore.train import train_local
from fedcore.train.personal import (
    PERSONAL_TRAINERS,
    apfl_mix,
    apfl_trainer,
    ditto_trainer,
    fb_trainer,
    ft_trainer,
)
from fedcore.train.trainers import TrainerState, load_trainer_state, save_trainer_state

SEEDS = round_seeds(7, "client-a", 3)
NAMES = ["ditto", "apfl", "ft", "fb"]

CFG = TrainingConfig(local_epochs=2, batch_size=5, learning_rate=0.1, momentum=0.9, weight_decay=1e-3,
                     grad_clip_norm=1.0, prox_mu=0.1)
# No FedProx term, so that a personal model's plain SGD can be compared with train_local's.
CFG_SGD = dataclasses.replace(CFG, prox_mu=0.0)
# One full-batch plain SGD step: hand computations.
ONE_STEP = TrainingConfig(local_epochs=1, batch_size=64, learning_rate=0.2)


def _data(n: int = 23, d: int = 6, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _net(seed: int = 0, dropout: float = 0.3, bn: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)  # tests only: a fixed initialisation
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16) if bn else nn.Identity(), nn.ReLU(),
                         nn.Dropout(dropout), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))


def _tiny(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4))


def _perturbed(model: nn.Module, scale: float = 0.3, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
    return out


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _prior_state(name: str, model: nn.Module) -> TrainerState:
    """A state as after an earlier recovery round: a personal model far from the global one (and APFL's α)."""
    trainer = PERSONAL_TRAINERS[name](None)
    st = trainer.init(model)
    return dataclasses.replace(st, adapted=_perturbed(model), active=True, rounds_adapted=1,
                               scalars={"alpha": 0.4} if name == "apfl" else {})


# ---- registry ----

def test_personal_trainers_are_registered_by_name() -> None:
    assert sorted(PERSONAL_TRAINERS) == sorted(NAMES)
    for name, factory in PERSONAL_TRAINERS.items():
        assert factory(None).name == name
    assert (ditto_trainer().name, apfl_trainer().name, ft_trainer().name, fb_trainer().name) == tuple(NAMES)


# ---- the update sent to the server never changes ----

@pytest.mark.parametrize("recovery", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_the_global_copy_is_bit_identical_to_train_local(name: str, recovery: bool) -> None:
    x, y = _data()
    ref = _net()
    res_ref = train_local(ref, x, y, CFG, learning_rate=0.07, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    trainer = PERSONAL_TRAINERS[name](None)
    for state in (trainer.init(_net()), _prior_state(name, _net())):
        m = _net()
        rng = torch.get_rng_state()
        res, st = trainer.train(m, state, x, y, CFG, SEEDS, recovery=recovery, learning_rate=0.07)
        assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn from the global RNG
        assert res == res_ref
        assert _states_equal(m.state_dict(), ref.state_dict())
        assert st.active == recovery
        if recovery:
            assert st.adapted is not None and st.rounds_adapted == state.rounds_adapted + 1
            assert st.metrics["personal_diverged"] == 0.0 and st.metrics["personal_steps"] > 0
            assert st.metrics["personal_seconds"] >= 0.0 and st.metrics["passes"] > 1.0


@pytest.mark.parametrize("name", NAMES)
def test_batches_override_and_epochs_keep_the_global_copy_identical(name: str) -> None:
    x, y = _data()
    stream = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 20, 4)]
    ref, m = _net(), _net()
    res_ref = train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout, epochs=3,
                          batches=lambda e: iter(stream))
    trainer = PERSONAL_TRAINERS[name](None)
    res, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=True, epochs=3,
                            batches=lambda e: iter(stream))
    assert res == res_ref and res.steps == 15
    assert _states_equal(m.state_dict(), ref.state_dict())
    # Ditto trains vᵢ for the round's epochs on its own batches, APFL on the global copy's, FT/FB for E′ = 1 epoch
    assert st.active and st.metrics["personal_steps"] == {"ditto": 15, "apfl": 15, "ft": 5, "fb": 5}[name]


@pytest.mark.parametrize("name", NAMES)
def test_without_recovery_the_round_is_train_local_and_the_personal_state_is_kept(name: str) -> None:
    x, y = _data()
    ref = _net()
    res_ref = train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    trainer = PERSONAL_TRAINERS[name](None)
    state = dataclasses.replace(_prior_state(name, _net()), metrics={"personal_steps": 3.0})
    m = _net()
    res, st = trainer.train(m, state, x, y, CFG, SEEDS, recovery=False)
    assert res == res_ref and _states_equal(m.state_dict(), ref.state_dict())
    assert st.adapted is state.adapted and st.scalars == state.scalars
    assert not st.active and st.metrics == {} and st.rounds_adapted == state.rounds_adapted


# ---- Ditto ----

def test_ditto_personal_step_matches_a_hand_computation() -> None:
    x, y = _data(n=8)
    lam, lr = 0.7, ONE_STEP.learning_rate
    model = _tiny()
    w = {k: t.clone() for k, t in model.state_dict().items()}
    v0 = _perturbed(model)
    # ∇ℓ(v) on the whole batch, by autograd on a separate copy
    probe = _tiny()
    probe.load_state_dict(v0)
    F.cross_entropy(probe(x), y).backward()  # type: ignore[no-untyped-call]
    grads = {f"0.{n}": p.grad for n, p in probe[0].named_parameters()}
    _, st = ditto_trainer({"lam": lam}).train(model, TrainerState(adapted=v0), x, y, ONE_STEP, SEEDS,
                                              recovery=True)
    assert st.adapted is not None
    for k in v0:
        g = grads[k]
        assert g is not None
        expected = v0[k] - lr * (g + lam * (v0[k] - w[k]))  # v' = v − η(∇ℓ(v) + λ(v − w))
        torch.testing.assert_close(st.adapted[k], expected, rtol=1e-5, atol=1e-6)
    assert st.metrics["personal_steps"] == 1.0 and st.metrics["passes"] == 2.0
    sq = sum(float(((v0[k] - w[k]) ** 2).sum()) for k in v0)
    assert st.metrics["personal_loss"] == pytest.approx(st.metrics["personal_ce"] + 0.5 * lam * sq, rel=1e-5)


def test_ditto_with_lambda_zero_is_plain_sgd_of_the_personal_model() -> None:
    x, y = _data()
    model = _net()
    v0 = _perturbed(model)
    expected = _net()
    expected.load_state_dict(v0)
    res_v = train_local(expected, x, y, CFG_SGD, seed=derive_seed(SEEDS.batches, "ditto"),
                        dropout_seed=derive_seed(SEEDS.dropout, "ditto"))
    _, st = ditto_trainer({"lam": 0.0}).train(model, TrainerState(adapted=v0), x, y, CFG_SGD, SEEDS, recovery=True)
    assert st.adapted is not None and _states_equal(st.adapted, expected.state_dict())
    assert st.metrics["personal_loss"] == pytest.approx(res_v.loss)
    assert st.metrics["personal_steps"] == res_v.steps == 10


def test_ditto_starts_from_the_received_model_and_persists_its_personal_model() -> None:
    x, y = _data()
    trainer = ditto_trainer({"lam": 0.5, "personal_epochs": 1})
    m = _net()
    received = {k: t.clone() for k, t in m.state_dict().items()}
    _, st1 = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=True)
    assert st1.adapted is not None and not _states_equal(st1.adapted, received)
    assert st1.metrics["personal_steps"] == 5 and st1.metrics["passes"] == pytest.approx(1.5)
    inf = trainer.inference_state(st1, received)
    assert inf is not None and _states_equal(inf, st1.adapted)  # infers with vᵢ
    # round 2 continues from round 1's vᵢ: different from starting over
    seeds2 = round_seeds(7, "client-a", 4)
    _, st2 = trainer.train(_net(seed=5), st1, x, y, CFG, seeds2, recovery=True)
    _, fresh = trainer.train(_net(seed=5), trainer.init(m), x, y, CFG, seeds2, recovery=True)
    assert st2.adapted is not None and fresh.adapted is not None
    assert not _states_equal(st2.adapted, fresh.adapted) and st2.rounds_adapted == 2


# ---- APFL ----

def test_apfl_step_of_v_and_alpha_matches_a_hand_computation() -> None:
    x, y = _data(n=8)
    lr, alpha_lr, alpha = ONE_STEP.learning_rate, 0.5, 0.3
    model = _tiny()
    w = {k: t.clone() for k, t in model.state_dict().items()}
    v0 = _perturbed(model)
    mixed = {k: (alpha * v0[k] + (1 - alpha) * w[k]).requires_grad_(True) for k in v0}
    loss = F.cross_entropy(F.linear(x, mixed["0.weight"], mixed["0.bias"]), y)
    g = dict(zip(mixed, torch.autograd.grad(loss, list(mixed.values())), strict=True))
    grad_alpha = sum(float(((v0[k] - w[k]) * g[k]).sum()) for k in v0)  # ∂ℓ(αv + (1−α)w)/∂α
    state = TrainerState(adapted=v0, scalars={"alpha": alpha})
    _, st = apfl_trainer({"alpha_lr": alpha_lr}).train(model, state, x, y, ONE_STEP, SEEDS, recovery=True)
    assert st.adapted is not None
    for k in v0:
        torch.testing.assert_close(st.adapted[k], v0[k] - lr * alpha * g[k], rtol=1e-5, atol=1e-6)
    expected_alpha = min(max(alpha - alpha_lr * grad_alpha, 0.0), 1.0)
    assert st.scalars["alpha"] == pytest.approx(expected_alpha, rel=1e-5, abs=1e-7)
    assert st.metrics["alpha"] == st.scalars["alpha"]
    assert st.metrics["personal_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert st.metrics["personal_steps"] == 1.0 and st.metrics["passes"] == 2.0


def test_apfl_starts_from_alpha0_and_alpha_stays_in_the_unit_interval() -> None:
    x, y = _data()
    m = _net()
    _, st = apfl_trainer().train(m, TrainerState(), x, y, CFG, SEEDS, recovery=True)
    assert st.adapted is not None and 0.0 <= st.scalars["alpha"] <= 1.0 and st.scalars["alpha"] != 0.01
    for alpha0 in (0.0, 0.5, 1.0):
        for seed in range(3):  # a huge step size: α is projected onto [0, 1]
            _, st = apfl_trainer({"alpha0": alpha0, "alpha_lr": 1e4}).train(
                _net(seed=seed), TrainerState(adapted=_perturbed(m, seed=seed)), x, y, CFG, SEEDS, recovery=True)
            assert 0.0 <= st.scalars["alpha"] <= 1.0
            assert st.scalars["alpha"] in (0.0, 1.0)
    _, st = apfl_trainer({"alpha_lr": 0.0, "alpha0": 0.25}).train(_net(), TrainerState(), x, y, CFG, SEEDS,
                                                                  recovery=True)
    assert st.scalars["alpha"] == 0.25  # α_lr = 0: α fixed


def test_apfl_inference_state_mixes_the_personal_and_received_models() -> None:
    m = _net()
    trainer = apfl_trainer()
    assert trainer.inference_state(TrainerState(), m.state_dict()) is None
    v = _perturbed(m, seed=2)
    received = _perturbed(m, seed=3)
    received["1.num_batches_tracked"] = torch.tensor(17)
    v["1.num_batches_tracked"] = torch.tensor(4)
    state = TrainerState(adapted=v, active=True, scalars={"alpha": 0.3})
    inf = trainer.inference_state(state, received)
    assert inf is not None and list(inf) == list(received)
    for k, t in received.items():
        if t.is_floating_point():
            torch.testing.assert_close(inf[k], 0.3 * v[k] + 0.7 * t)
        else:
            assert torch.equal(inf[k], t)
    assert _states_equal(apfl_mix(1.0, v, received) | {"1.num_batches_tracked": v["1.num_batches_tracked"]}, v)
    with pytest.raises(ValueError, match="needs the received global model"):
        trainer.inference_state(state)


def test_apfl_alpha_and_personal_model_persist(tmp_path: Path) -> None:
    x, y = _data()
    trainer = apfl_trainer({"alpha_lr": 0.3})
    m = _net()
    _, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=True)
    save_trainer_state(tmp_path, st)
    back = load_trainer_state(tmp_path)
    assert back is not None and back.adapted is not None and st.adapted is not None
    assert back.scalars == st.scalars and "alpha" in back.scalars
    assert _states_equal(back.adapted, st.adapted) and back.metrics == st.metrics
    seeds2 = round_seeds(7, "client-a", 4)
    _, a = trainer.train(_net(seed=3), st, x, y, CFG, seeds2, recovery=True)
    _, b = trainer.train(_net(seed=3), back, x, y, CFG, seeds2, recovery=True)
    assert a.adapted is not None and b.adapted is not None and _states_equal(a.adapted, b.adapted)
    assert a.scalars == b.scalars


# ---- FT and FB ----

def test_ft_with_zero_epochs_is_the_received_model() -> None:
    x, y = _data()
    m = _net()
    received = {k: t.clone() for k, t in m.state_dict().items()}
    for trainer in (ft_trainer({"epochs": 0}), fb_trainer({"epochs": 0})):
        _, st = trainer.train(_net(), _prior_state(trainer.name, m), x, y, CFG, SEEDS, recovery=True)
        assert st.adapted is not None and _states_equal(st.adapted, received)
        assert st.metrics["personal_steps"] == 0.0 and st.metrics["passes"] == 1.0


def test_ft_is_plain_sgd_of_the_received_model_and_restarts_each_round() -> None:
    x, y = _data()
    expected = _net()
    train_local(expected, x, y, CFG_SGD, seed=derive_seed(SEEDS.batches, "ft"),
                dropout_seed=derive_seed(SEEDS.dropout, "ft"), epochs=3)
    trainer = ft_trainer({"epochs": 3})
    _, st = trainer.train(_net(), trainer.init(_net()), x, y, CFG_SGD, SEEDS, recovery=True)
    assert st.adapted is not None and _states_equal(st.adapted, expected.state_dict())
    assert st.metrics["personal_steps"] == 15 and st.metrics["passes"] == pytest.approx(2.5)
    # the next round starts again from its received model: the previous personal model does not matter
    seeds2 = round_seeds(7, "client-a", 4)
    _, a = trainer.train(_net(seed=4), st, x, y, CFG_SGD, seeds2, recovery=True)
    _, b = trainer.train(_net(seed=4), trainer.init(_net()), x, y, CFG_SGD, seeds2, recovery=True)
    assert a.adapted is not None and b.adapted is not None and _states_equal(a.adapted, b.adapted)
    assert a.rounds_adapted == 2


def test_fb_changes_only_the_last_layer() -> None:
    x, y = _data()
    m = _net()
    received = {k: t.clone() for k, t in m.state_dict().items()}
    trainer = fb_trainer({"epochs": 2})
    _, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=True)
    assert st.adapted is not None
    top = {"6.weight", "6.bias"}
    assert set(st.frozen_keys) == set(received) - top
    for k in received:
        assert torch.equal(st.adapted[k], received[k]) == (k not in top), k
    # inference: the body follows the received global model, the classifier is the fine-tuned one
    new_global = _perturbed(m, seed=9)
    inf = trainer.inference_state(st, new_global)
    assert inf is not None
    for k in inf:
        assert torch.equal(inf[k], st.adapted[k] if k in top else new_global[k]), k


def test_fb_of_a_single_layer_model_fine_tunes_it_whole() -> None:
    x, y = _data(n=20)
    for trainer in (ft_trainer(), fb_trainer()):
        m = _tiny()
        _, st = trainer.train(m, trainer.init(m), x, y, CFG_SGD, SEEDS, recovery=True)
        assert st.frozen_keys == () and st.adapted is not None
    expected = _tiny()
    train_local(expected, x, y, CFG_SGD, seed=derive_seed(SEEDS.batches, "fb"),
                dropout_seed=derive_seed(SEEDS.dropout, "fb"), epochs=1)
    assert st.adapted is not None and _states_equal(st.adapted, expected.state_dict())


# ---- options ----

def test_options_are_validated_and_errors_name_the_option() -> None:
    cases: list[tuple[str, dict[str, object], str]] = [
        ("ditto", {"lam": -0.1}, r"^lam: must be a finite number >= 0"),
        ("ditto", {"lam": float("nan")}, r"^lam: must be a finite number >= 0"),
        ("ditto", {"lam": "0.1"}, r"^lam: expected a number"),
        ("ditto", {"personal_epochs": -1}, r"^personal_epochs: must be an integer >= 0"),
        ("ditto", {"personal_epochs": 1.5}, r"^personal_epochs: "),
        ("apfl", {"alpha0": 1.5}, r"^alpha0: must be a number in \[0, 1\]"),
        ("apfl", {"alpha0": -0.01}, r"^alpha0: must be a number in \[0, 1\]"),
        ("apfl", {"alpha_lr": -1.0}, r"^alpha_lr: must be a finite number >= 0"),
        ("ft", {"epochs": -1}, r"^epochs: must be an integer >= 0"),
        ("fb", {"epochs": True}, r"^epochs: expected an integer"),
        ("fb", {"bogus": 1}, r"^bogus: unknown field; known: epochs"),
        ("ditto", {"alpha0": 0.1}, r"^alpha0: unknown field"),
    ]
    for name, options, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            PERSONAL_TRAINERS[name](options)
    # accepted values
    ditto_trainer({"lam": 1, "personal_epochs": 0})
    apfl_trainer({"alpha0": 0, "alpha_lr": 0.2})
    ft_trainer({"epochs": 0})


# ---- determinism ----

@pytest.mark.parametrize("name", NAMES)
def test_same_seeds_give_bit_identical_personal_models(name: str) -> None:
    x, y = _data()
    outs = []
    for _ in range(2):
        m = _net()
        _, st = PERSONAL_TRAINERS[name](None).train(m, _prior_state(name, m), x, y, CFG, SEEDS, recovery=True)
        assert st.adapted is not None
        outs.append(st)
    assert _states_equal(outs[0].adapted or {}, outs[1].adapted or {})
    assert outs[0].scalars == outs[1].scalars
    m = _net()
    _, other = PERSONAL_TRAINERS[name](None).train(m, _prior_state(name, m), x, y, CFG,
                                                  RoundSeeds(SEEDS.batches, 99, 0), recovery=True)
    assert other.adapted is not None and not _states_equal(outs[0].adapted or {}, other.adapted)  # dropout seed


# ---- a zoo model on synthetic data ----

@pytest.mark.parametrize("name", NAMES)
def test_zoo_mlp_on_synthetic_data(name: str) -> None:
    data = load_client_data("synthetic", 0, 1)
    x, y = data.x_train, data.y_train
    cfg = TrainingConfig(local_epochs=1, batch_size=32, learning_rate=0.05)
    ref = build_model("mlp", {"in_features": 60, "num_classes": 10, "hidden": [16]}, seed=3)
    m = build_model("mlp", {"in_features": 60, "num_classes": 10, "hidden": [16]}, seed=3)
    res_ref = train_local(ref, x, y, cfg, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    trainer = PERSONAL_TRAINERS[name](None)
    received = m.state_dict()
    res, st = trainer.train(m, trainer.init(m), x, y, cfg, SEEDS, recovery=True)
    assert res == res_ref and _states_equal(m.state_dict(), ref.state_dict())
    inf = trainer.inference_state(st, received)
    assert inf is not None and list(inf) == list(received)
    assert st.metrics["passes"] == pytest.approx(2.0)  # every method here: one personal step per global step
