"""Resuming from the command line: `ckpt_path=<checkpoint | run directory | last>` continues a run exactly, and a
checkpoint that is missing, is not one, or belongs to another model stops before launch with one line. `last` on a
run directory without checkpoints starts fresh, so one command starts a run and resumes it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CONF, run_cli
from distributed import WORKERS
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch import nn

from config_checks import resolve_checkpoint
from lightning_parallel.checkpoint import META_FILE, MODEL_KEY, check_matches
from lightning_parallel.tasks import ClassificationTask
from train import ConfigError, build, train

QUICK = ["trainer.accelerator=cpu", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2"]
QUICK += ["callbacks.progress_bar=null", "callbacks.lr_monitor=null"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.slow
def test_resume_continues_the_run_exactly(tmp_path: Path) -> None:
    """The resume goes through the real command line; the first epoch and the uninterrupted reference run in this
    process (`train`, what the command line calls; a launch each cost ~10 s)."""
    train(compose_at(tmp_path / "run", *QUICK, "trainer.max_epochs=1"))
    # A checkpoint train.py saved loads the Lightning way: the network is rebuilt from the saved hyperparameters.
    loaded = ClassificationTask.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert type(loaded.model).__name__ == "SimpleCNN" and loaded.hparams.num_classes == 10
    resumed = run_cli(*QUICK, "trainer.max_epochs=2", "hydra.run.dir=run", "ckpt_path=last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    train(compose_at(tmp_path / "straight", *QUICK, "trainer.max_epochs=2"))
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
        "a run without checkpoints": ([f"ckpt_path={tmp_path}/empty_run"], "holds no complete checkpoint"),
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


# A checkpoint every 2 steps (the default callback, made periodic) and a plain-file single-device run of 6 steps.
PERIODIC = ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=0"]
PERIODIC += ["+callbacks.model_checkpoint.every_n_train_steps=2"]
SAME_COMMAND = ["trainer.accelerator=cpu", "trainer.max_steps=6", "ckpt_path=last", *QUICK[3:], *PERIODIC]


def compose_at(run: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={run}", *overrides])


def test_one_command_starts_resumes_after_a_failure_and_then_has_nothing_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ckpt_path=last` as a scheduler re-runs it: the first run starts from scratch (one line says so) and fails at
    step 3; the same command resumes from step 2, ends where an uninterrupted run ends, and records the resume in
    summary.json; run once more, it trains nothing and keeps the summary."""
    monkeypatch.chdir(tmp_path)  # FailAt notes the time of the failure in the working directory
    monkeypatch.syspath_prepend(str(WORKERS))
    fail = "+callbacks.fail={_target_:failing.FailAt,rank:0,step:3,mode:raise}"
    with pytest.raises(RuntimeError, match="injected failure on rank 0"):
        train(compose_at(tmp_path / "run", *SAME_COMMAND, fail))
    assert f"ckpt_path=last: no checkpoint in {tmp_path / 'run'} yet, starting from scratch" in capsys.readouterr().err
    resumed = train(compose_at(tmp_path / "run", *SAME_COMMAND))
    straight = train(compose_at(tmp_path / "straight", *SAME_COMMAND))
    (record,) = resumed["resumes"]
    assert (record["from_step"], record["steps_lost"]) == (2, 1) and record["wall_time_lost_s"] > 0, record
    assert resumed["resumed_from"] == str(tmp_path / "run" / "checkpoints" / "last.ckpt") and resumed["steps"] == 6
    want, got = straight["metrics"]["train/loss"]["history"], resumed["metrics"]["train/loss"]["history"]
    assert max(abs(a - b) for a, b in zip(got, want[2:], strict=True)) < 1e-6 and len(got) == 4
    runs = (tmp_path / "run", tmp_path / "straight")
    weights = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for run in runs]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[1]) < 1e-6
    capsys.readouterr()
    assert train(compose_at(tmp_path / "run", *SAME_COMMAND)) == json.loads(
        (tmp_path / "run" / "summary.json").read_text()
    )
    assert "nothing left to train" in capsys.readouterr().err


def test_the_newest_complete_checkpoint_is_taken_and_interrupted_saves_are_undone(tmp_path: Path) -> None:
    """A save cut short (a shard shorter than its metadata says) is passed over for the newest whole one; a
    `.partial` write is removed and a checkpoint renamed aside during a swap is put back."""
    model = nn.Linear(4, 2)
    folder = tmp_path / "run" / "checkpoints"
    for step, name in enumerate(["step=2.ckpt", "step=4.ckpt", "last.ckpt", "step=6.ckpt.partial"]):
        dcp.save({MODEL_KEY: model.state_dict()}, checkpoint_id=str(folder / name))
        torch.save({"global_step": step}, folder / name / META_FILE)
        time.sleep(0.05)  # distinct modification times
    shard = next((folder / "last.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # killed while writing
    cfg = compose_at(tmp_path / "run", "ckpt_path=last")
    with pytest.warns(
        UserWarning, match=r"passing over an incomplete checkpoint: checkpoint .*last.ckpt is incomplete"
    ):
        assert resolve_checkpoint(cfg) == str(folder / "step=4.ckpt")
    assert not (folder / "step=6.ckpt.partial").exists()
    (folder / "step=4.ckpt").rename(folder / "step=4.ckpt.old")  # killed between the two renames of a swap
    with pytest.warns(UserWarning, match="passing over"):
        assert resolve_checkpoint(cfg) == str(folder / "step=4.ckpt")
