"""idle_check.py's reading of torch's profiler trace, without the StageTimer's hooks: the ranges it annotates, and each
schedule.step window's shares on the rank's main thread of the stage's own ops (compute), send/recv and the waits on
them (comm), other ops, and no op at all. It profiles and trains nothing itself.
"""

from __future__ import annotations

import re
from typing import Any

STEP, WAIT, LOSS = "idle_check:schedule.step", "idle_check:wait", "idle_check:loss"
# Top-level ops inside schedule.step that are not the stage's layers: torch's and the strategy's micro-batch
# handling (split, select targets, detach, clone, stack losses, scale gradients) and the loss's backward.
NOT_STAGE = {
    f"aten::{op}"
    for op in "tensor_split split chunk select slice item detach detach_ to _to_copy ones_like zeros_like "
    "empty_like clone copy_ stack cat div_ mul_".split()
}
LOSS_BACKWARD = {"NllLossBackward0", "LogSoftmaxBackward0"}
COMM_PREFIXES = ("c10d::", "gloo:", "record_param_comms")
COMPUTE_ACTION = re.compile(r"PP:\d+[FBIW]\d+")  # torch's range around a multi-stage schedule's compute action


def top_level(event: Any) -> tuple[bool, set[str]]:
    """(not nested in another op, the annotations above it); torch's "PP:0F0"-style ranges are annotations."""
    names, parent = set(), event.cpu_parent
    while parent is not None:
        if not parent.is_user_annotation:
            return False, names
        names.add(parent.name)
        parent = parent.cpu_parent
    return True, names


def kind(event: Any, above: set[str]) -> str:
    name = event.name
    if name.startswith(COMM_PREFIXES):
        return "comm"
    if LOSS in above or name in NOT_STAGE:
        return "other"
    node = name.removeprefix("autograd::engine::evaluate_function: ")
    return "other" if node in LOSS_BACKWARD else "compute"


def covered(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Length of the union of `spans` inside the (disjoint) `windows`."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans for lo, hi in windows if min(b, hi) > max(a, lo))
    total, reach = 0.0, float("-inf")
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def breakdown(events: Any) -> dict[str, float]:
    """Shares of the schedule.step windows on the main thread: compute, comm, other ops, no op."""
    steps = [e for e in events if e.name == STEP]
    thread, windows = steps[0].thread, [(e.time_range.start, e.time_range.end) for e in steps]
    spans: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": [], "other": [], "actions": []}
    for e in events:
        if e.thread != thread:
            continue
        if e.is_user_annotation:
            if e.name == WAIT:
                spans["comm"].append((e.time_range.start, e.time_range.end))
            elif COMPUTE_ACTION.fullmatch(e.name):
                spans["actions"].append((e.time_range.start, e.time_range.end))
            continue
        outermost, above = top_level(e)
        if outermost:
            spans[kind(e, above)].append((e.time_range.start, e.time_range.end))
    wall = sum(b - a for a, b in windows)
    compute = covered(spans["compute"], windows)
    with_comm = covered(spans["compute"] + spans["comm"], windows)
    ops = covered(spans["compute"] + spans["comm"] + spans["other"], windows)
    return {
        "schedule_step_ms": wall / 1e3 / len(windows),
        "compute": compute / wall,
        "comm": (with_comm - compute) / wall,
        "other_ops": (ops - with_comm) / wall,
        "no_op": 1 - ops / wall,
        # inside torch's F/B/I/W action ranges but not in their waits for a receive (multi-stage schedules only)
        "actions": (covered(spans["actions"] + spans["comm"], windows) - covered(spans["comm"], windows)) / wall
        if spans["actions"]
        else None,
    }
