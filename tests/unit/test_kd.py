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
from fedcore.models import build_model, model_manifest
from fedcore.models.zoo import HydraModel, aux_head, count_parameters
from fedcore.seeds import round_seeds
from fedcore.serialization import save_state
from fedcore.train import train_local
from fedcore.train.kd import (
    HYDRA_SHALLOW_HEAD_DEFAULT,
    KD_TRAINERS,
    PREVIOUS,
    HydraConfig,
    _hydra_objective,
    _Meter,
    moon_loss,
    not_true_logits,
    ntd_kl,
    ntd_loss,
)
from fedcore.train.trainers import (
    TRAINER_STATE_FILE,
    TRAINERS,
    TrainerState,
    TrainerStateError,
    load_trainer_state,
    make_trainer,
    parameterised_layers,
    save_trainer_state,
)

SEEDS = round_seeds(7, "client-a", 3)
NEXT = round_seeds(7, "client-a", 4)
CFG = TrainingConfig(local_epochs=2, batch_size=5, learning_rate=0.05, momentum=0.9, weight_decay=1e-3,
                     grad_clip_norm=5.0)
# small images keep the HYDRA models tiny: 8x8 -> two conv+pool stages -> 2x2
NTD_KW = {"in_channels": 1, "image_size": 8, "num_classes": 4}
MOON_KW = {"in_channels": 1, "image_size": 16, "num_classes": 4}
# (trainer, options, model, model kwargs)
CASES = [
    ("fedntd", {}, "hydra_ntd_cnn", NTD_KW),
    ("moon", {}, "moon_cnn", MOON_KW),
    ("hydra", {}, "hydra_ntd_cnn", NTD_KW),
    ("hydra", {"base": "moon"}, "moon_cnn", MOON_KW),
]
IDS = ["fedntd", "moon", "hydra-fedntd", "hydra-moon"]


def _data(shape: tuple[int, ...], n: int = 17, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _model(name: str, kwargs: dict[str, int], seed: int = 0) -> HydraModel:
    m = build_model(name, kwargs, seed=seed)
    assert isinstance(m, HydraModel)
    return m


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _sd(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


# ---- losses ----

def test_not_true_logits_drop_the_true_class_in_order() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]])
    y = torch.tensor([0, 2, 3])
    assert torch.equal(not_true_logits(logits, y),
                       torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0], [8.0, 9.0, 10.0]]))


def _softmax(v: list[float], tau: float) -> list[float]:
    e = [math.exp(a / tau) for a in v]
    return [a / sum(e) for a in e]


def test_ntd_loss_matches_a_hand_computation_and_ignores_the_true_class() -> None:
    s = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.3, -0.2, 1.5, 0.0]])
    t = torch.tensor([[0.5, 1.0, 1.0, 0.0], [2.0, 0.1, -0.5, 0.7]])
    y = torch.tensor([1, 2])
    tau = 2.0
    # by hand: rows without the true class, softmax at τ, KL(teacher ‖ student), batch mean, times τ²
    s_nt, t_nt = [[1.0, 0.5, -1.0], [0.3, -0.2, 0.0]], [[0.5, 1.0, 0.0], [2.0, 0.1, 0.7]]
    kl = 0.0
    for srow, trow in zip(s_nt, t_nt, strict=True):
        ps, pt = _softmax(srow, tau), _softmax(trow, tau)
        kl += sum(b * (math.log(b) - math.log(a)) for a, b in zip(ps, pt, strict=True))
    expected = tau * tau * kl / 2
    got = ntd_loss(s, t, y, tau)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    # changing the true-class logit of the student or the teacher changes nothing
    s2, t2 = s.clone(), t.clone()
    s2[0, 1], s2[1, 2], t2[0, 1], t2[1, 2] = 50.0, -30.0, -7.0, 12.0
    assert torch.equal(ntd_loss(s2, t, y, tau), got)
    assert torch.equal(ntd_loss(s, t2, y, tau), got)
    # a not-true logit does matter; equal not-true logits give zero
    s3 = s.clone()
    s3[0, 0] += 1.0
    assert ntd_loss(s3, t, y, tau).item() != pytest.approx(got.item())
    assert ntd_loss(t2, t, y, tau).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least 2 classes"):
        ntd_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), 1.0)


def test_ntd_loss_gradient_reaches_only_not_true_student_logits() -> None:
    s = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.3, -0.2, 1.5, 0.0]], requires_grad=True)
    t = torch.tensor([[0.5, 1.0, 1.0, 0.0], [2.0, 0.1, -0.5, 0.7]])
    ntd_loss(s, t, torch.tensor([1, 2]), 1.0).backward()  # type: ignore[no-untyped-call]
    assert s.grad is not None
    assert s.grad[0, 1] == 0 and s.grad[1, 2] == 0 and s.grad.abs().sum() > 0


def test_moon_loss_matches_a_hand_computation() -> None:
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[1.0, 1.0], [0.0, 3.0]])
    z_prev = torch.tensor([[0.0, 1.0], [-1.0, -1.0]])
    temp = 0.5
    # cosines by hand: row 0: cos(z, z_glob) = 1/√2, cos(z, z_prev) = 0; row 1: 1 and −1/√2
    cos = [(1 / math.sqrt(2), 0.0), (1.0, -1 / math.sqrt(2))]
    per_row = []
    for pos, neg in cos:
        a, b = pos / temp, neg / temp
        m = max(a, b)
        per_row.append(m + math.log(math.exp(a - m) + math.exp(b - m)) - a)  # logsumexp − positive logit
    got = moon_loss(z, z_glob, z_prev, temp)
    assert got.item() == pytest.approx(sum(per_row) / 2, rel=1e-6)
    # positive = negative: log 2
    assert moon_loss(z, z_glob, z_glob, temp).item() == pytest.approx(math.log(2), rel=1e-6)


# ---- models ----

@pytest.mark.parametrize(("name", "kwargs", "plain", "with_heads", "head_counts"), [
    ("hydra_ntd_cnn", {"in_channels": 1, "image_size": 28}, 1_663_370, 6_491_550, [3_216_906, 1_611_274]),
    ("hydra_ntd_cnn", {"in_channels": 3, "image_size": 32}, 2_156_490, 8_459_230, [4_199_946, 2_102_794]),
    ("moon_cnn", {"in_channels": 1, "image_size": 28}, 75_046, 367_418, [224_010, 68_362]),
    ("moon_cnn", {"in_channels": 3, "image_size": 32}, 92_626, 501_734, [303_882, 105_226]),
])
def test_hydra_models_parameter_counts(name: str, kwargs: dict[str, int], plain: int, with_heads: int,
                                       head_counts: list[int]) -> None:
    m = _model(name, kwargs)
    assert count_parameters(m) == with_heads
    assert [count_parameters(h) for h in m.heads] == head_counts
    assert count_parameters(_model(name, {**kwargs, "heads": False})) == plain
    if name == "hydra_ntd_cnn":
        assert count_parameters(build_model("fedntd_cnn", kwargs)) == plain


def test_defaults_are_mnist() -> None:
    ntd, moon = _model("hydra_ntd_cnn", {}), _model("moon_cnn", {})
    assert ntd.input_shape == moon.input_shape == (1, 28, 28)
    assert (ntd.head_after, moon.head_after) == ((0, 1), (0, 1))
    assert (ntd.representation_size, moon.representation_size) == (512, 256)
    assert [moon.head_hidden_size(i) for i in range(2)] == [256, 256]
    assert [ntd.head_hidden_size(i) for i in range(2)] == [512, 512]


@pytest.mark.parametrize(("name", "kwargs"), [("hydra_ntd_cnn", NTD_KW), ("moon_cnn", MOON_KW)])
def test_kd_forward_logits_equal_forward_and_heads_are_parameters(name: str, kwargs: dict[str, int]) -> None:
    m = _model(name, kwargs)
    x, _ = _data(m.input_shape, n=3)
    out = m.kd_forward(x)
    assert torch.equal(out.logits, m(x))
    assert out.representation.shape == (3, m.representation_size)
    assert torch.equal(m.blocks[-1](out.representation), out.logits)
    assert sorted(out.head_logits) == sorted(out.head_hidden) == [0, 1]
    for i in range(2):
        assert out.head_logits[i].shape == (3, 4)
        assert out.head_hidden[i].shape == (3, m.head_hidden_size(i))
        _, classifier = m.head(i)
        assert torch.equal(classifier(out.head_hidden[i]), out.head_logits[i])
    assert m.kd_forward(x, heads=()).head_logits == {}
    assert list(m.kd_forward(x, heads=(1,)).head_logits) == [1]
    with pytest.raises(IndexError, match="head 2 does not exist"):
        m.kd_forward(x, heads=(2,))
    # heads are ordinary parameters: in the state dict and the manifest the server fingerprints
    assert any(k.startswith("heads.") for k in m.state_dict())
    assert any(t.name.startswith("heads.") for t in model_manifest(m))
    # ... but not layers of the inference path (FL-GUARD's l_fb, FB's top layer)
    names = [n for n, _ in parameterised_layers(m)]
    assert names and not any(n.startswith("heads") for n in names)
    assert names[-1] == f"blocks.{len(m.blocks) - 1}"


def test_hydra_model_rejects_bad_heads() -> None:
    blocks = [nn.Flatten(), nn.Linear(4, 3), nn.Linear(3, 2)]
    with pytest.raises(ValueError, match="2 heads but 1"):
        HydraModel(blocks, (4,), 3, [aux_head(4, 3, 2), aux_head(4, 3, 2)], (0,))
    with pytest.raises(ValueError, match="head_after 2"):
        HydraModel(blocks, (4,), 3, [aux_head(3, 3, 2)], (2,))


# ---- train_local's objective ----

def test_train_local_objective_replaces_the_loss_and_keeps_fedprox() -> None:
    x, y = _data((6,), n=23)
    prox = dataclasses.replace(CFG, prox_mu=0.1)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 4))
    a, b, c = (copy.deepcopy(base) for _ in range(3))
    calls: list[int] = []

    def ce(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        calls.append(len(yb))
        return F.cross_entropy(model(xb), yb)

    ra = train_local(a, x, y, prox, seed=3)
    rb = train_local(b, x, y, prox, seed=3, objective=ce)
    assert _states_equal(a.state_dict(), b.state_dict()) and ra == rb
    assert sum(calls) == 2 * len(y)
    rc = train_local(c, x, y, prox, seed=3, objective=lambda m, xb, yb: 2.0 * F.cross_entropy(m(xb), yb))
    assert rc.loss != ra.loss and not _states_equal(a.state_dict(), c.state_dict())


# ---- trainers ----

def test_kd_trainers_are_registered() -> None:
    assert sorted(KD_TRAINERS) == ["fedntd", "hydra", "moon"]
    for name in KD_TRAINERS:
        assert name in TRAINERS.names()
        assert make_trainer(name).name == name


@pytest.mark.parametrize(("name", "options", "model", "kwargs"), CASES, ids=IDS)
def test_kd_trainers_train_deterministically(name: str, options: dict[str, str], model: str,
                                             kwargs: dict[str, int]) -> None:
    trainer = make_trainer(name, options)
    runs = []
    for _ in range(2):
        m = _model(model, kwargs)
        x, y = _data(m.input_shape)
        start = _sd(m)
        state = trainer.init(m)
        rng = torch.get_rng_state()
        results = []
        for seeds in (SEEDS, NEXT):  # a second round has a previous model (MOON) and a moved teacher
            res, state = trainer.train(m, state, x, y, CFG, seeds, recovery=False)
            results.append(res)
        assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn from the global RNG
        assert all(math.isfinite(r.loss) and r.steps == 8 and r.num_samples == 34 for r in results)
        assert not _states_equal(start, m.state_dict())
        assert math.isfinite(state.metrics["kd_ce"]) and state.metrics["kd_steps"] == 8.0
        assert trainer.inference_state(state) is None
        runs.append((_sd(m), results, state))
    (sd1, res1, st1), (sd2, res2, st2) = runs
    assert _states_equal(sd1, sd2) and res1 == res2 and st1.metrics == st2.metrics
    assert (PREVIOUS in st1.kept) == (name == "moon" or options.get("base") == "moon")
    if PREVIOUS in st1.kept:
        assert _states_equal(st1.kept[PREVIOUS], sd1)


@pytest.mark.parametrize(("name", "options", "model", "kwargs"), CASES, ids=IDS)
def test_recovery_changes_nothing(name: str, options: dict[str, str], model: str, kwargs: dict[str, int]) -> None:
    trainer = make_trainer(name, options)
    out = []
    for recovery in (False, True):
        m = _model(model, kwargs)
        x, y = _data(m.input_shape)
        _, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=recovery)
        _, st = trainer.train(m, st, x, y, CFG, NEXT, recovery=recovery)
        out.append((_sd(m), st.metrics))
    assert _states_equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


@pytest.mark.parametrize(("name", "options", "model", "kwargs"), CASES, ids=IDS)
def test_learning_rate_epochs_and_batches_pass_through(name: str, options: dict[str, str], model: str,
                                                       kwargs: dict[str, int]) -> None:
    trainer = make_trainer(name, options)
    m = _model(model, kwargs)
    x, y = _data(m.input_shape)
    fixed = [(x[:6], y[:6]), (x[6:12], y[6:12])]
    res, _ = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=False, learning_rate=0.0, epochs=3,
                           batches=lambda e: fixed)
    assert (res.steps, res.num_samples) == (6, 36)
    m0 = _model(model, kwargs)
    for k, v in m0.state_dict().items():  # lr 0 (and plain SGD momentum from zero): no change
        assert torch.equal(v, m.state_dict()[k]), k


def test_hydra_trains_its_shallow_head_and_fedntd_does_not() -> None:
    x, y = _data((1, 8, 8))
    changed = {}
    for name in ("fedntd", "hydra"):
        m = _model("hydra_ntd_cnn", NTD_KW)
        before = _sd(m)
        make_trainer(name).train(m, TrainerState(), x, y, CFG, SEEDS, recovery=False)
        after = m.state_dict()
        changed[name] = {k for k in before if not torch.equal(before[k], after[k])}
        assert any(k.startswith("blocks.") for k in changed[name])
    assert not any(k.startswith("heads.") for k in changed["fedntd"])
    # the default head is head 1, the one after the second conv block (the authors' code)
    assert {k for k in changed["hydra"] if k.startswith("heads.")} == {
        "heads.1.0.1.weight", "heads.1.0.1.bias", "heads.1.1.weight", "heads.1.1.bias"}
    # shallow_head picks the head
    m = _model("hydra_ntd_cnn", NTD_KW)
    before = _sd(m)
    make_trainer("hydra", {"shallow_head": 0}).train(m, TrainerState(), x, y, CFG, SEEDS, recovery=False)
    assert {k for k in before if k.startswith("heads.") and not torch.equal(before[k], m.state_dict()[k])} == {
        "heads.0.0.1.weight", "heads.0.0.1.bias", "heads.0.1.weight", "heads.0.1.bias"}


@pytest.mark.parametrize(("name", "kwargs", "second_conv", "head_in"), [
    # MNIST 28x28: FedNTD's CNN pools 28 -> 14 -> 7 (64 channels), MOON's 28 -> 24 -> 12 -> 8 -> 4 (16 channels)
    ("hydra_ntd_cnn", {}, (32, 64), 64 * 7 * 7),
    ("moon_cnn", {}, (6, 16), 16 * 4 * 4),
])
def test_the_default_shallow_head_reads_the_second_conv_block(name: str, kwargs: dict[str, int],
                                                               second_conv: tuple[int, int], head_in: int) -> None:
    """HYDRA-FL's reference code distils at the head after the second conv block (``so2``): the default head
    index is 1, and head 1 of the paper's models reads block 1, whose conv is the second one (its input and
    output channels), flattened to that block's output size."""
    assert HydraConfig().shallow_head == HYDRA_SHALLOW_HEAD_DEFAULT == 1
    assert HydraConfig(base="moon").shallow_head == 1
    assert HydraConfig().shallow_tau2 is False
    m = _model(name, kwargs)
    k = HydraConfig().shallow_head
    assert m.head_after[k] == 1
    convs = [c for c in m.blocks[m.head_after[k]].modules() if isinstance(c, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [second_conv]
    hidden_part, _ = m.head(k)
    first_linear = next(c for c in hidden_part.modules() if isinstance(c, nn.Linear))
    assert first_linear.in_features == head_in
    # the earlier convs: exactly one conv block precedes it
    before = [c for b in list(m.blocks)[: m.head_after[k]] for c in b.modules() if isinstance(c, nn.Conv2d)]
    assert len(before) == 1


def test_hydra_moon_trains_its_head_once_there_is_a_previous_model() -> None:
    m = _model("moon_cnn", MOON_KW)
    x, y = _data(m.input_shape)
    trainer = make_trainer("hydra", {"base": "moon"})
    heads = {k: v.clone() for k, v in m.state_dict().items() if k.startswith("heads.")}
    _, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=False)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in heads.items())  # first round: plain CE
    _, st = trainer.train(m, st, x, y, CFG, NEXT, recovery=False)
    # the default head (1, after the second conv block) is trained, head 0 is not
    assert not torch.equal(heads["heads.1.0.1.weight"], m.state_dict()["heads.1.0.1.weight"])
    assert torch.equal(heads["heads.0.0.1.weight"], m.state_dict()["heads.0.0.1.weight"])
    assert st.metrics["kd_shallow"] > 0


def test_hydra_weights_follow_eq_8() -> None:
    """CE + (β/b)·KD_final + γ·KD_shallow: β = 0, γ = 0 is plain CE training; b rescales β."""
    x, y = _data((1, 8, 8))
    plain = _model("hydra_ntd_cnn", NTD_KW)
    train_local(plain, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    m = _model("hydra_ntd_cnn", NTD_KW)
    make_trainer("hydra", {"beta": 0.0, "gamma": 0.0}).train(m, TrainerState(), x, y, CFG, SEEDS, recovery=False)
    assert _states_equal(m.state_dict(), plain.state_dict())  # the heads get no gradient, not a zero one
    a, b = _model("hydra_ntd_cnn", NTD_KW), _model("hydra_ntd_cnn", NTD_KW)
    make_trainer("hydra", {"beta": 2.0, "b": 4.0}).train(a, TrainerState(), x, y, CFG, SEEDS, recovery=False)
    make_trainer("hydra", {"beta": 0.5}).train(b, TrainerState(), x, y, CFG, SEEDS, recovery=False)
    assert _states_equal(a.state_dict(), b.state_dict())


def test_gamma_default_depends_on_base() -> None:
    assert HydraConfig().shallow_weight == 2.0
    assert HydraConfig(base="moon").shallow_weight == 1.0
    assert HydraConfig(base="moon", gamma=0.3).shallow_weight == 0.3


@pytest.mark.parametrize(("name", "options"), [("moon", {}), ("hydra", {"base": "moon"})])
def test_first_moon_round_is_plain_cross_entropy(name: str, options: dict[str, str]) -> None:
    m, ref = _model("moon_cnn", MOON_KW), _model("moon_cnn", MOON_KW)
    x, y = _data(m.input_shape)
    trainer = make_trainer(name, options)
    res, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=False)
    ref_res = train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    assert _states_equal(m.state_dict(), ref.state_dict()) and res == ref_res
    assert st.metrics["kd_final"] == 0.0


@pytest.mark.parametrize(("name", "options"), [("moon", {}), ("hydra", {"base": "moon"})])
def test_moon_previous_model_survives_a_restart(tmp_path: Path, name: str, options: dict[str, str]) -> None:
    trainer = make_trainer(name, options)
    m = _model("moon_cnn", MOON_KW)
    x, y = _data(m.input_shape)
    _, st = trainer.train(m, trainer.init(m), x, y, CFG, SEEDS, recovery=False)
    save_trainer_state(tmp_path, st)
    back = load_trainer_state(tmp_path)
    assert back is not None and list(back.kept) == [PREVIOUS]
    assert _states_equal(back.kept[PREVIOUS], st.kept[PREVIOUS])
    # the next round (a new received model) with the loaded state equals the one with the in-memory state
    received = _model("moon_cnn", MOON_KW, seed=5).state_dict()
    outs = []
    for state in (st, back):
        mm = _model("moon_cnn", MOON_KW)
        mm.load_state_dict(received)
        _, after = trainer.train(mm, state, x, y, CFG, NEXT, recovery=False)
        outs.append((_sd(mm), after))
    assert _states_equal(outs[0][0], outs[1][0]) and outs[0][1].metrics == outs[1][1].metrics
    assert outs[0][1].metrics["kd_final"] > 0
    # ... and differs from a first round (the previous model matters)
    fresh = _model("moon_cnn", MOON_KW)
    fresh.load_state_dict(received)
    trainer.train(fresh, TrainerState(), x, y, CFG, NEXT, recovery=False)
    assert not _states_equal(outs[0][0], fresh.state_dict())


def test_a_previous_model_of_another_architecture_is_a_clear_error() -> None:
    other = _model("moon_cnn", {**MOON_KW, "num_classes": 3})
    m = _model("moon_cnn", MOON_KW)
    x, y = _data(m.input_shape)
    st = TrainerState(kept={PREVIOUS: _sd(other)})
    with pytest.raises(TrainerStateError, match="kept model 'previous' does not fit this model"):
        make_trainer("moon").train(m, st, x, y, CFG, SEEDS, recovery=False)


def test_fedntd_works_on_any_classifier() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    x, y = _data((6,))
    before = _sd(m)
    res, st = make_trainer("fedntd", {"tau": 3.0}).train(m, TrainerState(), x, y, CFG, SEEDS, recovery=False)
    assert math.isfinite(res.loss) and st.metrics["kd_final"] >= 0 and not _states_equal(before, m.state_dict())


# ---- options and models refused ----

@pytest.mark.parametrize(("name", "options", "pattern"), [
    ("fedntd", {"tau": 0.0}, r"^tau: must be > 0"),
    ("fedntd", {"beta": -1.0}, r"^beta: must be >= 0"),
    ("fedntd", {"tau": "x"}, r"^tau: expected a number"),
    ("fedntd", {"mu": 1.0}, r"^mu: unknown field"),
    ("moon", {"temperature": 0}, r"^temperature: must be > 0"),
    ("moon", {"mu": float("nan")}, r"^mu: must be >= 0"),
    ("hydra", {"base": "fedavg"}, r"^base: must be one of fedntd, moon"),
    ("hydra", {"b": 0}, r"^b: must be > 0"),
    ("hydra", {"gamma": -0.5}, r"^gamma: must be >= 0"),
    ("hydra", {"shallow_head": -1}, r"^shallow_head: must be an integer >= 0"),
    ("hydra", {"shallow_tau2": 1}, r"^shallow_tau2: expected true or false"),
    ("hydra", {"tau": float("inf")}, r"^tau: must be > 0"),
])
def test_option_errors_name_the_field(name: str, options: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        make_trainer(name, options)


def test_models_without_representation_or_heads_are_refused() -> None:
    seq = nn.Sequential(nn.Linear(6, 4))
    with pytest.raises(ConfigError, match=r"moon needs a model with a representation.*moon_cnn"):
        make_trainer("moon").init(seq)
    with pytest.raises(ConfigError, match="moon needs a model with a representation"):
        make_trainer("moon").train(seq, TrainerState(), *_data((6,)), CFG, SEEDS, recovery=False)
    plain = build_model("fedntd_cnn", NTD_KW)
    with pytest.raises(ConfigError, match=r"hydra needs a model with auxiliary shallow heads.*hydra_ntd_cnn"):
        make_trainer("hydra").init(plain)
    with pytest.raises(ConfigError, match="hydra needs"):
        make_trainer("hydra", {"base": "moon"}).init(seq)
    with pytest.raises(ConfigError, match=r"^shallow_head: must be < the model.s 2 heads"):
        make_trainer("hydra", {"shallow_head": 2}).init(_model("hydra_ntd_cnn", NTD_KW))
    # HYDRA-MOON contrasts a head's hidden representation with the projection: sizes must agree
    with pytest.raises(ConfigError, match=r"^base: .*sizes differ \(128 vs 256\).*moon_cnn"):
        make_trainer("hydra", {"base": "moon", "shallow_head": 0}).init(_wide_head_moon())
    # MOON on a model with a representation but no heads is fine; the plain FedNTD CNN has one too
    make_trainer("moon").init(plain)
    make_trainer("moon").init(_model("moon_cnn", {**MOON_KW, "heads": False}))


def _wide_head_moon() -> HydraModel:
    """A moon_cnn-like model whose head's hidden size (128) is not the representation size (256)."""
    m = _model("moon_cnn", {**MOON_KW, "heads": False})
    return HydraModel(list(m.blocks), m.input_shape, m.representation_size, [aux_head(6 * 6 * 6, 128, 4)], (0,))


def test_make_trainer_hydra_moon_on_moon_cnn() -> None:
    m = _model("moon_cnn", {"in_channels": 3, "image_size": 32})  # CIFAR
    trainer = make_trainer("hydra", {"base": "moon"})
    assert trainer.name == "hydra" and trainer.init(m) == TrainerState()


# ---- persistence of kept models ----

def test_kept_models_round_trip_with_an_adapted_model(tmp_path: Path) -> None:
    a = nn.Sequential(nn.Linear(3, 2))
    b = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    st = TrainerState(adapted=_sd(a), active=True, rounds_adapted=2, scalars={"alpha": 0.3},
                      kept={"previous": _sd(b), "other": _sd(a)})
    save_trainer_state(tmp_path, st)
    back = load_trainer_state(tmp_path)
    assert back is not None and back.adapted is not None
    assert _states_equal(back.adapted, _sd(a)) and list(back.kept) == ["previous", "other"]
    assert _states_equal(back.kept["previous"], _sd(b)) and _states_equal(back.kept["other"], _sd(a))
    assert (back.active, back.rounds_adapted, back.scalars) == (True, 2, {"alpha": 0.3})
    save_trainer_state(tmp_path, TrainerState(kept={"previous": _sd(b)}))
    only = load_trainer_state(tmp_path)
    assert only is not None and only.adapted is None and _states_equal(only.kept["previous"], _sd(b))
    with pytest.raises(ValueError, match="kept model name"):
        save_trainer_state(tmp_path, TrainerState(kept={"a/b": _sd(b)}))


def test_files_without_kept_models_still_load(tmp_path: Path) -> None:
    a = nn.Sequential(nn.Linear(3, 2))
    extra = {"format": "fedguard.trainer_state", "version": 1, "has_adapted": True, "active": False,
             "frozen_keys": [], "rounds_adapted": 1, "metrics": {}, "scalars": {}}
    save_state(tmp_path / TRAINER_STATE_FILE, _sd(a), extra)
    back = load_trainer_state(tmp_path)
    assert back is not None and back.kept == {} and back.adapted is not None
    assert _states_equal(back.adapted, _sd(a))


def test_corrupt_kept_models_are_a_clear_error(tmp_path: Path) -> None:
    b = nn.Sequential(nn.Linear(2, 2))
    base = {"format": "fedguard.trainer_state", "version": 1, "has_adapted": False, "active": False,
            "frozen_keys": [], "rounds_adapted": 0, "metrics": {}, "scalars": {}}
    tensors = {f"kept/previous/{k}": v for k, v in _sd(b).items()}
    save_state(tmp_path / TRAINER_STATE_FILE, tensors, {**base, "kept": {"previous": ["0.weight", "0.bias", "x"]}})
    with pytest.raises(TrainerStateError, match=r"trainer_state\.fgt: corrupt trainer state \(kept model "
                                                r"'previous' lacks tensor 'x'\)"):
        load_trainer_state(tmp_path)
    save_state(tmp_path / TRAINER_STATE_FILE, tensors, {**base, "kept": {"previous": "0.weight"}})
    with pytest.raises(TrainerStateError, match=r"trainer_state\.fgt: corrupt trainer state metadata"):
        load_trainer_state(tmp_path)
    save_state(tmp_path / TRAINER_STATE_FILE, tensors, base)  # tensors nobody lists
    with pytest.raises(TrainerStateError, match=r"trainer_state\.fgt: corrupt trainer state \(tensors without"):
        load_trainer_state(tmp_path)


# ---- Eq. 8–10 by hand: one full-batch plain SGD step ----

ONE_STEP = TrainingConfig(local_epochs=1, batch_size=64, learning_rate=0.1)


@pytest.mark.parametrize("base", ["fedntd", "moon"])
def test_one_hydra_step_equals_the_loss_written_out(base: str) -> None:
    name, kwargs = ("hydra_ntd_cnn", NTD_KW) if base == "fedntd" else ("moon_cnn", MOON_KW)
    m = _model(name, kwargs)
    x, y = _data(m.input_shape)
    prev_sd = _model(name, kwargs, seed=9).state_dict()
    opts = {"base": base, "beta": 1.5, "b": 3.0, "gamma": 0.7, "tau": 2.0, "temperature": 0.4, "shallow_head": 1}
    # by hand, with the formulas of Eq. 9 / Eq. 10
    student, teacher, prev = copy.deepcopy(m), copy.deepcopy(m), _model(name, kwargs, seed=9)
    out = student.kd_forward(x)
    with torch.no_grad():
        t, p = teacher.kd_forward(x), prev.kd_forward(x)
    if base == "fedntd":
        # τ² on the final term only (the authors' code; shallow_tau2 off)
        final, shallow = ntd_loss(out.logits, t.logits, y, 2.0), ntd_kl(out.head_logits[1], t.logits, y, 2.0)
    else:
        final = moon_loss(out.representation, t.representation, p.representation, 0.4)
        shallow = moon_loss(out.head_hidden[1], t.representation, p.head_hidden[1], 0.4)
    loss = F.cross_entropy(out.logits, y) + (1.5 / 3.0) * final + 0.7 * shallow
    loss.backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for q in student.parameters():
            if q.grad is not None:
                q.sub_(0.1 * q.grad)
    res, st = make_trainer("hydra", opts).train(m, TrainerState(kept={PREVIOUS: dict(prev_sd)}), x, y, ONE_STEP,
                                                 SEEDS, recovery=False)
    assert res.steps == 1 and res.loss == pytest.approx(loss.item(), rel=1e-5)
    assert st.metrics["kd_final"] == pytest.approx(final.item(), rel=1e-5)
    assert st.metrics["kd_shallow"] == pytest.approx(shallow.item(), rel=1e-5)
    for k, v in student.state_dict().items():
        torch.testing.assert_close(m.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_zero_weights_are_plain_cross_entropy() -> None:
    x, y = _data((1, 8, 8))
    ref = _model("hydra_ntd_cnn", NTD_KW)
    ref_res = train_local(ref, x, y, CFG, seed=SEEDS.batches, dropout_seed=SEEDS.dropout)
    for name, opts in (("fedntd", {"beta": 0.0}), ("moon", {"mu": 0.0})):
        m = _model("hydra_ntd_cnn", NTD_KW)
        res, st = make_trainer(name, opts).train(m, TrainerState(), x, y, CFG, SEEDS, recovery=False)
        assert res == ref_res and _states_equal(m.state_dict(), ref.state_dict()) and "kd_final" not in st.metrics


# ---- HYDRA-FedNTD's loss terms against a hand computation (Eq. 9 as the authors' code computes it) ----

def _tiny_hydra(final_w: list[list[float]], head_ws: list[list[list[float]]]) -> HydraModel:
    """A float64 HydraModel on 2 features whose logits are hand-known: identity blocks 0 and 1, a bias-free linear
    last block ``final_w``; head i (after block i) = identity hidden layer (then ReLU: inputs are >= 0) and the
    bias-free classifier ``head_ws[i]``."""
    heads = [aux_head(2, 2, 3) for _ in head_ws]
    m = HydraModel([nn.Identity(), nn.Identity(), nn.Linear(2, 3, bias=False)], (2,), 2, heads, (0, 1))
    with torch.no_grad():
        last = m.blocks[2]
        assert isinstance(last, nn.Linear)
        last.weight.copy_(torch.tensor(final_w))
        for i, w in enumerate(head_ws):
            hidden, classifier = m.head(i)
            assert isinstance(hidden, nn.Sequential)
            lin = hidden[1]
            assert isinstance(lin, nn.Linear)
            lin.weight.copy_(torch.eye(2))
            lin.bias.zero_()
            classifier.weight.copy_(torch.tensor(w))
            classifier.bias.zero_()
    return m.double()


def _kl_by_hand(student: list[list[float]], teacher: list[list[float]], tau: float) -> float:
    """batchmean KL(softmax(t/τ) ‖ softmax(s/τ)) over rows already stripped of the true class."""
    kl = 0.0
    for srow, trow in zip(student, teacher, strict=True):
        ps, pt = _softmax(srow, tau), _softmax(trow, tau)
        kl += sum(b * (math.log(b) - math.log(a)) for a, b in zip(ps, pt, strict=True))
    return kl / len(student)


@pytest.mark.parametrize("shallow_head", [None, 0, 1])
@pytest.mark.parametrize("shallow_tau2", [False, True])
def test_hydra_fedntd_loss_terms_match_a_hand_computation(shallow_head: int | None, shallow_tau2: bool) -> None:
    x = torch.tensor([[1.0, 2.0], [0.5, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 2])
    # student: logits [x1, x2, x1 + x2]; head 0: [x1, x1, x1]; head 1: [x2, x1, 2·x1]
    student = _tiny_hydra([[1, 0], [0, 1], [1, 1]], [[[1, 0], [1, 0], [1, 0]], [[0, 1], [1, 0], [2, 0]]])
    # teacher (the received global model): logits [x2, x1, 0]; its heads take no part
    teacher = _tiny_hydra([[0, 1], [1, 0], [0, 0]], [[[0, 0], [0, 0], [0, 0]], [[0, 0], [0, 0], [0, 0]]])
    tau, beta, b, gamma = 2.0, 1.5, 3.0, 0.7
    # by hand. Logits, row 1 (x = (1, 2), y = 0) and row 2 (x = (0.5, 0), y = 2):
    #   student [1, 2, 3] and [0.5, 0, 0.5]; teacher [2, 1, 0] and [0, 0.5, 0];
    #   head 0 [1, 1, 1] and [0.5, 0.5, 0.5]; head 1 [2, 1, 2] and [0, 0.5, 1]
    # not-true rows (true class removed): student [2, 3], [0.5, 0]; teacher [1, 0], [0, 0.5];
    #   head 0 [1, 1], [0.5, 0.5]; head 1 [1, 2], [0, 0.5]
    ce = (-math.log(_softmax([1, 2, 3], 1.0)[0]) - math.log(_softmax([0.5, 0, 0.5], 1.0)[2])) / 2
    kl_final = _kl_by_hand([[2, 3], [0.5, 0]], [[1, 0], [0, 0.5]], tau)
    head_nt: dict[int, list[list[float]]] = {0: [[1, 1], [0.5, 0.5]], 1: [[1, 2], [0, 0.5]]}
    k = 1 if shallow_head is None else shallow_head  # the default is head 1
    kl_shallow = _kl_by_hand(head_nt[k], [[1, 0], [0, 0.5]], tau)
    final_term = tau**2 * kl_final  # FedNTD's L_NTD: τ²·KL
    shallow_term = (tau**2 if shallow_tau2 else 1.0) * kl_shallow  # the authors' code: no τ²
    expected = ce + (beta / b) * final_term + gamma * shallow_term

    opts: dict[str, object] = {"beta": beta, "b": b, "gamma": gamma, "tau": tau, "shallow_tau2": shallow_tau2}
    if shallow_head is not None:
        opts["shallow_head"] = shallow_head
    cfg = HydraConfig(**opts).validate()  # type: ignore[arg-type]
    meter = _Meter(torch.device("cpu"))
    teacher.eval().requires_grad_(False)
    objective = _hydra_objective(cfg)(student, teacher, None, meter)
    loss = objective(student, x, y)
    metrics = meter.metrics()
    # float64 throughout: each value is a sum of < 20 terms of magnitude < 5 computed with exp/log to a few ulp
    # (2.2e-16), so the errors are below 20 · 5 · 4 · 2.2e-16 < 1e-13
    tol = 1e-13
    assert metrics["kd_ce"] == pytest.approx(ce, abs=tol)
    assert metrics["kd_final"] == pytest.approx(final_term, abs=tol)
    assert metrics["kd_shallow"] == pytest.approx(shallow_term, abs=tol)
    assert loss.item() == pytest.approx(expected, abs=tol)
    # what the test tells apart: the other head, and τ² on or off, each move the loss by far more than tol
    other = _kl_by_hand(head_nt[1 - k], [[1, 0], [0, 0.5]], tau)
    assert abs(other - kl_shallow) > 1e-3 and abs((tau**2 - 1) * gamma * kl_shallow) > 1e-3
