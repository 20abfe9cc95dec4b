"""Networks as users write them (custom modules and forwards, no named-block Sequential, no `tp_plan`, no
`init_weights`), for the automatic tensor plan, and a fit of one of them with a recorded loss trajectory.

Sizes fit the synthetic 3 x 32 x 32 images with 4 classes that `common.fit_model` trains on.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.callbacks import RunSummary
from lightning_parallel.data import SyntheticImagesDataModule
from lightning_parallel.tasks import ClassificationTask


class TutorialCNN(nn.Module):
    """The PyTorch "Training a classifier" tutorial network, verbatim but for 4 classes: one pool used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)  # flatten all dimensions except batch
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class TutorialCNNView(TutorialCNN):
    """The older tutorial's flatten, `x.view(x.size(0), -1)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class VGGish(nn.Module):
    """A VGG-style stack: (conv-bn-relu) x 2, pool, (conv-bn-relu) x 2, pool, flatten, linear."""

    def __init__(self, width: int = 8, num_classes: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width)
        self.conv4, self.bn4 = nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width)
        self.classifier = nn.Linear(2 * width * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (B, w, 16, 16)
        x = F.relu(self.bn3(self.conv3(x)))
        x = F.max_pool2d(F.relu(self.bn4(self.conv4(x))), 2)  # (B, 2w, 8, 8)
        return self.classifier(x.reshape(x.shape[0], -1))  # (B, 2w * 64)


class SimpleDenseNet(nn.Module):
    """lightning-hydra-template's `SimpleDenseNet`, as that template writes it (input size for 3 x 32 x 32)."""

    def __init__(
        self, input_size: int = 3 * 32 * 32, lin1_size: int = 32, lin2_size: int = 32, lin3_size: int = 16
    ) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, lin3_size),
            nn.BatchNorm1d(lin3_size),
            nn.ReLU(),
            nn.Linear(lin3_size, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()
        # (batch, 1, width, height) -> (batch, 1*width*height)
        x = x.view(batch_size, -1)
        return self.model(x)


NETWORKS: dict[str, type[nn.Module]] = {
    "tutorial_cnn": TutorialCNN,
    "tutorial_cnn_view": TutorialCNNView,
    "vgg": VGGish,
    "simple_dense_net": SimpleDenseNet,
}


def fit_user_network(
    strategy: Any, *, network: str, devices: int, global_batch: int, steps: int, seed: int = 0
) -> tuple[ClassificationTask, list[float]]:
    """Fit `NETWORKS[network]` with SGD on synthetic images; returns the task and the per-step training losses."""
    pl.seed_everything(seed, verbose=False)
    data = SyntheticImagesDataModule(
        num_samples=global_batch * steps * 2, channels=3, image_size=32, num_classes=4, batch_size=global_batch
    )
    recorder = RunSummary()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    with trainer.init_module():
        model = NETWORKS[network]()
    task = ClassificationTask(model, num_classes=4, optimizer=partial(torch.optim.SGD, lr=0.02, momentum=0.9))
    trainer.fit(task, datamodule=data)
    return task, recorder.history["train/loss"]
