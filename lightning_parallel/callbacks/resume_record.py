"""Records each resume of a run, for summary.json: from which step, the steps lost (done after that checkpoint by the
attempt that failed, and done again) and the wall time lost (from the checkpoint's save until training again). A
restart with no checkpoint to resume from (the attempt was lost before its first save) is one too: from step 0, every
step lost, the time since the lost attempt started training.

Rank 0 keeps `<directory>/progress.json` (the last finished step, the resumes so far, whether the run finished) up to
date after every step, so that a restarted attempt knows how far the lost one got. It neither saves nor chooses
checkpoints.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

PROGRESS_FILE = "progress.json"


class ResumeRecord(pl.Callback):
    """`resumes` holds one record per resume of the run in `directory`, oldest first (also after `fit`)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.resumes: list[dict[str, Any]] = []
        self.resumed_at: int | None = None  # the step this fit resumed from; None for a fresh one
        self._saved_at: float | None = None
        self._trained_from: float | None = None  # when this run last started training from scratch
        self._finished = False
        self._last_written = -1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"saved_at": time.time()}  # wall clock: a restart may run on another host of the cluster

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_at = state_dict.get("saved_at")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        earlier = self._read()
        self.resumed_at = trainer.global_step if trainer.ckpt_path else None
        if self.resumed_at is None and earlier.get("finished"):
            earlier = {}  # a new run in the directory of one that ended: nothing of it was lost
        self.resumes = list(earlier.get("resumes", []))
        self._trained_from = time.time() if self.resumed_at is None else earlier.get("trained_from")
        if self.resumed_at is not None:
            self.resumes.append(self._resume(self.resumed_at, str(trainer.ckpt_path), earlier, self._saved_at))
        elif earlier:  # an attempt of this run trained, and was lost before its first checkpoint
            self.resumes.append(self._resume(0, None, earlier, earlier.get("trained_from")))
        self._write(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finished = True
        self._write(trainer)

    @staticmethod
    def _resume(step: int, checkpoint: str | None, earlier: dict[str, Any], since: float | None) -> dict[str, Any]:
        """The record of a resume from `step`; `since`: when the state it resumes from was current."""
        reached = earlier.get("step")
        return {
            "from_step": step,
            "checkpoint": checkpoint,
            "steps_lost": max(0, reached - step) if isinstance(reached, int) else None,
            "wall_time_lost_s": time.time() - since if isinstance(since, float | int) else None,
        }

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._last_written:
            self._write(trainer)

    def _read(self) -> dict[str, Any]:
        try:
            found = json.loads((self.directory / PROGRESS_FILE).read_text())
        except (OSError, ValueError):  # none yet, or cut short by a kill
            return {}
        return found if isinstance(found, dict) else {}

    def _write(self, trainer: pl.Trainer) -> None:
        self._last_written = trainer.global_step
        if not trainer.is_global_zero:
            return
        progress = {"step": trainer.global_step, "time": time.time(), "resumes": self.resumes}
        progress |= {"trained_from": self._trained_from, "finished": self._finished}
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f"{PROGRESS_FILE}.tmp"
        tmp.write_text(json.dumps(progress))
        os.replace(tmp, self.directory / PROGRESS_FILE)
