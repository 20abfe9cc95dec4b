"""Lightning's DDP with 2 CPU processes matches one process at the same global batch.

Both runs go through train.py exactly as a user would start them, shuffling on: the data modules'
sampler makes the two ranks' half-batches together the single run's batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli

STEPS = 20
COMMON = [
    "seed=7",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    f"trainer.limit_train_batches={STEPS}",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "callbacks=none",
    "+callbacks.last={_target_:lightning.pytorch.callbacks.ModelCheckpoint,"
    "dirpath:${paths.output_dir}/checkpoints,save_last:true,save_top_k:0}",
]


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    out = tmp_path / name
    result = run_cli(*COMMON, *overrides, f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    return summary["metrics"]["train/loss"]["history"], state


@pytest.mark.slow
def test_ddp_two_processes_match_single_process(tmp_path: Path) -> None:
    single_losses, single_state = run(tmp_path, "single", "strategy=single", "data.batch_size=32")
    ddp_losses, ddp_state = run(tmp_path, "ddp", "strategy=ddp", "trainer.devices=2", "data.batch_size=16")
    assert len(single_losses) == len(ddp_losses) == STEPS
    assert max(abs(a - b) for a, b in zip(single_losses, ddp_losses, strict=True)) < 1e-5
    assert single_losses[-1] < single_losses[0]  # it trained
    assert single_state.keys() == ddp_state.keys()
    for name, value in single_state.items():
        torch.testing.assert_close(ddp_state[name], value, rtol=0, atol=1e-5, msg=name)
