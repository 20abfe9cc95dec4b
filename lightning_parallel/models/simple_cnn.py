"""The two-conv network of the classic PyTorch CIFAR / multi-GPU tutorials, as named blocks.

Single-device only: no parallelism here; the flat child list is what a pipeline split cuts between.
"""

from __future__ import annotations

from torch import nn

from lightning_parallel.weights import init_by_name, init_default


class SimpleCNN(nn.Sequential):
    """Two 5x5 convolutions (6 and 16 channels) with pooling, then three linear layers.

    The convolutions use ``padding=2`` so the spatial size is kept and only the two 2x2 poolings shrink it;
    any ``image_size >= 4`` therefore works. The flatten size is computed here rather than with lazy
    modules so that the model can be built on the meta device.

    Children, in order: ``conv1``, ``conv2``, ``fc1``, ``fc2``, ``head``.

    Args:
        in_channels: Channels of the input images.
        image_size: Height and width of the (square) input images.
        num_classes: Number of output logits.
    """

    input_kind = "image"
    # Tensor-parallel plan (module-name pattern -> style name, applied by a strategy): conv1 split by output
    # channels and conv2 by input channels (one all-reduce); fc1 column- and fc2 row-parallel; the head stays whole.
    tp_plan = {"conv1.0": "conv_colwise", "conv2.0": "conv_rowwise", "fc1.1": "colwise", "fc2.0": "rowwise"}

    def __init__(self, *, in_channels: int, image_size: int, num_classes: int) -> None:
        if image_size < 4:
            raise ValueError(
                f"SimpleCNN needs image_size >= 4, got {image_size}: two 2x2 poolings would leave an "
                "empty feature map. HINT: resize or pad the inputs to at least 4x4."
            )
        if in_channels < 1 or num_classes < 1:
            raise ValueError(
                f"SimpleCNN needs in_channels >= 1 and num_classes >= 1, got in_channels={in_channels}, "
                f"num_classes={num_classes}. HINT: check the data module's image and label shapes."
            )
        # Each MaxPool2d(2) floors the size; padding=2 keeps the 5x5 convs size-preserving.
        side = image_size // 2 // 2
        flat = 16 * side * side
        super().__init__()
        self.add_module("conv1", _conv_block(in_channels, 6))
        self.add_module("conv2", _conv_block(6, 16))
        # (B, 16, side, side) -> (B, 16 * side * side)
        self.add_module("fc1", nn.Sequential(nn.Flatten(), nn.Linear(flat, 120), nn.ReLU()))
        self.add_module("fc2", nn.Sequential(nn.Linear(120, 84), nn.ReLU()))
        self.add_module("head", nn.Linear(84, num_classes))
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter with PyTorch's defaults, keyed by name (see ``init_by_name``)."""
        init_by_name(self, init_default)


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
