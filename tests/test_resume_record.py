"""ResumeRecord without training (a stand-in trainer): a restart lost before its first checkpoint is a resume from
step 0 with every step lost; a resume from a checkpoint counts the steps after it; a new run in the directory of one
that ended inherits nothing. The end-to-end records are checked in test_resume_cli.py and test_restarts.py."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lightning_parallel.callbacks import ResumeRecord


def attempt(run: Path, *, steps: range, ckpt_path: str | None = None, saved_at: float | None = None,
            ends: bool = False) -> ResumeRecord:  # fmt: skip
    """One attempt's fit in `run`: starts at `steps.start` (from `ckpt_path`), trains to `steps.stop`, then is lost
    (or ends, `ends`)."""
    record = ResumeRecord(run)
    if saved_at is not None:
        record.load_state_dict({"saved_at": saved_at})
    trainer: Any = SimpleNamespace(global_step=steps.start, ckpt_path=ckpt_path, is_global_zero=True)
    record.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step in steps[1:]:
        trainer.global_step = step
        record.on_train_batch_end(trainer, None, None, None, step)  # type: ignore[arg-type]
    if ends:
        record.on_train_end(trainer, None)  # type: ignore[arg-type]
    return record


def test_a_restart_lost_before_its_first_checkpoint_is_a_resume_from_step_0_with_every_step_lost(
    tmp_path: Path,
) -> None:
    attempt(tmp_path, steps=range(0, 4))  # lost after step 3, before any checkpoint
    again = attempt(tmp_path, steps=range(0, 3))  # from scratch, lost again
    ((first, lost, wall),) = [(r["from_step"], r["steps_lost"], r["wall_time_lost_s"]) for r in again.resumes]
    assert (first, lost, again.resumed_at) == (0, 3, None) and wall > 0
    saved = time.time()
    resumed = attempt(tmp_path, steps=range(2, 7), ckpt_path="last.ckpt", saved_at=saved, ends=True)
    assert [(r["from_step"], r["steps_lost"], r["checkpoint"]) for r in resumed.resumes] == [
        (0, 3, None),
        (2, 0, "last.ckpt"),  # the second attempt reached step 2 only
    ]
    assert attempt(tmp_path, steps=range(0, 2)).resumes == []  # a new run here: the one before ended
