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
- ``hydra_ntd_cnn`` / ``fedntd_cnn``: FedNTD's CNN with / without HYDRA-FL's shallow heads (:class:`HydraModel`).
- ``moon_cnn``: MOON's CNN with a 256-d projection head, with HYDRA-FL's shallow heads (``heads=False``: without).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedcore.models.registry import ModelInput, register_model

# What the models take (ModelInput): a sample of in_channels x image_size x image_size (LINDT's CIFAR CNN, VGG,
# ResNet, the MNIST and HYDRA-FL CNNs), in_channels x window (HAR), seq_len symbol indices (the LSTM), or
# in_features values; each BlockModel states the same shape as its ``input_shape``.
_IMAGE = ModelInput(("in_channels", "image_size", "image_size"))


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

@register_model("cifar_cnn", takes=_IMAGE)
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


@register_model("char_lstm", takes=ModelInput(("seq_len",), "int64"))
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


@register_model("vgg11_bn", takes=_IMAGE)
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


@register_model("resnet18_cifar", takes=_IMAGE)
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

@register_model("har_cnn", takes=ModelInput(("in_channels", "window")))
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


@register_model("mlp_bn", takes=ModelInput(("in_features",)))
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

@register_model("mnist_mlp", takes=ModelInput(("in_channels", "image_size", "image_size"), flat=True))
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


@register_model("mnist_cnn", takes=_IMAGE)
def mnist_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
              channels: Sequence[int] = (16, 32), hidden: int = 128) -> BlockModel:
    """Small CNN: conv 1->16 5x5 pad 2, ReLU, pool; conv 16->32 5x5 pad 2, ReLU, pool; fc 1568->128, ReLU; fc 128->C."""
    return _mnist_cnn(num_classes, in_channels, image_size, channels, hidden, bn=False)


@register_model("mnist_cnn_bn", takes=_IMAGE)
def mnist_cnn_bn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
                 channels: Sequence[int] = (16, 32), hidden: int = 128) -> BlockModel:
    """:func:`mnist_cnn` with BatchNorm after each conv (bias-free convs), for DistFL on MNIST."""
    return _mnist_cnn(num_classes, in_channels, image_size, channels, hidden, bn=True)


# ---- HYDRA-FL (FedNTD, MOON) ----

@dataclass(frozen=True)
class KDOutputs:
    """What :meth:`HydraModel.kd_forward` computes in one pass.

    - ``logits``: the model's output, the same tensor ``forward`` would compute (the same operations).
    - ``representation``: the input of the last block (MOON's projection output z, FedNTD's penultimate features).
    - ``head_logits[i]`` / ``head_hidden[i]``: auxiliary head i's logits and its hidden representation (the output
      of its hidden part, HYDRA-FL Eq. 10's z_aux), for the heads asked for.
    """

    logits: torch.Tensor
    representation: torch.Tensor
    head_logits: dict[int, torch.Tensor]
    head_hidden: dict[int, torch.Tensor]


def aux_head(in_features: int, hidden: int, num_classes: int) -> nn.Sequential:
    """A HYDRA-FL auxiliary (shallow) classifier: ``Sequential(hidden part, classifier)`` with hidden part =
    Flatten → Linear(in_features, hidden) → ReLU and classifier = Linear(hidden, num_classes) (HYDRA-FL §4.2)."""
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU()),
                         nn.Linear(hidden, num_classes))


class HydraModel(BlockModel):
    """A :class:`BlockModel` with auxiliary shallow classifiers (HYDRA-FL §4, Fig. 4).

    ``forward(x)`` is the block model's (the logits only; the heads are not used), so every other part of the
    framework treats it as the plain model. ``heads[i]`` (an ``nn.ModuleList`` of :func:`aux_head`) reads the
    output of block ``head_after[i]``; the heads' parameters are ordinary parameters (in ``state_dict``), so they
    are uploaded and aggregated like the rest. :meth:`kd_forward` runs the blocks once and also returns the
    representation fed to the last block and the heads' outputs. ``representation_size`` is the width of that
    representation. A block that follows a head's input block must not modify its input in place (none here does).
    """

    def __init__(self, blocks: Sequence[nn.Module], input_shape: tuple[int, ...], representation_size: int,
                 heads: Sequence[nn.Sequential] = (), head_after: Sequence[int] = (),
                 input_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(blocks, input_shape, input_dtype)
        if len(heads) != len(head_after):
            raise ValueError(f"HydraModel: {len(heads)} heads but {len(head_after)} head_after positions")
        for head in heads:
            if not (isinstance(head, nn.Sequential) and len(head) == 2 and isinstance(head[1], nn.Linear)):
                raise ValueError("HydraModel: a head must be Sequential(hidden part, nn.Linear classifier) "
                                 "(fedcore.models.zoo.aux_head)")
        for i in head_after:
            if not 0 <= int(i) < len(blocks) - 1:
                raise ValueError(f"HydraModel: head_after {i} must be a block index in [0, {len(blocks) - 1})")
        self.heads = nn.ModuleList(heads)
        self.head_after: tuple[int, ...] = tuple(int(i) for i in head_after)
        self.representation_size = int(representation_size)

    def head(self, i: int) -> tuple[nn.Module, nn.Linear]:
        """Head ``i``'s hidden part and classifier."""
        head = self.heads[i]
        assert isinstance(head, nn.Sequential)  # checked by __init__
        hidden, classifier = head[0], head[1]
        assert isinstance(classifier, nn.Linear)
        return hidden, classifier

    def head_hidden_size(self, i: int) -> int:
        """The width of head ``i``'s hidden representation (its classifier's input)."""
        return int(self.head(i)[1].in_features)

    def kd_forward(self, x: torch.Tensor, heads: Sequence[int] | None = None) -> KDOutputs:
        """Logits, representation and the outputs of the heads ``heads`` (default: all; ``()``: none) in one pass.

        The blocks run exactly as in ``forward`` (same operations in the same order), so ``logits`` are
        bit-identical to ``forward(x)``'s; each head is applied to its block's output as soon as it exists."""
        wanted = range(len(self.heads)) if heads is None else heads
        after: dict[int, list[int]] = {}
        for h in wanted:
            if not 0 <= h < len(self.heads):
                raise IndexError(f"kd_forward: head {h} does not exist (the model has {len(self.heads)})")
            after.setdefault(self.head_after[h], []).append(h)
        head_logits: dict[int, torch.Tensor] = {}
        head_hidden: dict[int, torch.Tensor] = {}
        last = len(self.blocks) - 1
        representation = x
        for i, block in enumerate(self.blocks):
            if i == last:
                representation = x
            x = block(x)
            for h in after.get(i, ()):
                hidden_part, classifier = self.head(h)
                hidden = hidden_part(x)
                head_hidden[h] = hidden
                head_logits[h] = classifier(hidden)
        return KDOutputs(x, representation, head_logits, head_hidden)


def _flat_size(model_blocks: Sequence[nn.Module], input_shape: tuple[int, ...], upto: int) -> int:
    """The flattened size of block ``upto``'s output for one input of ``input_shape`` (shape inference on a zero
    batch of 1, without gradient; the blocks hold no state a forward pass changes: no BatchNorm here)."""
    with torch.no_grad():
        h = torch.zeros((1, *input_shape))
        for block in list(model_blocks)[: upto + 1]:
            h = block(h)
    return int(h[0].numel())


def _hydra(blocks: list[nn.Module], input_shape: tuple[int, ...], representation_size: int, heads: bool,
           head_after: Sequence[int], hidden: int, num_classes: int) -> HydraModel:
    aux = [aux_head(_flat_size(blocks, input_shape, i), hidden, num_classes) for i in head_after] if heads else []
    return HydraModel(blocks, input_shape, representation_size, aux, tuple(head_after) if heads else ())


def _check_two_pools(name: str, image_size: int, k: int, padding: int) -> int:
    side = _conv_out(_conv_out(image_size, k, padding) // 2, k, padding) // 2
    if side < 1:
        raise ValueError(f"{name}: image_size {image_size} is too small for two {k}x{k} conv + pool stages")
    return side


def _ntd_cnn(num_classes: int, in_channels: int, image_size: int, heads: bool) -> HydraModel:
    side = _check_two_pools("hydra_ntd_cnn", image_size, 5, 2)
    blocks: list[nn.Module] = [
        _conv_block(in_channels, 32, 5, pool=True, bn=False, padding=2),
        _conv_block(32, 64, 5, pool=True, bn=False, padding=2),
        _linear_block(64 * side * side, 512, flatten=True),
        nn.Linear(512, num_classes),
    ]
    return _hydra(blocks, (in_channels, image_size, image_size), 512, heads, (0, 1), 512, num_classes)


@register_model("hydra_ntd_cnn", takes=_IMAGE)
def hydra_ntd_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, heads: bool = True) -> HydraModel:
    """FedNTD's CNN (McMahan et al.'s MNIST CNN; HYDRA-FL §4.2, App. D) with HYDRA-FL's shallow heads.

    Blocks: conv in→32 5x5 pad 2, ReLU, max-pool 2; conv 32→64 5x5 pad 2, ReLU, max-pool 2; flatten, fc →512,
    ReLU; fc 512→C. Representation (input of the last block): the 512 penultimate features. With ``heads`` one
    auxiliary classifier after each conv block (``head_after = (0, 1)``): flatten → fc 512 → ReLU → fc C.

    Parameters (C = 10): MNIST 1x28x28: 1,663,370 without heads, 6,491,550 with heads (head 0: 3,216,906,
    head 1: 1,611,274); CIFAR 3x32x32: 2,156,490 without, 8,459,230 with (head 0: 4,199,946, head 1: 2,102,794).
    """
    return _ntd_cnn(num_classes, in_channels, image_size, heads)


@register_model("fedntd_cnn", takes=_IMAGE)
def fedntd_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> HydraModel:
    """FedNTD's plain CNN: :func:`hydra_ntd_cnn` without heads (MNIST 1,663,370, CIFAR 2,156,490 parameters)."""
    return _ntd_cnn(num_classes, in_channels, image_size, heads=False)


@register_model("moon_cnn", takes=_IMAGE)
def moon_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, heads: bool = True,
             projection_size: int = 256) -> HydraModel:
    """MOON's CNN (MOON's CIFAR-10 base encoder + projection head; HYDRA-FL App. D) with HYDRA-FL's shallow heads.

    Blocks: conv in→6 5x5, ReLU, max-pool 2; conv 6→16 5x5, ReLU, max-pool 2; flatten, fc →120, ReLU; fc 120→84,
    ReLU; projection fc 84→84, ReLU, fc 84→256 (one block); classifier fc 256→C. Representation: the projection
    output z (256). With ``heads`` (HYDRA-MOON, §4.2) one auxiliary classifier after each conv block: flatten → fc
    256 → ReLU → fc C, whose hidden representation (256 = the projection size) is the shallow contrastive anchor.
    ``heads=False`` gives the plain MOON CNN.

    Defaults: MNIST 1x28x28 (HYDRA-FL's MOON experiments, App. D; MOON's CIFAR-10 model: ``in_channels=3,
    image_size=32``). Parameters (C = 10): MNIST 75,046 without heads, 367,418 with heads (head 0: 224,010,
    head 1: 68,362); CIFAR 3x32x32: 92,626 without, 501,734 with (head 0: 303,882, head 1: 105,226).
    """
    side = _check_two_pools("moon_cnn", image_size, 5, 0)
    blocks: list[nn.Module] = [
        _conv_block(in_channels, 6, 5, pool=True, bn=False),
        _conv_block(6, 16, 5, pool=True, bn=False),
        _linear_block(16 * side * side, 120, flatten=True),
        _linear_block(120, 84),
        nn.Sequential(nn.Linear(84, 84), nn.ReLU(inplace=True), nn.Linear(84, projection_size)),
        nn.Linear(projection_size, num_classes),
    ]
    return _hydra(blocks, (in_channels, image_size, image_size), projection_size, heads, (0, 1), projection_size,
                  num_classes)
