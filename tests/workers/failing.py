"""A callback that makes one rank fail on purpose: raise, hang while alive, die (SIGKILL) or stop (SIGSTOP).

`attempt` limits it to one torchrun attempt (TORCHELASTIC_RESTART_COUNT), so that the restarted job runs through;
`strategy` to fits of one strategy class, so that one multirun job can fail each strategy in a different attempt.
Its part of a checkpoint written in the background is done before it fails (rank 0 then swaps it in within ms).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class FailAt(pl.Callback):
    def __init__(
        self,
        *,
        rank: int,
        step: int,
        mode: str,
        attempt: int | None = None,
        strategy: str | None = None,
        enabled: bool = True,
    ) -> None:
        self.rank, self.step, self.mode, self.attempt, self.strategy = rank, step, mode, attempt, strategy
        self.enabled = enabled

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if not self.enabled or trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.attempt is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != self.attempt:
            return
        if self.strategy is not None and type(trainer.strategy).__name__ != self.strategy:
            return
        writes = getattr(trainer.strategy.checkpoint_io, "writes", None)  # AsyncCheckpointIO's background writes
        if writes is not None:  # the failure comes once the checkpoint before it is whole: a fixed step to resume from
            writes.wait()  # (a kill during a write resumes from the one before: tests/test_async_checkpoints.py)
        Path("failed_at").write_text(str(time.time()))  # in the working directory: how long the rest took
        if self.mode == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if self.mode == "kill":  # dies without a word, as under the OOM killer
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "stop":  # stops answering, as a frozen host would
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)  # alive but stuck: its peers wait in a collective until the timeout
