"""A model that cannot take the dataset's samples is refused from the declarations (the model's ``ModelInput``, the
dataset's ``SampleShape``) before any data is read or model built, naming ``model.name``, what the model takes,
what the dataset gives and the registered models that fit; a model without a declaration still gets the forward
check, with the same kind of message. Real datasets are read from ../shared/data (skipped when absent)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.config import ConfigError, ServerConfig, build_config
from fedcore.data import SampleShape, load_client_data, sample_shape
from fedcore.models import MODELS, available_models, build_model, model_input, register_model
from fedcore.models.zoo import BlockModel

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MNIST_FITS = "fedntd_cnn, hydra_ntd_cnn, mnist_cnn, mnist_cnn_bn, mnist_mlp, moon_cnn"


def need(sub: str) -> Path:
    path = SHARED / sub
    if not path.exists():
        pytest.skip(f"real dataset not available: {path} is absent (the shared data folder lives at "
                    f"<repo>/../shared/data)")
    return path


def _server(model: dict[str, Any], data: dict[str, Any], **sections: Any) -> ServerConfig:
    table = {"security": {"insecure": True}, "rounds": {"clients_per_round": 2, "min_available": 2},
             "model": model, "data": data, **sections}
    return build_config(ServerConfig, None, [([k], v) for k, v in table.items()])


@pytest.fixture
def no_torch_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building or running any torch module fails the test: the declarations alone must decide."""
    import fedcore.preflight as preflight

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a torch model was built or run")

    monkeypatch.setattr(preflight, "build_model", boom)
    monkeypatch.setattr(preflight, "_forward_problem", boom)
    monkeypatch.setattr(nn.Module, "__init__", boom)
    monkeypatch.setattr(nn.Module, "__call__", boom)


@pytest.fixture
def undeclared() -> Iterator[str]:
    """A registered model that declares nothing: flatten, linear 50 -> 10."""

    @register_model("test_undeclared_fit")
    def factory(num_classes: int = 10) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(50, num_classes))

    try:
        yield "test_undeclared_fit"
    finally:
        MODELS.remove("test_undeclared_fit")


# ---- the declared check ----

def test_mlp_on_mnist_is_refused_from_the_declarations(tmp_path: Path, no_torch_model: None) -> None:
    from fedcore.preflight import check_declared_fit, check_server_config

    # an empty data folder: the refusal comes before the data is looked for
    config = _server({"name": "mlp"}, {"dataset": "mnist", "options": {"data_dir": str(tmp_path)}})
    for check in (lambda: check_declared_fit(config), lambda: check_server_config(config, num_clients=2)):
        with pytest.raises(ConfigError) as caught:
            check()
        message = str(caught.value)
        assert message.startswith("model.name: 'mlp' does not fit dataset 'mnist': one sample of shape [1, 28, 28] "
                                  "(float32) is not what 'mlp' takes, inputs of shape [60] float32 (flattened: any "
                                  "shape of 60 values; set by model.kwargs.in_features)"), message
        assert "to keep 'mlp', set model.kwargs.in_features = 784" in message
        assert message.endswith(f"registered models that fit it: {MNIST_FITS}"), message


@pytest.mark.parametrize(("model", "dataset", "options"), [
    ("mnist_cnn", "mnist", {}), ("mnist_mlp", "mnist", {}), ("moon_cnn", "mnist", {}),
    ("cifar_cnn", "cifar10", {}), ("resnet18_cifar", "cifar10", {}), ("vgg11_bn", "cifar10", {}),
    ("har_cnn", "har", {}), ("char_lstm", "shakespeare", {}), ("mlp", "synthetic", {}),
    ("logreg", "synthetic", {}), ("mlp_bn", "synthetic", {}),
])
def test_fitting_pairs_pass_the_declared_check(model: str, dataset: str, options: dict[str, Any],
                                               no_torch_model: None) -> None:
    from fedcore.preflight import check_declared_fit

    check_declared_fit(_server({"name": model}, {"dataset": dataset, "options": options}))


def test_a_fitting_pair_passes_the_whole_preflight_with_its_parameter_count() -> None:
    from fedcore.preflight import check_server_config

    config = _server({"name": "mlp_bn", "kwargs": {"in_features": 20, "num_classes": 4, "hidden": [16]}},
                     {"dataset": "synthetic", "options": {"num_features": 20, "num_classes": 4}})
    # linear (no bias), BatchNorm weight and bias, its running mean and variance, the classifier
    assert check_server_config(config, num_clients=2) == 20 * 16 + 2 * 16 + 2 * 16 + 16 * 4 + 4


def test_a_fitting_pair_on_real_mnist_passes_without_a_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedcore.preflight as preflight

    need("mnist")

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a declared model was run")

    monkeypatch.setattr(preflight, "_forward_problem", boom)
    config = _server({"name": "mnist_mlp"}, {"dataset": "mnist", "options": {"data_dir": str(SHARED / "mnist")}})
    assert preflight.check_server_config(config, num_clients=2) == 199_210


@pytest.mark.parametrize(("model", "kwargs", "dataset", "options", "fits", "hint"), [
    ("mlp", {"in_features": 784}, "mnist", {}, True, ""),
    ("cifar_cnn", {"in_channels": 1, "image_size": 28}, "mnist", {}, True, ""),
    ("mnist_cnn", {"in_channels": 3, "image_size": 32}, "cifar10", {}, True, ""),
    ("mnist_cnn", {"in_channels": 3}, "mnist", {}, False, "set model.kwargs.in_channels = 1"),
    ("cifar_cnn", {}, "mnist", {}, False, "set model.kwargs.in_channels = 1, model.kwargs.image_size = 28"),
    ("mlp", {}, "synthetic", {"num_features": 20}, False, "set model.kwargs.in_features = 20"),
    ("mlp", {"in_features": 20}, "synthetic", {"num_features": 20}, True, ""),
    ("char_lstm", {}, "shakespeare", {"seq_len": 20}, False, "set model.kwargs.seq_len = 20"),
    ("char_lstm", {"seq_len": 20}, "shakespeare", {"seq_len": 20}, True, ""),
    ("har_cnn", {"window": 64}, "har", {}, False, "set model.kwargs.window = 128"),
    ("har_cnn", {"num_classes": 10}, "har", {}, False, "set model.kwargs.num_classes = 6"),
    ("mlp", {}, "shakespeare", {}, False, ""),  # float features against symbol indices: no keyword helps
])
def test_keyword_arguments_that_set_the_input_are_honoured(model: str, kwargs: dict[str, Any], dataset: str,
                                                           options: dict[str, Any], fits: bool, hint: str,
                                                           no_torch_model: None) -> None:
    from fedcore.preflight import check_declared_fit

    config = _server({"name": model, "kwargs": kwargs}, {"dataset": dataset, "options": options})
    if fits:
        check_declared_fit(config)
        return
    with pytest.raises(ConfigError, match=rf"^model\.name: '{model}' does not fit dataset '{dataset}': .*"
                                          r"registered models that fit it: \w") as caught:
        check_declared_fit(config)
    message = str(caught.value)
    assert (f"; to keep '{model}', {hint};" in message) if hint else "to keep" not in message, message


def test_a_class_count_mismatch_names_the_keyword(no_torch_model: None) -> None:
    from fedcore.preflight import check_declared_fit

    with pytest.raises(ConfigError, match=r"^model\.name: 'har_cnn' does not fit dataset 'har': one sample of shape "
                                          r"\[6, 128\] \(float32\): it gives output \[1, 10\], not one score for each "
                                          r"of the dataset's 6 classes \(set by model\.kwargs\.num_classes\); to keep "
                                          r"'har_cnn', set model\.kwargs\.num_classes = 6; registered models that fit "
                                          r"it: har_cnn$"):
        check_declared_fit(_server({"name": "har_cnn", "kwargs": {"num_classes": 10}}, {"dataset": "har"}))


def test_without_a_declaration_on_either_side_the_declared_check_says_nothing(undeclared: str,
                                                                             no_torch_model: None) -> None:
    from fedcore.preflight import check_declared_fit

    assert model_input(undeclared) is None and model_input("fedcore.models:mlp") is None
    assert sample_shape("npz", {"path": "x.npz"}) is None and sample_shape("imagefolder", {"path": "x"}) is None
    check_declared_fit(_server({"name": undeclared}, {"dataset": "mnist"}))
    check_declared_fit(_server({"name": "mlp"}, {"dataset": "npz", "options": {"path": "x.npz"}}))


# ---- models that declare nothing: the forward check, translated ----

def test_an_undeclared_model_gets_the_forward_check_with_a_translated_message(undeclared: str) -> None:
    from fedcore.preflight import check_server_config

    with pytest.raises(ConfigError) as caught:
        check_server_config(_server({"name": undeclared}, {"dataset": "synthetic"}), num_clients=2)
    message = str(caught.value)
    assert re.match(r"^model\.name: 'test_undeclared_fit' does not fit dataset 'synthetic': one sample of shape "
                    r"\[60\] \(float32\) fails in the forward pass: RuntimeError: mat1 and mat2 shapes cannot be "
                    r"multiplied \(1x60 and 50x10\); registered models that fit it: logreg, mlp, mlp_bn$",
                    message), message
    # the output: not one score per class
    with pytest.raises(ConfigError, match=r"^model\.name: 'test_undeclared_fit' does not fit dataset 'synthetic': "
                                          r"one sample of shape \[50\] \(float32\): it gives output \[1, 10\], not "
                                          r"one score for each of the dataset's 4 classes; registered models that "
                                          r"fit it: none$"):
        check_server_config(_server({"name": undeclared}, {"dataset": "synthetic",
                                                           "options": {"num_features": 50, "num_classes": 4}}),
                            num_clients=2)


def test_an_undeclared_model_that_fits_is_listed_by_running_it(undeclared: str, tmp_path: Path) -> None:
    from fedcore.preflight import check_declared_fit, check_server_config

    # early (declared mnist, no data read): run on zeros of the declared sample
    with pytest.raises(ConfigError, match=r"fit it: test_undeclared_fit$"):
        check_declared_fit(_server({"name": "char_lstm"}, {"dataset": "synthetic", "options": {"num_features": 50}}))
    # late (a user's npz: only the data tells): run on one real sample; the declared mlp is judged without a run
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((40, 5, 10), dtype=np.float32), y=np.arange(40) % 10)
    config = _server({"name": "mlp"}, {"dataset": "npz", "options": {"path": str(path), "num_clients": 2}})
    with pytest.raises(ConfigError, match=r"^model\.name: 'mlp' does not fit dataset 'npz': one sample of shape "
                                          r"\[5, 10\] \(float32\) is not what 'mlp' takes, inputs of shape \[60\] "
                                          r"float32 .*; to keep 'mlp', set model\.kwargs\.in_features = 50; registered "
                                          r"models that fit it: test_undeclared_fit$"):
        check_server_config(config, num_clients=2)


# ---- the declarations against torch and the data ----

BUILT_IN = [name for name in available_models() if MODELS.get(name).__module__.startswith("fedcore.models")]


@pytest.mark.parametrize(("name", "kwargs"), [
    *[(name, {}) for name in BUILT_IN],
    ("mlp", {"in_features": 20, "num_classes": 3}), ("mlp_bn", {"in_features": 7}),
    ("cifar_cnn", {"in_channels": 1, "image_size": 28}), ("mnist_cnn", {"in_channels": 3, "image_size": 32}),
    ("mnist_mlp", {"in_features": 3 * 32 * 32, "in_channels": 3, "image_size": 32}),
    ("har_cnn", {"in_channels": 3, "window": 32}), ("char_lstm", {"seq_len": 5, "num_classes": 7}),
    ("moon_cnn", {"in_channels": 3, "image_size": 32, "heads": False}),
])
def test_every_declared_input_is_what_a_forward_pass_accepts(name: str, kwargs: dict[str, Any]) -> None:
    takes = model_input(name, kwargs)
    assert takes is not None, f"built-in model {name!r} declares no input"
    model = build_model(name, kwargs, seed=0).eval()
    dtype = getattr(torch, takes.dtype)
    with torch.no_grad():
        out = model(torch.zeros((2, *takes.shape), dtype=dtype))
        assert tuple(out.shape) == (2, takes.num_classes)
        if takes.flat:
            assert tuple(model(torch.zeros((2, takes.size), dtype=dtype)).shape) == (2, takes.num_classes)
    if isinstance(model, BlockModel):
        assert model.input_shape == takes.shape and model.input_dtype == dtype


def _declared_is_real(dataset: str, options: dict[str, Any]) -> None:
    declared = sample_shape(dataset, options)
    data = load_client_data(dataset, 0, 0, options)
    real = SampleShape(tuple(data.x_train.shape[1:]), str(data.x_train.dtype).removeprefix("torch."),
                       data.num_classes)
    assert declared is not None and declared.shape == real.shape and declared.dtype == real.dtype
    assert declared.num_classes in (None, real.num_classes)


@pytest.mark.parametrize("options", [{}, {"num_features": 20, "num_classes": 4}])
def test_the_synthetic_declaration_is_its_data(options: dict[str, Any]) -> None:
    _declared_is_real("synthetic", options)


@pytest.mark.parametrize(("dataset", "options"), [
    ("mnist", {}), ("har", {}), ("shakespeare", {"seq_len": 20, "num_clients": 2}),
    ("cifar10", {"max_samples": 60, "num_clients": 2}),
])
def test_the_real_datasets_declarations_are_their_data(dataset: str, options: dict[str, Any]) -> None:
    need(dataset)
    _declared_is_real(dataset, {"data_dir": str(SHARED), **options})
