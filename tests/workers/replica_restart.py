"""Callbacks for replica groups restarted by torchrun (tests/test_replica_groups.py): every rank of every group starting
its first step together, a group that holds after a step until a file exists, a restarted attempt that writes that
file once it is training, and each rank's final weights.
They change nothing in training; they only tell the test when the restart comes and what each rank ended with.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


class StartTogether(pl.Callback):
    """In torchrun's first attempt, wait (up to 300 s) at train start until `ranks` ranks in all have reached it: a
    group that trained alone up to its hold would keep the other from forming a quorum (it stays healthy)."""

    def __init__(self, *, directory: str, ranks: int, name: str) -> None:
        self.directory, self.ranks, self.name = Path(directory), ranks, name

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
            return
        (self.directory / f"ready-{self.name}-{trainer.global_rank}").write_text("")
        deadline = time.monotonic() + 300
        while len(list(self.directory.glob("ready-*"))) < self.ranks and time.monotonic() < deadline:
            time.sleep(0.05)


class HoldAt(pl.Callback):
    """After step `step`, wait (up to 120 s) until `file` exists: the other group's restart comes mid-run."""

    def __init__(self, *, step: int, file: str) -> None:
        self.step, self.file = step, Path(file)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + 120
        while not self.file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class AnnounceAt(pl.Callback):
    """In torchrun attempt `attempt`, write `file` `delay` seconds after its first step began, its first quorum asked
    for by then. The lighthouse keeps that quorum waiting while the other group, healthy, holds (no split brain), and
    the other group's next quorum, asked for once it sees the file, takes both; had it asked first, it would go on
    alone (the lighthouse's fast quorum: every group of its last quorum is there) and the restart could miss it."""

    def __init__(self, *, attempt: int, file: str, delay: float = 2.0) -> None:
        self.attempt, self.file, self.delay = attempt, Path(file), delay
        self.announced = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.announced or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != self.attempt:
            return
        self.announced = True
        threading.Timer(self.delay, self.file.write_text, args=("started",)).start()


class SaveWeights(pl.Callback):
    """At the end of fitting: `<directory>/rank<r>.pt`, this rank's parameters and the step count."""

    def __init__(self, *, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {name: p.detach().cpu().clone() for name, p in pl_module.named_parameters()}
        record = {"state": state, "step": trainer.global_step, "epoch": trainer.current_epoch}
        torch.save(record, self.directory / f"rank{trainer.global_rank}.pt")
