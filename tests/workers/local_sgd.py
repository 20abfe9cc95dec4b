"""Worker: fit the tiny GPT once per payload entry under ddp, local_sgd or diloco (2 replicas, plain or momentum
SGD), recording each step's parameter checksum on this rank; optionally checkpoint every 7 steps or resume.

Payload: [{"strategy": "ddp" | "local_sgd" | "diloco", "args": {...}, "steps", "momentum", "kernel"?, "save_dir",
"resume"}] ("kernel": SGD's {"foreach": true} or {"fused": true}).
(`args["outer_optimizer"]` is [lr, momentum, nesterov] for torch.optim.SGD). Saves a list of results per rank.
The test runs `fit({"strategy": "single", "devices": 1, ...})` in its own process: the one-process reference.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from common import local_state, payload, tiny_network
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import DiLoCoStrategy, LocalSGDStrategy
from lightning_parallel.callbacks import ExactResume, RunSummary
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.tasks import LanguageModelTask

GLOBAL_BATCH = 16
# int(178 * 0.9) = 160 training sequences = 10 global batches per epoch: the step-7 checkpoint lies inside an epoch
# (ExactResume moves the resumed epoch to its saved batch; Lightning alone would restart it at its first batch).
SAMPLES = 178


class Checksums(pl.Callback):
    """This rank's parameter sum (float64) after each optimizer step (after any averaging it made)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.sums.append(sum(p.detach().double().sum().item() for p in pl_module.parameters()))


def make_strategy(name: str, args: dict[str, Any]) -> pl.strategies.Strategy | str:
    if name == "single":
        return "auto"
    if name == "ddp":
        return DDPStrategy(timeout=60)
    if name == "local_sgd":
        return LocalSGDStrategy(**args, timeout=60)
    args = dict(args)
    if "outer_optimizer" in args:
        lr, momentum, nesterov = args["outer_optimizer"]
        args["outer_optimizer"] = partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=nesterov)
    return DiLoCoStrategy(**args, timeout=60)


def fit(config: dict[str, Any]) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    devices = config.get("devices", 2)
    data = SyntheticTokensDataModule(
        vocab_size=16, seq_len=8, num_samples=SAMPLES, batch_size=GLOBAL_BATCH // devices, seed=0
    )
    recorder, checksums = RunSummary(), Checksums()
    callbacks: list[pl.Callback] = [recorder, checksums, ExactResume()]
    if config.get("save_dir"):
        every = ModelCheckpoint(dirpath=config["save_dir"], filename="{step}", save_top_k=-1, every_n_train_steps=7)
        callbacks.append(every)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=make_strategy(config["strategy"], config.get("args", {})),
        max_steps=config["steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(config.get("save_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    with trainer.init_module():
        network = tiny_network("gpt")
    kernel = config.get("kernel", {})  # {"foreach": True} or {"fused": True}
    task = LanguageModelTask(network, optimizer=partial(torch.optim.SGD, lr=0.5, momentum=config["momentum"], **kernel))
    trainer.fit(task, datamodule=data, ckpt_path=config.get("resume"))
    return {"losses": recorder.history["train/loss"], "state": local_state(task), "sums": checksums.sums}


if __name__ == "__main__":
    configs, out = payload()
    results = [fit(config) for config in configs]
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
    # Leave together and tear down cleanly: gloo aborts ranks still connected at exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
