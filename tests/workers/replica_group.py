"""Worker: one replica group (one process) of a fault-tolerant run over torchft, or the single-process reference.

Training targets are padded (-100 past each row's own length). Each step is appended to `steps.jsonl` as it ends
(wall time, the group's step ledger, groups in the quorum, a parameter checksum, the loss), so the test watches the
run while it lives. At the end `result.pt` holds the weights.

Payload (`payload.json`): {"steps", "batch" (per group), "lighthouse", "replica_group", "replica_groups", "sync",
"period"?, "kill_at"? (this process SIGKILLs itself in that step: after its backward, before the exchange with
the other groups; with "kill_in": "exchange", inside the exchange, once its quorum has formed),
"start_together"? [directory, groups] (wait for every group's Manager before the first step), "hold_at"? [step, file]
(after that step, wait until the file exists), "announce"? (a file written at train start), "save_at"? (a step
after which the weights go to `state<step>.pt`)}
or {"reference": true, "steps", "batch", "save_at"?}.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import local_state, payload, tiny_network

from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.strategies.fault_tolerant import FaultTolerantStrategy
from lightning_parallel.tasks import LanguageModelTask

SAMPLES = 267  # int(267 * 0.9) = 240 training sequences: 20 batches of 12, so no shard is padded


def wait_for(condition: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.02)


class StepLog(pl.Callback):
    """One JSON line per training batch, written as it ends; and the test's kill, start and hold points."""

    def __init__(self, config: dict[str, Any], out: Path) -> None:
        self.config, self.out, self.file = config, out, (out / "steps.jsonl").open("a", buffering=1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "announce" in self.config:
            Path(self.config["announce"]).write_text("started")
        if "start_together" in self.config:  # every group's Manager heartbeats before anyone asks for a quorum
            directory, groups = Path(self.config["start_together"][0]), self.config["start_together"][1]
            (directory / f"ready{self.config['replica_group']}").write_text("")
            wait_for(lambda: len(list(directory.glob("ready*"))) == groups, "the other groups")
        if self.config.get("kill_in") == "exchange":  # die inside the exchange, once its quorum has formed
            strategy, allreduce = trainer.strategy, trainer.strategy.manager.allreduce

            def dying_allreduce(*args: Any, **kwargs: Any) -> Any:
                self.maybe_die(strategy)
                return allreduce(*args, **kwargs)

            strategy.manager.allreduce = dying_allreduce

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Padded text: each row's targets past its own length (1 + its tokens' sum mod the row length) are -100, so
        the groups' batches hold different numbers of valid tokens."""
        inputs, targets = batch
        lengths = 1 + inputs.sum(1) % inputs.shape[1]  # (B,)
        targets.masked_fill_(torch.arange(targets.shape[1]) >= lengths[:, None], -100)

    def maybe_die(self, strategy: Any) -> None:
        if strategy.ledger.applied + 1 == self.config.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, FaultTolerantStrategy) and self.config.get("kill_in") != "exchange":
            self.maybe_die(trainer.strategy)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        strategy = trainer.strategy
        ledger = asdict(strategy.ledger) if isinstance(strategy, FaultTolerantStrategy) else {}
        groups = strategy.manager.num_participants() if isinstance(strategy, FaultTolerantStrategy) else 1
        checksum = sum(p.detach().double().sum().item() for p in pl_module.parameters())
        record = {"t": time.time(), "step": trainer.global_step, "groups": groups, "sum": checksum, **ledger}
        self.file.write(json.dumps({**record, "loss": float(outputs["loss"])}) + "\n")
        if trainer.global_step == self.config.get("save_at"):
            torch.save(local_state(pl_module), self.out / f"state{trainer.global_step}.pt")  # type: ignore[arg-type]
        hold = self.config.get("hold_at")
        if hold is not None and trainer.global_step == hold[0]:
            wait_for(Path(hold[1]).exists, hold[1])


def fit(config: dict[str, Any], out: Path) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=SAMPLES, batch_size=config["batch"], seed=0)
    strategy: Any = "auto"
    if not config.get("reference"):
        strategy = FaultTolerantStrategy(
            replica_group=config["replica_group"],
            replica_groups=config["replica_groups"],
            sync=config["sync"],
            period=config.get("period"),
            min_replicas=2,
            lighthouse=config["lighthouse"],
            replica_timeout=10,
            quorum_timeout=60,
            timeout=60,
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=config["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=1000,  # no validation inside fit; `validate` below
        callbacks=[StepLog(config, out)],
        default_root_dir=str(out),
    )
    with trainer.init_module():
        network = tiny_network("gpt")
    task = LanguageModelTask(network, optimizer=partial(torch.optim.SGD, lr=0.5, momentum=0.9))
    trainer.fit(task, datamodule=data)
    describe = strategy.describe() if isinstance(strategy, FaultTolerantStrategy) else {}
    # each group evaluates the whole validation set (groups do not meet to reduce metrics)
    [metrics] = trainer.validate(task, datamodule=data, verbose=False)
    return {"state": local_state(task), "describe": describe, "val_loss": metrics["val/loss"]}


if __name__ == "__main__":
    config, out = payload()
    torch.save(fit(config, out), out / "result.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
