"""ExactResume: a fit resumed from a checkpoint saved anywhere (mid-epoch, at an epoch's last batch, and resumed again)
equals the uninterrupted fit exactly, for a module written the way users write one: a plain `shuffle=True`
DataLoader (its order drawn from the global RNG), dropout (the RNG again) and a per-step LR scheduler. Lightning
alone restarts the epoch's data and draws new random numbers. One process, a few hundred milliseconds per fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks import ExactResume

STEPS = 20  # 8 batches an epoch: 2.5 epochs


class DropoutModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        self.criterion = nn.MSELoss()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(40, 4, generator=generator), torch.randn(40, 1, generator=generator))
        return DataLoader(data, batch_size=5, shuffle=True)


def fit(steps: int, exact: bool, resume: Path | None = None, save: Path | None = None) -> tuple[list[float], Any]:
    pl.seed_everything(0, verbose=False)
    module = DropoutModule()
    callbacks: list[pl.Callback] = [ExactResume()] if exact else []
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, filename="{step}", save_top_k=-1, every_n_train_steps=1))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=save is not None, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=resume)
    return module.losses, torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("exact", [True, False], ids=["with ExactResume", "Lightning alone"])
def test_resumes_anywhere_equal_the_uninterrupted_fit(tmp_path: Path, exact: bool) -> None:
    straight, weights = fit(STEPS, exact)
    first, _ = fit(13, exact, save=tmp_path / "a")  # every step saved: 3 mid-epoch, 8 an epoch's last batch
    for step in (3, 8):
        rest, resumed = fit(STEPS, exact, resume=tmp_path / "a" / f"step={step}.ckpt")
        same = first[:step] + rest == pytest.approx(straight, abs=0) and torch.equal(resumed, weights)
        assert same == exact, (step, exact)
    second, _ = fit(16, exact, resume=tmp_path / "a" / "step=11.ckpt", save=tmp_path / "b")  # resumed mid-epoch
    third, resumed = fit(STEPS, exact, resume=tmp_path / "b" / "step=14.ckpt")  # and again from its checkpoint
    chained = first[:11] + second[:3] + third
    assert (chained == pytest.approx(straight, abs=0) and torch.equal(resumed, weights)) == exact
