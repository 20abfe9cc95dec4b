"""Checkpoints written in the background (issue 27, item 2): the same content as a save in the step, a resume from
one continues exactly, ModelCheckpoint keeps exactly the newest K, a process killed during a write leaves the
previous checkpoint whole (and the `.partial` is never taken for a checkpoint), and the time interval of the Hydra
config triggers. One-file checkpoints (single, ddp, local SGD, DiLoCo, async SGD) and the mesh strategies' sharded
directories (pipeline, tensor, 3D) each."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed import WORKERS, free_port, run_workers, start_worker
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from config_checks import newest_checkpoint
from lightning_parallel.background_write import BackgroundWrite
from lightning_parallel.callbacks import AsyncCheckpoints, RunSummary
from lightning_parallel.callbacks.async_checkpoints import AsyncCheckpointIO
from lightning_parallel.checkpoint import MODEL_KEY, load_module, read_meta, recover, whole_state
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.models import GPT
from lightning_parallel.tasks import LanguageModelTask

sys.path.insert(0, str(WORKERS))
from checkpointing import GPT_CONFIG  # noqa: E402

EVERY, STEPS = 5, 15  # 5 batches of 16 per epoch (checkpointing.SAMPLES): saves at epoch ends resume exactly


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def assert_equal_tensors(a: dict[str, Any], b: dict[str, Any], where: str = "") -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        if isinstance(a[key], dict):
            assert_equal_tensors(a[key], b[key], f"{where}.{key}")
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{where}.{key}"


# ---- the background write itself ------------------------------------------------------------------------------
def test_one_write_at_a_time_and_a_removal_waits_for_the_newer_write_to_succeed() -> None:
    writes, gate, log = BackgroundWrite(), threading.Event(), []
    weights = torch.ones(4)
    staged = writes.stage({"w": weights, "step": [3]})
    weights.add_(1)  # training goes on while the copy is written
    assert staged["w"].tolist() == [1.0] * 4 and staged["step"] == [3]
    writes.start(lambda: (gate.wait(5), log.append("first")))
    writes.after(lambda: log.append("older removed"))
    assert writes.in_flight and log == []
    threading.Timer(0.2, gate.set).start()
    writes.start(lambda: log.append("second"))  # waits for the first write and what waited for it
    assert log[:2] == ["first", "older removed"]
    writes.wait()
    writes.start(lambda: 1 / 0)
    while writes.in_flight:  # until the write has failed (a fixed sleep may end first on a loaded machine)
        time.sleep(0.01)
    # a removal asked for after a failed write is dropped as well
    writes.after(lambda: log.append("removed after a failed write"))
    with pytest.raises(ZeroDivisionError):
        writes.wait()
    writes.close()
    assert log == ["first", "older removed", "second"]


class StallingIO(TorchCheckpointIO):
    """Writes half of `stall_at`'s file and waits for `release`: a write a kill can land in."""

    def __init__(self, stall_at: str) -> None:
        self.stall_at, self.started, self.release = stall_at, threading.Event(), threading.Event()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if Path(path).name.startswith(self.stall_at):
            Path(path).write_bytes(b"PK\x03\x04 half a zip file")
            self.started.set()
            assert self.release.wait(10)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_kill_during_a_file_write_leaves_the_previous_checkpoint_and_a_failed_write_removes_nothing(
    tmp_path: Path,
) -> None:
    folder, stalling = tmp_path / "checkpoints", StallingIO("step=10")
    plugin = AsyncCheckpointIO(stalling)
    plugin.save_checkpoint({"step": 5, MODEL_KEY: {"w": torch.ones(3)}}, folder / "step=5.ckpt")
    plugin.save_checkpoint({"step": 10, MODEL_KEY: {"w": torch.full((3,), 2.0)}}, folder / "step=10.ckpt")
    assert stalling.started.wait(10)
    killed = tmp_path / "as a kill leaves it"
    shutil.copytree(folder, killed)  # the files on disk at this moment are what a SIGKILL would leave
    assert names(killed) == ["step=10.ckpt.partial", "step=5.ckpt"]
    assert newest_checkpoint(killed) == killed / "step=5.ckpt"  # ckpt_path=last: never the one being written
    assert names(killed) == ["step=5.ckpt"] and torch.load(killed / "step=5.ckpt")["step"] == 5
    stalling.release.set()
    plugin.remove_checkpoint(folder / "step=5.ckpt")  # ModelCheckpoint's top-k: only once step 10 is whole
    plugin.writes.wait()
    assert names(folder) == ["step=10.ckpt"]
    assert torch.load(folder / "step=10.ckpt")[MODEL_KEY]["w"].tolist() == [2.0] * 3
    # A write that fails: the older checkpoint stays, and the next save (or teardown) raises the error.
    stalling.save_checkpoint = lambda *args, **kwargs: 1 / 0  # type: ignore[method-assign]
    plugin.save_checkpoint({"step": 15}, folder / "step=15.ckpt")
    plugin.remove_checkpoint(folder / "step=10.ckpt")
    with pytest.raises(ZeroDivisionError):
        plugin.save_checkpoint({"step": 20}, folder / "step=20.ckpt")
    recover(folder)
    assert names(folder) == ["step=10.ckpt"]


# ---- one-file checkpoints through Lightning (strategy=single here; ddp's are the same file, written by rank 0) --
def fit_single(save_dir: Path, *, resume_from: Path | None = None) -> tuple[pl.Trainer, LanguageModelTask, list]:
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=89, batch_size=16, seed=0)
    recorder = RunSummary()
    saving = ModelCheckpoint(
        dirpath=save_dir, filename="{step}", monitor="step", mode="max", save_top_k=2, every_n_train_steps=EVERY
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, AsyncCheckpoints(), saving],
    )
    with trainer.init_module():
        model = GPT(**GPT_CONFIG)
    task = LanguageModelTask(model, optimizer=partial(torch.optim.AdamW, lr=0.01))
    trainer.fit(task, datamodule=data, ckpt_path=resume_from)
    return trainer, task, recorder.history["train/loss"]


def test_one_file_checkpoints_written_in_the_background_keep_the_newest_two_and_resume_exactly(tmp_path: Path) -> None:
    saved = tmp_path / "checkpoints"
    trainer, task, losses = fit_single(saved)
    assert names(saved) == ["step=10.ckpt", "step=15.ckpt"]  # newest K=2 of 5, 10, 15; nothing half-written
    assert not isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO)  # the run's own plugin is back
    trainer.save_checkpoint(tmp_path / "sync.ckpt")  # so this one is written in the step: the same content
    written, synchronous = torch.load(saved / "step=15.ckpt"), torch.load(tmp_path / "sync.ckpt")
    assert_equal_tensors(written[MODEL_KEY], synchronous[MODEL_KEY])
    assert_equal_tensors(written["optimizer_states"][0], synchronous["optimizer_states"][0])
    _, resumed, resumed_losses = fit_single(tmp_path / "resumed", resume_from=saved / "step=10.ckpt")
    assert max(abs(a - b) for a, b in zip(resumed_losses, losses[10:], strict=True)) < 1e-5
    for name, value in task.state_dict().items():
        assert torch.allclose(resumed.state_dict()[name], value, atol=1e-5, rtol=0), name


class SlowIO(TorchCheckpointIO):
    """Takes a second before each write: long enough for the run to fail while a write is in flight."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(1.0)
        super().save_checkpoint(checkpoint, path, storage_options)


class FailAt(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == EVERY + 2:
            raise RuntimeError("planned failure")


def test_a_run_that_fails_while_a_write_is_in_flight_keeps_that_checkpoint_whole(tmp_path: Path) -> None:
    """The error is the run's own; the write of step 5, under way when it came, is waited for and swapped in."""
    saved = tmp_path / "checkpoints"
    saving = ModelCheckpoint(dirpath=saved, filename="{step}", monitor="step", mode="max", every_n_train_steps=EVERY)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FailAt(), saving],
        plugins=[AsyncCheckpointIO(SlowIO())],
    )
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=89, batch_size=16, seed=0)
    task = LanguageModelTask(GPT(**GPT_CONFIG), optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(RuntimeError, match="planned failure"):
        trainer.fit(task, datamodule=data)
    assert names(saved) == ["step=5.ckpt"] and torch.load(saved / "step=5.ckpt")["global_step"] == EVERY


# ---- sharded checkpoints of the mesh strategies (dcp.async_save) ----------------------------------------------
@pytest.mark.timeout(240)
def test_sharded_checkpoints_written_in_the_background_equal_a_synchronous_save_and_resume_exactly(
    tmp_path: Path,
) -> None:
    """Pipeline over 2 ranks writes `step=5, 10, 15` in the background and keeps the newest 2; the last holds what
    a synchronous save of the same state holds; one process resumed from `step=10` continues with the same losses."""
    saved = tmp_path / "checkpoints"
    payload = {"layout": "1x2x1", "steps": STEPS, "every": EVERY, "keep": 2, "save_dir": str(saved)}
    payload |= {"resume_from": None, "sync_copy": str(tmp_path / "sync.ckpt")}
    first = run_workers("async_checkpoints", 2, payload, tmp_path / "first")
    assert names(saved) == ["step=10.ckpt", "step=15.ckpt"]
    assert_equal_tensors(whole_state(saved / "step=15.ckpt"), whole_state(tmp_path / "sync.ckpt"))
    assert read_meta(saved / "step=15.ckpt")["global_step"] == STEPS
    payload |= {"layout": "1x1x1", "resume_from": str(saved / "step=10.ckpt"), "sync_copy": None}
    payload |= {"save_dir": str(tmp_path / "resumed")}
    [resumed] = run_workers("async_checkpoints", 1, payload, tmp_path / "resume")
    assert max(abs(a - b) for a, b in zip(resumed["losses"], first[0]["losses"][10:], strict=True)) < 1e-5
    final = {name: value for result in first for name, value in result["state"].items()}
    assert final.keys() == resumed["state"].keys()
    assert all(torch.allclose(resumed["state"][k], v, atol=1e-5, rtol=0) for k, v in final.items())


@pytest.mark.timeout(120)
def test_a_process_killed_during_a_sharded_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    """SIGKILL while the background write of step 10 is under way (its shards written, DCP's metadata and meta.pt
    not): step 5 is whole and loads, and the `.partial` is removed rather than taken for a checkpoint."""
    saved, out = tmp_path / "checkpoints", tmp_path / "worker"
    payload = {"layout": "1x1x1", "steps": STEPS, "every": EVERY, "keep": 2, "save_dir": str(saved)}
    payload |= {"resume_from": None, "sync_copy": None, "block_at": 10}
    out.mkdir()
    (out / "payload.json").write_text(__import__("json").dumps(payload))
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0"}
    proc = start_worker("async_checkpoints", out, {**world, "LOCAL_RANK": "0", "NODE_RANK": "0"})
    try:
        deadline = time.monotonic() + 100
        while not (out / "blocked").exists():
            assert proc.exitcode is None and time.monotonic() < deadline, (out / "log.txt").read_text()[-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.join()
    assert names(saved) == ["step=10.ckpt.partial", "step=5.ckpt"]
    assert newest_checkpoint(saved) == saved / "step=5.ckpt"  # what ckpt_path=last resumes from
    assert names(saved) == ["step=5.ckpt"] and read_meta(saved / "step=5.ckpt")["global_step"] == EVERY
    load_module(LanguageModelTask(GPT(**GPT_CONFIG), optimizer=partial(torch.optim.SGD, lr=0.5)), saved / "step=5.ckpt")


def test_the_time_interval_triggers_periodic_checkpoints_and_a_resume_keeps_the_one_it_resumed_from(
    compose_cfg, tmp_path: Path
) -> None:
    """`callbacks.step_checkpoint.train_time_interval` of 0 s saves after every step (Lightning allows 0); the newest
    3 stay. The same command with `ckpt_path=last` and 3 more steps resumes from the newest (step 5) and keeps it
    while the newest 3 move on (Lightning spares the checkpoint a run resumed from; model_checkpoint is off, else its
    last.ckpt of the same step would be the one resumed from)."""
    from train import train

    command = [
        "trainer.accelerator=cpu",
        "trainer.limit_val_batches=1",
        "callbacks.progress_bar=null",
        "callbacks.lr_monitor=null",
        "callbacks.model_checkpoint=null",
        "callbacks.step_checkpoint.train_time_interval={_target_: datetime.timedelta, seconds: 0}",
    ]
    train(compose_cfg(*command, "trainer.max_steps=5"))
    assert names(tmp_path / "checkpoints") == ["step=3.ckpt", "step=4.ckpt", "step=5.ckpt"]  # nothing half-written
    resumed = train(compose_cfg(*command, "trainer.max_steps=8", "ckpt_path=last"))
    assert resumed["resumed_from"] == str(tmp_path / "checkpoints" / "step=5.ckpt")
    assert names(tmp_path / "checkpoints") == [f"step={n}.ckpt" for n in (5, 6, 7, 8)]
