"""Models on the meta device and the hardware the planner's tests (test_planner, test_planner_memory) share."""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.models import GPT, ResNet, SimpleCNN
from lightning_parallel.planner import Hardware

H100 = Hardware(name="H100", memory="80GB", flops=989e12, dp_overlap=0.5)


def small_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=64, context_length=32, depth=4, width=64, heads=4)


def meta_models() -> dict[str, tuple[nn.Sequential, torch.Tensor]]:
    with torch.device("meta"):
        resnet = ResNet(depth=50, in_channels=3, num_classes=16)
        cnn = SimpleCNN(in_channels=1, image_size=8, num_classes=12)
    return {
        "gpt": (small_gpt(), torch.zeros(2, 32, dtype=torch.long)),
        "resnet50": (resnet, torch.zeros(2, 3, 32, 32)),
        "simple_cnn": (cnn, torch.zeros(2, 1, 8, 8)),
    }
