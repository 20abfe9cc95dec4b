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
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.callbacks import ExactResume, RunSummary
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.models import GPT
from lightning_parallel.strategies.tensor import TensorParallelStrategy
from lightning_parallel.tasks import LanguageModelTask

torch.set_num_threads(1)

# Six blocks: enough for 4 pipeline ranks with 2 stages each (plus the embedding and head).
TINY_GPT = {"vocab_size": 16, "context_length": 8, "depth": 6, "width": 16, "heads": 2}


def payload() -> tuple[Any, Path]:
    out = Path(sys.argv[1])
    return json.loads((out / "payload.json").read_text()), out


def local_state(task: LanguageModelTask) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in task.model.named_parameters()}


def fit_model(
    strategy: Any,
    *,
    model: str,
    devices: int,
    global_batch: int,
    replicas: int,
    steps: int,
    seed: int = 0,
    task_class: type[pl.LightningModule] | None = None,
    val_batches: int = 0,
    optimizer: tuple[str, dict[str, Any]] | None = None,
    save: tuple[str, int] | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[pl.LightningModule, list[float], pl.Trainer]:
    """Fit a tiny "gpt" (4 heads, so TP=4 works), "gpt6" (TINY_GPT), "simple_cnn" or "resnet18" with SGD;
    returns task, per-step training losses, trainer.

    `task_class` replaces the default task class (LanguageModelTask / ClassificationTask), e.g. by a subclass.
    `optimizer` (a torch.optim class name and its arguments) replaces the default SGD.
    `val_batches` > 0 lets a later `trainer.validate(task, datamodule=trainer.datamodule)` run that many batches
    (an epoch is 2 x steps batches, so fit itself ends before its first validation).
    `save` (a directory, every n steps) writes `step=<n>.ckpt` checkpoints; `ckpt_path` resumes from one (exactly, also
    mid-epoch: `ExactResume`).
    """
    from lightning_parallel.data import SyntheticImagesDataModule
    from lightning_parallel.tasks import ClassificationTask

    pl.seed_everything(seed, verbose=False)
    samples = global_batch * steps * 2
    if model.startswith("gpt"):
        data: pl.LightningDataModule = SyntheticTokensDataModule(
            vocab_size=16, seq_len=8, num_samples=samples, batch_size=global_batch // replicas, seed=seed
        )
    else:
        data = SyntheticImagesDataModule(
            num_samples=samples,
            channels=3,
            image_size=32,
            num_classes=4,
            batch_size=global_batch // replicas,
            seed=seed,
        )
    recorder = RunSummary()
    callbacks: list[pl.Callback] = [recorder, ExactResume()]
    if save is not None:
        saving = ModelCheckpoint(dirpath=save[0], filename="{step}", save_top_k=-1, every_n_train_steps=save[1])
        callbacks.append(saving)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=val_batches,
        logger=False,
        enable_checkpointing=save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    # empty_init=True: the tensor strategy materialises one layer at a time (the pipeline builds on meta anyway)
    with trainer.init_module(empty_init=isinstance(strategy, TensorParallelStrategy) or None):
        network = tiny_network(model)
    chosen = partial(getattr(torch.optim, optimizer[0]), **optimizer[1]) if optimizer is not None else None
    if model.startswith("gpt"):
        task_class = task_class or LanguageModelTask
        task: pl.LightningModule = task_class(
            network, optimizer=chosen or partial(torch.optim.SGD, lr=0.5, momentum=0.9)
        )
    else:
        # ResNet-18 with BatchNorm at batch 8 is chaotic at ordinary rates: a 1e-7 relative nudge of the weights
        # grows to 1e-1 in the loss within 20 steps at lr 5e-4. At lr 1e-4 without momentum it stays near 1e-6.
        rate = {"resnet18": {"lr": 1e-4}}.get(model, {"lr": 0.02, "momentum": 0.9})
        task = (task_class or ClassificationTask)(
            network, num_classes=4, optimizer=chosen or partial(torch.optim.SGD, **rate)
        )
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    return task, recorder.history["train/loss"], trainer


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and floating-point buffers, DTensors gathered whole (a collective: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    tensors = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if b.is_floating_point())]
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for name, t in tensors}


def tiny_network(model: str) -> torch.nn.Module:
    """The networks `fit_model` trains; built after `pl.seed_everything(seed)` they hold its initial weights."""
    from lightning_parallel.models import ResNet, SimpleCNN

    if model == "gpt":
        return GPT(vocab_size=16, context_length=8, depth=2, width=16, heads=4)
    if model == "gpt6":
        return GPT(**TINY_GPT)
    if model == "simple_cnn":
        return SimpleCNN(in_channels=3, image_size=32, num_classes=4)
    return ResNet(depth=18, in_channels=3, num_classes=4)
