"""The one local training loop (fedcore.train.loop): its hook order, its pieces, and that it is op for op the
plain SGD loop every method used to copy (so trained weights did not change when the copies were merged)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedcore.config import TrainingConfig
from fedcore.train import deterministic_dropout, shuffled_batches, train_local
from fedcore.train.loop import (
    DIVERGED,
    Companion,
    LossMeter,
    Optimised,
    StepHooks,
    diverged,
    fedprox_penalty,
    fill_missing_grads,
    raise_if_diverged,
    run_sgd,
    sgd_step,
)

ROOT = Path(__file__).resolve().parents[2]
CFG = TrainingConfig(local_epochs=2, batch_size=5, learning_rate=0.1, momentum=0.9, weight_decay=1e-3,
                     grad_clip_norm=1.0, prox_mu=0.1)


def _data(n: int = 23, d: int = 6, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)  # tests only: a fixed initialisation
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def _old_train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainingConfig, seed: int,
                     dropout_seed: int) -> float:
    """The SGD loop as train_local wrote it before the loop had hooks (and as FL-GUARD, LINDT and the personal
    methods copied it), kept here as the reference the one loop must reproduce bit for bit."""
    opt = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    anchor = [p.detach().clone() for p in model.parameters()] if config.prox_mu > 0 else []
    source = shuffled_batches(x, y, config.batch_size, seed)
    model.train()
    total = torch.zeros((), dtype=torch.float64)
    steps = 0
    with deterministic_dropout(model, dropout_seed):
        for e in range(config.local_epochs):
            for xb, yb in source(e):
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb), yb)
                if anchor:
                    prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
                    loss = loss + 0.5 * config.prox_mu * prox
                loss.backward()  # type: ignore[no-untyped-call]
                if config.grad_clip_norm > 0:
                    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
                opt.step()
                total += loss.detach()
                steps += 1
    return float(total) / max(steps, 1)


@pytest.mark.parametrize("config", [CFG, TrainingConfig(local_epochs=1, batch_size=4, learning_rate=0.05)],
                         ids=["prox-clip-momentum", "plain"])
def test_train_local_is_the_old_loop_bit_for_bit(config: TrainingConfig) -> None:
    x, y = _data()
    a, b = _net(), _net()
    ref = _old_train_local(a, x, y, config, seed=3, dropout_seed=11)
    res = train_local(b, x, y, config, seed=3, dropout_seed=11)
    assert res.loss == ref
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_hooks_run_in_the_documented_order() -> None:
    x, y = _data(n=10)
    model = nn.Linear(6, 4)
    calls: list[str] = []

    class RecordingSGD(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append("zero_grad")
            super().zero_grad(set_to_none)

        def step(self, closure: None = None) -> None:  # type: ignore[override]
            calls.append("step")
            super().step()

    def objective(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        calls.append("objective")
        return F.cross_entropy(m(xb), yb)

    def penalty() -> torch.Tensor:
        calls.append("penalty")
        return torch.zeros(())

    def extra_loss() -> torch.Tensor:
        calls.append("extra_loss")
        return torch.zeros(())

    def after_backward(xb: torch.Tensor, yb: torch.Tensor, loss: torch.Tensor) -> None:
        assert model.weight.grad is not None  # the backward pass has run
        calls.append("after_backward")

    def grad_transform(loss: torch.Tensor) -> None:
        assert not torch.is_grad_enabled()
        calls.append("grad_transform")

    hooks = StepHooks(objective=objective, penalty=penalty, extra_loss=extra_loss,
                      before_step=lambda: calls.append("before_step"), after_backward=after_backward,
                      grad_transform=grad_transform, after_step=lambda: calls.append("after_step"))
    params: list[torch.Tensor] = list(model.parameters())
    sgd_step(model, x, y, [Optimised(params, RecordingSGD(params, lr=0.1))], hooks)
    assert calls == ["before_step", "zero_grad", "objective", "penalty", "extra_loss", "after_backward",
                     "grad_transform", "step", "after_step"]


def test_the_step_loss_counts_the_penalty_but_not_the_extra_loss() -> None:
    x, y = _data(n=10)
    model = nn.Linear(6, 4)
    with torch.no_grad():
        ce = float(F.cross_entropy(model(x), y))
    params: list[torch.Tensor] = list(model.parameters())
    hooks = StepHooks(penalty=lambda: torch.tensor(2.0), extra_loss=lambda: torch.tensor(100.0))
    loss = sgd_step(model, x, y, [Optimised(params, torch.optim.SGD(params, lr=0.0))], hooks)
    assert float(loss) == pytest.approx(ce + 2.0)


def test_optimised_sgd_takes_the_config_and_clips_each_set_separately() -> None:
    o = Optimised.sgd(nn.Linear(2, 2).parameters(), 0.3, CFG)
    assert isinstance(o.optimizer, torch.optim.SGD) and o.clip == CFG.grad_clip_norm
    group = o.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.3, CFG.momentum, CFG.weight_decay)
    # two parameter sets on one backward pass: each clipped to its own bound
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    seen: dict[str, float] = {}

    def objective(_: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return 10.0 * a.sum() + 10.0 * b.sum()

    def keep_norms() -> None:
        assert a.grad is not None and b.grad is not None
        seen["a"], seen["b"] = float(a.grad.norm()), float(b.grad.norm())

    sgd_step(nn.Identity(), torch.zeros(1), torch.zeros(1),
             [Optimised([a], torch.optim.SGD([a], lr=0.0), clip=1.0),
              Optimised([b], torch.optim.SGD([b], lr=0.0), clip=0.0)],
             StepHooks(objective=objective, after_step=keep_norms))
    assert seen["a"] == pytest.approx(1.0) and seen["b"] == pytest.approx(10.0 * math.sqrt(3))


def test_fedprox_penalty_is_half_mu_times_the_squared_distance_to_the_start() -> None:
    model = nn.Linear(3, 1)
    penalty = fedprox_penalty(model, 0.4)
    assert float(penalty().detach()) == 0.0
    with torch.no_grad():
        model.weight.add_(1.0)  # ‖Δw‖² = 3
        model.bias.sub_(2.0)  # + 4
    assert float(penalty().detach()) == pytest.approx(0.5 * 0.4 * 7.0)


def test_companions_train_with_their_own_dropout_seed_and_leave_the_model_alone() -> None:
    x, y = _data()

    def run(companion_seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
        model, companion = _net(), nn.Dropout(0.5)
        companion.eval()
        outputs: list[torch.Tensor] = []

        def after_backward(xb: torch.Tensor, yb: torch.Tensor, loss: torch.Tensor) -> None:
            assert companion.training
            outputs.append(companion(torch.ones(8)))

        run_sgd(model, shuffled_batches(x, y, 5, 1), 1, [Optimised.sgd(model.parameters(), 0.1, CFG)],
                dropout_seed=7, hooks=StepHooks(after_backward=after_backward),
                companions=[Companion(companion, companion_seed)])
        return model, outputs

    torch.manual_seed(0)
    m1, out1 = run(5)
    torch.manual_seed(1)  # the global RNG takes no part
    m2, out2 = run(5)
    _, out3 = run(6)
    assert all(torch.equal(a, b) for a, b in zip(out1, out2, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(out1, out3, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True))


def test_run_sgd_returns_a_divergence_and_raise_if_diverged_raises_it() -> None:
    x, y = _data()
    model = _net()
    res = run_sgd(model, shuffled_batches(x, y, 5, 0), 1, [Optimised.sgd(model.parameters(), 1e30, CFG)],
                  dropout_seed=0, hooks=StepHooks(objective=lambda m, xb, yb: m(xb).sum() * float("inf")))
    assert res.steps == 5 and not math.isfinite(res.loss)
    assert diverged(res.steps, res.loss) and not diverged(0, math.nan) and not diverged(3, 1.0, 2.0)
    with pytest.raises(FloatingPointError, match="diverged"):
        raise_if_diverged(res.steps, res.loss)
    with pytest.raises(FloatingPointError, match=r"^mine$"):
        raise_if_diverged(1, 0.0, math.inf, message="mine")
    assert "lower the learning rate" in DIVERGED


def test_fill_missing_grads_gives_unreached_parameters_a_zero_gradient() -> None:
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    (2.0 * a).sum().backward()  # type: ignore[no-untyped-call]
    grads = fill_missing_grads([a, b])
    assert torch.equal(grads[0], torch.full((2,), 2.0)) and torch.equal(grads[1], torch.zeros(3))
    assert grads[1] is b.grad


def test_loss_meter_sums_in_float64_and_means_over_the_steps() -> None:
    meter = LossMeter(torch.device("cpu"))
    meter.add(ce=torch.tensor(1.0), kd=torch.tensor(0.5, requires_grad=True))
    meter.add(ce=torch.tensor(2.0))
    assert meter.sums["ce"].dtype == torch.float64 and not meter.sums["kd"].requires_grad
    assert meter.mean("ce", 2) == 1.5 and meter.mean("kd", 2) == 0.25
    assert meter.mean("absent", 2) == 0.0 and meter.mean("ce", 0) == 3.0


def _step_calls(path: Path) -> list[int]:
    """Lines of ``<something>.step()`` calls without arguments (an optimiser's step) in one source file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"
            and not node.args and not node.keywords]


def test_fedcore_steps_an_optimiser_in_one_place_only() -> None:
    """Every local training runs on fedcore.train.loop; the only other optimiser is DistFL's, which optimises
    synthetic inputs, not a model on batches."""
    found = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "fedcore").rglob("*.py"))
             if (lines := _step_calls(p))}
    assert set(found) == {"fedcore/train/loop.py", "fedcore/distfl/extraction.py"}, found
    assert len(found["fedcore/train/loop.py"]) == 1


def test_the_docs_example_of_a_new_objective_runs() -> None:
    """docs/training_loop.md's example trains with train_local and its objective: same batches and masks as
    vanilla, other weights (its loss has an extra term)."""
    from fedcore.seeds import round_seeds
    from fedcore.train.trainers import TrainerState

    text = (ROOT / "docs" / "training_loop.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/training_loop.md", "exec"), namespace)
    x, y = _data()
    seeds = round_seeds(1, "c", 0)
    model, vanilla = _net(), _net()
    state = TrainerState()
    res, out = namespace["train"](model, state, x, y, CFG, seeds, recovery=False)  # type: ignore[operator]
    ref = train_local(vanilla, x, y, CFG, seed=seeds.batches, dropout_seed=seeds.dropout)
    assert out is state and res.steps == ref.steps and res.num_samples == ref.num_samples
    assert math.isfinite(res.loss) and res.loss != ref.loss
    assert not torch.equal(next(model.parameters()), next(vanilla.parameters()))
