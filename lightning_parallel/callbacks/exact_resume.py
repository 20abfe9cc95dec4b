"""A callback that makes a second resume exact under any strategy (`seams.finish_restored_epoch` says why)."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_parallel.seams import finish_restored_epoch


class ExactResume(pl.Callback):
    """Lightning 2.6.6 miscounts the epoch after a resume from an epoch-end checkpoint; this counts it again, so
    the checkpoints of a resumed run resume exactly too. train.py adds it to every run; the strategies of this
    package apply the same fix themselves."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        finish_restored_epoch(trainer)
