"""Worker: fit a tiny GPT under a pipeline or tensor-parallel strategy, optionally resuming from a checkpoint.

Payload: {"strategy": "pipeline" | "tensor" | "pipeline_x_tensor", "size", "steps", "resume_from" (or null),
"save_dir"}.
Lightning's ModelCheckpoint saves `step=<N>.ckpt` every 10 training steps (two epochs).
Measured on Lightning 2.6.6 with a single process:
a checkpoint saved by `every_n_epochs` or by `trainer.save_checkpoint` after `fit` resumes one batch
into a stale epoch and skips batches, while `every_n_train_steps` resumes exactly.
"""

from __future__ import annotations

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
# 6 blocks for up to 4 pipeline stages; 4 heads (and widths divisible by 4) for up to 4 tensor ranks.
GPT_CONFIG = {"vocab_size": 16, "context_length": 8, "depth": 4, "width": 16, "heads": 4}


def make_strategy(kind: str, size: int) -> object:
    """`size` processes: pipeline stages, tensor ranks, or pipeline x tensor with two tensor ranks per stage."""
    if kind == "pipeline":
        return PipelineParallelStrategy(schedule="1f1b", microbatches=2 * size, timeout=60)
    if kind == "pipeline_x_tensor":
        return PipelineParallelStrategy(schedule="1f1b", microbatches=4, tensor_parallel_size=2, timeout=60)
    return TensorParallelStrategy(tensor_parallel_size=size, timeout=60)


def build(
    devices: int, steps: int, strategy: object, save_dir: str | None = None
) -> tuple[pl.Trainer, LanguageModelTask, pl.LightningDataModule, RunSummary]:
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=SAMPLES, batch_size=GLOBAL_BATCH, seed=0)
    recorder = RunSummary()
    callbacks: list[pl.Callback] = [recorder]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{step}", save_top_k=-1, every_n_train_steps=10))
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
    strategy = make_strategy(config["strategy"], config["size"])
    trainer, task, data, recorder = build(config["size"], config["steps"], strategy, config["save_dir"])
    trainer.fit(task, datamodule=data, ckpt_path=config["resume_from"])
    state = full_state(task.model)  # whole tensors: DTensors gathered; a pipeline rank's own stages
    result = {"losses": recorder.history["train/loss"], "state": state, "step": trainer.global_step}
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")
    # Leave together and tear down cleanly: gloo aborts ranks still connected at exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
