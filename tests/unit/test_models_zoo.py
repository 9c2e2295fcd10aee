from __future__ import annotations

import pytest
import torch
from torch import nn

from fedcore.models import available_models, build_model, model_fingerprint
from fedcore.models.zoo import BlockModel, count_parameters

# (name, kwargs, expected output classes)
ZOO = [
    ("cifar_cnn", {}, 10),
    ("char_lstm", {}, 80),
    ("vgg11_bn", {}, 10),
    ("resnet18_cifar", {}, 10),
    ("har_cnn", {}, 6),
    ("mnist_mlp", {}, 10),
    ("mnist_cnn", {}, 10),
    ("mnist_cnn_bn", {}, 10),
]


def test_paper_models_have_exact_parameter_counts() -> None:
    assert count_parameters(build_model("cifar_cnn")) == 940_362
    assert count_parameters(build_model("char_lstm")) == 819_920
    assert count_parameters(build_model("mnist_mlp")) == 199_210  # McMahan et al.'s 2NN


def test_all_zoo_models_are_registered() -> None:
    assert {name for name, _, _ in ZOO} <= set(available_models())


@pytest.mark.parametrize(("name", "kwargs", "classes"), ZOO, ids=[z[0] for z in ZOO])
def test_forward_on_a_tiny_batch_and_layers(name: str, kwargs: dict[str, int], classes: int) -> None:
    model = build_model(name, kwargs, seed=0)
    assert isinstance(model, BlockModel)
    x = model.example_input(2)
    x = torch.randint(0, 80, x.shape) if x.dtype == torch.int64 else torch.randn(x.shape)
    model.eval()
    with torch.no_grad():
        out = model(x)
        outs = model.layer_outputs(x)
        # layer by layer: running the rest of the blocks on layer m's output gives the same logits
        mid = model.num_layers // 2
        resumed = model.forward_from(outs[mid - 1], mid)
    assert out.shape == (2, classes)
    assert len(outs) == model.num_layers == len(model.layers()) >= 3
    torch.testing.assert_close(outs[-1], out)
    torch.testing.assert_close(resumed, out)


def test_lstm_layers_are_separate_blocks_with_per_step_outputs() -> None:
    model = build_model("char_lstm", seed=0)
    assert isinstance(model, BlockModel)
    kinds = [type(b).__name__ for b in model.layers()]
    assert kinds == ["Embedding", "LSTMBlock", "LSTMBlock", "Sequential"]
    model.eval()
    with torch.no_grad():
        outs = model.layer_outputs(torch.randint(0, 80, (3, 80)))
    assert outs[1].shape == (3, 80, 256) and outs[2].shape == (3, 80, 256)


def test_num_classes_and_input_options() -> None:
    m = build_model("cifar_cnn", {"num_classes": 7, "in_channels": 1, "image_size": 28}, seed=0)
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 7)
    v = build_model("vgg11_bn", {"num_classes": 4, "in_channels": 1}, seed=0)
    assert v(torch.randn(2, 1, 32, 32)).shape == (2, 4)
    h = build_model("har_cnn", {"num_classes": 3}, seed=0)
    assert h(torch.randn(2, 6, 128)).shape == (2, 3)


def test_seeded_builds_are_identical_and_distfl_models_have_batchnorm() -> None:
    a, b = build_model("mnist_cnn_bn", seed=3), build_model("mnist_cnn_bn", seed=3)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    for name in ("vgg11_bn", "resnet18_cifar", "har_cnn", "mnist_cnn_bn"):
        assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in build_model(name).modules()), name
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in build_model("mnist_cnn").modules())
