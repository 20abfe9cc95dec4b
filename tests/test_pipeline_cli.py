"""The pipeline strategy from train.py: ResNet-18 and the transformer on 4 CPU processes, SimpleCNN on 2 under a
sweep of two zero-bubble schedules (which also checks that consecutive multi-process jobs each get a fresh process
group), and bad input. (ResNet-152's split over 4 stages: tests/test_partition.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli
from distributed import run_script

from train import ConfigError, build

TINY = [
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=1",
    "callbacks=none",
    "logger=csv",
]
TINY_IMAGES = [
    "data=synthetic_images",
    "data.image_size=16",
    "data.num_classes=10",
    "data.num_samples=64",
    "data.batch_size=16",
]


@pytest.mark.slow
def test_resnet_and_transformer_train_on_four_pipeline_stages(tmp_path: Path) -> None:
    """SimpleCNN is not run on 4 stages here (a third 4-process launch): it splits through the same image path as
    ResNet-18, and runs pipelined from train.py on 2 stages in the split-backward sweep below."""
    images = run_cli(
        "strategy=pipeline",
        "trainer.devices=4",
        "model=resnet18",
        *TINY_IMAGES,
        *TINY,
        "hydra.run.dir=images",
        cwd=tmp_path,
    )
    assert images.returncode == 0, images.stderr[-3000:]
    tokens = run_cli(
        "strategy=pipeline",
        "trainer.devices=4",
        "model=transformer",
        "data=synthetic_tokens",
        "data.seq_len=16",
        "data.batch_size=8",
        *TINY,
        "hydra.run.dir=tokens",
        cwd=tmp_path,
    )
    assert tokens.returncode == 0, tokens.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("summary.json"))]
    picture = tmp_path / "measured.png"
    draw = ["--from-summary", str(tmp_path / "tokens" / "summary.json"), "--out", str(picture)]
    # `python -m` runs it without warnings (the package must not import its modules eagerly: its module would be
    # imported before it runs, which the fork of the tests' server, the package imported, shows as a fresh run does)
    drawn = run_script(
        "-m lightning_parallel.insight.schedule_picture", draw, cwd=tmp_path, env=dict(os.environ), timeout=120
    )
    assert drawn.returncode == 0 and drawn.stderr == "" and picture.stat().st_size > 10_000, drawn.stderr
    assert sorted(s["model"] for s in summaries) == ["GPT", "ResNet"]
    for summary in summaries:
        parallel = summary["parallel"]
        assert summary["world_size"] == 4 and parallel["pipeline_size"] == 4
        assert len(parallel["stages"]) == 4 and 0 < parallel["bubble_fraction"] < 1
        assert len(summary["parameter_bytes_per_rank"]) == 4 and len(summary["step_time_s_per_rank"]) == 4
        # No rank holds the whole model: each holds its stages only.
        assert sum(summary["parameter_bytes_per_rank"]) == summary["parameters"] * 4
        # Measured per rank: idle share inside training steps, and the last step's compute events.
        assert len(summary["per_rank"]) == 4
        for rank in summary["per_rank"]:
            assert 0 < rank["idle_fraction"] < 1
            assert {kind for _, _, kind, _, _ in rank["events"]} == {"F", "B"}
    # How evenly ResNet-152's parameters split over 4 stages (<= 1.15 x a quarter): tests/test_partition.py


@pytest.mark.slow
def test_split_backward_schedules_validate_from_train_py(tmp_path: Path) -> None:
    """Zero-bubble schedules split the backward; evaluation must run a forward-only order (it used to fail with
    torch's "can't steal_bwd_input" in the sanity check). Validation metrics must equal one process's."""
    common = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=3", "callbacks=none"]
    single = run_cli("strategy=single", *common, "hydra.run.dir=single", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    sweep = run_cli(
        "-m",
        "strategy=pipeline",
        "trainer.devices=2",
        "strategy.schedule=zbv,interleaved_zero_bubble",
        *common,
        cwd=tmp_path,
        timeout=300,
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    expected = json.loads((tmp_path / "single" / "summary.json").read_text())["metrics"]
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "multirun").rglob("summary.json"))]
    assert sorted(s["parallel"]["schedule"] for s in summaries) == ["interleaved_zero_bubble", "zbv"]
    for summary in summaries:
        for key in ("val/loss", "val/acc"):
            got, want = summary["metrics"][key]["history"], expected[key]["history"]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (key, got, want)


BAD = {
    "devices not divisible": (["trainer.devices=3", "strategy.data_parallel_size=2"], "world size 3"),
    "more stages than blocks": (["trainer.devices=8"], "cannot split 5 blocks into 8 stages"),
    "unknown schedule": (["trainer.devices=2", "strategy.schedule=zigzag"], "zigzag"),
    "zero micro-batches": (["trainer.devices=2", "strategy.microbatches=0"], "microbatches=0"),
    "wrong stages per rank": (
        ["trainer.devices=2", "strategy.schedule=zbv", "strategy.stages_per_rank=3"],
        "exactly 2 stages per rank",
    ),
    "network attribute missing": (
        ["trainer.devices=2", "strategy.network_attr=net"],
        "at `ClassificationTask.net`; found nothing",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_pipeline_input_fails_before_launch(compose_cfg, case: str) -> None:
    overrides, expected = BAD[case]
    cfg = compose_cfg("strategy=pipeline", "trainer.accelerator=cpu", *overrides)
    with pytest.raises(ConfigError, match=expected) as error:
        build(cfg)
    assert "HINT" in str(error.value) and "\n" not in str(error.value)


def test_one_stage_runs_the_network_whole_like_one_device(tmp_path: Path) -> None:
    """pp=1: no split, schedule or micro-batches; the same losses as strategy=single, and the summary says so."""
    sweep = ["-m", "strategy=single,pipeline", "trainer.devices=1", "trainer.max_steps=3", "callbacks=none"]
    result = run_cli(*sweep, "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    single, pipeline = (json.loads((tmp_path / "sweep" / job / "summary.json").read_text()) for job in ("0", "1"))
    assert pipeline["parallel"]["pipelined"] is False and "schedule" not in pipeline["parallel"]
    losses = [s["metrics"]["train/loss"]["history"] for s in (single, pipeline)]
    assert losses[0] == losses[1] and len(losses[0]) > 0
