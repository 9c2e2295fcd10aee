"""Model zoo of the papers (SPEC §12), registered by name with :func:`fedcore.models.register_model`.

Every model is a :class:`BlockModel`: an ordered ``blocks`` list whose ``forward`` runs the blocks in turn. A
block is one "layer" in LINDT's sense — conv+activation+pool, linear+activation, or one LSTM layer — so the
layer-wise dual model can mix the outputs of layer m of two models and feed the mix to layer m+1
(:meth:`BlockModel.layers`, :meth:`BlockModel.forward_from`). Each model also states its ``input_shape``
(without the batch dimension) and ``input_dtype``, which DistFL's input synthesis and tests use.

- ``cifar_cnn``: LINDT/FL-GUARD CIFAR CNN, 940,362 parameters.
- ``char_lstm``: LINDT/FL-GUARD Shakespeare character LSTM, 819,920 parameters.
- ``vgg11_bn``: VGG-11 with BatchNorm and a global-average-pooling head (DistFL).
- ``resnet18_cifar``: ResNet-18 with a 3x3 stem and no max-pool (CIFAR variant; DistFL).
- ``har_cnn``: small 1-D CNN with BatchNorm for 6-channel HAR windows.
- ``mnist_mlp``, ``mnist_cnn``, ``mnist_cnn_bn``: MNIST MLP (McMahan et al.'s 2NN) and a small CNN without/with BN.
- ``mlp_bn``: an MLP with BatchNorm1d after each hidden layer, for DistFL on flat features (``synthetic``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedcore.models import register_model


class BlockModel(nn.Module):
    """A model that is an ordered sequence of blocks; ``forward`` applies them in order."""

    def __init__(self, blocks: Sequence[nn.Module], input_shape: tuple[int, ...],
                 input_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.input_shape = tuple(input_shape)
        self.input_dtype = input_dtype

    def layers(self) -> list[nn.Module]:
        """The blocks in order (LINDT's layers 1..M)."""
        return list(self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward_from(self, h: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        """Run blocks ``start``..``stop``-1 (0-based) on ``h``, the output of block ``start``-1 (or the input)."""
        for block in list(self.blocks)[start:stop]:
            h = block(h)
        return h

    def layer_outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The output of every block in order (the last one is the logits)."""
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return outs

    def example_input(self, batch_size: int = 2) -> torch.Tensor:
        """A zero batch of the model's input shape and dtype."""
        return torch.zeros((batch_size, *self.input_shape), dtype=self.input_dtype)


def count_parameters(model: nn.Module) -> int:
    """Trainable and frozen parameters (buffers such as BatchNorm running statistics are not counted)."""
    return sum(p.numel() for p in model.parameters())


# ---- blocks ----

class LSTMBlock(nn.Module):
    """One LSTM layer over [B, T, F] (batch first); returns the per-step outputs [B, T, H]."""

    def __init__(self, input_size: int, hidden_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers=1, batch_first=True)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.dropout(out)  # type: ignore[no-any-return]


class LastStep(nn.Module):
    """[B, T, F] -> [B, F]: the last time step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1, :]


def _conv_block(cin: int, cout: int, k: int, pool: bool, bn: bool, padding: int = 0) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, padding=padding, bias=not bn)]
    if bn:
        layers.append(nn.BatchNorm2d(cout))
    layers.append(nn.ReLU(inplace=True))
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def _linear_block(fin: int, fout: int, dropout: float = 0.0, flatten: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()] if flatten else []
    layers += [nn.Linear(fin, fout), nn.ReLU(inplace=True)]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def _conv_out(size: int, k: int, padding: int = 0) -> int:
    return size - k + 1 + 2 * padding


# ---- CIFAR / LINDT ----

@register_model("cifar_cnn")
def cifar_cnn(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, dropout: float = 0.5) -> BlockModel:
    """conv 3->32 5x5, ReLU, pool; conv 32->64 5x5, ReLU, pool; fc 1600->512, ReLU; fc 512->128, ReLU; fc 128->C.

    940,362 parameters for 3x32x32 inputs and 10 classes. Dropout (0.5, LINDT Table 9) follows each hidden
    linear layer.
    """
    side = _conv_out(_conv_out(image_size, 5) // 2, 5) // 2
    if side < 1:
        raise ValueError(f"cifar_cnn: image_size {image_size} is too small for two 5x5 conv + pool stages")
    flat = 64 * side * side
    return BlockModel([
        _conv_block(in_channels, 32, 5, pool=True, bn=False),
        _conv_block(32, 64, 5, pool=True, bn=False),
        _linear_block(flat, 512, dropout, flatten=True),
        _linear_block(512, 128, dropout),
        nn.Linear(128, num_classes),
    ], (in_channels, image_size, image_size))


@register_model("char_lstm")
def char_lstm(num_classes: int = 80, vocab_size: int = 80, embed_dim: int = 8, hidden: int = 256,
              num_lstm_layers: int = 2, seq_len: int = 80, dropout: float = 0.2) -> BlockModel:
    """Embedding 80->8, 2 stacked LSTM layers of 256, linear 256->80 on the last step: 819,920 parameters.

    Each LSTM layer is its own block (LINDT mixes per layer); ``dropout`` (0.2, LINDT Table 9) follows each
    LSTM layer. Input: int64 symbol indices [B, seq_len].
    """
    blocks: list[nn.Module] = [nn.Embedding(vocab_size, embed_dim)]
    width = embed_dim
    for _ in range(num_lstm_layers):
        blocks.append(LSTMBlock(width, hidden, dropout))
        width = hidden
    blocks.append(nn.Sequential(LastStep(), nn.Linear(width, num_classes)))
    return BlockModel(blocks, (seq_len,), torch.int64)


_VGG11: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


@register_model("vgg11_bn")
def vgg11_bn(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> BlockModel:
    """VGG-11 (configuration A) with BatchNorm after every conv; head = global average pool + linear 512->C.

    DistFL replaces VGG's fully connected layers with global average pooling. One block per conv
    (conv+BN+ReLU, with the following max-pool when there is one).
    """
    blocks: list[nn.Module] = []
    cin = in_channels
    cfg = list(_VGG11)
    for i, v in enumerate(cfg):
        if isinstance(v, str):
            continue
        pool = i + 1 < len(cfg) and cfg[i + 1] == "M"
        blocks.append(_conv_block(cin, v, 3, pool=pool, bn=True, padding=1))
        cin = v
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)))
    return BlockModel(blocks, (in_channels, image_size, image_size))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, identity or 1x1-conv+BN shortcut, ReLU after the sum."""

    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))  # type: ignore[no-any-return]


@register_model("resnet18_cifar")
def resnet18_cifar(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> BlockModel:
    """ResNet-18 for 32x32 inputs: 3x3 stem conv 64 + BN + ReLU (no max-pool), 4 stages of 2 basic blocks
    (64, 128, 256, 512; stride 2 from stage 2), global average pool, linear 512->C. One block per basic block."""
    blocks: list[nn.Module] = [nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
                                             nn.BatchNorm2d(64), nn.ReLU(inplace=True))]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)))
    return BlockModel(blocks, (in_channels, image_size, image_size))


# ---- HAR ----

@register_model("har_cnn")
def har_cnn(num_classes: int = 6, in_channels: int = 6, window: int = 128,
            channels: Sequence[int] = (32, 64, 128), kernel_size: int = 5) -> BlockModel:
    """1-D CNN over [B, 6, 128] windows: BatchNorm of the raw 6 channels, then per stage conv1d + BN + ReLU +
    max-pool 2; head = global average pool + linear -> C. Every stage has BatchNorm (DistFL needs it)."""
    blocks: list[nn.Module] = []
    cin = in_channels
    for i, cout in enumerate(channels):
        layers: list[nn.Module] = [nn.BatchNorm1d(cin)] if i == 0 else []
        layers += [nn.Conv1d(cin, int(cout), kernel_size, padding=kernel_size // 2, bias=False),
                   nn.BatchNorm1d(int(cout)), nn.ReLU(inplace=True), nn.MaxPool1d(2)]
        blocks.append(nn.Sequential(*layers))
        cin = int(cout)
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(cin, num_classes)))
    return BlockModel(blocks, (in_channels, window))


@register_model("mlp_bn")
def mlp_bn(in_features: int = 60, num_classes: int = 10, hidden: Sequence[int] = (64,)) -> BlockModel:
    """:func:`fedcore.models.mlp` with BatchNorm: per hidden width a block Linear (no bias) + BatchNorm1d + ReLU,
    then a linear classifier; for DistFL on flat features (the offline ``synthetic`` dataset)."""
    blocks: list[nn.Module] = []
    width = int(in_features)
    for h in hidden:
        blocks.append(nn.Sequential(nn.Linear(width, int(h), bias=False), nn.BatchNorm1d(int(h)), nn.ReLU()))
        width = int(h)
    blocks.append(nn.Linear(width, num_classes))
    return BlockModel(blocks, (int(in_features),))


# ---- MNIST ----

@register_model("mnist_mlp")
def mnist_mlp(num_classes: int = 10, in_features: int = 784, hidden: Sequence[int] = (200, 200),
              in_channels: int = 1, image_size: int = 28) -> BlockModel:
    """McMahan et al.'s 2NN: flatten, fc 784->200, ReLU, fc 200->200, ReLU, fc 200->C (199,210 parameters)."""
    if in_features != in_channels * image_size * image_size:
        raise ValueError(f"mnist_mlp: in_features {in_features} != {in_channels}x{image_size}x{image_size}")
    blocks: list[nn.Module] = []
    width = in_features
    for i, h in enumerate(hidden):
        blocks.append(_linear_block(width, int(h), flatten=i == 0))
        width = int(h)
    blocks.append(nn.Sequential(nn.Flatten(), nn.Linear(width, num_classes)) if not hidden
                  else nn.Linear(width, num_classes))
    return BlockModel(blocks, (in_channels, image_size, image_size))


def _mnist_cnn(num_classes: int, in_channels: int, image_size: int, channels: Sequence[int], hidden: int,
               bn: bool) -> BlockModel:
    c1, c2 = (int(c) for c in channels)
    side = image_size // 2 // 2
    return BlockModel([
        _conv_block(in_channels, c1, 5, pool=True, bn=bn, padding=2),
        _conv_block(c1, c2, 5, pool=True, bn=bn, padding=2),
        _linear_block(c2 * side * side, hidden, flatten=True),
        nn.Linear(hidden, num_classes),
    ], (in_channels, image_size, image_size))


@register_model("mnist_cnn")
def mnist_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
              channels: Sequence[int] = (16, 32), hidden: int = 128) -> BlockModel:
    """Small CNN: conv 1->16 5x5 pad 2, ReLU, pool; conv 16->32 5x5 pad 2, ReLU, pool; fc 1568->128, ReLU; fc 128->C."""
    return _mnist_cnn(num_classes, in_channels, image_size, channels, hidden, bn=False)


@register_model("mnist_cnn_bn")
def mnist_cnn_bn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
                 channels: Sequence[int] = (16, 32), hidden: int = 128) -> BlockModel:
    """:func:`mnist_cnn` with BatchNorm after each conv (bias-free convs), for DistFL on MNIST."""
    return _mnist_cnn(num_classes, in_channels, image_size, channels, hidden, bn=True)
