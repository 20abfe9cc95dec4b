"""A `train.py -m` sweep's jobs as records: every job directory under the sweep (`.hydra/` or `summary.json`), in job
order, with its overrides, its summary (None: it failed or is running) and the overrides that set it apart. Reads only;
the report and plots are `sweep_report.py`'s.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Job", "load_jobs"]


@dataclass(frozen=True)
class Job:
    """One job directory of a sweep; `summary` is None when the job wrote none (it failed or is running)."""

    name: str
    path: Path
    overrides: list[str]
    summary: dict[str, Any] | None
    label: str = field(default="", compare=False)  # the overrides that differ between the sweep's jobs

    @property
    def failed(self) -> bool:
        return self.summary is None


def _natural(name: str) -> list[Any]:
    # job "10" after job "9"
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_jobs(sweep_dir: str | Path) -> list[Job]:
    """Every job under `sweep_dir` (any directory holding `.hydra/` or `summary.json`), in job order.

    Raises:
        ValueError: `sweep_dir` is missing, holds no job directories, or no job wrote a summary.
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory. HINT: pass a sweep directory such as multirun/<date>/<time>")
    dirs = {p.parent for p in root.rglob("summary.json")} | {p.parent for p in root.rglob(".hydra") if p.is_dir()}
    jobs = [_load_job(root, d) for d in sorted(dirs, key=lambda d: _natural(str(d.relative_to(root))))]
    if not any(not job.failed for job in jobs):
        raise ValueError(
            f"no summary.json under {root} ({len(jobs)} job directories, none finished). "
            "HINT: pass the directory of a finished `python train.py -m ...` sweep, e.g. multirun/<date>/<time>"
        )
    return _with_labels(jobs)


def _load_job(root: Path, job_dir: Path) -> Job:
    summary_file = job_dir / "summary.json"
    try:
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    except json.JSONDecodeError as error:
        raise ValueError(f"{summary_file} is not valid JSON ({error}). HINT: delete it or re-run that job") from error
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else None
    name = job_dir.name if job_dir == root else str(job_dir.relative_to(root))
    return Job(name=name, path=job_dir, overrides=[str(o) for o in overrides or []], summary=summary)


def _with_labels(jobs: list[Job]) -> list[Job]:
    shared = set.intersection(*(set(job.overrides) for job in jobs)) if len(jobs) > 1 else set()
    return [
        Job(job.name, job.path, job.overrides, job.summary, " ".join(o for o in job.overrides if o not in shared))
        for job in jobs
    ]
