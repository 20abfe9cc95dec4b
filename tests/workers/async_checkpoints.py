"""Worker: fit checkpointing.py's tiny GPT on one dp x pp x tp layout with checkpoints written in the background
(`AsyncCheckpoints`), `step=<N>.ckpt` every `every` steps, the newest `keep` kept.

Payload: {"layout", "steps", "every", "keep", "save_dir", "resume_from" (or null), "sync_copy" (a path to save the
final state to once more after fit, now synchronously, or null), "block_at" (a step whose background write never
ends, for the kill test: the worker writes `<out>/blocked` once that write's shards are on disk, or null)}.
"""

from __future__ import annotations

import os
import sys
import threading
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
from checkpointing import GLOBAL_BATCH, GPT_CONFIG, SAMPLES, make_strategy, sizes
from common import full_state, payload
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from lightning_parallel.callbacks import AsyncCheckpoints, RunSummary
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.models import GPT
from lightning_parallel.tasks import LanguageModelTask


def block_write_of(step: int, out: Path) -> None:
    """The background write of `step=<step>.ckpt` writes its shards, says so, and never ends."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        written = original(self, plan, planner)
        if Path(str(self.path)).name == f"step={step}.ckpt.partial":
            written.wait()
            (out / "blocked").write_text(str(self.path))
            threading.Event().wait()  # until the test kills this process
        return written

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


def build(config: dict) -> tuple[pl.Trainer, LanguageModelTask, pl.LightningDataModule, RunSummary]:
    dp, pp, tp = sizes(config["layout"])
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(
        vocab_size=16, seq_len=8, num_samples=SAMPLES, batch_size=GLOBAL_BATCH // dp, seed=0
    )
    recorder = RunSummary()
    saving = ModelCheckpoint(
        dirpath=config["save_dir"],
        filename="{step}",
        monitor="step",
        mode="max",
        save_top_k=config["keep"],
        every_n_train_steps=config["every"],
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dp * pp * tp,
        strategy=make_strategy(config["layout"]),
        max_steps=config["steps"],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder, AsyncCheckpoints(), saving],
    )
    with trainer.init_module():
        model = GPT(**GPT_CONFIG)
    task = LanguageModelTask(model, optimizer=partial(torch.optim.SGD, lr=0.5, momentum=0.9))
    return trainer, task, data, recorder


if __name__ == "__main__":
    config, out = payload()
    if config.get("block_at") is not None:
        block_write_of(config["block_at"], out)
    trainer, task, data, recorder = build(config)
    trainer.fit(task, datamodule=data, ckpt_path=config["resume_from"])
    if config.get("sync_copy"):
        trainer.save_checkpoint(config["sync_copy"])  # AsyncCheckpoints gave the run's own plugin back: synchronous
    state = full_state(task.model)
    result = {"losses": recorder.history["train/loss"], "state": state, "step": trainer.global_step}
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
