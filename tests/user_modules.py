"""LightningModules written the way users write them (the network in `self.model`, `self.criterion`, plain
DataLoaders, metrics in training_step), for the drop-in tests. Nothing here knows about our strategies.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

CLASSES = 10
SAMPLES = 96  # 1x8x8 images, digits-sized


def sequential_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )


class Classifier(pl.LightningModule):
    """A plain classifier; `step` picks how training_step computes its loss."""

    def __init__(self, net: nn.Module, step: str = "criterion", lr: float = 0.1) -> None:
        super().__init__()
        self.model = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.step = step
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step == "criterion":
            return self.criterion(self(x), y)
        if self.step == "functional_with_metrics":
            logits = self(x)
            loss = F.cross_entropy(logits, y)
            self.train_acc(logits.argmax(1), y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)
            return loss
        if self.step == "scaled":
            return 2 * self.criterion(self(x), y)
        if self.step == "l2":
            return self.criterion(self(x), y) + 0.05 * sum(p.pow(2).sum() for p in self.parameters())
        if self.step == "two_forwards":
            return self.criterion(self(x), y) + self.criterion(self(x.flip(0)), y.flip(0))
        raise ValueError(self.step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Loss(pl.Callback):
    """The loss each training step returned, as Lightning saw it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def loader(*, shuffle: bool, batch_size: int = 16, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 1, 8, 8, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def fit(module: pl.LightningModule, *, strategy: Any, devices: int, steps: int, shuffle: bool) -> dict[str, Any]:
    """Fit with the user's defaults (use_distributed_sampler=True); losses, logged metrics, local weights."""
    pl.seed_everything(0, verbose=False)
    losses = Loss()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(module, train_dataloaders=loader(shuffle=shuffle))
    # DTensors gathered whole (a collective, and every rank gets here)
    state = {name: _whole(p).detach().cpu().clone() for name, p in module.named_parameters()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"losses": losses.losses, "state": state, "metrics": metrics}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def build(net: str, step: str) -> Classifier:
    torch.manual_seed(0)
    networks = {"sequential_mlp": sequential_mlp, "tied_sequential": tied_sequential}
    return Classifier(networks[net](), step=step)


def tied_sequential() -> nn.Sequential:
    """Two blocks sharing one weight matrix, far enough apart to land on different pipeline stages."""
    first, second = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
    second.weight = first.weight
    return nn.Sequential(nn.Flatten(), first, nn.ReLU(), second, nn.Linear(64, CLASSES))
