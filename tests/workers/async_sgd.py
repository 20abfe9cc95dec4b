"""Asynchronous SGD scenarios on SimpleCNN over digits (one launch each, see tests/test_async_sgd.py):
"parity": one worker served by the parameter server against one plain process, and that served run resumed from its
mid-epoch step-7 checkpoint; "resume": a 2-worker run saved and resumed. SGD runs fused (the kernel CUDA users ask
for), on the server as on the workers."""

from __future__ import annotations

import copy
import os
import socket
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import payload
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_parallel.callbacks import ExactResume, RunSummary
from lightning_parallel.data import DigitsDataModule
from lightning_parallel.models import SimpleCNN
from lightning_parallel.strategies.async_sgd import AsyncSGDStrategy
from lightning_parallel.tasks import ClassificationTask

torch.set_num_threads(1)
WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read before Lightning's teardown removes it


def fresh_rendezvous() -> None:
    """End this process group so the next fit makes its own, on a port rank 0 found free: re-using the first one's
    port raced, under load, with that rendezvous store's teardown (the second fit's rendezvous failed ~1 run in 4)."""
    port = [0]
    if torch.distributed.get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = [probe.getsockname()[1]]
    torch.distributed.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


class ServedAlone(AsyncSGDStrategy):
    """The parameter server's path with one worker, which the strategy itself skips (it would change nothing): the
    one deterministic check of the exchange, the server's optimizer copy and its LR following."""

    @property
    def serves(self) -> bool:
        return True


class StartState(pl.Callback):
    """The weights, step and optimizer state a fit starts training from."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.strategy.optimizer_state(trainer.optimizers[0]))  # live tensors


def fit(
    strategy: Any, steps: int, *, ckpt_path: str | None = None, save: Path | None = None
) -> tuple[pl.Trainer, ClassificationTask, dict]:
    pl.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=32, seed=0)
    recorder, start = RunSummary(), StartState()
    callbacks: list[pl.Callback] = [recorder, start, ExactResume()]
    if save is not None:  # 44 batches an epoch: step 7 lies inside the first
        callbacks.append(ModelCheckpoint(dirpath=save, filename="{step}", save_top_k=-1, every_n_train_steps=7))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE if isinstance(strategy, AsyncSGDStrategy) else 1,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    task = ClassificationTask(
        SimpleCNN(**data.model_hints),
        num_classes=10,
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9, fused=True),
    )
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    return trainer, task, {"losses": recorder.history["train/loss"], "start": start}


def state(task: ClassificationTask) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in task.state_dict().items()}


def main() -> None:
    config, out = payload()
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {}
    if config["scenario"] == "parity":
        _, plain, plain_run = fit(SingleDeviceStrategy(device=torch.device("cpu")), 20)
        trainer, task, run = fit(ServedAlone(), 20, save=Path(out) / "served")
        _, resumed, resumed_run = fit(ServedAlone(), 20, ckpt_path=str(Path(out) / "served" / "step=7.ckpt"))
        result = {
            "plain_losses": plain_run["losses"],
            "async_losses": run["losses"],
            "plain": state(plain),
            "async": state(task),
            "describe": trainer.strategy.describe(),
            "resumed_losses": resumed_run["losses"],
            "resumed": state(resumed),
        }
    elif config["scenario"] == "resume":
        ckpt = Path(out) / "saved.ckpt"
        trainer, task, _ = fit(AsyncSGDStrategy(), 6)
        trainer.save_checkpoint(ckpt)
        result["saved_local"] = state(task)
        fresh_rendezvous()
        resumed, task, run = fit(AsyncSGDStrategy(), 8, ckpt_path=str(ckpt))
        start = run["start"]
        result.update(
            start_step=start.step,
            start_weights=start.weights,
            start_optimizer=start.optimizer,
            end_step=resumed.global_step,
            describe=resumed.strategy.describe(),
        )
    torch.save(result, Path(out) / f"rank{rank}.pt")
    # Leave together and tear down cleanly, like the other workers: gloo aborts ranks still connected at exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
