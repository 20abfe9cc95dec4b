"""Sharded checkpoints: a run resumed link by link along 2x2x2 -> one process -> 1x4x1 -> 1x1x2 -> 2x2x2
(dp x pp x tp) matches a straight single-process run (optimizer state included); a sharded checkpoint loads into
one plain process; the export command writes one file that loads with weights_only=True and with the task's
load_from_checkpoint."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from distributed import WORKERS, run_workers

sys.path.insert(0, str(WORKERS))
from checkpointing import build, sizes  # noqa: E402
from common import full_state  # noqa: E402

from lightning_parallel.checkpoint import is_sharded_checkpoint, load_module  # noqa: E402
from lightning_parallel.checkpoint import main as export_command  # noqa: E402
from lightning_parallel.tasks import LanguageModelTask  # noqa: E402


def merged(results: list[dict]) -> dict[str, torch.Tensor]:
    return {name: value for result in results for name, value in result["state"].items()}


# Issue 10 item 3, dp x pp x tp: every link resumes from the previous link's checkpoint on another layout.
CHAIN = ("2x2x2", "1x1x1", "1x4x1", "1x1x2", "2x2x2")
EVERY = 5  # steps per link: one epoch, since Lightning resumes a plain DataLoader exactly only at an epoch end


@pytest.mark.slow
@pytest.mark.timeout(480)  # 23 processes start one after another: 2 to 3 minutes on 2 busy cores
def test_resume_along_2x2x2_one_process_1x4x1_1x1x2_2x2x2(tmp_path: Path) -> None:
    """Each link trains EVERY steps and matches the straight single-process run's losses, and the last link its
    weights, so model and optimizer state crossed every layout change.

    "One process" (1x1x1) is the tensor strategy on one process: a plain Trainer cannot resume from a sharded
    checkpoint (Lightning's TorchCheckpointIO reads one file; `export` writes DCP's flattened optimizer state, not
    Lightning's `optimizer_states`), and a mesh strategy cannot resume from a plain `.ckpt` (`read_meta` refuses a
    file). A plain process is covered by `load_module` (the 2x2x2 weights) and the export at the end."""
    steps = EVERY * len(CHAIN)
    trainer, task, data, recorder = build(1, steps, "auto")
    trainer.fit(task, datamodule=data)
    straight_losses, straight = recorder.history["train/loss"], full_state(task.model)

    saved, resume_from = tmp_path / "checkpoints", None
    for link, layout in enumerate(CHAIN):
        start, stop = link * EVERY, (link + 1) * EVERY
        payload = {"layout": layout, "steps": stop, "every": EVERY, "resume_from": resume_from, "save_dir": str(saved)}
        results = run_workers("checkpointing", math.prod(sizes(layout)), payload, tmp_path / f"{link}-{layout}")
        assert all(result["step"] == stop for result in results), layout
        losses = results[0]["losses"]
        assert max(abs(a - b) for a, b in zip(losses, straight_losses[start:stop], strict=True)) < 1e-5, layout
        checkpoint = saved / f"step={stop}.ckpt"
        assert is_sharded_checkpoint(checkpoint) and not list(saved.glob("*.partial"))
        if link == 0:  # into one plain process: the sharded checkpoint equals the saving run's own weights
            _, fresh, _, _ = build(1, steps, "auto")
            load_module(fresh, checkpoint)
            whole = full_state(fresh.model)
            assert merged(results).keys() == whole.keys()
            for result in results:  # every replica of every stage, not only the last replica's ranks
                for name, value in result["state"].items():
                    torch.testing.assert_close(whole[name], value, rtol=0, atol=0, msg=name)
        resume_from = str(checkpoint)

    assert merged(results).keys() == straight.keys()
    for result in results:  # every replica of every stage
        for name, value in result["state"].items():
            torch.testing.assert_close(value, straight[name], rtol=0, atol=1e-5, msg=name)

    # One documented command exports a plain single-file checkpoint (its main, in this process: a launch costs 5 s).
    out = tmp_path / "export" / "model.ckpt"
    assert export_command(["export", resume_from, str(out)]) == 0
    exported = torch.load(out, weights_only=True)  # plain tensors and containers: loads without trusting code
    assert exported["global_step"] == steps
    # ... and loads the Lightning way: the task rebuilds its network from the saved hyperparameters.
    loaded = LanguageModelTask.load_from_checkpoint(out, map_location="cpu")
    for name, value in task.model.named_parameters():
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
