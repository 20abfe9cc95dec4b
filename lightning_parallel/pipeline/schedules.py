"""Every pipeline schedule's properties in one table: torch class, stage layout, backward split, micro-batch rules.

The strategy, the runtime, the micro-batch fallback and the planner all read this table instead of keeping their own
name sets. It checks a schedule's sizes; resolving, ordering and simulating a schedule is `schedule_plan.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.pipelining import schedules as torch_schedules


@dataclass(frozen=True)
class ScheduleTraits:
    """What one schedule is, independent of any run's sizes.

    Args:
        name: Our name (``strategy.schedule``).
        torch_class_name: The class in ``torch.distributed.pipelining.schedules``.
        style: ``"loop"``: stage i on rank i % pp; ``"v"``: down the ranks, then back up (rank 0 holds first and last).
        multi_stage: Several stages per rank (2 by default; a V always exactly 2), else exactly one.
        splits_backward: Runs input-gradient (I) and weight-gradient (W) work as separate actions.
        microbatches: What torch demands of the micro-batch count: ``"any"``; ``"per_stage"``, at least one per
            stage; ``"rounds"``, a multiple of the rounds ``max(1, microbatches // pp)``.
        all_forwards_first: Every forward runs before any backward, so a rank holds every micro-batch's activations.
    """

    name: str
    torch_class_name: str
    style: Literal["loop", "v"]
    multi_stage: bool
    splits_backward: bool
    microbatches: Literal["any", "per_stage", "rounds"] = "any"
    all_forwards_first: bool = False

    @property
    def torch_class(self) -> type:
        return getattr(torch_schedules, self.torch_class_name)

    @property
    def holds_sends(self) -> bool:
        """Every tensor a rank sends in a step (a stage's output, its inputs' gradients) stays alive until the step
        ends: torch's `_PipelineScheduleRuntime` (the multi-stage schedules) waits on its sends only then."""
        return issubclass(self.torch_class, getattr(torch_schedules, "_PipelineScheduleRuntime", ()))

    @property
    def default_stages_per_rank(self) -> int:
        """What the pipeline strategy runs when ``stages_per_rank`` is not given."""
        return 2 if self.multi_stage else 1

    @property
    def fallback(self) -> str:
        """The schedule with the same stage layout that takes any micro-batch count (itself if this one does)."""
        return next(
            other.name
            for other in SCHEDULE_TRAITS.values()
            if other.microbatches == "any" and (other.style, other.multi_stage) == (self.style, self.multi_stage)
        )

    def check_stages_per_rank(self, stages_per_rank: int | None) -> int:
        """The stages per rank this schedule runs with, ``stages_per_rank`` if given and allowed."""
        if not self.multi_stage:
            if stages_per_rank not in (None, 1):
                raise ValueError(
                    f"schedule={self.name} runs one stage per rank; got stages_per_rank={stages_per_rank}. "
                    "HINT: drop stages_per_rank, or use interleaved_1f1b"
                )
            return 1
        v = self.default_stages_per_rank if stages_per_rank is None else stages_per_rank
        if self.style == "v" and v != 2:
            raise ValueError(f"schedule={self.name} needs exactly 2 stages per rank; got {v}. HINT: stages_per_rank=2")
        if v < 2:
            raise ValueError(
                f"schedule={self.name} needs stages_per_rank >= 2; got {v}. HINT: stages_per_rank=2, or use 1f1b"
            )
        return v

    def check_microbatches(self, pp: int, microbatches: int, stages_per_rank: int) -> None:
        """Raise one line with the numbers and a fix when torch would refuse this count."""
        where = f"schedule={self.name} with pp={pp}"
        num_stages = pp * stages_per_rank
        if microbatches < 1:
            raise ValueError(f"{where} needs microbatches >= 1; got {microbatches}. HINT: microbatches={pp}")
        if self.microbatches == "per_stage" and microbatches < num_stages:
            least = "pp" if stages_per_rank == 1 else f"{stages_per_rank} * pp = {num_stages}"
            raise ValueError(
                f"{where} needs microbatches >= {least}; got {microbatches}. "
                f"HINT: microbatches={num_stages}, or use {self.fallback}"
            )
        if self.microbatches == "rounds" and not _rounds_ok(pp, microbatches):
            rounds = max(1, microbatches // pp)
            raise ValueError(
                f"{where} needs microbatches to be a multiple of the rounds max(1, microbatches // pp) = {rounds}; "
                f"got {microbatches}. {_rounds_hint(pp, microbatches)}"
            )


def _rounds_ok(pp: int, microbatches: int) -> bool:
    # torch derives "rounds" from the micro-batch count and demands microbatches % rounds == 0
    return microbatches % max(1, microbatches // pp) == 0


def _rounds_hint(pp: int, microbatches: int) -> str:
    above = next(m for m in range(microbatches + 1, 2 * microbatches + pp) if _rounds_ok(pp, m))
    below = next(m for m in range(microbatches - 1, 0, -1) if _rounds_ok(pp, m))
    return f"HINT: microbatches={below} or {above} (any multiple of pp={pp} works)"


_TABLE = (
    ScheduleTraits("gpipe", "ScheduleGPipe", "loop", multi_stage=False, splits_backward=False, all_forwards_first=True),
    ScheduleTraits("1f1b", "Schedule1F1B", "loop", multi_stage=False, splits_backward=False, microbatches="per_stage"),
    ScheduleTraits("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", multi_stage=True, splits_backward=False,
                   microbatches="rounds"),
    ScheduleTraits("looped_bfs", "ScheduleLoopedBFS", "loop", multi_stage=True, splits_backward=False,
                   all_forwards_first=True),
    ScheduleTraits("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", "loop", multi_stage=True,
                   splits_backward=True, microbatches="rounds"),
    ScheduleTraits("zbv", "ScheduleZBVZeroBubble", "v", multi_stage=True, splits_backward=True),
    ScheduleTraits("dualpipev", "ScheduleDualPipeV", "v", multi_stage=True, splits_backward=True,
                   microbatches="per_stage"),
)  # fmt: skip
SCHEDULE_TRAITS: dict[str, ScheduleTraits] = {traits.name: traits for traits in _TABLE}
# our name -> class name in torch.distributed.pipelining.schedules
SCHEDULES: dict[str, str] = {name: traits.torch_class_name for name, traits in SCHEDULE_TRAITS.items()}


def schedule_traits(name: str) -> ScheduleTraits:
    """The traits of a schedule by name.

    Raises:
        ValueError: An unknown name; the message lists the known ones.
    """
    if name not in SCHEDULE_TRAITS:
        raise ValueError(f"unknown schedule {name!r}. HINT: choose one of {', '.join(SCHEDULE_TRAITS)}")
    return SCHEDULE_TRAITS[name]
