"""A callback that makes a resumed fit continue exactly where its checkpoint was saved, under any strategy.

What Lightning 2.6.6 does not restore, it saves and restores: every rank's random number generators (torch, CUDA,
numpy, Python) and, for a checkpoint saved mid-epoch, the training data's position
(`lightning_seams.skip_training_batches`), with the generators as they were when the epoch's loader started, so a
shuffle that draws from them (a plain `shuffle=True` DataLoader) draws the same order again. It also counts the epoch
after a resume from an epoch's last batch (`lightning_seams.finish_restored_epoch`). It does not choose or write
checkpoints.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_parallel.callbacks.run_summary import gather_objects
from lightning_parallel.lightning_seams import finish_restored_epoch, skip_training_batches

try:
    import numpy as np
except ImportError:  # pragma: no cover - Lightning installs numpy
    np = None  # type: ignore[assignment]


def rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors, ints and tuples (what a `weights_only` load accepts)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
        words = torch.from_numpy(np.asarray(keys, dtype=np.int64))
        state["numpy"] = (kind, words, int(position), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and np is not None:
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))


class ExactResume(pl.Callback):
    """Resume exactly: generators and mid-epoch data position restored, epochs counted right. train.py adds it to
    every run; add it to your Trainer's callbacks for the same (`Trainer(callbacks=[ExactResume()])`).

    Each rank's generators are saved in every checkpoint (gathered to rank 0: a few KB per rank), twice: as they
    are at the save, and as they were when the epoch's data loader started."""

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._epoch_start: dict[str, Any] | None = None  # generators when this epoch's loader iterator was made
        self._first_epoch = True  # the fit's first epoch: its iterator is made before `on_train_epoch_start`
        self._continue: dict[str, Any] | None = None  # restored: the generators to train on from the saved batch

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        # Lightning warns that a mid-epoch resume of a plain DataLoader is unreliable; with this callback it is exact.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._continue is None:  # a fresh fit (a restored one was set in `load_state_dict`)
            self._epoch_start, self._first_epoch = rng_state(), True

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._first_epoch:
            self._first_epoch = False
        else:  # the fit loop makes this epoch's iterator right after this hook
            self._epoch_start = rng_state()

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not trainer.training:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress
        mine = {"now": rng_state(), "epoch_start": self._epoch_start or rng_state()}
        return {"ranks": gather_objects(mine), "mid_epoch": not progress.is_last_batch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        if trainer is None or not state_dict.get("ranks"):
            return
        ranks = state_dict["ranks"]
        mine = ranks[trainer.global_rank] if len(ranks) == trainer.world_size else ranks[0]  # another layout: rank 0's
        # Mid-epoch: the epoch's loader is made again from the epoch's generators; `on_train_start` then moves to the
        # saved batch and restores the generators of the save. Otherwise the next epoch starts from the save's.
        start = mine["epoch_start"] if state_dict["mid_epoch"] else mine["now"]
        set_rng_state(start)
        self._epoch_start, self._continue, self._first_epoch = start, mine["now"], True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        finish_restored_epoch(trainer)  # a second resume stays exact (lightning_seams says why)
        if self._continue is None:
            return
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if trainer.fit_loop.restarted_mid_epoch and batches > 0:
            skip_training_batches(trainer, batches)
            self._first_epoch = False  # the next `on_train_epoch_start` starts a new epoch
            set_rng_state(self._continue)  # (at an epoch's end they were restored in `load_state_dict`)
        self._continue = None
