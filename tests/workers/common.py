"""What the multi-process test workers share: a tiny GPT language-model task and a fit that records losses.

SGD, not Adam: the attention key bias has an exactly zero gradient (softmax ignores a per-row constant),
and Adam turns the float noise left there into full-size steps that differ between any two summation orders.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_parallel.callbacks import RunSummary
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.models import GPT
from lightning_parallel.tasks import LanguageModelTask

torch.set_num_threads(1)

TINY_GPT = {"vocab_size": 16, "context_length": 8, "depth": 6, "width": 16, "heads": 2}


def payload() -> tuple[Any, Path]:
    out = Path(sys.argv[1])
    return json.loads((out / "payload.json").read_text()), out


def fit_tiny_gpt(
    strategy: Any, *, devices: int, global_batch: int, replicas: int, steps: int, seed: int = 0, **trainer_kwargs: Any
) -> tuple[LanguageModelTask, list[float]]:
    """Fit the tiny GPT on the copy task; returns the task and the per-step training loss."""
    pl.seed_everything(seed, verbose=False)
    data = SyntheticTokensDataModule(
        vocab_size=16, seq_len=8, num_samples=global_batch * steps * 2, batch_size=global_batch // replicas, seed=seed
    )
    recorder = RunSummary()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    with trainer.init_module():
        model = GPT(**TINY_GPT)
    task = LanguageModelTask(model, optimizer=partial(torch.optim.SGD, lr=0.5, momentum=0.9))
    trainer.fit(task, datamodule=data)
    return task, recorder.history["train/loss"]


def local_state(task: LanguageModelTask) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in task.model.named_parameters()}
