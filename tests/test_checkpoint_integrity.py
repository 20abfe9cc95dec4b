"""Damaged checkpoints are named before anything loads, and a save killed at any moment leaves a checkpoint
that a resume can use (issue 12, item 3)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_parallel.checkpoint import (
    META_FILE,
    MODEL_KEY,
    check_matches,
    load_module,
    old_path,
    partial_path,
    read_meta,
    recover,
    replace_with,
)
from train import ConfigError, build


def write_checkpoint(path: Path, module: nn.Module, step: int = 1) -> Path:
    """What a strategy writes: DCP shards of the model and optimizer state, plus meta.pt."""
    dcp.save({MODEL_KEY: module.state_dict(), "optimizer_0": {"lr": torch.tensor(0.1)}}, checkpoint_id=str(path))
    torch.save({"global_step": step, "epoch": 0}, path / META_FILE)
    return path


def shard(path: Path) -> Path:
    [found] = path.glob("*.distcp")
    return found


def truncate(file: Path) -> None:
    with open(file, "r+b") as handle:
        handle.truncate(file.stat().st_size // 2)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "a deleted shard": (lambda p: shard(p).unlink(), r"incomplete: shard __0_0\.distcp is missing"),
    "a truncated shard": (lambda p: truncate(shard(p)), r"incomplete: shard __0_0\.distcp has \d+ bytes, its metadata"),
    "a truncated meta.pt": (lambda p: truncate(p / META_FILE), r"damaged: meta\.pt does not read"),
    "a deleted meta.pt": (lambda p: (p / META_FILE).unlink(), r"incomplete: meta\.pt is missing"),
    "a truncated .metadata": (lambda p: truncate(p / ".metadata"), r"damaged: \.metadata does not read"),
    "a deleted .metadata": (lambda p: (p / ".metadata").unlink(), r"incomplete: \.metadata is missing"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_named_in_one_line_before_loading(tmp_path: Path, case: str) -> None:
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    path = write_checkpoint(tmp_path / "last.ckpt", module)
    read_meta(path)  # whole: reads
    damage, expected = DAMAGE[case]
    damage(path)
    for reader in (read_meta, lambda p: check_matches(p, module), lambda p: load_module(module, p)):
        with pytest.raises(ValueError, match=expected) as error:
            reader(path)
        assert "\n" not in str(error.value) and "HINT" in str(error.value)


def test_train_py_refuses_a_damaged_checkpoint_before_launch(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg("trainer.accelerator=cpu", f"ckpt_path={tmp_path}")
    trainer, task, *_ = build(compose_cfg("trainer.accelerator=cpu"))
    path = write_checkpoint(tmp_path / "checkpoints" / "last.ckpt", task)
    build(cfg)  # the run directory's checkpoint matches the default model
    shard(path).unlink()
    with pytest.raises(ConfigError, match=r"last\.ckpt is incomplete: shard __0_0\.distcp is missing"):
        build(cfg)


def test_a_save_killed_during_the_swap_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    module = nn.Linear(2, 2)
    folder = tmp_path / "checkpoints"
    path = write_checkpoint(folder / "last.ckpt", module, step=1)
    new = write_checkpoint(partial_path(path), module, step=2)
    # The kill lands after the old checkpoint was renamed aside and before the new one moved in.
    os.replace(path, old_path(path))
    assert not path.exists()
    recover(folder)
    assert read_meta(path)["global_step"] == 1 and not new.exists() and not old_path(path).exists()
    # Uninterrupted, the swap leaves only the new checkpoint.
    write_checkpoint(partial_path(path), module, step=2)
    replace_with(partial_path(path), path)
    assert read_meta(path)["global_step"] == 2
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


def test_recover_removes_unfinished_saves_and_keeps_whole_checkpoints(tmp_path: Path) -> None:
    module = nn.Linear(2, 2)
    whole = write_checkpoint(tmp_path / "epoch=0-step=5.ckpt", module)
    write_checkpoint(partial_path(tmp_path / "epoch=1-step=10.ckpt"), module)  # killed before its swap
    write_checkpoint(old_path(whole), module)  # killed after the swap, before removing the old copy
    recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=5.ckpt"]
    read_meta(whole)
