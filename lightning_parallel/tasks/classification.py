"""Image classification: cross-entropy loss and torchmetrics accuracy. No parallelism here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from lightning_parallel.tasks.base import OptimizerFactory, SchedulerFactory, Task


class ClassificationTask(Task):
    """Classifies `(x, y)` batches of images; logs `train/loss`, `val/loss`, `val/acc`.

    Args:
        model: a network mapping (B, C, H, W) images to (B, num_classes) logits.
        num_classes: number of classes, for the accuracy metric.
        optimizer: partial optimizer (Hydra `_partial_: true`).
        scheduler: optional partial LR scheduler.
        model_config: how to build the network (see `Task`).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        num_classes: int,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        model_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.num_classes = num_classes
        super().__init__(model, optimizer=optimizer, scheduler=scheduler, model_config=model_config)

    def make_metrics(self) -> dict[str, Metric]:
        return {"acc": MulticlassAccuracy(num_classes=self.num_classes, average="micro")}

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)
