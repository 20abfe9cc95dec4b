"""Two Lightning callbacks that `sync_vs_async.py` adds to its train.py runs (through `+callbacks.<name>._target_`
with this folder on PYTHONPATH): a deliberately slow worker, and rank 0's weights recorded over wall time.

Neither communicates between ranks, so neither adds a meeting that asynchronous training would not have.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


class Straggler(pl.Callback):
    """Makes one rank `slowdown` times slower: after its forward and backward (before the optimizer step, so an
    asynchronous worker's gradient grows stale while it waits) it sleeps (slowdown - 1) x as long as they took."""

    def __init__(self, *, rank: int = 1, slowdown: float = 2.0) -> None:
        if slowdown < 1:
            raise ValueError(f"Straggler(slowdown={slowdown}): a straggler is at least as slow as the others")
        self.rank, self.slowdown = rank, slowdown
        self._started = 0.0
        self.slept_s = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._started = time.perf_counter()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank != self.rank:
            return
        pause = (self.slowdown - 1) * (time.perf_counter() - self._started)
        time.sleep(pause)
        self.slept_s += pause


class Snapshots(pl.Callback):
    """Rank 0 keeps a copy of its network's weights at the start, after every `every`-th optimizer step counted from
    `offset` (put them right after a synchronisation: local SGD averages after steps 1, 1 + period, ...; DiLoCo after
    period, 2 x period, ...) and at the end of fit, each with rank 0's seconds since training started and its step;
    they are saved to `path` (one `torch.save` list) when fit ends, for evaluation outside the run."""

    def __init__(self, *, path: str, every: int, offset: int = 0) -> None:
        if every < 1:
            raise ValueError(f"Snapshots(every={every}) must be >= 1")
        self.path, self.every, self.offset = path, every, offset
        self.taken: list[dict[str, Any]] = []
        self._started = 0.0

    def _take(self, trainer: pl.Trainer, pl_module: pl.LightningModule, final: bool = False) -> None:
        network = getattr(pl_module, "model", pl_module)
        state = {name: tensor.detach().clone() for name, tensor in network.state_dict().items()}
        elapsed = time.perf_counter() - self._started
        self.taken.append({"step": trainer.global_step, "time_s": elapsed, "final": final, "state": state})

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()
        if trainer.is_global_zero:
            self._take(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step >= self.offset and (step - self.offset) % self.every == 0:
            self._take(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy's end of training: asynchronous SGD has loaded the server's final weights by now.
        if trainer.is_global_zero:
            self._take(trainer, pl_module, final=True)
            torch.save(self.taken, self.path)
