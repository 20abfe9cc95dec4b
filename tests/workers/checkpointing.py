"""Worker: fit a tiny GPT on one dp x pp x tp layout, optionally resuming from a checkpoint, saving every few steps.

Payload: {"layout": "<dp>x<pp>x<tp>" (e.g. "2x2x2"), "steps", "every", "resume_from" (or null), "save_dir"}.
Lightning's ModelCheckpoint saves `step=<N>.ckpt` every `every` training steps.
Measured on Lightning 2.6.6 with a single process:
a checkpoint saved by `every_n_epochs` or by `trainer.save_checkpoint` after `fit` resumes one batch
into a stale epoch and skips batches, and one saved inside an epoch restarts a plain DataLoader's epoch, while
`every_n_train_steps` at an epoch's last batch resumes exactly (a second resume too: the mesh strategies apply
`lightning_seams.finish_restored_epoch`).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import lightning.pytorch as pl
import torch
from common import full_state, payload
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy
from lightning_parallel.callbacks import RunSummary
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.models import GPT
from lightning_parallel.tasks import LanguageModelTask

GLOBAL_BATCH = 16
SAMPLES = 89  # int(89 * 0.9) = 80 training sequences = 5 batches of 16 per epoch
# 4 blocks for up to 4 pipeline stages; 4 heads (and widths divisible by 4) for up to 4 tensor ranks.
GPT_CONFIG = {"vocab_size": 16, "context_length": 8, "depth": 4, "width": 16, "heads": 4}


def sizes(layout: str) -> tuple[int, int, int]:
    """(dp, pp, tp) of a "<dp>x<pp>x<tp>" layout such as "2x2x2"."""
    dp, pp, tp = (int(size) for size in layout.split("x"))
    return dp, pp, tp


def make_strategy(layout: str) -> object:
    """Pipeline stages (tensor ranks inside, replicas derived) when pp > 1, else tensor ranks; 1x1x1 is the tensor
    strategy on one process (test_checkpoints says why not a plain Trainer)."""
    dp, pp, tp = sizes(layout)
    if pp > 1:
        return PipelineParallelStrategy(
            schedule="1f1b", microbatches=2 * pp, pipeline_parallel_size=pp, tensor_parallel_size=tp, timeout=60
        )
    return TensorParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, timeout=60)


def build(
    devices: int,
    steps: int,
    strategy: object,
    save_dir: str | None = None,
    *,
    replicas: int = 1,
    every: int = 5,
) -> tuple[pl.Trainer, LanguageModelTask, pl.LightningDataModule, RunSummary]:
    """`replicas` share the global batch, so every layout takes the same optimizer steps. Checkpoints every `every`
    steps: one epoch, see the module docstring."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(
        vocab_size=16, seq_len=8, num_samples=SAMPLES, batch_size=GLOBAL_BATCH // replicas, seed=0
    )
    recorder = RunSummary()
    callbacks: list[pl.Callback] = [recorder]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{step}", save_top_k=-1, every_n_train_steps=every))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    with trainer.init_module():
        model = GPT(**GPT_CONFIG)
    config = {"_target_": "lightning_parallel.models.GPT", **GPT_CONFIG}  # lets load_from_checkpoint rebuild it
    task = LanguageModelTask(model, optimizer=partial(torch.optim.SGD, lr=0.5, momentum=0.9), model_config=config)
    return trainer, task, data, recorder


if __name__ == "__main__":
    config, out = payload()
    dp, pp, tp = sizes(config["layout"])
    strategy = make_strategy(config["layout"])
    trainer, task, data, recorder = build(
        dp * pp * tp, config["steps"], strategy, config["save_dir"], replicas=dp, every=config["every"]
    )
    trainer.fit(task, datamodule=data, ckpt_path=config["resume_from"])
    state = full_state(task.model)  # whole tensors: DTensors gathered; a pipeline rank's own stages
    result = {"losses": recorder.history["train/loss"], "state": state, "step": trainer.global_step}
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")
    # Leave together and tear down cleanly: gloo aborts ranks still connected at exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Skip the interpreter's teardown of torch and Lightning (1.5 s of CPU a process; the chain launches 23).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
