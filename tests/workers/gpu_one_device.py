"""Worker (one process, one CUDA device): fit the tiny GPT once per payload entry under a strategy given by registry
name, with bf16-mixed and torch's default AdamW (on CUDA tensors that is the foreach kernel); save each run's losses
and final weights, how far they moved, how many are DTensors, whether DDP wrapped the module and the strategy's own
summary (`describe()`), or the one line it stopped with.

Payload: [{"strategy": registry name, e.g. "auto", "tensor", "pipeline", "ddp" (this library's), "local_sgd", "diloco",
"async_sgd", "precision": Lightning's precision, "steps", "accelerator"? ("gpu"; "cpu" checks the worker itself)}].
"""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import torch
from common import TINY_GPT, full_state, payload
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import lightning_parallel  # noqa: F401 - registers the strategies
from lightning_parallel.callbacks import RunSummary
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.models import GPT
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.tasks import LanguageModelTask


class WrapperSeen(pl.Callback):
    """Whether DDP wrapped the module while training (Lightning unwraps it again at teardown)."""

    wrapped = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.wrapped |= isinstance(trainer.strategy.model, DistributedDataParallel)


def fit(config: dict) -> dict:
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=16 * config["steps"] * 2, batch_size=16)
    recorder, wrapper = RunSummary(), WrapperSeen()
    trainer = pl.Trainer(
        accelerator=config.get("accelerator", "gpu"),
        devices=1,
        strategy=DDPStrategy() if config["strategy"] == "ddp" else config["strategy"],  # "ddp" is Lightning's name
        precision=config["precision"],
        max_steps=config["steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, wrapper],
    )
    task = LanguageModelTask(GPT(**TINY_GPT), optimizer=partial(torch.optim.AdamW, lr=1e-2))
    start = full_state(task.model)
    try:
        trainer.fit(task, datamodule=data)
    except Exception as error:  # the one line a user would read
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    end = full_state(task.model)
    moved = max((end[name].float().cpu() - start[name].float().cpu()).abs().max().item() for name in start)
    dtensors = sum(isinstance(p, DTensor) for p in task.model.parameters())
    describe = getattr(trainer.strategy, "describe", dict)()
    return {
        "losses": recorder.history["train/loss"],
        "state": end,
        "moved": moved,
        "dtensors": dtensors,
        "ddp_wrapped": wrapper.wrapped,
        "parallel": describe,
    }


configs, out = payload()
results = [fit(config) for config in configs]
torch.save(results, out / "rank0.pt")
