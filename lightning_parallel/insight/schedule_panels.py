"""The panels a schedule picture draws (`schedule_picture.py`): one schedule's per-rank compute events, from a simulated
`Timeline` (`schedule_plan`), from measured events, or from a pipeline run's summary.json, with the bubble and the
micro-batches in flight they show. Draws nothing and launches no processes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_parallel.pipeline.schedule_plan import SCHEDULES, Timeline, rank_actions, resolve_schedule, simulate

__all__ = [
    "COLORS", "KIND_NAMES", "Event", "Panel", "display_name", "measured_panels", "panel_from_events",
    "panel_from_timeline", "simulated_panel",
]  # fmt: skip

# (start, end, kind, stage, microbatch): kind is F (forward), B (full backward), I (input grad), W (weight grad)
Event = tuple[float, float, str, int, int]

COLORS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


@dataclass(frozen=True)
class Panel:
    """One schedule to draw: per-rank events (times start at 0), a heading and the time unit."""

    heading: str
    events: list[list[Event]]
    time_unit: str

    @property
    def makespan(self) -> float:
        return max((e[1] for rank in self.events for e in rank), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """1 - busy time / (ranks * makespan): the share of device time spent idle."""
        busy = sum(end - start for rank in self.events for start, end, *_ in rank)
        total = len(self.events) * self.makespan
        return 1.0 - busy / total if total > 0 else 0.0

    def in_flight(self, rank: int) -> int:
        """Most micro-batches whose forward ran but whose backward (B, or W when split) had not finished."""
        held = peak = 0
        for _, _, kind, _, _ in sorted(self.events[rank]):
            held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)  # activations live from F until the backward ends
            peak = max(peak, held)
        return peak

    @property
    def title(self) -> str:
        stages = len({e[3] for rank in self.events for e in rank})
        microbatches = len({e[4] for rank in self.events for e in rank})
        return (
            f"{self.heading}: {_count(stages, 'stage')} on {_count(len(self.events), 'rank')}, "
            f"{_count(microbatches, 'micro-batch', 'es')}, bubble {self.bubble_fraction:.1%}"
        )


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{plural}"


def panel_from_timeline(timeline: Timeline, *, heading: str) -> Panel:
    """A panel for a simulated step; times are in units of one forward (`schedule_plan.DEFAULT_COST`)."""
    events = [
        [(start, end, a.kind, a.stage, a.microbatch) for start, end, a in timeline.events[rank]]
        for rank in sorted(timeline.events)
    ]
    return Panel(heading=heading, events=events, time_unit="forward = 1")


def panel_from_events(events: Sequence[Sequence[Sequence[Any]]], *, heading: str, time_unit: str = "s") -> Panel:
    """A panel for measured events: a list per rank of `(start_seconds, end_seconds, kind, stage, microbatch)`.

    Times may come from any common clock (e.g. `time.time()` on every rank); they are shifted so the
    earliest start is 0.

    Raises:
        ValueError: one line naming the first malformed event and how to fix it.
    """
    if not events or not any(events):
        raise ValueError(f"no events to draw: got {len(events)} ranks with 0 events. HINT: one list of events per rank")
    checked = [[_check_event(rank, i, e) for i, e in enumerate(rank_events)] for rank, rank_events in enumerate(events)]
    origin = min(e[0] for rank_events in checked for e in rank_events)
    shifted = [
        sorted((s - origin, t - origin, kind, stage, mb) for s, t, kind, stage, mb in rank_events)
        for rank_events in checked
    ]
    return Panel(heading=heading, events=shifted, time_unit=time_unit)


def _check_event(rank: int, index: int, event: Sequence[Any]) -> Event:
    where = f"event {index} of rank {rank} ({tuple(event)!r})"
    hint = "HINT: each event is (start_seconds, end_seconds, kind, stage, microbatch)"
    if len(event) != 5:
        raise ValueError(f"{where} has {len(event)} fields, not 5. {hint}")
    start, end, kind, stage, microbatch = event
    if kind not in COLORS:
        raise ValueError(f"{where} has kind {kind!r}, not one of {', '.join(COLORS)}. {hint}")
    if not (math.isfinite(float(start)) and math.isfinite(float(end)) and float(start) <= float(end)):
        raise ValueError(f"{where} needs finite start <= end; got start={start}, end={end}. {hint}")
    if int(stage) < 0 or int(microbatch) < 0:
        raise ValueError(f"{where} needs stage >= 0 and microbatch >= 0. {hint}")
    return float(start), float(end), str(kind), int(stage), int(microbatch)


def display_name(schedule: str) -> str:
    """`1f1b` -> `1F1B (1f1b)`: torch's class name without its `Schedule` prefix, then our name."""
    return f"{SCHEDULES[schedule].removeprefix('Schedule')} ({schedule})"


def simulated_panel(schedule: str, *, pp: int, microbatches: int, stages_per_rank: int | None = None) -> Panel:
    """Validate, list and simulate one step of `schedule` under unit costs; no processes are started.

    Raises:
        ValueError: the schedule, rank count or micro-batch count is invalid (one line with a HINT).
    """
    spec = resolve_schedule(schedule, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
    timeline = simulate(
        rank_actions(spec, pp=pp, microbatches=microbatches),
        pp=pp,
        num_stages=pp * spec.stages_per_rank,
        stage_to_rank=spec.stage_to_rank(pp),
    )
    return panel_from_timeline(timeline, heading=display_name(schedule))


def measured_panels(summary_path: str | Path) -> list[Panel]:
    """The measured last training step of a pipeline run (one row per rank) and its simulated schedule."""
    path = Path(summary_path)
    if not path.is_file():
        raise ValueError(f"--from-summary {path} does not exist. HINT: pass a pipeline run's <run dir>/summary.json")
    summary = json.loads(path.read_text())
    parallel, per_rank = summary.get("parallel", {}), summary.get("per_rank")
    if not per_rank or "schedule" not in parallel:
        raise ValueError(f"{path} holds no measured pipeline events. HINT: use the summary of a strategy=pipeline run")
    measured = panel_from_events(
        [rank["events"] for rank in per_rank], heading=f"measured: {display_name(parallel['schedule'])}"
    )
    simulated = simulated_panel(
        parallel["schedule"],
        pp=parallel["pipeline_size"],
        microbatches=parallel["microbatches"],
        stages_per_rank=parallel["stages_per_rank"] if parallel["stages_per_rank"] > 1 else None,
    )
    return [measured, simulated]
