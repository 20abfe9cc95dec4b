"""How many micro-batches a batch runs with, and on which schedule: the largest count <= the requested one that
divides the batch, else a same-layout schedule that takes any count; and the record of what actually ran.

Pure arithmetic over schedule names; building and running the schedules is `runtime.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lightning_parallel.pipeline.schedule_plan import resolve_schedule
from lightning_parallel.pipeline.schedules import schedule_traits


def choose_microbatches(batch_size: int, requested: int, fits: Callable[[int], bool]) -> int | None:
    """The largest micro-batch count <= `requested` that divides the batch and the schedule accepts.

    Equal micro-batches keep the mean of micro-batch losses equal to the batch loss; a count per shape
    avoids PipelineStage's fixed receive buffers ever seeing a different size. None if no count fits.
    """
    for count in range(min(requested, batch_size), 0, -1):
        if batch_size % count == 0 and fits(count):
            return count
    return None


def _fits(name: str, count: int, *, pp: int, stages_per_rank: int) -> bool:
    try:
        resolve_schedule(name, pp=pp, microbatches=count, stages_per_rank=stages_per_rank)
    except ValueError:
        return False
    return True


def plan_microbatches(
    batch_size: int, *, schedule: str, requested: int, pp: int, stages_per_rank: int
) -> tuple[str, int]:
    """Schedule name and micro-batch count for a batch: the configured schedule when some count fits,
    else the same-layout schedule that takes any count (`ScheduleTraits.fallback`, e.g. for a last batch of prime
    size). The schedule only orders the work; every schedule computes the same gradients."""
    fits = partial(_fits, pp=pp, stages_per_rank=stages_per_rank)
    count = choose_microbatches(batch_size, requested, partial(fits, schedule))
    if count is not None:
        return schedule, count
    fallback = schedule_traits(schedule).fallback
    count = choose_microbatches(batch_size, requested, partial(fits, fallback))
    if count is None:  # the fallbacks accept a single micro-batch
        raise RuntimeError(f"{fallback} refused 1 micro-batch for a batch of {batch_size}")
    return fallback, count


@dataclass
class PlanUsed:
    """What ran for one kind of batch (training or evaluation, its size): summary.json reports these, not
    the configured schedule, since a batch the requested count does not divide runs a smaller plan."""

    training: bool
    batch_size: int
    schedule: str
    microbatches: int
    batches: int = 0  # batches run with this plan so far


def fallback_warning(used: PlanUsed, *, schedule: str, requested: int) -> str | None:
    """One line when a batch runs fewer micro-batches (or another schedule) than configured, else None."""
    if (used.schedule, used.microbatches) == (schedule, requested):
        return None
    instead = f"{schedule} with {requested}" if used.schedule != schedule else f"{requested}"
    divisible = -(-used.batch_size // requested) * requested
    return (
        f"pipeline: batches of {used.batch_size} run {used.schedule} with {used.microbatches} "
        f"micro-batch{'es' if used.microbatches != 1 else ''} instead of {instead} ({used.batch_size} rows do not "
        f"split into {requested} equal micro-batches). HINT: a batch size divisible by microbatches={requested} "
        f"(e.g. {divisible}), or drop a short last batch"
    )


class PlansUsed:
    """The plan each kind of batch ran with, keyed by (training?, batch size). `warn` hears of a fallback once
    per batch size: the plan depends on the size alone, so training and evaluation batches fall back alike."""

    def __init__(self, *, schedule: str, requested: int, warn: Callable[[str], None] | None = None) -> None:
        self.schedule, self.requested, self.warn = schedule, requested, warn
        self.plans: dict[tuple[bool, int], PlanUsed] = {}

    def record(self, training: bool, batch_size: int, name: str, count: int) -> PlanUsed:
        """The record for this kind of batch (created on first sight); the caller counts its batches."""
        key = (training, batch_size)
        if key not in self.plans:
            seen = any(plan.batch_size == batch_size for plan in self.plans.values())
            self.plans[key] = PlanUsed(training, batch_size, name, count)
            message = fallback_warning(self.plans[key], schedule=self.schedule, requested=self.requested)
            if message is not None and self.warn is not None and not seen:
                self.warn(message)
        return self.plans[key]
