"""Resuming from the command line: `ckpt_path=<checkpoint | run directory | last>` continues a run exactly, and a
checkpoint that is missing, is not one, or belongs to another model stops before launch with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from torch import nn

from lightning_parallel.checkpoint import META_FILE, MODEL_KEY, check_matches
from lightning_parallel.tasks import ClassificationTask
from train import ConfigError, build

QUICK = ["trainer.accelerator=cpu", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2"]
QUICK += ["callbacks.progress_bar=null", "callbacks.lr_monitor=null"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.slow
def test_resume_continues_the_run_exactly(tmp_path: Path) -> None:
    first = run_cli(*QUICK, "trainer.max_epochs=1", "hydra.run.dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    # A checkpoint train.py saved loads the Lightning way: the network is rebuilt from the saved hyperparameters.
    loaded = ClassificationTask.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert type(loaded.model).__name__ == "SimpleCNN" and loaded.hparams.num_classes == 10
    resumed = run_cli(*QUICK, "trainer.max_epochs=2", "hydra.run.dir=run", "ckpt_path=last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight = run_cli(*QUICK, "trainer.max_epochs=2", "hydra.run.dir=straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    after, reference = summary(tmp_path / "run"), summary(tmp_path / "straight")
    assert after["resumed_from"].endswith("run/checkpoints/last.ckpt") and reference["resumed_from"] is None
    final = after["metrics"]["val/loss"]["final"]
    assert abs(final - reference["metrics"]["val/loss"]["final"]) < 1e-6, (final, reference["metrics"]["val/loss"])


def bad_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    (tmp_path / "garbage.ckpt").write_text("not a checkpoint")
    (tmp_path / "folder.ckpt").mkdir()
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    return {
        "missing path": ([f"ckpt_path={tmp_path}/nope.ckpt"], "does not exist"),
        "not a checkpoint": ([f"ckpt_path={tmp_path}/garbage.ckpt"], "is not a checkpoint torch can read"),
        "a directory without meta.pt": ([f"ckpt_path={tmp_path}/folder.ckpt"], "is not a sharded checkpoint"),
        "a run without checkpoints": ([f"ckpt_path={tmp_path}/empty_run"], "holds no checkpoint"),
        "last in a fresh run directory": (["ckpt_path=last"], "has no checkpoints/"),
    }


def test_bad_checkpoints_stop_before_launch(compose_cfg, tmp_path: Path) -> None:
    for case, (overrides, expected) in bad_cases(tmp_path).items():
        cfg = compose_cfg("trainer.accelerator=cpu", *overrides)
        with pytest.raises(ConfigError, match=expected) as error:
            build(cfg)
        assert "HINT" in str(error.value) and "\n" not in str(error.value), case


def test_a_checkpoint_of_another_model_is_refused_by_names_and_shapes(tmp_path: Path) -> None:
    saved, other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    sharded = tmp_path / "sharded.ckpt"
    dcp.save({MODEL_KEY: saved.state_dict()}, checkpoint_id=str(sharded))  # what a strategy writes
    torch.save({"global_step": 1}, sharded / META_FILE)
    single = tmp_path / "single.ckpt"
    torch.save({MODEL_KEY: saved.state_dict()}, single)  # what Lightning writes on one device
    for path in (sharded, single):
        check_matches(path, saved)
        with torch.device("meta"):
            shaped_differently = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        for module in (other, shaped_differently):
            with pytest.raises(ValueError, match=r"was saved from another model \(shapes \['0.bias \(8,\) != \(6,\)'"):
                check_matches(path, module)
        with pytest.raises(ValueError, match=r"missing \['2.bias', '2.weight'\]"):
            check_matches(path, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2)))
