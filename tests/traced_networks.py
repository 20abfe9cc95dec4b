"""Small networks with their own forward for the traced pipeline split tests (test_traced_split.py): each a construct
the tracer must follow (skips, norms, dropout, tied weights) or refuse (a branch on data, Python numbers, strings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TutorialCNN(nn.Module):
    """The CIFAR tutorial network: a pool module called twice and a flatten that bakes in the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc = nn.Linear(16 * 5 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc(x.view(x.size(0), -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2, self.fc3 = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(F.gelu(self.fc1(F.relu(self.fc0(x)))))))


class Skip(nn.Module):
    """``h`` jumps from the first block over a whole stage; ``y`` leaves the network from a middle stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        y = self.c(torch.relu(self.b(h)))
        return self.d(y + h), y


class NormDrop(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.head(self.drop(x.flatten(1)))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + torch.arange(tokens.shape[1], device=tokens.device, dtype=torch.float32)[:, None]
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.head(x)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:
            x = x * 2
        return self.b(x)


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        scale = x.abs().max().item()
        return self.b(x) / scale


class Labelled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return self.b(self.a(x)), "logits"
