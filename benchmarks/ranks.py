"""The bare Lightning Trainer a timed strategy run uses (nothing but the strategy and its callbacks) and its data:
whole prepared batches, no collation. Launching ranks is harness.py's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


def bare_trainer(
    strategy: Any,
    devices: int,
    steps: int,
    callbacks: list[pl.Callback],
    *,
    accelerator: Any = "cpu",
    precision: str | None = None,
) -> pl.Trainer:
    """A Trainer that only trains: no logger, checkpoint, progress bar, summary or validation. All ranks read
    the same sequential batches (no distributed sampler): every rank here is one replica's part.
    `precision` None is Lightning's default (32-true)."""
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )


class BatchList(torch.utils.data.Dataset):
    """Item i is whole batch i % len(batches), for DataLoader(batch_size=None): no collation anywhere."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index % len(self.batches)]


def batch_loader(batches: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> torch.utils.data.DataLoader:
    """`length` steps over the prepared batches, in order, as a timed Lightning run consumes them."""
    return torch.utils.data.DataLoader(BatchList(batches, length), batch_size=None, shuffle=False)
