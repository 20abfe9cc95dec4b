"""ResNet-18/34/50/101/152 (v1.5: stride on the 3x3 conv) as a flat sequence of residual blocks.

Single-device only: no parallelism here. Blocks are flattened so a pipeline can split between any two.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.weights import init_by_name, init_default

# depth -> (block type, blocks per stage)
_LAYOUTS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    # A 1x1 projection matches both the channel count and the spatial size of the residual branch.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34).

    Args:
        in_channels: Input channels.
        channels: Output channels (``expansion`` is 1).
        stride: Stride of the first convolution and of the shortcut.
    """

    expansion = 1

    def __init__(self, *, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a residual connection (ResNet-50/101/152).

    Args:
        in_channels: Input channels.
        channels: Width of the inner 3x3 convolution; the output has ``4 * channels``.
        stride: Stride of the 3x3 convolution and of the shortcut (v1.5 placement).
    """

    expansion = 4

    def __init__(self, *, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Sequential):
    """A ResNet whose residual blocks are direct children, named ``layer{stage}_{index}``.

    Children, in order: ``stem``, ``layer1_0`` ... ``layer4_{n-1}``, ``head``. With ``in_channels=3`` and
    ``num_classes=1000`` the parameter counts equal torchvision's (e.g. 25,557,032 for depth 50).

    Args:
        depth: One of 18, 34, 50, 101, 152.
        in_channels: Channels of the input images.
        num_classes: Number of output logits.
    """

    input_kind = "image"
    # Tensor-parallel plan (module-name pattern -> style name, applied by a strategy): in every residual block conv1
    # is split by output channels, bn1 runs on those channel shards, conv2 is split by input channels (one
    # all-reduce per block). Stem, the rest of each block, shortcuts and head stay whole.
    tp_plan = {"layer*.conv1": "conv_colwise", "layer*.bn1": "batchnorm_sharded", "layer*.conv2": "conv_rowwise"}

    def __init__(self, *, depth: int, in_channels: int = 3, num_classes: int = 1000) -> None:
        if depth not in _LAYOUTS:
            raise ValueError(f"ResNet depth {depth} is not supported. HINT: use one of {sorted(_LAYOUTS)}.")
        if in_channels < 1 or num_classes < 1:
            raise ValueError(
                f"ResNet needs in_channels >= 1 and num_classes >= 1, got in_channels={in_channels}, "
                f"num_classes={num_classes}. HINT: check the data module's image and label shapes."
            )
        kind, counts = _LAYOUTS[depth]
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock if kind == "basic" else Bottleneck
        super().__init__()
        self.add_module(
            "stem",
            nn.Sequential(
                nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            ),
        )
        channels_in = 64
        for stage, (count, width) in enumerate(zip(counts, (64, 128, 256, 512), strict=True), start=1):
            for index in range(count):
                # Only the first block of stages 2-4 downsamples.
                stride = 2 if stage > 1 and index == 0 else 1
                self.add_module(f"layer{stage}_{index}", block(in_channels=channels_in, channels=width, stride=stride))
                channels_in = width * block.expansion
        # (B, C, H, W) -> (B, C, 1, 1) -> (B, C) -> (B, num_classes)
        self.add_module(
            "head",
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels_in, num_classes)),
        )
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter and BatchNorm statistic, keyed by name (see ``init_by_name``)."""
        init_by_name(self, _init_module)


def _init_module(module: nn.Module) -> None:
    # Kaiming fan_out for convs as in torchvision; BatchNorm (weight 1, bias 0, fresh stats) and Linear keep
    # PyTorch's defaults.
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    else:
        init_default(module)
