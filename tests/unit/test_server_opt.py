"""fedcore.server_opt: FedAvgM, FedAdagrad, FedAdam, FedYogi against the formulas computed here by hand in float64.

The reference below is written from the formulas (Reddi et al., ICLR 2021, Algorithm 2; Hsu et al. 2019), not by
calling the module. Tolerance: float32 rounds each operation to within U = 2^-24 of its exact result (round to
nearest). Counting the roundings along one parameter's chain over 3 steps -- the constants β1, 1−β1, β2, 1−β2, η
and the bias corrections rounded to float32, each multiply/add of m and v (~4 per step each), sqrt (halves v's
error), + τ, the division, the bias-correction divisions, η·(.) and x + (.) -- gives about 30 U of error relative
to the *magnitude* of the computation (the same recurrences with |Δ| in place of Δ, so that a cancellation in m
does not turn a small absolute error into a large relative one). The tests allow N_OPS = 64 U times that magnitude
(about 3.8e-6), twice the count.
"""

from __future__ import annotations

import io
import math
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from fedcore.errors import ConfigError
from fedcore.server_opt import (
    SERVER_OPTIMIZERS,
    FedAdamOptions,
    FedAvgMOptions,
    ServerOptimizer,
    ServerOptimizerConfig,
    ServerOptState,
    make,
)

Tensors = dict[str, torch.Tensor]

U = 2.0 ** -24  # float32's unit roundoff
N_OPS = 64  # roundings allowed per chain (about twice the ~30 counted in the module docstring)
RTOL = N_OPS * U

STEPS = 3

# The defaults the module must have (their source: fedcore/server_opt/config.py's docstring; Flower's strategies).
DEFAULTS: dict[str, dict[str, Any]] = {
    "fedavgm": {"lr": 1.0, "momentum": 0.9},
    "fedadagrad": {"lr": 0.1, "beta1": 0.0, "tau": 1e-9, "bias_correction": False},
    "fedadam": {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-9, "bias_correction": False},
    "fedyogi": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "bias_correction": False},
}

CASES: list[tuple[str, dict[str, Any]]] = [
    ("fedavgm", {}),
    ("fedavgm", {"lr": 0.5, "momentum": 0.5}),
    ("fedadagrad", {}),
    ("fedadagrad", {"beta1": 0.9}),
    ("fedadagrad", {"beta1": 0.9, "bias_correction": True}),
    ("fedadam", {}),
    ("fedadam", {"bias_correction": True}),
    ("fedadam", {"lr": 0.03, "beta1": 0.5, "beta2": 0.9, "tau": 1e-3, "bias_correction": True}),
    ("fedyogi", {}),
    ("fedyogi", {"bias_correction": True}),
    ("fedyogi", {"lr": 0.1, "tau": 1e-9}),
]


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def params_of(seed: int) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(3, generator=g),
            "scale": torch.randn((), generator=g)}


def deltas_of(seed: int, params: Mapping[str, torch.Tensor], steps: int = STEPS) -> list[Tensors]:
    g = torch.Generator().manual_seed(seed)
    return [{k: 0.1 * torch.randn(p.shape, generator=g) for k, p in params.items()} for _ in range(steps)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 differs from 0.0 and NaN equals itself)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert same_bits(a[k], b[k]), k


def run(opt: ServerOptimizer, params: Tensors, deltas: list[Tensors]) -> tuple[list[Tensors], ServerOptState]:
    state = opt.init(params)
    out = []
    for delta in deltas:
        params, state = opt.step(state, params, delta)
        out.append(params)
    return out, state


# ---- the reference, by hand in float64 ----


def reference(name: str, options: Mapping[str, Any], params: Tensors, deltas: list[Tensors]) -> list[dict[str, Any]]:
    """Per step: {"x", "x_mag", "m", "m_mag", "v", "v_mag"} by parameter name, in float64; ``*_mag`` is the same
    recurrence on magnitudes (|Δ|, |terms|), the scale the float32 error is relative to."""
    o = {**DEFAULTS[name], **options}
    steps: list[dict[str, Any]] = [{key: {} for key in ("x", "x_mag", "m", "m_mag", "v", "v_mag")}
                                   for _ in deltas]
    for k, p in params.items():
        x = p.double()
        x_mag = x.abs()
        m = torch.zeros_like(x)
        m_mag = torch.zeros_like(x)
        v = torch.zeros_like(x)
        v_mag = torch.zeros_like(x)
        for t, delta in enumerate(deltas, start=1):
            d = delta[k].double()
            if name == "fedavgm":
                # v ← μ·v + Δ; x ← x + η·v
                v = o["momentum"] * v + d
                v_mag = o["momentum"] * v_mag + d.abs()
                step, step_mag = o["lr"] * v, o["lr"] * v_mag
            else:
                b1, lr, tau = o["beta1"], o["lr"], o["tau"]
                # m ← β1·m + (1−β1)·Δ
                m = b1 * m + (1 - b1) * d
                m_mag = b1 * m_mag + (1 - b1) * d.abs()
                d2 = d * d
                if name == "fedadagrad":  # v ← v + Δ²
                    v = v + d2
                    v_mag = v_mag + d2
                elif name == "fedadam":  # v ← β2·v + (1−β2)·Δ²
                    v = o["beta2"] * v + (1 - o["beta2"]) * d2
                    v_mag = o["beta2"] * v_mag + (1 - o["beta2"]) * d2
                else:  # fedyogi: v ← v − (1−β2)·Δ²·sign(v − Δ²)
                    v = v - (1 - o["beta2"]) * d2 * torch.sign(v - d2)
                    v_mag = v_mag + (1 - o["beta2"]) * d2
                m_hat, m_hat_mag, v_hat = m, m_mag, v
                if o["bias_correction"]:  # m̂ = m/(1−β1^t); v̂ = v/(1−β2^t) (fedadagrad: v̂ = v)
                    m_hat, m_hat_mag = m / (1 - b1 ** t), m_mag / (1 - b1 ** t)
                    if name != "fedadagrad":
                        v_hat = v / (1 - o["beta2"] ** t)
                # x ← x + η·m̂/(√v̂ + τ)
                step = lr * m_hat / (torch.sqrt(v_hat) + tau)
                step_mag = lr * m_hat_mag / (torch.sqrt(v_hat) + tau)
            x = x + step
            x_mag = x_mag + step_mag
            for key, value in (("x", x), ("x_mag", x_mag), ("m", m), ("m_mag", m_mag), ("v", v), ("v_mag", v_mag)):
                steps[t - 1][key][k] = value
    return steps


def assert_close_to(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    bound = RTOL * magnitude
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max()):.3g}, " \
                                       f"max of error/bound {float((err / bound.clamp_min(1e-300)).max()):.3g}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_three_steps_match_the_formulas_in_float64(case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    params = params_of(1)
    deltas = deltas_of(2, params)
    outs, state = run(make(name, options), params, deltas)
    want = reference(name, options, params, deltas)
    for t, (out, ref) in enumerate(zip(outs, want, strict=True), start=1):
        for k in params:
            assert out[k].dtype == torch.float32
            assert_close_to(out[k], ref["x"][k], ref["x_mag"][k], f"step {t} {k}")
    assert state.step == STEPS
    last = want[-1]
    assert set(state.slots) == ({"v"} if name == "fedavgm" else {"m", "v"})
    for slot in state.slots:
        for k in params:
            assert state.slots[slot][k].dtype == torch.float32
            assert_close_to(state.slots[slot][k], last[slot][k], last[f"{slot}_mag"][k], f"state {slot} {k}")
    # the steps moved the model by more than the tolerance: the comparison is not vacuous
    assert any(float((outs[-1][k].double() - params[k].double()).abs().max()) > 1e3 * RTOL for k in params)


@pytest.mark.parametrize("name", ["fedadagrad", "fedadam", "fedyogi"])
def test_bias_correction_changes_the_step_and_not_the_state(name: str) -> None:
    options: dict[str, Any] = {"beta1": 0.9} if name == "fedadagrad" else {}
    params = params_of(3)
    deltas = deltas_of(4, params)
    plain, plain_state = run(make(name, options), params, deltas)
    corrected, corrected_state = run(make(name, {**options, "bias_correction": True}), params, deltas)
    # (fedadam: not at step 1, where m̂/√v̂ = m/√v = Δ/|Δ| up to τ)
    assert not torch.allclose(plain[-1]["fc.weight"], corrected[-1]["fc.weight"])
    # m and v are kept uncorrected: the same recurrences either way, as long as the params do not feed them
    assert_same_bits(plain_state.to_tensors(), corrected_state.to_tensors())


def test_fedavgm_without_momentum_at_lr_1_is_fedavg_bit_for_bit() -> None:
    opt = make("fedavgm", {"momentum": 0.0, "lr": 1.0})
    params = params_of(5)
    deltas = deltas_of(6, params, steps=4)
    deltas[1]["fc.bias"][0] = -0.0  # a signed zero survives too
    state = opt.init(params)
    for delta in deltas:
        new, state = opt.step(state, params, delta)
        assert_same_bits(new, {k: params[k] + delta[k] for k in params})
        params = new


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_step_modifies_no_input_and_returns_no_alias(case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    opt = make(name, options)
    params = params_of(7)
    deltas = deltas_of(8, params, steps=2)
    _, state = opt.step(opt.init(params), params, deltas[0])  # a state with nonzero slots
    kept_params = {k: t.clone() for k, t in params.items()}
    kept_delta = {k: t.clone() for k, t in deltas[1].items()}
    kept_state = {k: t.clone() for k, t in state.to_tensors().items()}
    new, new_state = opt.step(state, params, deltas[1])
    assert_same_bits(params, kept_params)
    assert_same_bits(deltas[1], kept_delta)
    assert_same_bits(state.to_tensors(), kept_state)
    assert state.step == 1 and new_state.step == 2
    inputs = {t.untyped_storage().data_ptr() for t in (*params.values(), *deltas[1].values(),
                                                       *state.to_tensors().values())}
    outputs = [t.untyped_storage().data_ptr() for t in (*new.values(), *new_state.to_tensors().values())]
    assert not inputs & set(outputs)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_step_save_load_step_is_bit_identical_to_two_steps(case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    params = params_of(9)
    deltas = deltas_of(10, params, steps=2)
    straight, straight_state = run(make(name, options), params, deltas)

    opt = make(name, options)
    first, state = opt.step(opt.init(params), params, deltas[0])
    buffer = io.BytesIO()
    torch.save({"meta": state.to_dict(), "tensors": state.to_tensors()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_opt = make(name, options)  # a new process would build a new optimizer
    loaded = ServerOptState.from_dict(saved["meta"], saved["tensors"], first)
    assert loaded.step == 1
    again = resumed_opt.load(saved["meta"]["step"], saved["tensors"], first)
    second, second_state = resumed_opt.step(loaded, first, deltas[1])
    assert_same_bits(second, straight[-1])
    assert second_state.step == straight_state.step == 2
    assert_same_bits(second_state.to_tensors(), straight_state.to_tensors())
    assert_same_bits(resumed_opt.step(again, first, deltas[1])[0], straight[-1])


def test_init_is_zero_slots_at_step_0() -> None:
    params = params_of(11)
    state = make("fedadam").init(params)
    assert state.step == 0 and list(state.slots) == ["m", "v"]
    for slot in state.slots.values():
        for k, p in params.items():
            assert slot[k].shape == p.shape and slot[k].dtype == p.dtype and not bool(slot[k].any())
    assert set(state.to_tensors()) == {f"{s}/{k}" for s in ("m", "v") for k in params}
    assert state.to_dict() == {"step": 0, "slots": ["m", "v"]}
    assert list(make("fedavgm").init(params).slots) == ["v"]


def test_from_tensors_refuses_another_models_state() -> None:
    params = params_of(12)
    opt = make("fedadam")
    tensors = opt.init(params).to_tensors()
    assert ServerOptState.from_tensors(3, tensors, params).step == 3

    wrong_shape = {**tensors, "m/fc.weight": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match=r"m/fc\.weight: shape \(3, 4\).*'fc\.weight' is shape \(4, 3\)"):
        ServerOptState.from_tensors(1, wrong_shape, params)
    wrong_dtype = {**tensors, "v/fc.bias": torch.zeros(3, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"v/fc\.bias: .*float64.*float32"):
        ServerOptState.from_tensors(1, wrong_dtype, params)
    renamed = {("m/fc.w" if k == "m/fc.weight" else k): t for k, t in tensors.items()}
    with pytest.raises(ValueError, match=r"no tensor for the model's 'fc\.weight'"):
        ServerOptState.from_tensors(1, renamed, params)
    extra = {**tensors, "v/other.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"'other\.weight' is not a parameter of the model"):
        ServerOptState.from_tensors(1, extra, params)
    with pytest.raises(ValueError, match=r"'nosep' is not a '<slot>/<parameter name>' name"):
        ServerOptState.from_tensors(1, {**tensors, "nosep": torch.zeros(1)}, params)
    with pytest.raises(ValueError, match=r"^step: must be an integer >= 0, got -1"):
        ServerOptState.from_tensors(-1, tensors, params)
    # a fedavgm state (slot v only) is not a fedadam state, and a fedadam state not a fedavgm one
    fedavgm_tensors = make("fedavgm").init(params).to_tensors()
    with pytest.raises(ValueError, match=r"slot 'm' is missing"):
        opt.load(1, fedavgm_tensors, params)
    with pytest.raises(ValueError, match=r"slot 'm' is not one this optimizer keeps \(v\)"):
        make("fedavgm").load(1, tensors, params)
    with pytest.raises(ValueError, match=r"^step: missing"):
        ServerOptState.from_dict({"slots": ["m", "v"]}, tensors, params)


def test_step_refuses_a_mismatched_delta_or_state() -> None:
    params = params_of(13)
    opt = make("fedyogi")
    state = opt.init(params)
    delta = deltas_of(14, params, steps=1)[0]
    with pytest.raises(ValueError, match=r"delta/fc\.bias: shape \(4,\)"):
        opt.step(state, params, {**delta, "fc.bias": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"delta: no tensor for the model's 'scale'"):
        opt.step(state, params, {k: t for k, t in delta.items() if k != "scale"})
    with pytest.raises(ValueError, match=r"fedyogi keeps slots m, v, the state has v"):
        opt.step(make("fedavgm").init(params), params, delta)
    with pytest.raises(ValueError, match=r"'steps'\]: a server optimizer needs floating-point tensors"):
        opt.init({**params, "steps": torch.zeros(1, dtype=torch.int64)})


@pytest.mark.parametrize(("name", "options", "message"), [
    ("fedadam", {"lr": -1}, r"^lr: must be a finite number > 0, got -1"),
    ("fedadam", {"lr": math.inf}, r"^lr: must be a finite number > 0"),
    ("fedadam", {"beta1": 1.0}, r"^beta1: must be a number in \[0, 1\), got 1\.0"),
    ("fedyogi", {"beta2": -0.1}, r"^beta2: must be a number in \[0, 1\)"),
    ("fedadagrad", {"tau": 0.0}, r"^tau: must be a finite number > 0"),
    ("fedavgm", {"momentum": 1.5}, r"^momentum: must be a number in \[0, 1\)"),
    ("fedadam", {"bias_correction": "yes"}, r"^bias_correction: expected true or false"),
    ("fedadagrad", {"beta2": 0.9}, r"^beta2: server optimizer 'fedadagrad' has no option 'beta2'"),
    ("fedavgm", {"lr": "fast"}, r"^lr: expected a number, got 'fast'"),
])
def test_bad_options_name_the_field(name: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(name, options)


def test_unknown_name_lists_the_known_ones_and_options_may_be_the_dataclass() -> None:
    with pytest.raises(ValueError, match=r"unknown server optimizer 'adam'; known: fedadagrad, fedadam, fedavgm, "
                                         r"fedyogi"):
        make("adam")
    assert make("fedadam", FedAdamOptions(lr=0.5)).options == FedAdamOptions(lr=0.5)
    with pytest.raises(ConfigError, match=r"^options: server optimizer 'fedadam' takes FedAdamOptions"):
        make("fedadam", FedAvgMOptions())
    with pytest.raises(ConfigError, match=r"^lr: must be a finite number > 0"):
        make("fedadam", FedAdamOptions(lr=0.0))


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults_and_registry(name: str) -> None:
    opt = make(name)
    assert opt.name == name
    assert {k: getattr(opt.options, k) for k in DEFAULTS[name]} == DEFAULTS[name]
    assert SERVER_OPTIMIZERS.summaries()[name]
    assert SERVER_OPTIMIZERS.plugin(name).options_type() is type(opt.options)


def test_config_section_names_the_field() -> None:
    path = "server_optimizer"
    default = ServerOptimizerConfig().validate()
    assert not default.enabled and default.parsed_options() is None
    config = ServerOptimizerConfig.from_table({"name": "fedadam", "options": {"lr": 0.5}}, path).validate()
    assert config.enabled and config.parsed_options() == FedAdamOptions(lr=0.5)
    assert isinstance(make(config.name, config.options).options, FedAdamOptions)
    with pytest.raises(ConfigError, match=r"^server_optimizer\.name: unknown server optimizer 'adam'; known: "
                                          r"fedadagrad, fedadam, fedavgm, fedyogi"):
        ServerOptimizerConfig.from_table({"name": "adam"}, path).validate()
    with pytest.raises(ConfigError, match=r"^server_optimizer\.options\.lr: must be a finite number > 0"):
        ServerOptimizerConfig.from_table({"name": "fedyogi", "options": {"lr": -1}}, path)
    with pytest.raises(ConfigError, match=r"^server_optimizer\.options\.lr: must be a finite number > 0"):
        ServerOptimizerConfig(name="fedyogi", options={"lr": -1}).validate()
    with pytest.raises(ConfigError, match=r"^server_optimizer\.options\.momentum: server optimizer 'fedadam' has "
                                          r"no option 'momentum'"):
        ServerOptimizerConfig(name="fedadam", options={"momentum": 0.9}).validate()
    with pytest.raises(ConfigError, match=r"^server_optimizer\.options: no server optimizer is named"):
        ServerOptimizerConfig(options={"lr": 0.1}).validate()
    with pytest.raises(ConfigError, match=r"^server_optimizer\.frobnicate: unknown field"):
        ServerOptimizerConfig.from_table({"frobnicate": 1}, path)


def test_the_config_module_imports_no_torch() -> None:
    code = ("import sys, fedcore.server_opt.config\n"
            "assert 'torch' not in sys.modules, 'fedcore.server_opt.config imported torch'\n"
            "import fedcore.server_opt as so\n"
            "so.ServerOptimizerConfig.from_table({'name': 'fedadam', 'options': {'lr': 0.5}}, 's').validate()\n"
            "assert 'torch' not in sys.modules, 'fedcore.server_opt or validating a config imported torch'\n"
            "so.make('fedadam')\n"
            "assert 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
