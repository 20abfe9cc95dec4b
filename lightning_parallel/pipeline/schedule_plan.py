"""What each `torch.distributed.pipelining` schedule does, known without launching processes.

Resolves and validates a schedule name against its traits (`schedules.py`), lists the compute actions per rank in
torch's own order, and simulates them under unit costs to get a timeline and the bubble fraction. It runs nothing
and draws nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_parallel.pipeline.partition import STAGE_TO_RANK
from lightning_parallel.pipeline.schedules import SCHEDULES as SCHEDULES  # the strategy's argument check reads it here
from lightning_parallel.pipeline.schedules import ScheduleTraits, schedule_traits

# a full backward costs as much as its input-gradient plus weight-gradient halves
DEFAULT_COST: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class ScheduleSpec:
    """A validated schedule of one run: its traits (`schedules.SCHEDULE_TRAITS`) and the stages per rank it runs."""

    traits: ScheduleTraits
    stages_per_rank: int

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def torch_class(self) -> type:
        return self.traits.torch_class

    @property
    def style(self) -> str:
        """Stage layout: "loop" puts stage i on rank i % pp; "v" goes down the ranks, then back up."""
        return self.traits.style

    @property
    def splits_backward(self) -> bool:
        """Runs input-gradient (I) and weight-gradient (W) work separately."""
        return self.traits.splits_backward

    def stage_to_rank(self, pp: int) -> list[int]:
        """Rank owning each stage, indexed by stage."""
        return STAGE_TO_RANK[self.style](pp * self.stages_per_rank, pp)


@dataclass(frozen=True)
class Action:
    """One compute action: kind F (forward), B (full backward), I (input grad) or W (weight grad)."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        # torch's notation, e.g. "3F1" = stage 3, forward, microbatch 1
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """Per-rank `(start, end, action)` events of a simulated step, in time order."""

    events: dict[int, list[tuple[float, float, Action]]]
    makespan: float
    bubble_fraction: float  # 1 - busy time / (pp * makespan)


def resolve_schedule(name: str, *, pp: int, microbatches: int, stages_per_rank: int | None = None) -> ScheduleSpec:
    """Validate a schedule choice against every constraint torch enforces, before any process starts.

    Args:
        name: one of `SCHEDULES`.
        pp: pipeline ranks (torch accepts 1 for every schedule).
        microbatches: microbatches per step.
        stages_per_rank: stages per rank for multi-stage schedules (default 2); must be 1 or None otherwise.

    Raises:
        ValueError: one line naming the numbers and a fix.
    """
    traits = schedule_traits(name)
    if pp < 1:
        raise ValueError(f"schedule={name} needs pp >= 1; got {pp}. HINT: pp=2")
    v = traits.check_stages_per_rank(stages_per_rank)
    traits.check_microbatches(pp, microbatches, v)
    return ScheduleSpec(traits=traits, stages_per_rank=v)


@dataclass
class _FakeStage:
    """The attributes multi-stage schedule constructors read; enough to build `pipeline_order`."""

    group_size: int
    group_rank: int
    num_stages: int
    stage_index: int
    submod: Any = None  # read by the torch.compile check of the split-backward schedules
    stage_index_to_group_rank: dict[int, int] | None = None  # set by the constructor

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _single_stage_order(name: str, rank: int, pp: int, microbatches: int) -> list[Action]:
    # written here because single-stage schedules run a hand-coded loop, not an action list
    forwards = [Action("F", rank, m) for m in range(microbatches)]
    backwards = [Action("B", rank, m) for m in range(microbatches)]
    if name == "gpipe":
        return forwards + backwards
    warmup = pp - 1 - rank  # forwards in flight before the first backward returns; <= microbatches here
    order = forwards[:warmup]
    for m in range(microbatches - warmup):
        order += [forwards[warmup + m], backwards[m]]
    return order + backwards[microbatches - warmup :]


def _flatten(torch_action: Any) -> list[Action]:
    # DualPipeV packs an overlapped forward+backward pair; torch runs its sub-actions one after the other
    if torch_action.sub_actions is not None:
        return [a for sub in torch_action.sub_actions for a in _flatten(sub)]
    kind = torch_action.computation_type.value
    if kind not in DEFAULT_COST:  # communication, (un)shard and grad-reduction actions cost nothing here
        return []
    return [Action(kind, torch_action.stage_index, torch_action.microbatch_index)]


def rank_actions(spec: ScheduleSpec, *, pp: int, microbatches: int) -> dict[int, list[Action]]:
    """Compute actions per rank, in the order torch runs them (idle slots dropped).

    Multi-stage orders come from the torch class's own `pipeline_order`, built on lightweight fake
    stages: the constructors only read sizes and ranks, so no process group is needed.
    """
    num_stages = pp * spec.stages_per_rank
    spec.traits.check_microbatches(pp, microbatches, spec.stages_per_rank)
    if spec.stages_per_rank == 1:
        return {rank: _single_stage_order(spec.name, rank, pp, microbatches) for rank in range(pp)}
    owner = spec.stage_to_rank(pp)
    # any rank's construction computes every rank's order; rank 0 is as good as any
    stages = [_FakeStage(pp, 0, num_stages, s) for s in range(num_stages) if owner[s] == 0]
    quiet = logging.getLogger(torch_schedules.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the constructors log "Using <class>" at info level
    try:
        order = spec.torch_class(stages, microbatches).pipeline_order
    finally:
        quiet.setLevel(level)
    return {rank: [a for t in order[rank] if t is not None for a in _flatten(t)] for rank in range(pp)}


def _dependencies(action: Action, num_stages: int) -> list[tuple[str, int, int]]:
    # keys into the finish-time table; "G" = input gradient ready, written by both B and I
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [("F", s - 1, m)] if s > 0 else []
    if action.kind == "W":
        return [("I", s, m)]
    return [("F", s, m)] + ([("G", s + 1, m)] if s < num_stages - 1 else [])


def _check_placement(actions: dict[int, list[Action]], pp: int, num_stages: int, stage_to_rank: list[int]) -> None:
    if len(stage_to_rank) != num_stages:
        raise ValueError(
            f"stage_to_rank has {len(stage_to_rank)} entries but num_stages={num_stages}. HINT: one rank per stage"
        )
    for rank, order in actions.items():
        if not 0 <= rank < pp:
            raise ValueError(f"actions name rank {rank} but pp={pp}. HINT: ranks are 0..{pp - 1}")
        for a in order:
            owner = stage_to_rank[a.stage] if 0 <= a.stage < num_stages else None
            if owner != rank:
                raise ValueError(
                    f"action {a} is listed on rank {rank} but stage {a.stage} belongs to rank {owner}. "
                    "HINT: pass stage_to_rank=spec.stage_to_rank(pp)"
                )


def simulate(
    actions: dict[int, list[Action]],
    *,
    pp: int,
    num_stages: int,
    stage_to_rank: list[int],
    cost: dict[str, float] | None = None,
) -> Timeline:
    """Run each rank's actions in order under per-kind costs; communication is free.

    An action starts once its rank is idle and its inputs exist: F needs the previous stage's F; B or I
    need their own F and the next stage's B/I; W needs its own I.

    Raises:
        ValueError: an unknown cost kind, or an action on a rank that does not own its stage.
        RuntimeError: the orders deadlock; names the action each stuck rank waits on.
    """
    costs = {**DEFAULT_COST, **(cost or {})}
    if set(costs) != set(DEFAULT_COST):
        raise ValueError(f"cost kinds must be among {sorted(DEFAULT_COST)}; got {sorted(cost or {})}. HINT: e.g. F=1")
    _check_placement(actions, pp, num_stages, stage_to_rank)
    finish: dict[tuple[str, int, int], float] = {}
    events: dict[int, list[tuple[float, float, Action]]] = {rank: [] for rank in range(pp)}
    free = dict.fromkeys(range(pp), 0.0)
    head = dict.fromkeys(actions, 0)
    # start times follow from finish times alone, so resolving ready heads in any order is exact
    progress = True
    while progress:
        progress = False
        for rank, order in actions.items():
            while head[rank] < len(order):
                a = order[head[rank]]
                deps = _dependencies(a, num_stages)
                if any(d not in finish for d in deps):
                    break
                start = max([free[rank]] + [finish[d] for d in deps])
                end = start + costs[a.kind]
                events[rank].append((start, end, a))
                free[rank] = end
                finish[(a.kind, a.stage, a.microbatch)] = end
                if a.kind in ("B", "I"):
                    finish[("G", a.stage, a.microbatch)] = end
                head[rank] += 1
                progress = True
    stuck = {rank: str(order[head[rank]]) for rank, order in actions.items() if head[rank] < len(order)}
    if stuck:
        raise RuntimeError(f"schedule deadlocks; each stuck rank waits on its next action: {stuck}")
    makespan = max((e[1] for ev in events.values() for e in ev), default=0.0)
    busy = sum(end - start for ev in events.values() for start, end, _ in ev)
    bubble = 1.0 - busy / (pp * makespan) if makespan > 0 else 0.0
    return Timeline(events=events, makespan=makespan, bubble_fraction=bubble)


def analytic_bubble(name: str, *, pp: int, microbatches: int, stages_per_rank: int | None = None) -> float:
    """Bubble fraction of one step of `name` under the default unit costs."""
    spec = resolve_schedule(name, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
    return simulate(
        rank_actions(spec, pp=pp, microbatches=microbatches),
        pp=pp,
        num_stages=pp * spec.stages_per_rank,
        stage_to_rank=spec.stage_to_rank(pp),
    ).bubble_fraction
