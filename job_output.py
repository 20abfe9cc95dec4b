"""What a `train.py` job says and writes: one line to the terminal from rank 0, files written whole (via a temporary
file and a rename), summary.json's content (and an earlier run's, when it already finished), the closing `done` line,
and a failed rank's one line (its whole traceback to `rank<R>.log`). It composes and runs nothing (`train.py` does).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

__all__ = ["finished", "print_summary", "report_failure", "run_summary", "say", "write_atomically"]


@rank_zero_only
def say(line: str) -> None:
    """One line to the terminal, from rank 0 only."""
    print(line, file=sys.stderr, flush=True)


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_summary(
    trainer: pl.Trainer,
    task: pl.LightningModule,
    data: pl.LightningDataModule,
    *,
    parameters: int,
    seed: int,
    resumed_from: str | None,
    resumes: Any,
    recorded: dict[str, Any],
) -> dict[str, Any]:
    """summary.json's content: what ran, the recorders' figures (`recorded`), what strategy=auto chose and why, the
    strategy's own description and the config groups Hydra chose."""
    summary = {
        "strategy": type(trainer.strategy).__name__,
        "accelerator": type(trainer.accelerator).__name__,
        "devices": trainer.num_devices,
        "world_size": trainer.world_size,
        "precision": trainer.precision,
        "model": type(task.model).__name__,
        "data": type(data).__name__,
        "parameters": parameters,
        "seed": seed,
        "resumed_from": resumed_from,
        "resumes": resumes,
        **recorded,
    }
    auto_choice = getattr(trainer.strategy, "auto_choice", None)  # strategy=auto: what it chose and why
    if auto_choice is not None:
        summary["auto"] = auto_choice
    describe = getattr(trainer.strategy, "describe", None)
    if callable(describe):
        summary["parallel"] = describe()
    if HydraConfig.initialized():
        summary["choices"] = {k: v for k, v in HydraConfig.get().runtime.choices.items() if "hydra" not in k}
    return summary


def finished(cfg: DictConfig) -> dict[str, Any] | None:
    """With `ckpt_path=last`, the summary of this run directory when the run already reached its end (the same
    command again, e.g. a scheduler's requeue after the job finished), else None."""
    done = Path(cfg.paths.output_dir) / "summary.json"
    if str(cfg.get("ckpt_path")) != "last" or not done.is_file():
        return None
    summary = json.loads(done.read_text())
    max_steps, max_epochs = cfg.trainer.get("max_steps", -1), cfg.trainer.get("max_epochs")
    if max_steps is not None and max_steps > 0:
        return summary if summary.get("steps", 0) >= max_steps else None
    return summary if max_epochs is not None and max_epochs >= 0 and summary.get("epochs", 0) >= max_epochs else None


def print_summary(summary: dict[str, Any], output_dir: str) -> None:
    from rich.console import Console

    metrics = summary["metrics"]
    headline = next((name for name in ("val/acc", "val/ppl", "val/loss") if name in metrics), None)
    best = f"best {headline} {metrics[headline]['best']:.4f}" if headline else "no validation metric"
    rate = summary["throughput_samples_per_s"]
    Console(stderr=True).print(
        f"[bold green]done[/] {best} | {summary['strategy']} x{summary['world_size']} | "
        f"{summary['steps']} steps in {summary['wall_time_s']:.1f} s"
        + (f" | {rate:.0f} samples/s" if rate else "")
        + f" | files: {output_dir}"
    )


def report_failure(error: BaseException, output_dir: str) -> str | None:
    """A run that failed after launch: the whole traceback goes to `<output_dir>/rank<R>.log` and the terminal
    gets one line per rank (each rank would otherwise print 100+ lines). It names the first error, not one
    raised while cleaning up after it, and a rank stopped by another's death says so (strategies/peers.py)."""
    rank = rank_zero_only.rank
    log = Path(output_dir) / f"rank{rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(traceback.format_exception(error)))
    first = error
    while (cause := first.__cause__ or (None if first.__suppress_context__ else first.__context__)) is not None:
        first = cause  # an error raised while handling, or from, another (e.g. in teardown after a lost peer)
    if any(note.startswith("caused by: ") for note in getattr(first, "__notes__", [])):
        return f"rank {rank} stopped after the failure above (traceback: {log})"
    if getattr(first, "same_on_every_rank", False):  # e.g. a training_step the pipeline refuses: say it once
        return f"{first} (traceback: {log})" if rank == 0 else None
    message = str(first).strip().splitlines()[0] if str(first).strip() else ""
    return f"rank {rank} failed: {type(first).__name__}: {message} (traceback: {log})"
