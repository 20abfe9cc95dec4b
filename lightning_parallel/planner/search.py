"""Every valid layout of a workload on ``devices`` devices, estimated, ranked, and the winner explained in a sentence.

Prunes what cannot win or cannot run (tensor sizes the model's plan cannot divide, more stages than blocks, a few
micro-batch counts per schedule); it builds no strategy and prints nothing (the ``plan`` command does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS
from lightning_parallel.planner.estimate import CostModel, Estimate, Layout
from lightning_parallel.planner.hardware import Hardware, human_bytes
from lightning_parallel.planner.schedule_costs import schedule_names, valid_microbatches
from lightning_parallel.planner.workload import Workload
from lightning_parallel.sync_methods import alternatives

MICROBATCH_CHOICES = 6  # micro-batch counts tried per (layout, schedule), spread geometrically


@dataclass(frozen=True)
class Plan:
    """Estimates ranked best first: layouts that fit before those that do not, then by samples per second."""

    workload: Workload
    hardware: Hardware
    devices: int
    estimates: tuple[Estimate, ...]
    global_batch: int | None = None  # None: each replica had its own batch (train.py's data.batch_size)
    activation_checkpointing: str = "none"  # what every estimate assumed

    @property
    def best(self) -> Estimate | None:
        """The fastest layout that fits, or None when none does."""
        return next((e for e in self.estimates if e.fits), None)

    def explain(self) -> str:
        """One sentence: what wins and why."""
        return explain(self)

    def table(self, top: int = 15, *, note: Callable[[Layout], str] | None = None, note_header: str = "") -> str:
        """A plain-text table of the first ``top`` estimates (``note`` adds a column, e.g. how to run it)."""
        return table(self.estimates[:top], note=note, note_header=note_header)


def plan(
    workload: Workload,
    *,
    devices: int,
    hardware: Hardware,
    global_batch: int | None = None,
    replica_batch: int | None = None,
    precision: str = "32-true",
    optimizer_states: int = 2,
    activation_checkpointing: str = "none",
    schedules: Sequence[str] | None = None,
    allow: Callable[[Layout], bool] | None = None,
) -> Plan:
    """Estimate and rank every valid layout of ``workload`` on ``devices`` devices.

    Args:
        workload: The model's figures (``gpt_workload``, ``workload_from_module``).
        devices: Devices to fill exactly (``dp * pp * tp``).
        hardware: The devices and network.
        global_batch: Samples per optimizer step over all replicas; each replica gets ``global_batch / dp``.
        replica_batch: Samples per replica per step instead (``train.py``'s ``data.batch_size``); give one of the two.
        precision: A Lightning precision name.
        optimizer_states: Optimizer state elements per parameter (Adam: 2).
        activation_checkpointing: "none", "full" or "selective", as the strategies' argument of that name.
        schedules: Pipeline schedules to try; None tries all of ``pipeline.schedule_plan.SCHEDULES``.
        allow: Keep only layouts for which this returns True (e.g. those a strategy can run).

    Raises:
        ValueError: Bad sizes, or no valid layout at all (one line with the reason and a fix).
    """
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} must be an integer >= 1. HINT: devices=8")
    if (global_batch is None) == (replica_batch is None):
        raise ValueError("give exactly one of global_batch and replica_batch. HINT: global_batch=256")
    batch = global_batch if global_batch is not None else replica_batch
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch size {batch!r} must be an integer >= 1. HINT: global_batch=256")
    chosen = list(schedules) if schedules is not None else schedule_names()
    unknown = sorted(set(chosen) - set(schedule_names()))
    if unknown or not chosen:
        raise ValueError(f"unknown schedules {unknown or chosen}. HINT: choose from {', '.join(schedule_names())}")
    model = CostModel(
        workload,
        hardware,
        precision=precision,
        optimizer_states=optimizer_states,
        activation_checkpointing=activation_checkpointing,
    )
    estimates = []
    for layout, per_replica in _layouts(workload, devices, global_batch, replica_batch, chosen):
        if allow is None or allow(layout):
            estimates.append(model.estimate(layout, batch=per_replica))
    if not estimates:
        raise ValueError(_no_layout_reason(workload, devices, global_batch))
    estimates.sort(key=lambda e: (not e.fits, -e.throughput if e.fits else e.memory["total"]))
    return Plan(
        workload=workload,
        hardware=hardware,
        devices=devices,
        estimates=tuple(estimates),
        global_batch=global_batch,
        activation_checkpointing=activation_checkpointing,
    )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _layouts(
    workload: Workload, devices: int, global_batch: int | None, replica_batch: int | None, schedules: list[str]
) -> Iterable[tuple[Layout, int]]:
    blocks = len(workload.blocks)
    for tp in _divisors(devices):
        if workload.tp_modulus % tp:
            continue
        for pp in _divisors(devices // tp):
            dp = devices // tp // pp
            if pp > blocks:
                continue
            if global_batch is not None and global_batch % dp:
                continue
            batch = global_batch // dp if global_batch is not None else replica_batch
            assert batch is not None
            for shard in (False, True) if dp > 1 else (False,):
                if pp == 1:
                    yield Layout(dp=dp, pp=1, tp=tp, dp_shard=shard), batch
                    continue
                for name in schedules:
                    v = SCHEDULE_TRAITS[name].default_stages_per_rank  # what the pipeline strategy runs
                    if pp * v > blocks:
                        continue
                    for m in _microbatch_choices(name, pp, v, batch):
                        yield (
                            Layout(
                                dp=dp, pp=pp, tp=tp, dp_shard=shard, schedule=name, microbatches=m, stages_per_rank=v
                            ),
                            batch,
                        )


def _microbatch_choices(name: str, pp: int, v: int, batch: int) -> list[int]:
    """A few valid counts dividing the batch, from the smallest at least pp (or the largest below) up to the largest."""
    valid = [m for m in _divisors(batch) if valid_microbatches(name, pp, m, v)]
    if not valid:
        return []
    enough = [m for m in valid if m >= pp] or valid[-1:]
    if len(enough) <= MICROBATCH_CHOICES:
        return enough
    picks = {enough[round(i * (len(enough) - 1) / (MICROBATCH_CHOICES - 1))] for i in range(MICROBATCH_CHOICES)}
    return sorted(picks)


def _no_layout_reason(workload: Workload, devices: int, global_batch: int | None) -> str:
    batch = f"data-parallel sizes must divide global_batch={global_batch}, " if global_batch is not None else ""
    return (
        f"no layout of {workload.name} fills {devices} devices: {batch}pipelines need <= {len(workload.blocks)} "
        f"stages and tensor-parallel sizes must divide {workload.tp_modulus}. HINT: try another device count"
    )


# ---- words and tables ----------------------------------------------------------------------------------------------
def describe(layout: Layout) -> str:
    """``dp4 x pp2 x tp1 (1f1b, 8 micro-batches, fsdp)``."""
    extra = []
    if layout.pp > 1:
        extra.append(f"{layout.schedule}, {layout.microbatches} micro-batches")
    if layout.dp > 1:
        extra.append("fsdp" if layout.dp_shard else "ddp")
    return layout.label + (f" ({'; '.join(extra)})" if extra else "")


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def _rate(samples_per_second: float) -> str:
    return f"{samples_per_second:,.0f}" if samples_per_second >= 100 else f"{samples_per_second:.3g}"


def _percent(share: float) -> str:
    return "under 1%" if f"{share:.0%}" == "0%" else f"{share:.0%}"


def _shares(estimate: Estimate) -> str:
    step, t = estimate.step_time, estimate.time
    parts = [("compute", t["compute"]), ("pipeline bubble", t["bubble"]), ("communication", estimate.communication),
             ("optimizer and overhead", t["optimizer"] + t["overhead"])]  # fmt: skip
    return ", ".join(f"{share / step:.0%} {name}" for name, share in parts if share / step >= 0.005)


def explain(result: Plan) -> str:
    """One sentence: the winner, its cost, and why it beats plain data parallelism (or why that is the winner); for
    a plain data-parallel winner, a second one on what local SGD, DiLoCo or asynchronous SGD would trade."""
    best = result.best
    capacity = human_bytes(result.hardware.memory_bytes * result.hardware.usable_memory)
    if best is None:
        leanest = min(result.estimates, key=lambda e: e.memory["total"])
        return (
            f"No layout fits in {capacity} usable per device: the leanest, {describe(leanest.layout)}, needs "
            f"{human_bytes(leanest.memory['total'])}; use more devices, a smaller batch or a lower precision."
        )
    head = (
        f"{describe(best.layout)} wins at {_rate(best.throughput)} samples/s ({_seconds(best.step_time)} per step, "
        f"{human_bytes(best.memory['total'])} of {capacity} usable per device)"
    )
    sentence = f"{head}: {_why(result, best)}; its step is {_shares(best)}."
    layout = best.layout
    if layout.dp > 1 and layout.pp == layout.tp == 1 and not layout.dp_shard:
        sentence += " " + alternatives(best.time["dp_comm"] / best.step_time)
    return sentence


# what a winner saves against plain data parallelism, by time component
_SAVING = {
    "compute": "less compute per device",
    "dp_comm": "less gradient traffic",
    "optimizer": "each device updating only its share of the parameters",
    "tp_comm": "fewer tensor-parallel collectives",
    "pp_comm": "fewer pipeline messages",
    "bubble": "a smaller pipeline bubble",
    "overhead": "less fixed overhead",
}


def _why(result: Plan, best: Estimate) -> str:
    plain = next((e for e in result.estimates if e.layout.pp == e.layout.tp == 1 and not e.layout.dp_shard), None)
    if plain is best:
        rival = next((e for e in result.estimates if e.fits and e.layout.kind != best.layout.kind), None)
        whole = "each device holds the whole model"
        if rival is None:
            return f"{whole} and no other kind of layout fits"
        return (
            f"{whole} and only gradients cross devices ({_percent(best.communication / best.step_time)} of the step), "
            f"{best.throughput / rival.throughput:.2f}x the best {rival.layout.kind} layout, {describe(rival.layout)}"
        )
    if plain is None:
        batch = result.global_batch
        reason = (
            f"a global batch of {batch} does not split into {result.devices} replicas"
            if batch is not None and batch % result.devices
            else "it is not among the layouts considered"
        )
        widest = max(result.estimates, key=lambda e: e.layout.dp)  # the most data-parallel layout there is
        if not widest.fits:
            reason += (
                f", and even {describe(widest.layout)} would need {human_bytes(widest.memory['total'])} per device"
            )
        return f"plain data parallelism is out ({reason})"
    if not plain.fits:
        return f"plain data parallelism would need {human_bytes(plain.memory['total'])} per device and does not fit"
    savings = {key: plain.time[key] - best.time[key] for key in best.time}
    key = max(savings, key=lambda k: savings[k])
    return (
        f"{best.throughput / plain.throughput:.2f}x plain data parallelism, mostly from {_SAVING[key]} "
        f"({_seconds(savings[key])} less per step)"
    )


def table(estimates: Sequence[Estimate], *, note: Callable[[Layout], str] | None = None, note_header: str = "") -> str:
    """Plain-text table, one row per estimate, in the given order."""
    header = ["#", "layout", "schedule", "micro", "step", "samples/s", "memory/device", "fits", "bubble", "comm"]
    if note is not None:
        header.append(note_header)
    rows = [header]
    for rank, e in enumerate(estimates, start=1):
        layout = e.layout
        row = [
            str(rank),
            layout.label + (" fsdp" if layout.dp_shard else ""),
            layout.schedule or "-",
            str(layout.microbatches) if layout.pp > 1 else "-",
            _seconds(e.step_time),
            _rate(e.throughput),
            human_bytes(e.memory["total"]),
            "yes" if e.fits else "NO",
            ("" if e.exact_schedule else "~") + f"{e.bubble_fraction:.0%}" if layout.pp > 1 else "-",
            f"{e.communication / e.step_time:.0%}",
        ]
        if note is not None:
            row.append(note(layout))
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    right = {0, 3, 4, 5, 6, 8, 9}
    lines = [
        "  ".join(
            cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)
