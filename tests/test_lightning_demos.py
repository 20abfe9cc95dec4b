"""Clients nobody here wrote: Lightning's own demo modules, unmodified, under both strategies by registry name.
Each stops before any process is launched with one line that says what to change (the outcomes the README
lists); none trains silently wrong."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401 - registers the strategies


def tokens() -> DataLoader:
    data = torch.randint(0, 32, (32, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8)


CASES = {
    ("boring", "pipeline"): "Linear.forward calls no submodule exactly once",
    ("boring", "tensor_parallel"): "found nothing to shard in Linear",
    ("transformer", "pipeline"): "Transformer.forward branches on a tensor value at",
    ("transformer", "tensor_parallel"): "torch.fx cannot trace Transformer",
}


@pytest.mark.parametrize(("demo", "strategy"), list(CASES))
def test_lightning_demo_modules_stop_before_launch_with_one_line(demo: str, strategy: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False)
    with pytest.raises(ValueError, match="HINT") as raised:
        if demo == "boring":
            trainer.fit(BoringModel())  # its own train_dataloader hook
        else:
            trainer.fit(LightningTransformer(vocab_size=32), train_dataloaders=tokens())
    message = str(raised.value)
    assert CASES[(demo, strategy)] in message and "\n" not in message
    assert trainer.strategy.launcher is not None and not getattr(trainer.strategy.launcher, "procs", [])
