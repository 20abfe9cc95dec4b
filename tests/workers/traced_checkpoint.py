"""Worker: fit the tutorial CNN (a custom forward, split by tracing) under the pipeline strategy, saving a
sharded checkpoint every 6 steps, optionally resuming from one. Payload: {"steps", "resume_from", "save_dir"}."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import payload
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parents[1]))
from user_modules import Loss, build, loader  # noqa: E402

import lightning_parallel  # noqa: E402, F401 - registers the strategies


def fit(devices: int, steps: int, strategy: str, save_dir: str | None, resume_from: str | None) -> tuple:
    pl.seed_everything(0, verbose=False)
    module, losses = build("tutorial_cnn", "criterion"), Loss()
    callbacks: list[pl.Callback] = [losses]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{step}", save_top_k=-1, every_n_train_steps=6))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader(shuffle=False), ckpt_path=resume_from)
    return module, losses.losses, trainer


if __name__ == "__main__":
    config, out = payload()
    module, losses, trainer = fit(
        config["devices"], config["steps"], "pipeline", config["save_dir"], config["resume_from"]
    )
    state = {name: p.detach().clone() for name, p in module.named_parameters()}
    result = {"losses": losses, "state": state, "step": trainer.global_step}
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
