"""Sharded checkpoints: saved on one layout (pipeline, tensor, or pipeline x tensor), they load into one plain
process and resume on another layout, matching a straight single-process run (optimizer state included); the
export command writes one file that loads with weights_only=True and with the task's load_from_checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import WORKERS, run_workers

sys.path.insert(0, str(WORKERS))
from checkpointing import build  # noqa: E402

from lightning_parallel.checkpoint import is_sharded_checkpoint, load_module  # noqa: E402
from lightning_parallel.tasks import LanguageModelTask  # noqa: E402


def merged(results: list[dict]) -> dict[str, torch.Tensor]:
    return {name: value for result in results for name, value in result["state"].items()}


# (saved by, processes) -> (resumed by, processes): a layout change at every resume (dp x pp x tp in the ids).
# Two stages -> four: test_traced_split_saves_on_two_stages_loads_into_one_process_and_resumes_on_four.
CHAINS = {
    "1x2x1 -> 1x2x2": (("pipeline", 2), ("pipeline_x_tensor", 4)),
    "1x2x2 -> 1x1x2": (("pipeline_x_tensor", 4), ("tensor", 2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("chain", CHAINS)
def test_save_load_into_one_process_and_resume_on_another_layout(tmp_path: Path, chain: str) -> None:
    (kind, size), (resume_kind, resume_size) = CHAINS[chain]
    saved = tmp_path / "checkpoints"
    ckpt10, ckpt20 = saved / "step=10.ckpt", saved / "step=20.ckpt"
    first = run_workers(
        "checkpointing",
        size,
        {"strategy": kind, "size": size, "steps": 10, "resume_from": None, "save_dir": str(saved)},
        tmp_path / "a",
    )
    assert is_sharded_checkpoint(ckpt10) and not list(saved.glob("*.partial"))

    # The straight single-process run: 10 steps, then 10 more.
    trainer, task, data, recorder = build(1, 20, "auto")
    trainer.fit(task, datamodule=data)
    straight = {name: p.detach().clone() for name, p in task.model.named_parameters()}

    # Into one process: the 10-step checkpoint equals the parallel run's own weights at step 10.
    _, fresh, _, _ = build(1, 20, "auto")
    load_module(fresh, ckpt10)
    whole = dict(fresh.model.named_parameters())
    for name, value in merged(first).items():
        if name in whole:
            torch.testing.assert_close(whole[name], value, rtol=0, atol=0, msg=name)

    # Resumed on another layout for steps 10..19: the same losses and weights (optimizer state included).
    second = run_workers(
        "checkpointing",
        resume_size,
        {"strategy": resume_kind, "size": resume_size, "steps": 20, "resume_from": str(ckpt10), "save_dir": str(saved)},
        tmp_path / "b",
    )
    assert all(result["step"] == 20 for result in second)
    resumed_losses = second[0]["losses"]
    assert max(abs(a - b) for a, b in zip(resumed_losses, recorder.history["train/loss"][10:], strict=True)) < 1e-5
    resumed = {name: value for name, value in merged(second).items() if name in straight}
    assert resumed.keys() == straight.keys()
    for name, value in resumed.items():
        torch.testing.assert_close(value, straight[name], rtol=0, atol=1e-5, msg=name)

    # One documented command exports a plain single-file checkpoint.
    out = tmp_path / "export" / "model.ckpt"
    command = [sys.executable, "-m", "lightning_parallel.checkpoint", "export", str(ckpt20), str(out)]
    subprocess.run(command, check=True, capture_output=True)
    exported = torch.load(out, weights_only=True)  # plain tensors and containers: loads without trusting code
    assert exported["global_step"] == 20
    # ... and loads the Lightning way: the task rebuilds its network from the saved hyperparameters.
    loaded = LanguageModelTask.load_from_checkpoint(out, map_location="cpu")
    for name, value in straight.items():
        torch.testing.assert_close(exported["state_dict"][f"model.{name}"], value, rtol=0, atol=1e-5)
        torch.testing.assert_close(loaded.model.get_parameter(name), value, rtol=0, atol=1e-5)


def test_load_from_a_wrong_path_is_one_clear_error(tmp_path: Path) -> None:
    _, task, _, _ = build(1, 1, "auto")
    with pytest.raises(FileNotFoundError, match="is not a sharded checkpoint"):
        load_module(task, tmp_path)


@pytest.mark.slow
def test_traced_split_saves_on_two_stages_loads_into_one_process_and_resumes_on_four(tmp_path: Path) -> None:
    """A network with its own forward (split by tracing) keeps its parameter names in checkpoints."""
    from traced_checkpoint import fit
    from user_modules import build as build_user_module

    saved = tmp_path / "checkpoints"
    first = run_workers(
        "traced_checkpoint", 2, {"devices": 2, "steps": 6, "resume_from": None, "save_dir": str(saved)}, tmp_path / "a"
    )
    ckpt6 = saved / "step=6.ckpt"
    assert is_sharded_checkpoint(ckpt6)
    module, losses, _ = fit(1, 12, "auto", None, None)
    straight = {name: p.detach().clone() for name, p in module.named_parameters()}

    fresh = build_user_module("tutorial_cnn", "criterion")
    load_module(fresh, ckpt6)
    whole = dict(fresh.named_parameters())
    assert merged(first).keys() == whole.keys()
    for name, value in merged(first).items():
        torch.testing.assert_close(whole[name], value, rtol=0, atol=0, msg=name)

    second = run_workers(
        "traced_checkpoint", 4, {"devices": 4, "steps": 12, "resume_from": str(ckpt6), "save_dir": None}, tmp_path / "b"
    )
    assert all(result["step"] == 12 for result in second)
    assert max(abs(a - b) for a, b in zip(second[0]["losses"], losses[6:], strict=True)) < 1e-5
    assert merged(second).keys() == straight.keys()
    for name, value in merged(second).items():
        torch.testing.assert_close(value, straight[name], rtol=0, atol=1e-5, msg=name)
