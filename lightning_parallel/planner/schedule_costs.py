"""What a pipeline schedule costs a layout, known without launching: the idle (bubble) fraction under unit costs, how
many ranks are busy at once over the step, and the peak number of micro-batches whose activations each rank holds.

Exact (by simulating torch's own action order, as ``pipeline.schedule_plan``) for small pipelines; for large ones
extrapolated from a small pipeline with the same micro-batches-per-rank ratio, since building torch's orders for
64 ranks takes seconds. It prices no stage and knows no model.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from lightning_parallel.pipeline.schedule_plan import Timeline, rank_actions, resolve_schedule, simulate
from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS

# (pairs per stage, of which awaiting W per stage, sent outputs, sent input gradients): ``ScheduleCost.at_peak``
Moment = tuple[tuple[int, ...], tuple[int, ...], int, int]

# Up to these sizes the torch order is built and simulated (milliseconds); larger ones are extrapolated.
EXACT_MAX_RANKS = 8
EXACT_MAX_MICROBATCHES_PER_RANK = 4


@dataclass(frozen=True)
class ScheduleCost:
    """Bubble and memory figures of one (schedule, pp, micro-batches, stages per rank).

    Args:
        bubble: Idle fraction of a step under unit costs (forward 1, backward 2): ``pipeline.analytic_bubble``.
        in_flight: Per pipeline rank, the peak number of (stage, micro-batch) pairs holding activations.
        at_first_grad: Per pipeline rank, the pairs holding activations when its first gradient-making backward (B or
            W) starts, that one included (the rank's gradients do not exist before it).
        with_grads: Per pipeline rank, the peak pairs holding activations at a forward after that first backward,
            beside the whole gradients (0: no forward follows, e.g. GPipe's all-forwards-first order).
        actions: Actions per (stage, micro-batch): 2 (forward, backward) or 3 (forward, input grad, weight grad).
        exact: Whether the figures come from simulating this very size (else extrapolated).
        busy_ranks: ``busy_ranks[j]``: the fraction of the step during which exactly ``j`` ranks compute (what
            devices that share cores run at; ``Hardware.slowdown``).
        at_peak: Per pipeline rank, what it holds at the moments it holds the most pairs, one ``Moment`` per such
            moment: its pairs per stage (its stages in order), of which those between their input-gradient and
            weight-gradient actions (a split backward; not the first stage's, whose I does nothing), and the stage
            outputs and input gradients sent to another rank so far, which the multi-stage schedules hold until the
            step ends (``ScheduleTraits.holds_sends``).
    """

    bubble: float
    in_flight: tuple[int, ...]
    actions: int
    exact: bool
    busy_ranks: tuple[float, ...] = ()
    at_first_grad: tuple[int, ...] = ()
    with_grads: tuple[int, ...] = ()
    at_peak: tuple[tuple[Moment, ...], ...] = ()


def valid_microbatches(name: str, pp: int, microbatches: int, stages_per_rank: int | None = None) -> bool:
    """Whether torch accepts this schedule with these sizes (``resolve_schedule`` does not raise)."""
    try:
        resolve_schedule(name, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=8192)
def schedule_cost(name: str, *, pp: int, microbatches: int, stages_per_rank: int | None = None) -> ScheduleCost:
    """Bubble fraction and peak in-flight micro-batches; exact for small pipelines, extrapolated for large ones.

    Raises:
        ValueError: torch would reject the schedule with these sizes (one line, from ``resolve_schedule``).
    """
    spec = resolve_schedule(name, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
    v = spec.stages_per_rank
    if pp <= EXACT_MAX_RANKS and microbatches <= EXACT_MAX_MICROBATCHES_PER_RANK * pp:
        return _simulated(name, pp, microbatches, v)
    # A smaller pipeline with the same micro-batches per rank (capped: past a few per rank nothing changes but the
    # busy time, and the warm-up/cool-down idle stays constant).
    small_pp = min(pp, EXACT_MAX_RANKS)
    target = max(1, min(round(microbatches * small_pp / pp), EXACT_MAX_MICROBATCHES_PER_RANK * small_pp))
    small_m = next(
        (
            m
            for m in [*range(target, 0, -1), *range(target + 1, 8 * small_pp + 1)]
            if valid_microbatches(name, small_pp, m, v)
        ),
        None,
    )
    if small_m is None:  # pragma: no cover - every schedule accepts some count at pp <= 8
        raise ValueError(f"schedule={name}: no reference size for pp={pp}. HINT: use pp <= {EXACT_MAX_RANKS}")
    small = _simulated(name, small_pp, small_m, v)
    busy_small = 3.0 * small_m * v  # per rank, in forward units (F=1, B=2 or F=I=W=1)
    idle_small = small.bubble * busy_small / (1.0 - small.bubble) if small.bubble < 1 else 0.0
    idle = idle_small * (pp - 1) / (small_pp - 1) if small_pp > 1 else 0.0  # warm-up + cool-down grow with pp
    busy = 3.0 * microbatches * v
    if spec.traits.all_forwards_first:  # the peak in-flight count grows with the micro-batch count
        peak = microbatches * v
    else:
        peak = min(microbatches * v, round(max(small.in_flight) * pp / small_pp))
    # steady-state orders reach their peak again once gradients exist; all-forwards-first orders never do
    after = 0 if spec.traits.all_forwards_first else peak
    bubble = idle / (idle + busy)
    everyone = max(0.0, 1.0 - bubble * pp / (pp - 1))  # ranks join and leave the step one at a time, roughly
    profile = (0.0, 1.0 - everyone, *(0.0,) * (pp - 2), everyone)
    return ScheduleCost(bubble=bubble, in_flight=(peak,) * pp, actions=small.actions, exact=False, busy_ranks=profile,
                        at_first_grad=(peak,) * pp, with_grads=(after,) * pp)  # fmt: skip


def _simulated(name: str, pp: int, microbatches: int, v: int) -> ScheduleCost:
    spec = resolve_schedule(name, pp=pp, microbatches=microbatches, stages_per_rank=v)
    actions = rank_actions(spec, pp=pp, microbatches=microbatches)
    owner = spec.stage_to_rank(pp)
    timeline = simulate(actions, pp=pp, num_stages=pp * v, stage_to_rank=owner)
    peaks, firsts, afters, states = [], [], [], []
    for rank, order in actions.items():
        local = sorted({a.stage for a in order})
        held: set[tuple[int, int]] = set()
        awaiting: set[tuple[int, int]] = set()
        sent = [0, 0]  # stage outputs, input gradients
        peak = after = 0
        first: int | None = None
        moments: list[Moment] = []
        for action in order:
            key = (action.stage, action.microbatch)
            if action.kind == "F":
                held.add(key)
                after = max(after, len(held)) if first is not None else after
                sent[0] += spec.traits.holds_sends and action.stage < pp * v - 1 and owner[action.stage + 1] != rank
            elif action.kind in ("B", "W"):  # a split backward keeps the weight-gradient inputs until W
                first = len(held) if first is None else first
                held.discard(key)
                awaiting.discard(key)
            if action.kind in ("B", "I"):
                sent[1] += spec.traits.holds_sends and action.stage > 0 and owner[action.stage - 1] != rank
                if action.kind == "I" and action.stage > 0:
                    awaiting.add(key)
            if len(held) > peak:
                peak, moments = len(held), []
            if len(held) == peak:
                held_by, awaiting_by = (
                    tuple(sum(k[0] == s for k in pairs) for s in local) for pairs in (held, awaiting)
                )
                moments.append((held_by, awaiting_by, sent[0], sent[1]))
        peaks.append(peak)
        firsts.append(first or peak)
        afters.append(after)
        states.append(tuple(sorted(set(moments))))
    return ScheduleCost(
        bubble=timeline.bubble_fraction,
        in_flight=tuple(peaks),
        actions=3 if spec.splits_backward else 2,
        exact=True,
        busy_ranks=busy_ranks(timeline, pp),
        at_first_grad=tuple(firsts),
        with_grads=tuple(afters),
        at_peak=tuple(states),
    )


def busy_ranks(timeline: Timeline, pp: int) -> tuple[float, ...]:
    """Fraction of the makespan during which exactly 0, 1, ..., pp ranks run an action (one sweep over the events)."""
    changes = sorted((t, step) for events in timeline.events.values() for start, end, _ in events
                     for t, step in ((start, 1), (end, -1)))  # fmt: skip
    profile = [0.0] * (pp + 1)
    busy = 0
    for (time, step), (later, _) in itertools.pairwise([*changes, (timeline.makespan, 0)]):
        busy += step
        profile[busy] += (later - time) / timeline.makespan
    return tuple(profile)


def schedule_names() -> list[str]:
    """Every schedule the pipeline strategy runs, in ``pipeline.schedules.SCHEDULE_TRAITS`` order."""
    return list(SCHEDULE_TRAITS)
