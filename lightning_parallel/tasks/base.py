"""The step logic shared by every task: model call, named loss method, logging, optimizer wiring.

Strategy-agnostic on purpose: no parallelism here, and nothing a strategy needs beyond an ordinary
LightningModule (the network in one attribute, `training_step` returning a loss computed from its output).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import Metric, MetricCollection

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


class Task(pl.LightningModule, ABC):
    """A LightningModule around a single-device network.

    Subclasses set `loss_fn` and `make_metrics`. Batches are `(x, y)` tuples.

    Args:
        model: the network, an ordered container of named blocks.
        optimizer: a partial optimizer taking the parameters (Hydra `_partial_: true`).
        scheduler: an optional partial LR scheduler taking the optimizer; stepped every optimizer step.
    """

    def __init__(
        self, model: nn.Module, *, optimizer: OptimizerFactory, scheduler: SchedulerFactory | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.val_metrics = MetricCollection(self.make_metrics(), prefix="val/")
        self.test_metrics = MetricCollection(self.make_metrics(), prefix="test/")

    @abstractmethod
    def make_metrics(self) -> dict[str, Metric]:
        """The evaluation metrics, built once each for validation and test."""

    @abstractmethod
    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of one (micro-)batch; a pipeline strategy calls it on the last stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        # sync_dist: every rank logs the global-batch loss, so progress bar and monitors agree.
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=len(x))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_metrics)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_metrics)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str, metrics: MetricCollection) -> None:
        x, y = batch
        output = self(x)
        loss = self.loss_fn(output, y)
        metrics.update(*self.metric_inputs(output, y))
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=len(x))
        self.log_dict(metrics, prog_bar=stage == "val", batch_size=len(x))

    def metric_inputs(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """How model output and target feed the metrics; tasks reshape here."""
        return output, target

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
