"""A callback that makes one rank fail on purpose: raise, or hang while alive."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class FailAt(pl.Callback):
    def __init__(self, *, rank: int, step: int, mode: str) -> None:
        self.rank, self.step, self.mode = rank, step, mode

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        Path("failed_at").write_text(str(time.time()))  # in the working directory: how long the rest took
        if self.mode == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if self.mode == "kill":  # dies without a word, as under the OOM killer
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # alive but stuck: its peers wait in a collective until the timeout
