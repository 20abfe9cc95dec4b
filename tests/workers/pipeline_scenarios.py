"""Lightning-feature scenarios run once under a pipeline strategy (worker) and once in one process (test).

Each scenario returns plain numbers, so the test can compare the two runs value by value.
"""

from __future__ import annotations

import warnings
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import TINY_GPT
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_parallel.callbacks import RunSummary
from lightning_parallel.data import SyntheticImagesDataModule, SyntheticTokensDataModule
from lightning_parallel.models import GPT, ResNet
from lightning_parallel.tasks import ClassificationTask, LanguageModelTask

SGD = partial(torch.optim.SGD, lr=0.5, momentum=0.9)
QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}


def _trainer(strategy: Any, devices: int, callbacks: list, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks, **QUIET, **kwargs)


def lightning_loops(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """fit with validation, checkpoint/early-stopping monitors, LR scheduler and monitor; then
    validate, test and predict on the trained model."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=72, batch_size=16, seed=0)
    recorder, lr_monitor = RunSummary(), LearningRateMonitor(logging_interval="step")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", monitor="val/loss", mode="min", save_top_k=1)
    stopper = EarlyStopping(monitor="val/loss", mode="min", patience=10)
    logger = CSVLogger(out, name="csv", version="")
    trainer = _trainer(
        strategy, devices, [recorder, lr_monitor, checkpoint, stopper], max_epochs=3, logger=logger, log_every_n_steps=1
    )
    with trainer.init_module():
        model = GPT(**TINY_GPT)
    scheduler = partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    task = LanguageModelTask(model, optimizer=SGD, scheduler=scheduler)
    trainer.fit(task, datamodule=data)
    callback_loss = float(trainer.callback_metrics["val/loss"])
    validated = trainer.validate(task, datamodule=data, verbose=False)[0]
    tested = trainer.test(task, datamodule=data, verbose=False)[0]
    predictions = torch.cat(trainer.predict(task, datamodule=data))
    return {
        "train_loss": recorder.history["train/loss"],
        "val_loss": recorder.history["val/loss"],
        "validate": validated,
        "test": tested,
        "predictions": predictions,
        "best_score": float(checkpoint.best_model_score),
        "best_exists": Path(checkpoint.best_model_path).exists(),
        "stopped_epoch": stopper.stopped_epoch,
        "callback_loss": callback_loss,
    }


def uneven_batches(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """Global batch 6 (not divisible by 4 micro-batches), last training batch 2 (< 4 micro-batches),
    validation batches 6 and 1."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(
        vocab_size=16, seq_len=8, num_samples=23, batch_size=6, val_fraction=0.3, seed=0
    )  # 16 train (6, 6, 4), 7 val (6, 1)
    recorder = RunSummary()
    trainer = _trainer(strategy, devices, [recorder], max_epochs=2, logger=False, enable_checkpointing=False)
    with trainer.init_module():
        model = GPT(**TINY_GPT)
    task = LanguageModelTask(model, optimizer=SGD)
    trainer.fit(task, datamodule=data)
    return {"train_loss": recorder.history["train/loss"], "val_loss": recorder.history["val/loss"]}


def batchnorm_one_microbatch(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """ResNet-18 (BatchNorm) with one micro-batch: statistics over the whole batch, as in one process."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticImagesDataModule(num_samples=40, channels=3, image_size=8, num_classes=4, batch_size=8, seed=0)
    recorder = RunSummary()
    trainer = _trainer(
        strategy, devices, [recorder], max_steps=6, logger=False, enable_checkpointing=False, limit_val_batches=0
    )
    with trainer.init_module():
        model = ResNet(depth=18, in_channels=3, num_classes=4)
    task = ClassificationTask(model, num_classes=4, optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9))
    trainer.fit(task, datamodule=data)
    buffers = {name: b.detach().clone() for name, b in task.model.named_buffers() if "running" in name}
    params = {name: p.detach().clone() for name, p in task.model.named_parameters()}
    return {"train_loss": recorder.history["train/loss"], "buffers": buffers, "params": params}


def bf16_mixed(strategy: Any, devices: int, out: Path, parts: int = 1) -> dict[str, Any]:
    """bf16 autocast; with `parts` (one process) each batch of 16 runs as that many accumulated micro-batches, the
    rows and order the pipeline's micro-batches have, so both round alike."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=200, batch_size=16 // parts, seed=0)
    recorder = RunSummary()
    trainer = _trainer(
        strategy,
        devices,
        [recorder],
        max_steps=4,  # compared exactly: a wrong gradient shows from step 2 on
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        precision="bf16-mixed",
        accumulate_grad_batches=parts,
    )
    with trainer.init_module():
        model = GPT(**TINY_GPT)
    task = LanguageModelTask(model, optimizer=SGD)
    trainer.fit(task, datamodule=data)
    return {"train_loss": per_step(recorder.history["train/loss"], parts), "params": parameters(task)}


def per_step(losses: list[float], parts: int) -> list[float]:
    """One loss per optimizer step: the mean of its `parts` equal micro-batches' losses."""
    return [sum(losses[step : step + parts]) / parts for step in range(0, len(losses), parts)]


def parameters(task: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in task.model.named_parameters()}


def balanced_by_time(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """Stages split by measured block time: a different split, the same training."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=200, batch_size=16, seed=0)
    recorder = RunSummary()
    trainer = _trainer(
        strategy, devices, [recorder], max_steps=5, logger=False, enable_checkpointing=False, limit_val_batches=0
    )
    with trainer.init_module():
        model = GPT(**TINY_GPT)
    trainer.fit(LanguageModelTask(model, optimizer=SGD), datamodule=data)
    describe = getattr(trainer.strategy, "describe", None)
    return {"train_loss": recorder.history["train/loss"], "unit": describe()["cost_unit"] if describe else None}


def deferred_batchnorm(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """ResNet-18 over 4 micro-batches with deferred BatchNorm, one step."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticImagesDataModule(num_samples=40, channels=3, image_size=8, num_classes=4, batch_size=8, seed=0)
    trainer = _trainer(
        strategy, devices, [], max_steps=1, logger=False, enable_checkpointing=False, limit_val_batches=0
    )
    with trainer.init_module():
        model = ResNet(depth=18, in_channels=3, num_classes=4)
    task = ClassificationTask(model, num_classes=4, optimizer=partial(torch.optim.SGD, lr=0.05))
    trainer.fit(task, datamodule=data)
    return {
        "buffers": {
            name: b.detach().clone()
            for name, b in task.model.state_dict().items()
            if "bn" in name or name.startswith("stem.1")
        }
    }


OVERFLOW_STEP, OVERFLOW_PARAMETER = 3, "block_0.mlp.down.bias"  # on the first pipeline stage only


class OverflowOnce(pl.Callback):
    """Puts an inf into one first-stage gradient at one step, as an fp16 overflow would, and records the loss scale
    after every step: every rank must skip that step and halve its scale, as one process does."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, param in pl_module.named_parameters():
            if trainer.global_step == OVERFLOW_STEP and name.endswith(OVERFLOW_PARAMETER) and param.grad is not None:
                param.grad[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # the plugin's scaler as it is now: a mesh strategy swaps in an overflow-agreeing one at set-up
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))  # type: ignore[attr-defined]


def fp16_mixed(strategy: Any, devices: int, out: Path, parts: int = 1) -> dict[str, Any]:
    """fp16 autocast with a GradScaler (Lightning allows it on CPU through the plugin), one overflow forced on the
    first stage; `parts` as for `bf16_mixed`, each micro-batch's loss scaled `parts` times higher: a pipeline
    back-propagates each micro-batch's mean at the whole scale and divides the summed gradients by the micro-batch
    count (torch's `scale_grads`), and fp16's subnormals round a 4 times smaller gradient differently (measured: 1.8e-5
    in the losses at the same scale, 1.2e-7 at 4 times it)."""
    from lightning.pytorch.plugins import MixedPrecision

    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=200, batch_size=16 // parts, seed=0)
    recorder = RunSummary()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10 * parts))
    overflow = OverflowOnce()
    trainer = _trainer(
        strategy,
        devices,
        [recorder, overflow],
        max_steps=5,  # the forced overflow at step 4, and one step after it
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        plugins=[plugin],
        accumulate_grad_batches=parts,
    )
    with trainer.init_module():
        model = GPT(**TINY_GPT)
    task = LanguageModelTask(model, optimizer=SGD)
    trainer.fit(task, datamodule=data)
    scales = [scale / parts for scale in overflow.scales[parts - 1 :: parts]]  # after each optimizer step
    return {"train_loss": per_step(recorder.history["train/loss"], parts), "scales": scales, "params": parameters(task)}


def fallback_reported(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """Training batches 7, 7, 2 and a validation batch 7, with 4 micro-batches requested of 1f1b on 2 stages:
    what describe() says before the first step and after fit, and the warnings this rank raised."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=23, batch_size=7, val_fraction=0.3, seed=0)
    before: dict[str, Any] = {}

    class BeforeFirstStep(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            before.update(trainer.strategy.describe())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(
            strategy, devices, [BeforeFirstStep()], max_epochs=1, logger=False, enable_checkpointing=False
        )
        with trainer.init_module():
            model = GPT(**TINY_GPT)
        trainer.fit(LanguageModelTask(model, optimizer=SGD), datamodule=data)
    return {
        "before": before,
        "after": trainer.strategy.describe(),
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("pipeline: ")],
    }


def gradients_held(strategy: Any, devices: int, out: Path) -> dict[str, Any]:
    """accumulate_grad_batches=2: per micro-step, whether the gradients the last one left are still alive while
    the network runs. Lightning discards a finished window's unread after the next training_step, so the pipeline
    frees them before its schedule (one copy of the stage's gradients less at its peak); a window's first
    micro-step's must stay for the second."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=96, batch_size=16, seed=0)
    left: list[weakref.ref] = []
    alive: dict[int, bool] = {}

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            alive[batch_idx] = False

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
            left[:] = [weakref.ref(p.grad) for p in module.parameters() if p.grad is not None]

    recorder = RunSummary()
    trainer = _trainer(strategy, devices, [recorder, Watch()], max_steps=3, accumulate_grad_batches=2)
    with trainer.init_module():
        model = GPT(**TINY_GPT)

    def look(module: torch.nn.Module, args: Any) -> None:
        if module.training and left:
            alive[max(alive)] |= any(ref() is not None for ref in left)

    for block in model.modules():
        block.register_forward_pre_hook(look)
    trainer.fit(LanguageModelTask(model, optimizer=SGD), datamodule=data)
    return {"train_loss": recorder.history["train/loss"], "alive": [alive[i] for i in sorted(alive)]}


SCENARIOS = {
    "lightning_loops": (lightning_loops, {"schedule": "1f1b", "microbatches": 4}),
    "uneven_batches": (uneven_batches, {"schedule": "1f1b", "microbatches": 4}),
    "batchnorm_one_microbatch": (batchnorm_one_microbatch, {"schedule": "gpipe", "microbatches": 1}),
    "bf16_mixed": (bf16_mixed, {"schedule": "1f1b", "microbatches": 4}),
    "fp16_mixed": (fp16_mixed, {"schedule": "1f1b", "microbatches": 4}),
    "deferred_batchnorm": (deferred_batchnorm, {"schedule": "1f1b", "microbatches": 4, "deferred_batchnorm": True}),
    "balanced_by_time": (balanced_by_time, {"schedule": "1f1b", "microbatches": 4, "balance": "time"}),
    "fallback_reported": (fallback_reported, {"schedule": "1f1b", "microbatches": 4}),
    "gradients_held": (gradients_held, {"schedule": "1f1b", "microbatches": 4}),
}
