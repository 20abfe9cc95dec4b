"""The step logic shared by every task: model call, named loss method, logging, optimizer wiring.

Strategy-agnostic on purpose: no parallelism here, and nothing a strategy needs beyond an ordinary
LightningModule (the network in one attribute, `training_step` returning a loss computed from its output).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import Metric, MetricCollection

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


def build_from_config(config: Mapping[str, Any]) -> nn.Module:
    """The network from a flat `{"_target_": "package.Class", **arguments}` (what train.py saves)."""
    arguments = dict(config)
    module_name, _, class_name = str(arguments.pop("_target_")).rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)(**arguments)


class Task(pl.LightningModule, ABC):
    """A LightningModule around a single-device network.

    Subclasses set `loss_fn` and `make_metrics`. Batches are `(x, y)` tuples.

    Args:
        model: the network, an ordered container of named blocks.
        optimizer: a partial optimizer taking the parameters (Hydra `_partial_: true`).
        scheduler: an optional partial LR scheduler taking the optimizer; stepped every optimizer step.
        model_config: how to build the network, `{"_target_": "package.Class", **arguments}`; saved as a
            hyperparameter, and used when `model` is not given (`load_from_checkpoint`).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        model_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # Saved with the checkpoint (the network, optimizer and scheduler are objects, not hyperparameters), so
        # `Task.load_from_checkpoint(file)` rebuilds the network from `model_config` alone.
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        if model is None:
            if model_config is None:
                raise ValueError(f"{type(self).__name__} needs a model, or a model_config to build it from")
            model = build_from_config(model_config)
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        # dict(): a copy typed as MetricCollection takes it (dict[str, Metric | MetricCollection]; dict is invariant)
        self.val_metrics = MetricCollection(dict(self.make_metrics()), prefix="val/")
        self.test_metrics = MetricCollection(dict(self.make_metrics()), prefix="test/")

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
        if self.optimizer_factory is None:
            raise ValueError(
                f"{type(self).__name__} was built without an optimizer (e.g. by load_from_checkpoint). HINT: pass "
                "optimizer=functools.partial(torch.optim.AdamW, lr=1e-3) to train it"
            )
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
